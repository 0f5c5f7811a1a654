"""``accelport launch``: start the workers on the engine each backend's ecosystem trusts.

- eager backends (cpu, cuda, tpu, neuron): torchrun (``torch.distributed.run``),
  one process per device, run in this process so a failure is caught as data, not
  as a traceback;
- lazy XLA backends: ``torch_xla.launch``, which starts one process per device it
  finds (through :mod:`accelport.launch.worker`).

A plan (:class:`LaunchPlan`) is built first and never imports torch, so
``--dry-run`` shows exactly the command and environment that would run.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from accelport.contract import Backend
from accelport.errors import AccelportError, UsageError
from accelport.settings import explicit_pjrt_device

__all__ = [
    "ENGINES",
    "LaunchError",
    "LaunchPlan",
    "Rendezvous",
    "build_plan",
    "check_resolves",
    "engine_for",
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
#: Seconds a worker may take from the launch to the end of its first training step under
#: --timeout, unless --startup-timeout says otherwise (and never less than --timeout):
#: starting Python, importing torch, loading data and a first compilation are not steps,
#: and take as long as they take on a busy host. The same bound as the hosts' rendezvous.
STARTUP_TIMEOUT_S = RDZV_TIMEOUT_S
#: The --rdzv-conf key each rendezvous backend reads its timeout from (torch 2.x:
#: static_tcp_rendezvous.py and etcd_rendezvous.py read "timeout"; the dynamic
#: rendezvous of c10d and etcd-v2 reads "join_timeout").
_RDZV_TIMEOUT_KEY = {"static": "timeout", "etcd": "timeout"}


class LaunchError(AccelportError):
    """The launch itself could not start or finish (not a worker's own error)."""


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
    #: --timeout: seconds a worker may go without ending a training step, once it ended its first,
    #: before the job is stopped.
    timeout: int | None = None
    #: Seconds from the launch a worker may take to end its first training step (--startup-timeout;
    #: with --timeout at least that, :data:`STARTUP_TIMEOUT_S` by default); None: no limit.
    startup_timeout: int | None = None
    #: --max-restarts: times the whole group of workers is started again after one fails (torchrun's
    #: elastic agent; on XLA the launcher's own loop around torch_xla's launcher, which has none).
    max_restarts: int = 0

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
    timeout: int | None = None,
    startup_timeout: int | None = None,
    oversubscribe: bool = False,
    max_restarts: int = 0,
    diagnose: Sequence[str] | None = None,
) -> LaunchPlan:
    """The command and environment that start ``script`` on ``backend``. Imports nothing heavy.

    Raises the CLI's usage error for bad input (no such script, a script path that
    starts with "-", ``nprocs`` < 1 or more than the host's devices without
    ``oversubscribe``, a ``timeout`` or ``startup_timeout`` < 1, ``max_restarts`` < 0,
    rendezvous options that cannot work), with what to do instead. ``diagnose``: the job runs under
    ``accelport diagnose`` with these options: under torchrun each worker, and rank 0 says the job's; on
    torch_xla the process that calls ``torch_xla.launch``, which watches every replica and says the job's.
    """
    environ = os.environ if environ is None else environ
    rdzv = rdzv or Rendezvous()
    python = python or sys.executable
    if nprocs is not None and (isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1):
        raise _usage(f"--nprocs must be at least 1 (worker processes per host), not {nprocs!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1):
        raise _usage(f"--timeout must be at least 1 (seconds a worker may go without ending a training step "
                     f"before the job is stopped), not {timeout!r}")
    if startup_timeout is not None and (isinstance(startup_timeout, bool) or not isinstance(startup_timeout, int)
                                        or startup_timeout < 1):
        raise _usage(f"--startup-timeout must be at least 1 (seconds from the launch a worker may take to end its "
                     f"first training step), not {startup_timeout!r}")
    if timeout is not None and startup_timeout is not None and startup_timeout < timeout:
        raise _usage(f"--startup-timeout {startup_timeout} is shorter than --timeout {timeout}: the first step "
                     "also has to start the worker. Give a --startup-timeout of at least the --timeout, or "
                     "leave it out (default: the larger of --timeout and "
                     f"{STARTUP_TIMEOUT_S})")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise _usage(f"--max-restarts must be 0 or more (times the workers are started again, from the newest "
                     f"checkpoint, after one fails), not {max_restarts!r}")
    _check_script(script)
    _check_nnodes(rdzv.nnodes)
    _check_rendezvous(rdzv)
    probe = backend.probe()
    engine = engine_for(backend)
    if engine == "torchrun" and nprocs is not None and not oversubscribe:
        _check_room(backend, nprocs, probe.available, probe.device_count)
    env = {"ACCELPORT_BACKEND": backend.name}
    notes: list[str] = []
    if engine == "xla":
        command, n = _xla_command(backend, script, script_args, nprocs, rdzv, environ, platform, python,
                                  env, notes)
        if diagnose is not None:
            # The worker that calls torch_xla.launch runs under `accelport diagnose`, which watches each replica
            # torch_xla.launch starts and says the job's findings from that one process.
            command = [python, "-m", "accelport", "diagnose", *diagnose, *command[1:]]
        if max_restarts:
            notes.append(f"torch_xla's launcher has no restarts: accelport starts it again, up to {max_restarts} "
                         "time(s), when a worker fails (TORCHELASTIC_RESTART_COUNT counts the restarts, as under "
                         "torchrun)")
    else:
        command, n = _torchrun_command(backend, script, script_args, nprocs, rdzv, python, max_restarts,
                                       diagnose)
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
        rendezvous=_meeting_point(rdzv) if engine == "torchrun" else {}, timeout=timeout,
        startup_timeout=startup_timeout or (max(timeout, STARTUP_TIMEOUT_S) if timeout else None),
        max_restarts=max_restarts,
    )


def _check_script(script: str) -> None:
    """Refuse a script that is not a file, or whose path the worker would read as an option."""
    if script.startswith("-"):
        # Python (and torchrun, which starts `python -u SCRIPT`) take a leading "-" for an
        # option: `python --evil.py` is "unknown option", `python -` reads stdin. So would the
        # worker wrapper. "./" in front names the same file and cannot be taken for one.
        if os.path.isfile(script):
            raise _usage(f"script {script!r} starts with '-', which Python and torchrun read as an option; "
                         f"give its path as {os.path.join('.', script)!r}")
        raise _usage(f"script {script!r} starts with '-' and is not a file: accelport launch's own options go "
                     "before the script (and before a `--`); a script whose name starts with '-' is given as "
                     f"{os.path.join('.', script)!r}")
    if not os.path.isfile(script):
        what = "is a directory" if os.path.isdir(script) else f"not found (relative to {os.getcwd()})"
        raise _usage(f"script {script!r} {what}; give the path of the training script to run")


def _check_room(backend: Backend, nprocs: int, available: bool, device_count: int | None) -> None:
    """Refuse more workers than this host has devices (CPU cores on cpu): they would share them."""
    if getattr(backend, "device_type", None) == "cpu":
        room, what = os.cpu_count() or 1, "CPU cores"
    elif available and device_count:
        room, what = device_count, f"{backend.name} devices"
    else:
        return  # nothing counted here (a plan for another machine): the launch itself will tell
    if nprocs > room:
        raise _usage(f"--nprocs {nprocs} is more than the {room} {what} of this host: workers would share them "
                     f"and run slower than {room} would. Use --nprocs {room} or fewer (per host; add hosts with "
                     "--nnodes), or --oversubscribe to start them anyway (e.g. to test a larger world size)")


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


def check_resolves(rendezvous: Mapping[str, Any]) -> None:
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
                      rdzv: Rendezvous, python: str, max_restarts: int = 0,
                      diagnose: Sequence[str] | None = None) -> tuple[list[str], int]:
    n = nprocs if nprocs is not None else max(1, backend.probe().device_count or 1)
    args = ["--nproc-per-node", str(n), "--nnodes", rdzv.nnodes]
    if max_restarts:
        args += ["--max-restarts", str(max_restarts)]  # the elastic agent restarts the whole group
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
    watched = ["--diagnose", *(x for option in diagnose for x in ("--diagnose-arg", option))] if diagnose is not None \
        else []
    return [python, "-m", "torch.distributed.run", *args, "-m", "accelport.launch.worker", *watched, script,
            *script_args], n


def _xla_command(backend: Backend, script: str, script_args: Sequence[str], nprocs: int | None,
                 rdzv: Rendezvous, environ: Mapping[str, str], platform: str | None, python: str,
                 env: dict[str, str], notes: list[str]) -> tuple[list[str], int | None]:
    if rdzv.given():
        raise _usage(f"backend {backend.name!r} starts through torch_xla, which finds the other hosts "
                     "of a TPU pod itself: run the same `accelport launch` on every host (for example "
                     "`gcloud compute tpus tpu-vm ssh NAME --worker=all --command=...`) without "
                     f"{', '.join('--' + g.replace('_', '-') for g in rdzv.given())}")
    pjrt = explicit_pjrt_device(environ)
    if pjrt is None:
        if platform is None:
            from accelport.platform import detect

            platform = detect().name
        pjrt = _PJRT_BY_PLATFORM.get(platform, "CPU")
        env["PJRT_DEVICE"] = pjrt
    else:
        env["PJRT_DEVICE"] = environ["PJRT_DEVICE"].strip().upper()
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
    return [python, "-m", "accelport.launch.worker", *flags, script, *script_args], nprocs
