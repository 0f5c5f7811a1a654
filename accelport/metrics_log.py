"""``ACCELPORT_METRICS_FILE=run.jsonl``: one JSON line per step, for analysis after the run.

A built-in plugin on ``accelport_step_end`` (name ``metrics-file``). Each line
holds the step number, wall-clock time, the step's duration and data wait, its
batch signature, and the change of every cheap backend counter over the step
(compilations, transfers, executions where the backend measures them). Lines
are flushed as they are written, so a crashed run keeps its history.
"""

from __future__ import annotations

import json
import os
from typing import IO, Any

from .contract import StepRecord
from .hookspecs import hookimpl

__all__ = ["MetricsFile", "create_plugin", "record_to_dict"]


def record_to_dict(record: StepRecord) -> dict[str, Any]:
    """The JSON object written for one step."""
    out: dict[str, Any] = {
        "step": record.step,
        "time": round(record.time, 6),
        "backend": record.backend,
        "lazy": record.lazy,
        "seconds": round(record.seconds, 6),
        "data_wait_seconds": round(record.data_wait_seconds, 6),
        "signature": [[list(shape), dtype] for shape, dtype in record.signature or ()],
        "loader": dict(record.loader),
    }
    for key, value in sorted(record.delta.items()):
        out[key] = round(value, 6) if isinstance(value, float) else value
    return out


class MetricsFile:
    """Appends one JSON line per step to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: IO[str] | None = None

    @hookimpl
    def accelport_step_end(self, record: StepRecord) -> None:
        if self._file is None:
            directory = os.path.dirname(os.path.abspath(self.path))
            os.makedirs(directory, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the run
        self._file.write(json.dumps(record_to_dict(record)) + "\n")
        self._file.flush()


class _Off:
    """Registered when ACCELPORT_METRICS_FILE is unset: implements no hook, costs nothing."""


def create_plugin() -> Any:
    path = os.environ.get("ACCELPORT_METRICS_FILE", "").strip()
    return MetricsFile(path) if path else _Off()
