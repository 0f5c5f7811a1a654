"""What ``accelport launch`` runs in each worker: the user's script, as ``python script.py`` would.

    python -m accelport.launch.worker [--engine torchrun|xla] [--single-process] SCRIPT [ARGS ...]

With ``--engine torchrun`` (the default) torchrun has already started one
process per replica and this module runs the script in it. With ``--engine
xla`` it hands the script to ``torch_xla.launch``, which starts one process per
device it finds (``--single-process``: one process, torch_xla's debug mode).

If the script raises, the error is recorded (when the launcher asked for it
through ``ACCELPORT_LAUNCH_DIR``) with a precise time, so the launcher can name
the replica that failed first, not one that failed because a peer vanished;
then the exception propagates as usual (traceback on this worker's stderr,
exit status 1).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback

__all__ = ["main", "run_script", "FAILURE_PREFIX"]

#: Failure records are ``$ACCELPORT_LAUNCH_DIR/<FAILURE_PREFIX><rank>.json``.
FAILURE_PREFIX = "failure-rank"


def _record_failure(rank: int, exc: BaseException) -> None:
    directory = os.environ.get("ACCELPORT_LAUNCH_DIR")
    if not directory:
        return
    record = {
        "rank": rank,
        "local_rank": int(os.environ.get("LOCAL_RANK", rank)),
        "host": os.uname().nodename,
        "pid": os.getpid(),
        "time": time.time(),
        "error": f"{type(exc).__name__}: {exc}",
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    }
    path = os.path.join(directory, f"{FAILURE_PREFIX}{rank}.json")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # the launcher falls back to the exit status


def run_script(rank: int, script: str, args: list[str]) -> None:
    """Run ``script`` as ``__main__`` with ``args``; record a failure before it propagates."""
    sys.argv = [script, *args]
    # As `python script.py` does: the script's own directory comes first on sys.path.
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _record_failure(rank, exc)
        raise
    except BaseException as exc:
        _record_failure(rank, exc)
        raise


def _xla_replica(index: int, script: str, args: list[str]) -> None:
    # torch_xla.launch calls this in each replica process with its global ordinal.
    run_script(index, script, args)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    engine, single = "torchrun", False
    while argv and argv[0].startswith("--"):
        flag = argv.pop(0)
        if flag == "--engine" and argv:
            engine = argv.pop(0)
        elif flag == "--single-process":
            single = True
        else:
            raise SystemExit(f"accelport.launch.worker: unknown option {flag!r}")
    if not argv:
        raise SystemExit("usage: python -m accelport.launch.worker [--engine torchrun|xla] SCRIPT [ARGS ...]")
    script, args = argv[0], argv[1:]
    if engine == "xla":
        import torch_xla  # only here, in the launched job: never to detect anything

        # By its importable name: spawned replicas unpickle it from there, not from __main__.
        from accelport.launch.worker import _xla_replica as replica

        torch_xla.launch(replica, args=(script, args), debug_single_process=single)
    elif engine == "torchrun":
        run_script(int(os.environ.get("RANK", "0")), script, args)
    else:
        raise SystemExit(f"accelport.launch.worker: unknown engine {engine!r} (torchrun or xla)")


if __name__ == "__main__":
    main()
