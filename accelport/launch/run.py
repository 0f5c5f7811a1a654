"""Run a launch plan to its end: start the workers, watch them, name the first that failed.

The plan (:mod:`accelport.launch.plan`) says what to start; this module starts
it on the engine the backend trusts (torchrun, or torch_xla's own launcher)
and turns a worker's failure into one :class:`WorkerFailedError`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from accelport.errors import AccelportError
from accelport.launch.heartbeat import DONE_PREFIX, HEARTBEAT_PREFIX, read, write_json
from accelport.launch.plan import LaunchError, LaunchPlan, check_resolves

__all__ = ["WorkerFailure", "WorkerFailedError", "parent_launch_env", "run_plan"]


@dataclass
class WorkerFailure:
    """One worker that ended badly, as the launcher saw it."""

    rank: int
    exitcode: int | None
    error: str
    traceback: str = ""
    host: str = ""
    pid: int | None = None
    time: float | None = None
    #: raised, exit, signal, stopped (by the launcher), stalled (no progress within --timeout),
    #: ended-early (its script returned while the others still needed it).
    cause: str = ""

    @property
    def headline(self) -> str:
        """How this worker ended, after "rank N": the launch's one-line summary when it is the first."""
        verb = {"stalled": "stopped making progress", "ended-early": "ended early"}.get(self.cause, "failed first")
        return f"{verb}: {self.error}"


class WorkerFailedError(AccelportError):
    """A worker failed; the others were stopped. ``first`` is the one that failed first."""

    def __init__(self, first: WorkerFailure, failures: list[WorkerFailure]) -> None:
        self.first = first
        self.failures = failures
        others = [f for f in failures if f is not first]
        tail = ""
        if others:
            tail = "; then " + ", ".join(f"rank {f.rank} ({_short(f.error)})" for f in others)
        super().__init__(f"rank {first.rank} {first.headline}{tail}")

    @property
    def exit_status(self) -> int:
        code = self.first.exitcode
        return code if code is not None and 0 < code < 256 else 1

    def to_dict(self) -> dict[str, Any]:
        return {"first": asdict(self.first), "failures": [asdict(f) for f in self.failures]}


def _short(text: str, limit: int = 80) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line if len(line) <= limit else line[: limit - 3] + "..."


_PARENT_ENV_CODE = """
import importlib, json, os, sys
module, function, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
for name in filter(None, sys.argv[4].split(",")):
    importlib.import_module(name)  # the vendor package that registers the function's module
before = dict(os.environ)
getattr(importlib.import_module(module), function)(**kwargs)
changed = {k: v for k, v in os.environ.items() if before.get(k) != v}
print("ACCELPORT_LAUNCH_ENV=" + json.dumps(changed), flush=True)
"""


def parent_launch_env(spec: str, kwargs: Mapping[str, int], environ: Mapping[str, str],
                      *, python: str | None = None, timeout: float = 900,
                      preload: str | None = None) -> dict[str, str]:
    """Call ``module:function(**kwargs)`` in a child process; return the variables it set.

    ``preload`` names a module to import first: ``torch.tpu`` exists only once
    ``torch_tpu`` is imported, which autoload does not do when
    ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``.

    A child, not this process: the function imports a vendor runtime (TorchTPU
    reads the devices, and may kill the process when libtpu is missing), and the
    launcher must stay able to report any failure.
    """
    module, sep, function = spec.partition(":")
    if not sep or not module or not function:
        raise LaunchError(f"launch_env_function must be 'module:function', not {spec!r}")
    call = f"{spec}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"
    try:
        out = subprocess.run([python or sys.executable, "-c", _PARENT_ENV_CODE, module, function,
                              json.dumps(dict(kwargs)), preload or ""], env=dict(environ), capture_output=True,
                             text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{call} did not finish within {timeout:.0f} s on this host") from None
    for line in reversed(out.stdout.splitlines()):
        if out.returncode == 0 and line.startswith("ACCELPORT_LAUNCH_ENV="):
            return {str(k): str(v) for k, v in json.loads(line.split("=", 1)[1]).items()}
    lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else f"exit status {out.returncode}, no output"
    raise LaunchError(f"{call} failed on this host before any worker started: {last}")


def run_plan(plan: LaunchPlan, environ: Mapping[str, str] | None = None) -> None:
    """Run ``plan`` to the end. Raises :class:`WorkerFailedError` naming the first failed rank."""
    base = dict(os.environ if environ is None else environ)
    if not plan.available:
        from accelport.errors import BackendUnavailableError

        raise BackendUnavailableError(plan.backend, plan.reason, "--backend")
    check_resolves(plan.rendezvous)
    env = {**base, **plan.env}
    if plan.parent_env_function:
        env.update(parent_launch_env(plan.parent_env_function, plan.parent_env_kwargs, env,
                                     python=plan.command[0], preload=plan.parent_env_preload))
    launch_dir = tempfile.mkdtemp(prefix="accelport-launch-")
    env["ACCELPORT_LAUNCH_DIR"] = launch_dir
    env["ACCELPORT_LAUNCHER_PID"] = str(os.getpid())  # each worker dies with this process (worker.py)
    try:
        if plan.engine == "torchrun":
            _run_torchrun(plan, env, launch_dir)
        else:
            _run_subprocess(plan, env, launch_dir)
    finally:
        shutil.rmtree(launch_dir, ignore_errors=True)


# -- --timeout: a job that stops making progress -------------------------------------------

#: Seconds between SIGTERM and SIGKILL for a worker the launcher stops.
STOP_GRACE_S = 10.0


def _ranked(launch_dir: str, prefix: str, suffix: str = "") -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    try:
        names = os.listdir(launch_dir)
    except OSError:
        return out
    for name in names:
        number = name[len(prefix):len(name) - len(suffix)] if suffix else name[len(prefix):]
        if name.startswith(prefix) and name.endswith(suffix) and number.isdigit():
            record = read(os.path.join(launch_dir, name))
            if record is not None:
                out[int(number)] = record
    return out


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc); [] where that cannot be read."""
    found: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and fields[1] == str(pid):
            found.append(int(entry))
    return found


def _signal_group(pid: int, sig: int) -> None:
    """``sig`` to ``pid``'s process group where it leads one (torchrun's workers do), else to ``pid``."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except OSError:
        pass  # it ended already


def _stop(pids: list[int]) -> None:
    """SIGTERM ``pids`` (their groups), then SIGKILL whatever is left after :data:`STOP_GRACE_S`."""
    for pid in pids:
        _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline:
        if not any(_alive(pid) for pid in pids):
            return
        time.sleep(0.1)
    for pid in pids:
        _signal_group(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True


class _Watchdog(threading.Thread):
    """Stops the job when a worker has not ended a step for ``timeout`` seconds (see launch.heartbeat).

    Progress is a training step ending (``ap.optimizer_step``) on each worker that has not
    finished its script; before its first step, the time since the worker started counts.
    A stalled worker gets a failure record saying so, then every worker is stopped and the
    engine reports them as failed, so the launch ends like any other failure.
    """

    def __init__(self, launch_dir: str, timeout: int, expected: int | None,
                 workers: Callable[[], list[int]]) -> None:
        super().__init__(name="accelport-launch-watchdog", daemon=True)
        self.launch_dir, self.timeout, self.expected, self.workers = launch_dir, timeout, expected, workers
        self.started_at = time.time()
        self.fired = False
        self._done = threading.Event()

    def close(self) -> None:
        self._done.set()

    def run(self) -> None:
        poll = min(1.0, self.timeout / 5)
        while not self._done.wait(poll):
            if self.check(time.time()):
                return

    def check(self, now: float) -> bool:
        """Stop the job if it stalled at ``now``; True when it did."""
        beats = _ranked(self.launch_dir, HEARTBEAT_PREFIX)
        done = _ranked(self.launch_dir, DONE_PREFIX, ".json")
        stalled = {rank: beat for rank, beat in beats.items()
                   if rank not in done and now - float(beat.get("time") or 0) > self.timeout}
        missing = (self.expected or 0) - len(beats)
        if not stalled and not (missing > 0 and now - self.started_at > self.timeout):
            return False
        self.fired = True
        from accelport.launch.worker import FAILURE_PREFIX

        for rank, beat in stalled.items():
            step = int(beat.get("step") or 0)
            since = now - float(beat.get("time") or now)
            last = f"last heartbeat at step {step}" if step else "none since it started"
            write_json(os.path.join(self.launch_dir, f"{FAILURE_PREFIX}{rank}.json"), {
                "rank": rank, "pid": beat.get("pid"), "host": os.uname().nodename, "time": now,
                "stalled": True, "step": step,
                "error": f"no training step ended for {since:.0f} s ({last}), more than --timeout {self.timeout}; "
                         "stopped by the launcher (a hang outside a collective, or a wait inside one for a rank "
                         "that hangs)"})
        pids = {int(b["pid"]) for b in beats.values() if isinstance(b.get("pid"), int)}
        _stop(sorted(pids | set(self.workers())))
        return True


def _watch(plan: LaunchPlan, launch_dir: str, workers: Callable[[], list[int]]) -> _Watchdog | None:
    if not plan.timeout:
        return None
    dog = _Watchdog(launch_dir, plan.timeout, plan.nprocs if plan.engine == "torchrun" else None, workers)
    dog.start()
    return dog


#: Errors of a worker whose peer went away (it waited for it in a collective).
_LOST_PEER = re.compile(r"Connection (closed|reset) by peer|Broken pipe|DistNetworkError|DistBackendError|"
                        r"gloo|NCCL|timed out|Timeout", re.IGNORECASE)


def _explain(failures: list[WorkerFailure], launch_dir: str,
             dog: _Watchdog | None) -> tuple[WorkerFailure, list[WorkerFailure]]:
    """The first failure and all of them, with a rank that finished early named as the cause.

    A rank whose script returned (exit status 0) while the others still ran leaves them
    waiting for it in a collective it never joins: they fail with a lost connection or
    stall, and the one torchrun reports first is a victim, not the cause.
    """
    if dog is not None and dog.fired:  # the launcher stopped them: say why, not "another worker failed"
        beats = _ranked(launch_dir, HEARTBEAT_PREFIX)
        for i, f in enumerate(failures):
            if f.cause != "stopped":
                continue
            if f.rank in beats:
                f.error = f"stopped by the launcher (--timeout {dog.timeout}) when another rank stopped making progress"
            else:
                failures[i] = WorkerFailure(
                    f.rank, f.exitcode, f"never started its script within --timeout {dog.timeout} s of the launch "
                    "(stuck starting Python or importing?); stopped by the launcher", "", f.host, f.pid, f.time,
                    "stalled")
    first = _first(failures)
    early = [d for d in _ranked(launch_dir, DONE_PREFIX, ".json").values()
             if d.get("peers_met") is not True and isinstance(d.get("rank"), int)
             and float(d.get("time") or 0) <= (first.time or float("inf"))]
    if not early or not (first.cause == "stalled" or _LOST_PEER.search(first.error)):
        return first, failures
    ended = min(early, key=lambda d: float(d.get("time") or 0))
    others = sorted(f.rank for f in failures if f.rank != ended["rank"])
    steps = f" after {ended['steps']} step(s)" if isinstance(ended.get("steps"), int) else ""
    who = ", ".join(map(str, others)) or "the others"
    error = (f"its script returned{steps} (exit status 0) while rank {who} still ran and waited for it in a "
             f"collective it never joined; then rank {first.rank}: {_short(first.error)}. Every rank must run "
             "the same steps and collectives: give each the same number of batches (ap.loader(..., shard=True) "
             "does) and keep collectives out of branches that depend on the rank")
    cause = WorkerFailure(ended["rank"], 0, error, "", os.uname().nodename, ended.get("pid"),
                          float(ended.get("time") or 0), "ended-early")
    rest = [f for f in failures if f.rank != ended["rank"]]
    return cause, [cause, *rest]


def _records(launch_dir: str) -> dict[int, dict[str, Any]]:
    from accelport.launch.worker import FAILURE_PREFIX

    out: dict[int, dict[str, Any]] = {}
    for name in os.listdir(launch_dir):
        if name.startswith(FAILURE_PREFIX) and name.endswith(".json"):
            try:
                with open(os.path.join(launch_dir, name)) as f:
                    record = json.load(f)
                out[int(record["rank"])] = record
            except (OSError, ValueError, KeyError):
                continue
    return out


def _signal_name(exitcode: int | None) -> str | None:
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _first(failures: list[WorkerFailure]) -> WorkerFailure:
    """The root cause, as far as the launcher can tell.

    A worker killed by a signal other than the launcher's own SIGTERM (out of
    memory, a crash) had no chance to record anything and is nearly always the
    cause; otherwise the earliest recorded error. Peers that lost their
    connection, or that the launcher stopped, come later.
    """
    def key(f: WorkerFailure) -> tuple[int, float]:
        sig = _signal_name(f.exitcode)
        if f.cause == "stalled":  # the launcher's own verdict, stopped with SIGTERM by it
            return (2, f.time or 0.0)
        if sig is not None and sig not in ("SIGTERM", "SIGINT"):
            return (0, f.time or 0.0)
        if f.traceback:
            return (1, f.time or 0.0)
        return (3 if sig is None else 4, f.time or 0.0)

    return min(failures, key=key)


def _failure_from(rank: int, exitcode: int | None, record: dict[str, Any] | None,
                  pid: int | None = None, observed: float | None = None) -> WorkerFailure:
    if record is not None:
        cause = "stalled" if record.get("stalled") else "raised"
        return WorkerFailure(rank, exitcode, record.get("error", ""), record.get("traceback", ""),
                             record.get("host", ""), record.get("pid", pid), record.get("time"), cause)
    sig = _signal_name(exitcode)
    if sig == "SIGTERM":
        error, cause = "stopped by the launcher after another worker failed (SIGTERM)", "stopped"
    elif sig is not None:
        hint = " (out of memory?)" if sig == "SIGKILL" else ""
        error, cause = f"killed by {sig}{hint}", "signal"
    else:
        error, cause = f"exited with status {exitcode} without raising a Python exception", "exit"
    return WorkerFailure(rank, exitcode, error, "", os.uname().nodename, pid, observed, cause)


def _run_torchrun(plan: LaunchPlan, env: dict[str, str], launch_dir: str) -> None:
    # torchrun reads the workers' environment from os.environ: set it for the run only.
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        from torch.distributed import DistError
        from torch.distributed import run as torchrun
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.elastic.rendezvous.api import RendezvousError

        args = torchrun.parse_args(plan.command[3:])
        launcher = os.getpid()  # torchrun runs here: its workers are this process's children
        dog = _watch(plan, launch_dir, lambda: _children(launcher))
        try:
            torchrun.run(args)
        except ChildFailedError as exc:
            records = _records(launch_dir)
            failures = [
                _failure_from(int(rank), pf.exitcode, records.get(int(rank)), pf.pid, float(pf.timestamp))
                for rank, pf in sorted(exc.failures.items())
            ]
            raise WorkerFailedError(*_explain(failures, launch_dir, dog)) from None
        except (RendezvousError, DistError) as exc:
            # A static rendezvous (--master-addr) fails with the store's DistError (a client that
            # cannot connect, a master whose clients never came); c10d with a RendezvousError.
            where = plan.rendezvous
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else "no details"
            waited = f" within {where['timeout_s']} s" if where.get("timeout_s") else ""
            raise LaunchError(
                f"the {plan.nnodes} hosts did not meet{waited} ({type(exc).__name__}: {detail}); check "
                "that every host runs the same command with the same --nnodes and --rdzv-endpoint (or "
                "--master-addr), that the address is reachable from all of them, and --rdzv-timeout "
                "if the hosts start far apart") from None
        except SignalException as exc:
            raise LaunchError(f"the launch received {exc.sigval.name}; all workers were stopped") from None
        finally:
            if dog is not None:
                dog.close()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _run_subprocess(plan: LaunchPlan, env: dict[str, str], launch_dir: str) -> None:
    # A session of its own: the watchdog (and an interrupt) stop torch_xla's replicas with it.
    proc = subprocess.Popen(plan.command, env=env, start_new_session=True)
    dog = _watch(plan, launch_dir, lambda: [proc.pid])
    try:
        code = proc.wait()
    except BaseException:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    finally:
        if dog is not None:
            dog.close()
    if code == 0:
        return
    records = _records(launch_dir)
    failures = [_failure_from(rank, code, rec) for rank, rec in sorted(records.items())]
    if not failures:
        failures = [_failure_from(0, code, None)]
    raise WorkerFailedError(*_explain(failures, launch_dir, dog))
