"""``accelport launch``: start the workers on the engine each backend's ecosystem trusts.

- eager backends (cpu, cuda, tpu, neuron): torchrun (``torch.distributed.run``),
  one process per device, run in this process so a failure is caught as data, not
  as a traceback;
- lazy XLA backends: ``torch_xla.launch``, which starts one process per device it
  finds (through :mod:`accelport._worker`).

A plan (:class:`LaunchPlan`) is built first and never imports torch, so
``--dry-run`` shows exactly the command and environment that would run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .contract import Backend
from .errors import AccelportError

__all__ = [
    "ENGINES",
    "LaunchError",
    "LaunchPlan",
    "Rendezvous",
    "WorkerFailedError",
    "build_plan",
    "engine_for",
    "parent_launch_env",
    "run_plan",
]

ENGINES = ("torchrun", "xla")

#: PJRT device torch_xla uses on each platform when PJRT_DEVICE is not set.
_PJRT_BY_PLATFORM = {"gcp-tpu": "TPU", "aws-neuron": "NEURON"}
#: The variable that sets how many devices torch_xla replicates over, per PJRT device.
_XLA_NUM_DEVICES = {"CPU": "CPU_NUM_DEVICES", "NEURON": "NEURONCORE_NUM_DEVICES"}

#: How long (seconds) a host waits for the others of a multi-host job before the launch
#: fails, unless --rdzv-timeout says otherwise: torchrun's own default, now passed
#: explicitly, so the bound is visible in a dry run and stays the same across torch versions.
RDZV_TIMEOUT_S = 600
#: The --rdzv-conf key each rendezvous backend reads its timeout from (torch 2.x:
#: static_tcp_rendezvous.py and etcd_rendezvous.py read "timeout"; the dynamic
#: rendezvous of c10d and etcd-v2 reads "join_timeout").
_RDZV_TIMEOUT_KEY = {"static": "timeout", "etcd": "timeout"}


class LaunchError(AccelportError):
    """The launch itself could not start or finish (not a worker's own error)."""


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


@dataclass(frozen=True)
class Rendezvous:
    """How the hosts of a multi-host job find each other (torchrun's options)."""

    nnodes: str = "1"
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str | None = None
    rdzv_id: str | None = None
    #: Seconds to wait for the other hosts (default :data:`RDZV_TIMEOUT_S`).
    rdzv_timeout: int | None = None

    def max_nodes(self) -> int:
        return int(self.nnodes.split(":")[-1])

    def given(self) -> list[str]:
        """The options that were set (beyond the single-host default)."""
        names = [k for k, v in asdict(self).items() if k != "nnodes" and v is not None]
        return (["nnodes"] if self.nnodes != "1" else []) + names


@dataclass(frozen=True)
class LaunchPlan:
    """Everything ``accelport launch`` will run; ``--dry-run`` prints it."""

    backend: str
    engine: str
    nprocs: int | None  # per host; None: every device the engine finds
    nnodes: str
    command: list[str]
    #: Variables set for the workers, on top of the launching environment.
    env: dict[str, str]
    #: "module:function" run before the workers start; the variables it sets are added.
    parent_env_function: str | None = None
    parent_env_preload: str | None = None
    parent_env_kwargs: dict[str, int] = field(default_factory=dict)
    available: bool = True
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    #: Where the hosts meet, on several hosts: option, host, port, timeout_s. Empty on one host.
    #: ``run_plan`` checks that the host resolves before anything starts.
    rendezvous: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def engine_for(backend: Backend) -> str:
    """The engine that starts ``backend``'s workers: its ``launcher``, else by family."""
    engine = backend.launcher or ("xla" if backend.lazy else "torchrun")
    if engine not in ENGINES:
        raise LaunchError(f"backend {backend.name!r} asks for launcher {engine!r}; "
                          f"accelport knows {', '.join(ENGINES)}")
    return engine


def _usage(message: str) -> Exception:
    from .cli import UsageError

    return UsageError(message)


def _check_nnodes(text: str) -> str:
    parts = text.split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(parts) not in (1, 2) or len(values) != len(parts) or min(values, default=0) < 1 or \
            values != sorted(values):
        raise _usage(f"--nnodes must be a number of hosts (2) or a range (1:4), not {text!r}")
    return text


def _check_rendezvous(rdzv: Rendezvous) -> None:
    """Values torchrun would accept but that cannot work: say so before any process starts."""
    if rdzv.node_rank is not None and rdzv.max_nodes() > 1 and not 0 <= rdzv.node_rank < rdzv.max_nodes():
        raise _usage(f"--node-rank must be between 0 and {rdzv.max_nodes() - 1} (--nnodes {rdzv.nnodes}), "
                     f"not {rdzv.node_rank}")
    if rdzv.rdzv_timeout is not None and rdzv.rdzv_timeout < 1:
        raise _usage(f"--rdzv-timeout must be at least 1 (seconds to wait for the other hosts), "
                     f"not {rdzv.rdzv_timeout}")
    if rdzv.master_port is not None and not 1 <= rdzv.master_port <= 65535:
        raise _usage(f"--master-port must be a TCP port (1 to 65535), not {rdzv.master_port}")
    if rdzv.rdzv_endpoint is not None:
        host, sep, port = rdzv.rdzv_endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise _usage(f"--rdzv-endpoint must be HOST:PORT (e.g. node0:29400), not {rdzv.rdzv_endpoint!r}")


def build_plan(
    backend: Backend,
    script: str,
    script_args: Sequence[str] = (),
    *,
    nprocs: int | None = None,
    rdzv: Rendezvous | None = None,
    environ: Mapping[str, str] | None = None,
    platform: str | None = None,
    python: str | None = None,
) -> LaunchPlan:
    """The command and environment that start ``script`` on ``backend``. Imports nothing heavy.

    Raises the CLI's usage error for bad input (no such script, ``nprocs`` < 1,
    rendezvous options that cannot work), with what to do instead.
    """
    environ = os.environ if environ is None else environ
    rdzv = rdzv or Rendezvous()
    python = python or sys.executable
    if nprocs is not None and (isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1):
        raise _usage(f"--nprocs must be at least 1 (worker processes per host), not {nprocs!r}")
    if not os.path.isfile(script):
        what = "is a directory" if os.path.isdir(script) else f"not found (relative to {os.getcwd()})"
        raise _usage(f"script {script!r} {what}; give the path of the training script to run")
    _check_nnodes(rdzv.nnodes)
    _check_rendezvous(rdzv)
    probe = backend.probe()
    engine = engine_for(backend)
    env = {"ACCELPORT_BACKEND": backend.name}
    notes: list[str] = []
    if engine == "xla":
        command, n = _xla_command(backend, script, script_args, nprocs, rdzv, environ, platform, python,
                                  env, notes)
    else:
        command, n = _torchrun_command(backend, script, script_args, nprocs, rdzv, python)
    kwargs: dict[str, int] = {}
    if backend.launch_env_function:
        kwargs = {"nproc_per_node": n} if n is not None else {}
        if rdzv.max_nodes() > 1:
            kwargs["nnodes"] = rdzv.max_nodes()
        notes.append(f"{backend.launch_env_function} runs before the workers start and adds the "
                     "variables it sets (not computed in a dry run: it reserves ports and reads the devices)")
    return LaunchPlan(
        backend=backend.name, engine=engine, nprocs=n, nnodes=rdzv.nnodes, command=command, env=env,
        parent_env_function=backend.launch_env_function, parent_env_kwargs=kwargs,
        parent_env_preload=getattr(backend, "vendor_module", None),
        available=probe.available, reason=probe.reason, notes=notes,
        rendezvous=_meeting_point(rdzv) if engine == "torchrun" else {},
    )


def _meeting_point(rdzv: Rendezvous) -> dict[str, Any]:
    """Where the hosts meet (the plan's ``rendezvous``); empty on one host."""
    if rdzv.max_nodes() == 1:
        return {}
    timeout = rdzv.rdzv_timeout or RDZV_TIMEOUT_S
    if rdzv.rdzv_endpoint:
        host, _, port = rdzv.rdzv_endpoint.rpartition(":")
        return {"option": "--rdzv-endpoint", "host": host, "port": int(port), "timeout_s": timeout}
    return {"option": "--master-addr", "host": rdzv.master_addr, "port": rdzv.master_port or 29500,
            "timeout_s": timeout}


def _check_resolves(rendezvous: Mapping[str, Any]) -> None:
    """Refuse a meeting point whose host name does not resolve here, before anything starts.

    torchrun would retry an unresolvable name until its rendezvous timeout (ten
    minutes by default), printing only c10d warnings; a typo deserves a usage error now.
    """
    host = rendezvous.get("host")
    if not host:
        return
    try:
        socket.getaddrinfo(host.strip("[]"), rendezvous.get("port"), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:  # socket.gaierror is an OSError; an over-long label a UnicodeError
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        option = rendezvous.get("option", "--master-addr")
        what = "the host of --rdzv-endpoint" if option == "--rdzv-endpoint" else option
        raise _usage(f"{what} {host!r} does not resolve on this host ({reason}); give a host name or "
                     "IP address that every host of the job can resolve (check the spelling, DNS or "
                     "/etc/hosts)") from None


def _torchrun_command(backend: Backend, script: str, script_args: Sequence[str], nprocs: int | None,
                      rdzv: Rendezvous, python: str) -> tuple[list[str], int]:
    n = nprocs if nprocs is not None else max(1, backend.probe().device_count or 1)
    args = ["--nproc-per-node", str(n), "--nnodes", rdzv.nnodes]
    options = [g for g in rdzv.given() if g != "nnodes"]
    flags = ", ".join("--" + g.replace("_", "-") for g in options)
    timeout = str(rdzv.rdzv_timeout or RDZV_TIMEOUT_S)
    if rdzv.max_nodes() == 1:
        # One host: the rendezvous options are refused rather than ignored or obeyed. Obeyed, a
        # static rendezvous of one host at --master-addr only works if that address is this host,
        # and otherwise waits minutes for a store that never answers; ignored, a forgotten
        # --nnodes would run a multi-host job as several independent single-host ones, each
        # training on its own. Either way the user meant several hosts, so say what is missing.
        if options:
            raise _usage(f"{flags} only {'applies' if len(options) == 1 else 'apply'} with --nnodes > 1 "
                         "(several hosts); on one host the workers meet on a free local port by "
                         "themselves. Give --nnodes N (the number of hosts, the same on every host), "
                         f"or drop {flags}")
        # One host: torchrun picks a free port itself, so two jobs never collide on 29500.
        args.append("--standalone")
    elif rdzv.rdzv_endpoint:
        mixed = [f for f, v in (("--master-addr", rdzv.master_addr), ("--node-rank", rdzv.node_rank),
                                ("--master-port", rdzv.master_port)) if v is not None]
        if mixed:
            raise _usage("give either --rdzv-endpoint (hosts meet there, ranks are assigned) or "
                         "--master-addr with --node-rank (fixed ranks), not both: drop "
                         f"{', '.join(mixed)}")
        backend_name = rdzv.rdzv_backend or "c10d"
        if backend_name == "static":  # torchrun would give every host rank 0: it needs --node-rank
            raise _usage("--rdzv-backend static is a fixed-rank rendezvous: use --master-addr HOST "
                         "--master-port PORT with --node-rank N instead of --rdzv-endpoint")
        args += ["--rdzv-backend", backend_name, "--rdzv-endpoint", rdzv.rdzv_endpoint]
        if rdzv.rdzv_id:
            args += ["--rdzv-id", rdzv.rdzv_id]
        # A bound on the wait for the other hosts: without one a host that never comes is
        # waited for as long as the backend's default allows.
        args += ["--rdzv-conf", f"{_RDZV_TIMEOUT_KEY.get(backend_name, 'join_timeout')}={timeout}"]
    elif rdzv.master_addr:
        if rdzv.node_rank is None:
            raise _usage("--master-addr on several hosts needs --node-rank (0 on the master host, "
                         "1, 2, ... on the others), or use --rdzv-endpoint instead")
        if ":" in rdzv.nnodes:
            raise _usage("a range of hosts (--nnodes MIN:MAX) needs --rdzv-endpoint, not --master-addr")
        mixed = [f for f, v in (("--rdzv-backend", rdzv.rdzv_backend), ("--rdzv-id", rdzv.rdzv_id))
                 if v is not None]
        if mixed:
            raise _usage(f"{', '.join(mixed)} go with --rdzv-endpoint; --master-addr with --node-rank "
                         f"is a fixed (static) rendezvous: drop {', '.join(mixed)} or use --rdzv-endpoint")
        args += ["--master-addr", rdzv.master_addr, "--master-port", str(rdzv.master_port or 29500),
                 "--node-rank", str(rdzv.node_rank), "--rdzv-conf", f"timeout={timeout}"]
    else:
        raise _usage(f"--nnodes {rdzv.nnodes} needs a meeting point: --rdzv-endpoint HOST:PORT "
                     "(the same on every host), or --master-addr HOST with --node-rank N")
    return [python, "-m", "torch.distributed.run", *args, "-m", "accelport._worker", script,
            *script_args], n


def _xla_command(backend: Backend, script: str, script_args: Sequence[str], nprocs: int | None,
                 rdzv: Rendezvous, environ: Mapping[str, str], platform: str | None, python: str,
                 env: dict[str, str], notes: list[str]) -> tuple[list[str], int | None]:
    if rdzv.given():
        raise _usage(f"backend {backend.name!r} starts through torch_xla, which finds the other hosts "
                     "of a TPU pod itself: run the same `accelport launch` on every host (for example "
                     "`gcloud compute tpus tpu-vm ssh NAME --worker=all --command=...`) without "
                     f"{', '.join('--' + g.replace('_', '-') for g in rdzv.given())}")
    pjrt = environ.get("PJRT_DEVICE", "").strip().upper()
    if not pjrt:
        if platform is None:
            from .platform import detect

            platform = detect().name
        pjrt = _PJRT_BY_PLATFORM.get(platform, "CPU")
    env["PJRT_DEVICE"] = pjrt
    flags = ["--engine", "xla"]
    if nprocs == 1:
        flags.append("--single-process")
    elif nprocs is not None:
        if pjrt == "CPU":
            raise _usage(
                f"--nprocs {nprocs} on XLA:CPU: several XLA:CPU replicas deadlock in their first "
                "all-reduce with torch_xla 2.9, so accelport does not start them; use --nprocs 1, or "
                "--backend cpu for several CPU processes")
        if pjrt not in _XLA_NUM_DEVICES:
            raise _usage(f"torch_xla starts one process per {pjrt} device it finds and cannot be told "
                         "how many: omit --nprocs (every device) or use --nprocs 1 (one process)")
        env[_XLA_NUM_DEVICES[pjrt]] = str(nprocs)
    if nprocs != 1:
        notes.append("several XLA replicas have not been verified by accelport's tests (they need a TPU "
                     "or Trainium host); one replica has")
    return [python, "-m", "accelport._worker", *flags, script, *script_args], nprocs


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
        from .errors import BackendUnavailableError

        raise BackendUnavailableError(plan.backend, plan.reason, "--backend")
    _check_resolves(plan.rendezvous)
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
    from ._worker import FAILURE_PREFIX

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
