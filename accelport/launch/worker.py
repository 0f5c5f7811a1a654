"""What ``accelport launch`` runs in each worker: the user's script, as ``python script.py`` would.

    python -m accelport.launch.worker [--engine torchrun|xla] [--single-process]
                                      [--diagnose [--diagnose-arg OPTION] ...] SCRIPT [ARGS ...]

With ``--engine torchrun`` (the default) torchrun has already started one
process per replica and this module runs the script in it. With ``--engine
xla`` it hands the script to ``torch_xla.launch``, which starts one process per
device it finds (``--single-process``: one process, torch_xla's debug mode).

If the script raises, or ends with ``sys.exit(non-zero)`` or ``sys.exit("message")``,
the error is recorded (when the launcher asked for it through
``ACCELPORT_LAUNCH_DIR``) with a precise time, so the launcher can name the
replica that failed first, not one that failed because a peer vanished; then the
exception propagates as usual (traceback on this worker's stderr, exit status 1
or the script's own) without waiting for the other replicas at exit. If it
returns (or exits with status 0), the worker says so (``done-rank<N>.json``),
waits for the other replicas and destroys the process group (see
:func:`accelport.eager.teardown_process_group`).

While the script runs, a thread of the wrapper answers the launcher's probes
(:mod:`accelport.launch.heartbeat`): the script's own line, and the collective it
waits in, if it is inside one.

On Linux every worker asks the kernel to kill it when the process that started
it ends (``PR_SET_PDEATHSIG``): torchrun starts its workers in sessions of their
own, so a launcher killed with SIGKILL (which cannot stop them itself) would
otherwise leave them running. Workers beat a heartbeat file as their steps end,
for ``--timeout`` (:mod:`accelport.launch.heartbeat`).
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Mapping
from typing import Any

from accelport.errors import mark_ending_with_error
from accelport.launch.heartbeat import (
    DONE_PREFIX,
    HEARTBEAT_PREFIX,
    PROBE_FILE,
    WHERE_PREFIX,
    attempt,
    beat,
    read,
    write_json,
)
from accelport.launch.stop import EXIT_PREEMPTED, STOPPED_PREFIX

__all__ = ["main", "run_script", "die_with_parent", "locate", "api_functions", "record_failure", "FAILURE_PREFIX"]

#: Failure records are ``$ACCELPORT_LAUNCH_DIR/<FAILURE_PREFIX><rank>.json``.
FAILURE_PREFIX = "failure-rank"


def _describe(exc: BaseException) -> str:
    """The one-line error the launcher shows for ``exc``."""
    if isinstance(exc, SystemExit):
        code = exc.code
        if isinstance(code, int):  # (bool too: sys.exit(True) is status 1)
            return f"SystemExit: exit status {int(code)}"
        return f"SystemExit: {code} (exit status 1)"  # sys.exit("message") prints it and exits with 1
    return f"{type(exc).__name__}: {exc}"


def record_failure(rank: int, exc: BaseException) -> None:
    """Record why this worker fails, and leave its process group alone at exit (the peers may never come)."""
    mark_ending_with_error()  # (nor does any exit hook run device work that may wait for them)
    if "accelport.eager" in sys.modules:  # (otherwise no process group of accelport's to leave alone)
        from accelport.eager import skip_teardown_at_exit

        skip_teardown_at_exit()
    directory = os.environ.get("ACCELPORT_LAUNCH_DIR")
    if not directory:
        return
    record = {
        "rank": rank,
        "local_rank": int(os.environ.get("LOCAL_RANK", rank)),
        "host": os.uname().nodename,
        "pid": os.getpid(),
        "time": time.time(),
        "error": _describe(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "attempt": attempt(os.environ),
    }
    # Not over a verdict the launcher wrote before it stopped this worker (a peer's failure
    # seen while the stop was under way is not this rank's own). If it cannot be written,
    # the launcher falls back to the exit status.
    write_json(os.path.join(directory, f"{FAILURE_PREFIX}{rank}.json"), record, replace=False)


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


def _runtime() -> Any:
    """This process's accelport runtime, if the script imported accelport's runtime at all."""
    return getattr(sys.modules.get("accelport.runtime.state"), "RUNTIME", None)


def _steps_taken() -> int | None:
    """Training steps this process ended through accelport, if it used accelport at all."""
    runtime = _runtime()
    if runtime is None or runtime.selected is None:
        return None
    return int(runtime.tracker.steps)


def _waiting_in(thread: int) -> str | None:
    """The world collective of accelport's that ``thread`` waits in now, as its backend marked it."""
    runtime = _runtime()
    collectives = getattr(runtime.selected, "collectives", None) if runtime is not None else None
    return None if collectives is None else collectives.waiting_in(thread)


def _finished(rank: int, directory: str | None) -> None:
    """The script returned: say so, then wait for the others and destroy the process group."""
    from accelport.eager import teardown_process_group

    path = os.path.join(directory, f"{DONE_PREFIX}{rank}.json") if directory else None
    record = {"rank": rank, "pid": os.getpid(), "time": time.time(), "steps": _steps_taken(),
              "attempt": attempt(os.environ)}
    if path:
        write_json(path, record)  # before the wait: a rank that finished is not one that hangs
    met = teardown_process_group()
    if path and met is not None:
        write_json(path, {**record, "peers_met": met})


#: torch.distributed's own files: a script inside them waits in a collective (of any group).
_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep
#: Seconds between two looks at the probe file: a stat each time, nothing else.
PROBE_POLL_S = 0.5


def api_functions(api: Any) -> dict[types.CodeType, str]:
    """The code of ``api``'s (``accelport``'s) public functions, by the name the user calls them (``ap.save``)."""
    out: dict[types.CodeType, str] = {}
    for name in getattr(api, "__all__", ()):
        code = getattr(api.__dict__.get(name), "__code__", None)  # (not through the lazy __getattr__)
        if isinstance(code, types.CodeType):
            out[code] = f"ap.{name}"
    return out


def locate(frame: types.FrameType | None, api: Mapping[types.CodeType, str],
           world: str | None = None) -> dict[str, Any]:
    """Where a thread whose innermost frame is ``frame`` is: its user's line, and what it waits in.

    ``world`` is the world collective the thread's backend says it waits in now
    (:meth:`accelport.collectives.Collectives.waiting_in`): only the code that waits for
    the other ranks is marked, not the rest of ``ap.optimizer_step`` (the optimizer's own
    step, the step hooks). ``where`` is ``file:line`` of the innermost frame outside
    accelport, torch and the import machinery, ``code`` that line's text; ``waiting``
    the collective it is inside, named by the outermost of accelport's functions on the
    stack (``ap.optimizer_step``, ``ap.save``) when marked, else the innermost
    torch.distributed function (``torch.distributed.all_reduce``), else None; and
    ``world`` whether it is one of accelport's over every rank; ``script_running`` False where no frame of the
    script is on the stack (accelport's own code runs: under ``accelport diagnose``, before the script starts
    or after it ended, gathering the job's ranks).
    """
    from accelport.observe.frames import user_site  # the same "user's line" as diagnose shows

    outermost, innermost = None, None
    f = frame
    while f is not None:
        code = f.f_code
        if code in api:
            outermost = api[code]
        elif innermost is None and world is None and _DISTRIBUTED in os.path.abspath(code.co_filename):
            # The innermost of torch.distributed's frames: all_reduce, not its logging wrapper.
            innermost = f"torch.distributed.{code.co_name}"
        f = f.f_back
    waiting = (outermost or world) if world is not None else innermost
    site = user_site(frame) if frame is not None else None
    text = ""
    if site is not None:
        import linecache

        text = linecache.getline(site[0], site[1]).strip()
    return {"where": f"{site[0]}:{site[1]}" if site else None, "code": text, "waiting": waiting,
            "world": world is not None, "script_running": site is not None or frame is None}


class _Responder(threading.Thread):
    """Answers the launcher's probes: where the script's thread is now, and what it waits in."""

    def __init__(self, directory: str, rank: int, thread: int, steps: Callable[[], int | None],
                 waiting_in: Callable[[int], str | None]) -> None:
        super().__init__(name="accelport-launch-probe", daemon=True)
        self.question = os.path.join(directory, PROBE_FILE)
        self.answer = os.path.join(directory, f"{WHERE_PREFIX}{rank}.json")
        self.thread, self.steps, self.waiting_in = thread, steps, waiting_in

    def run(self) -> None:
        seen: tuple[int, int] | None = None
        answered = None
        while True:
            time.sleep(PROBE_POLL_S)
            try:
                st = os.stat(self.question)
            except OSError:
                continue
            if (st.st_mtime_ns, st.st_ino) == seen:
                continue
            seen = (st.st_mtime_ns, st.st_ino)
            seq = (read(self.question) or {}).get("seq")
            if seq is None or seq == answered:
                continue
            answered = seq
            try:
                world = self.waiting_in(self.thread)
                frame = sys._current_frames().get(self.thread)
                place = locate(frame, api_functions(sys.modules.get("accelport")), world)
                del frame
            except Exception as exc:  # an answer without a place is still an answer
                place = {"where": None, "code": "", "waiting": None, "world": False, "error": repr(exc)}
            write_json(self.answer, {"seq": seq, "pid": os.getpid(), "time": time.time(), "steps": self.steps(),
                                     "attempt": attempt(os.environ), **place})


def run_script(rank: int, script: str, args: list[str], diagnose: list[str] | None = None) -> None:
    """Run ``script`` as ``__main__`` with ``args``; record a failure before it propagates. ``diagnose``: run it
    as ``accelport diagnose DIAGNOSE -- script args`` runs it (the program, as `python -m accelport` would), so
    the worker is watched and rank 0 says the job's findings."""
    directory = os.environ.get("ACCELPORT_LAUNCH_DIR") or None
    if directory and attempt(os.environ):
        _forget_attempt(directory, rank)
    if directory:
        _Responder(directory, rank, threading.get_ident(), _steps_taken, _waiting_in).start()
        heartbeat = os.path.join(directory, f"{HEARTBEAT_PREFIX}{rank}")
        os.environ["ACCELPORT_HEARTBEAT"] = heartbeat  # read by the launch-heartbeat plugin on first use
        beat(heartbeat, 0)
    try:
        if diagnose is not None:
            sys.argv = ["accelport", "diagnose", *diagnose, "--", script, *args]
            runpy.run_module("accelport", run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *args]
            # As `python script.py` does: the script's own directory comes first on sys.path.
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        # A stop request that saved (ap.Checkpointer) ends every rank at the same step: they meet at exit.
        if exc.code not in (None, 0, EXIT_PREEMPTED):  # sys.exit("message") or a non-zero status: this rank fails
            record_failure(rank, exc)
            raise
        _finished(rank, directory)
        raise
    except BaseException as exc:
        record_failure(rank, exc)
        raise
    _finished(rank, directory)


def _forget_attempt(directory: str, rank: int) -> None:
    """A restarted worker: what this rank told the launcher in the attempt before is not about this one."""
    for name in (f"{FAILURE_PREFIX}{rank}.json", f"{DONE_PREFIX}{rank}.json", f"{WHERE_PREFIX}{rank}.json",
                 f"{STOPPED_PREFIX}{rank}.json"):
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            pass


def _xla_replica(index: int, script: str, args: list[str]) -> None:
    # torch_xla.launch calls this in each replica process with its global ordinal; the
    # replica's parent is the worker that called torch_xla.launch.
    die_with_parent(_launcher_pid())
    run_script(index, script, args)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    engine, single = "torchrun", False
    diagnose: list[str] | None = None
    while argv and argv[0].startswith("--"):
        flag = argv.pop(0)
        if flag == "--engine" and argv:
            engine = argv.pop(0)
        elif flag == "--single-process":
            single = True
        elif flag == "--diagnose":
            diagnose = diagnose or []
        elif flag == "--diagnose-arg" and argv and diagnose is not None:
            diagnose.append(argv.pop(0))
        else:
            raise SystemExit(f"accelport.launch.worker: unknown option {flag!r}")
    if not argv:
        raise SystemExit("usage: python -m accelport.launch.worker [--engine torchrun|xla] SCRIPT [ARGS ...]")
    script, args = argv[0], argv[1:]
    die_with_parent(_launcher_pid())
    if engine == "xla":
        import torch_xla  # only here, in the launched job: never to detect anything

        os.environ["ACCELPORT_LAUNCHER_PID"] = str(os.getpid())  # the replicas' parent
        if not single:
            # The launcher signals the whole group: the replicas save and exit; this parent waits for them
            # (ended by the signal, it would take them with it: they die with their parent).
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: None)

        # By its importable name: spawned replicas unpickle it from there, not from __main__.
        from accelport.launch.worker import _xla_replica as replica

        torch_xla.launch(replica, args=(script, args), debug_single_process=single)
    elif engine == "torchrun":
        run_script(int(os.environ.get("RANK", "0")), script, args, diagnose)
    else:
        raise SystemExit(f"accelport.launch.worker: unknown engine {engine!r} (torchrun or xla)")


if __name__ == "__main__":
    main()
