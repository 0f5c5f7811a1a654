"""``ACCELPORT_METRICS_FILE=run.jsonl``: one JSON line per step, for analysis after the run.

A built-in plugin on ``accelport_step_end`` (name ``metrics-file``). Each line
holds the step number, wall-clock time, the step's duration and data wait, its
batch signature, and the change of every cheap backend counter over the step
(compilations, transfers, executions where the backend measures them), and the
device's memory where it was read (``"memory"``: bytes in use, the peak, the capacity,
the activations and the parameters, gradients and optimizer state). Where
the counters were read for several steps at once, the last of them carries the
change and ``counted_steps`` (how many steps it covers); the others carry
``counted_steps: 0`` and no counters. A diagnosis made on a step is written on
its line (``"diagnoses"``: kind, message, step, evidence, severity), so the report
shows what the live run found, with what only the live run can see (dynamo's
reasons, parameter names). Each line says where the step's time went
(``"breakdown"``: category -> seconds, adding up to ``seconds``), and the last step of a
profiled window what the profile found (``"profile"``). Lines are flushed as they are
written, so a crashed run keeps its history.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from accelport.contract import TIME_CATEGORIES, StepRecord
from accelport.plugins.hookspecs import hookimpl
from accelport.safe_io import open_append

__all__ = ["MetricsFile", "create_plugin", "record_to_dict", "record_from_dict"]

#: Keys of a line that are not counter deltas.
_FIELDS = frozenset({"step", "time", "backend", "lazy", "seconds", "data_wait_seconds", "signature", "loader",
                     "counted_steps", "diagnoses", "memory", "breakdown", "profile"})


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
    if record.counted_steps != 1:  # counters read for several steps at once (see StepRecord)
        out["counted_steps"] = record.counted_steps
    out["breakdown"] = {k: round(v, 6) for k, v in record.breakdown.items()}
    if record.profile is not None:
        out["profile"] = dict(record.profile)
    for key, value in sorted(record.delta.items()):
        out[key] = round(value, 6) if isinstance(value, float) else value
    if record.memory:  # the device's memory, where it was read with the counters
        out["memory"] = dict(record.memory)
    return out


def record_from_dict(line: dict[str, Any]) -> StepRecord:
    """The StepRecord a line came from; ValueError names the field that is wrong."""

    def number(key: str, default: float | None = None) -> float:
        value = line.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key!r} must be a number, not {value!r}")
        return float(value)

    step = line.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"'step' must be an integer, not {step!r}")
    raw_signature = line.get("signature") or []
    try:
        signature = tuple((tuple(int(n) for n in shape), str(dtype)) for shape, dtype in raw_signature)
    except (TypeError, ValueError):
        raise ValueError(f"'signature' must be a list of [shape, dtype] pairs, not {raw_signature!r}") from None
    loader = line.get("loader") or {}
    if not isinstance(loader, dict):
        raise ValueError(f"'loader' must be an object, not {loader!r}")
    counted = line.get("counted_steps", 1)
    if isinstance(counted, bool) or not isinstance(counted, int) or counted < 0:
        raise ValueError(f"'counted_steps' must be a non-negative integer, not {counted!r}")
    breakdown = line.get("breakdown") or {}
    if not isinstance(breakdown, dict) or not all(
            isinstance(k, str) and all(part in TIME_CATEGORIES for part in k.split("+"))
            and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
            for k, v in breakdown.items()):
        raise ValueError(f"'breakdown' must map time categories ({', '.join(TIME_CATEGORIES)}, or two joined by "
                         f"'+') to seconds (finite, not negative), not {breakdown!r}")
    profile = line.get("profile")
    if profile is not None and not isinstance(profile, dict):
        raise ValueError(f"'profile' must be an object, not {profile!r}")
    delta = {k: v for k, v in line.items()
             if k not in _FIELDS and isinstance(v, (int, float)) and not isinstance(v, bool)}
    memory = line.get("memory")
    if memory is not None and not (isinstance(memory, dict) and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in memory.values())):
        raise ValueError(f"'memory' must be an object of byte counts, not {memory!r}")
    return StepRecord(step=step, backend=str(line.get("backend", "?")), lazy=bool(line.get("lazy", False)),
                      seconds=number("seconds"), data_wait_seconds=number("data_wait_seconds", 0.0),
                      signature=signature or None, delta=delta, time=number("time", 0.0), loader=loader,
                      counted_steps=counted, memory=memory or None,
                      breakdown={k: float(v) for k, v in breakdown.items()}, profile=profile)


class MetricsFile:
    """Appends one JSON line per step to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._ready = False
        if os.path.exists(path) and not os.path.isfile(path):  # a FIFO would block the first step
            open_append(path, what="ACCELPORT_METRICS_FILE").close()  # raises, saying what it is

    @hookimpl
    def accelport_step_end(self, record: StepRecord, diagnoses: Sequence[Any]) -> None:
        if not self._ready:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._ready = True
        line = record_to_dict(record)
        if diagnoses:  # made by the rules on this record (or outside the steps, since the last one)
            line["diagnoses"] = [d.to_dict() for d in diagnoses]
        # Opened per line (tens of microseconds): nothing stays open when the run ends or crashes.
        # Never blocking: a FIFO put there after the run started is refused, not waited on.
        with open_append(self.path, what="ACCELPORT_METRICS_FILE") as f:
            f.write((json.dumps(line, default=str) + "\n").encode("utf-8"))


class _Off:
    """Registered when ACCELPORT_METRICS_FILE is unset: implements no hook, costs nothing."""


def create_plugin(environ: Mapping[str, str]) -> Any:
    """A MetricsFile when ``ACCELPORT_METRICS_FILE`` names a file, else a plugin that implements nothing."""
    path = (environ.get("ACCELPORT_METRICS_FILE") or "").strip()
    return MetricsFile(path) if path else _Off()
