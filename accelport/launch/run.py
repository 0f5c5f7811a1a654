"""Run a launch plan to its end: start the workers, watch them, name the first that failed.

The plan (:mod:`accelport.launch.plan`) says what to start; this module starts
it on the engine the backend trusts (torchrun, or torch_xla's own launcher)
and turns a worker's failure into one :class:`WorkerFailedError`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from accelport.errors import AccelportError
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


class WorkerFailedError(AccelportError):
    """A worker failed; the others were stopped. ``first`` is the one that failed first."""

    def __init__(self, first: WorkerFailure, failures: list[WorkerFailure]) -> None:
        self.first = first
        self.failures = failures
        others = [f for f in failures if f is not first]
        tail = ""
        if others:
            tail = "; then " + ", ".join(f"rank {f.rank} ({_short(f.error)})" for f in others)
        super().__init__(f"rank {first.rank} failed first: {first.error}{tail}")

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
    try:
        if plan.engine == "torchrun":
            _run_torchrun(plan, env, launch_dir)
        else:
            _run_subprocess(plan, env, launch_dir)
    finally:
        shutil.rmtree(launch_dir, ignore_errors=True)


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
        if sig is not None and sig not in ("SIGTERM", "SIGINT"):
            return (0, f.time or 0.0)
        if f.traceback:
            return (1, f.time or 0.0)
        return (2 if sig is None else 3, f.time or 0.0)

    return min(failures, key=key)


def _failure_from(rank: int, exitcode: int | None, record: dict[str, Any] | None,
                  pid: int | None = None, observed: float | None = None) -> WorkerFailure:
    if record is not None:
        return WorkerFailure(rank, exitcode, record.get("error", ""), record.get("traceback", ""),
                             record.get("host", ""), record.get("pid", pid), record.get("time"))
    sig = _signal_name(exitcode)
    if sig == "SIGTERM":
        error = "stopped by the launcher after another worker failed (SIGTERM)"
    elif sig is not None:
        hint = " (out of memory?)" if sig == "SIGKILL" else ""
        error = f"killed by {sig}{hint}"
    else:
        error = f"exited with status {exitcode} without raising a Python exception"
    return WorkerFailure(rank, exitcode, error, "", os.uname().nodename, pid, observed)


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
        try:
            torchrun.run(args)
        except ChildFailedError as exc:
            records = _records(launch_dir)
            failures = [
                _failure_from(int(rank), pf.exitcode, records.get(int(rank)), pf.pid, float(pf.timestamp))
                for rank, pf in sorted(exc.failures.items())
            ]
            raise WorkerFailedError(_first(failures), failures) from None
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
        os.environ.clear()
        os.environ.update(saved)


def _run_subprocess(plan: LaunchPlan, env: dict[str, str], launch_dir: str) -> None:
    code = subprocess.run(plan.command, env=env).returncode
    if code == 0:
        return
    records = _records(launch_dir)
    failures = [_failure_from(rank, code, rec) for rank, rec in sorted(records.items())]
    if not failures:
        failures = [_failure_from(0, code, None)]
    raise WorkerFailedError(_first(failures), failures)
