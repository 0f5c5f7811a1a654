"""What a launched worker tells the launcher while it runs: that it makes progress, and that it finished.

``accelport launch --timeout SECONDS`` defines progress as *a training step ended*
(``ap.optimizer_step``) on every worker: each one rewrites
``$ACCELPORT_LAUNCH_DIR/heartbeat-rank<N>`` when it starts and then at most once a
second as its steps end (a built-in plugin on ``accelport_step_end``, named
``launch-heartbeat``, active only where the worker wrapper set
``ACCELPORT_HEARTBEAT``). A worker that ended a step and whose last beat is older
than the timeout has stopped making progress; before its first step, the time since
the launch (or the restart, for a later attempt) counts, against ``--startup-timeout``.
When its script returns, the worker writes ``done-rank<N>.json``: a rank that finished
is never taken for one that hangs, and a rank that finished while the others still ran
is named as the cause of their failure.

When something looks wrong (a rank stopped making progress, or a rank finished
while the others still run), the launcher asks every worker where its script is:
it rewrites ``probe`` with a new sequence number, and each worker's wrapper
answers in ``where-rank<N>.json`` with the script's own line and the collective it
waits in, if any (:mod:`accelport.launch.worker`). A rank stuck outside any
collective is the one that hangs; a rank waiting in one waits for another.

The files hold small JSON objects, written to a temporary name and renamed, so
the launcher never reads half of one. Each says which attempt wrote it
(``"attempt"``, ``TORCHELASTIC_RESTART_COUNT``): after a restart the files of the
attempt before are still there until each rank's new worker replaces them, and the
launcher never takes them for the new attempt's.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

from accelport.goodput import ATTEMPT_ENV, attempt
from accelport.plugins.hookspecs import hookimpl

__all__ = ["HEARTBEAT_PREFIX", "DONE_PREFIX", "WHERE_PREFIX", "PROBE_FILE", "INTERVAL_S", "ATTEMPT_ENV", "Heartbeat",
           "attempt", "attempt_of", "beat", "create_plugin", "read", "read_ranked", "write_json"]

HEARTBEAT_PREFIX = "heartbeat-rank"
DONE_PREFIX = "done-rank"
#: The launcher's question (``{"seq": N}``) and each worker's answer (``where-rank<N>.json``).
PROBE_FILE = "probe"
WHERE_PREFIX = "where-rank"
#: At most one beat per this many seconds: a file write per second, not per step.
INTERVAL_S = 1.0


def attempt_of(record: Mapping[str, Any]) -> int:
    """The attempt that wrote ``record`` (0 for a record that does not say)."""
    value = record.get("attempt")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def write_json(path: str, record: Mapping[str, Any], *, replace: bool = True) -> bool:
    """Write ``record`` to ``path`` atomically; False if it was not written.

    ``replace=False`` keeps a record that is already there (the first verdict on a rank
    stands: the launcher's, or the worker's own). A failure to write is not raised: the
    launcher falls back to what the engine reports.
    """
    data = json.dumps(dict(record)).encode()
    tmp = f"{path}.{os.getpid()}.tmp"  # per process: the launcher and a worker may write one name
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        if replace:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)  # fails where the file exists: never half a check-then-write
            return True
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links (EPERM, ENOTSUP ...): create it exclusively
            return _create_new(path, data)
        finally:
            os.unlink(tmp)
    except OSError:
        return False


def _create_new(path: str, data: bytes) -> bool:
    """Write ``data`` to ``path`` unless it exists (``O_EXCL``), in one write; False if it exists or fails.

    Not renamed into place: a reader may meet the file before its one write, empty, and reads
    it as missing (:func:`read`), as it would a moment earlier.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError:
        return False
    try:
        return os.write(fd, data) == len(data)
    except OSError:
        return False
    finally:
        os.close(fd)


def read(path: str) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None if it is missing or unreadable."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def beat(path: str, step: int) -> None:
    """Say this worker is alive at ``step`` (0: started, before any step)."""
    write_json(path, {"pid": os.getpid(), "step": step, "time": time.time(), "attempt": attempt(os.environ)})


def read_ranked(directory: str, prefix: str, suffix: str = "", attempt: int | None = None) -> dict[int, dict[str, Any]]:
    """Rank -> its record ``<prefix><rank><suffix>`` in ``directory``; only those ``attempt`` wrote, when it is
    given."""
    out: dict[int, dict[str, Any]] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    for name in names:
        number = name[len(prefix):len(name) - len(suffix)] if suffix else name[len(prefix):]
        if name.startswith(prefix) and name.endswith(suffix) and number.isdigit():
            record = read(os.path.join(directory, name))
            if record is not None and (attempt is None or attempt_of(record) == attempt):
                out[int(number)] = record
    return out


class Heartbeat:
    """Rewrites the heartbeat file at most every :data:`INTERVAL_S` seconds as steps end."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._next = 0.0

    @hookimpl
    def accelport_step_end(self, record: Any) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + INTERVAL_S
        beat(self.path, int(record.step))


class _Off:
    """Registered outside a launched worker: implements no hook, costs nothing."""


def create_plugin(environ: Mapping[str, str]) -> Any:
    """A Heartbeat where the worker wrapper set ``ACCELPORT_HEARTBEAT`` (its file), else nothing."""
    path = (environ.get("ACCELPORT_HEARTBEAT") or "").strip()
    return Heartbeat(path) if path else _Off()
