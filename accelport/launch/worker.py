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
exit status 1). If it returns, the worker says so (``done-rank<N>.json``), waits
for the other replicas and destroys the process group (see
:func:`accelport.eager.teardown_process_group`).

On Linux every worker asks the kernel to kill it when the process that started
it ends (``PR_SET_PDEATHSIG``): torchrun starts its workers in sessions of their
own, so a launcher killed with SIGKILL (which cannot stop them itself) would
otherwise leave them running. Workers beat a heartbeat file as their steps end,
for ``--timeout`` (:mod:`accelport.launch.heartbeat`).
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
import traceback

from accelport.launch.heartbeat import DONE_PREFIX, HEARTBEAT_PREFIX, beat, write_json

__all__ = ["main", "run_script", "die_with_parent", "FAILURE_PREFIX"]

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


#: prctl(2) option: the signal this process gets when its parent ends (<linux/prctl.h>).
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None) -> bool:
    """Linux: have the kernel SIGKILL this process when its parent ends. False where that is not possible.

    ``parent`` is the pid the parent had; if it has already ended (this process was
    adopted before the call), exit at once rather than run unsupervised.
    """
    if not sys.platform.startswith("linux") or parent == os.getpid():  # (a single-process replica: itself)
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent is not None and os.getppid() != parent:
        os._exit(1)  # the launcher is gone already: nobody would ever stop this worker
    return True


def _launcher_pid() -> int | None:
    try:
        return int(os.environ["ACCELPORT_LAUNCHER_PID"])
    except (KeyError, ValueError):
        return None


def _steps_taken() -> int | None:
    """Training steps this process ended through accelport, if it used accelport at all."""
    state = sys.modules.get("accelport.runtime.state")
    runtime = getattr(state, "RUNTIME", None)
    if runtime is None or runtime.selected is None:
        return None
    return int(runtime.tracker.steps)


def _finished(rank: int, directory: str | None) -> None:
    """The script returned: say so, then wait for the others and destroy the process group."""
    from accelport.eager import teardown_process_group

    path = os.path.join(directory, f"{DONE_PREFIX}{rank}.json") if directory else None
    record = {"rank": rank, "pid": os.getpid(), "time": time.time(), "steps": _steps_taken()}
    if path:
        write_json(path, record)  # before the wait: a rank that finished is not one that hangs
    met = teardown_process_group()
    if path and met is not None:
        write_json(path, {**record, "peers_met": met})


def run_script(rank: int, script: str, args: list[str]) -> None:
    """Run ``script`` as ``__main__`` with ``args``; record a failure before it propagates."""
    directory = os.environ.get("ACCELPORT_LAUNCH_DIR") or None
    if directory:
        heartbeat = os.path.join(directory, f"{HEARTBEAT_PREFIX}{rank}")
        os.environ["ACCELPORT_HEARTBEAT"] = heartbeat  # read by the launch-heartbeat plugin on first use
        beat(heartbeat, 0)
    sys.argv = [script, *args]
    # As `python script.py` does: the script's own directory comes first on sys.path.
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _record_failure(rank, exc)
            raise
        _finished(rank, directory)
        raise
    except BaseException as exc:
        _record_failure(rank, exc)
        raise
    _finished(rank, directory)


def _xla_replica(index: int, script: str, args: list[str]) -> None:
    # torch_xla.launch calls this in each replica process with its global ordinal; the
    # replica's parent is the worker that called torch_xla.launch.
    die_with_parent(_launcher_pid())
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
    die_with_parent(_launcher_pid())
    if engine == "xla":
        import torch_xla  # only here, in the launched job: never to detect anything

        os.environ["ACCELPORT_LAUNCHER_PID"] = str(os.getpid())  # the replicas' parent

        # By its importable name: spawned replicas unpickle it from there, not from __main__.
        from accelport.launch.worker import _xla_replica as replica

        torch_xla.launch(replica, args=(script, args), debug_single_process=single)
    elif engine == "torchrun":
        run_script(int(os.environ.get("RANK", "0")), script, args)
    else:
        raise SystemExit(f"accelport.launch.worker: unknown engine {engine!r} (torchrun or xla)")


if __name__ == "__main__":
    main()
