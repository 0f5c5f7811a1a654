"""``accelport launch``: run a training script on several devices and hosts.

    accelport launch --nprocs 4 train.py --epochs 3
    accelport launch --nnodes 2 --rdzv-endpoint host0:29400 --nprocs 8 train.py   # on every host
    accelport launch --nnodes 2 --node-rank 1 --master-addr host0 train.py        # fixed ranks
    accelport launch --backend xla train.py                                       # torch_xla.launch
    accelport launch --dry-run --json --nprocs 2 train.py                         # what would run
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser(
        "launch",
        help="run a training script in several processes (torchrun, torch_xla.launch) and hosts",
        description="Start one worker per device on the engine the backend's ecosystem uses "
                    "(torchrun for eager backends, torch_xla.launch for XLA). The workers get the "
                    "backend in ACCELPORT_BACKEND. If one fails, the others are stopped and the "
                    "launch exits non-zero naming the rank that failed first. SIGTERM (or SIGINT) goes to "
                    "every worker: with ap.Checkpointer each saves at its next step and the launch exits "
                    "with status 75 (143 if a worker could not save within ACCELPORT_STOP_DEADLINE_S). "
                    "On several hosts, run the same command on each with the same rendezvous options.",
    )
    p.add_argument("--nprocs", type=int, default=None, metavar="N",
                   help="worker processes per host (default: one per device the backend sees; 1 on cpu)")
    p.add_argument("--backend", default=None,
                   help="backend for the workers (default: ACCELPORT_BACKEND, else the selection)")
    p.add_argument("--oversubscribe", action="store_true",
                   help="allow --nprocs above this host's devices (CPU cores on cpu), e.g. to test a larger world")
    p.add_argument("--timeout", type=int, default=None, metavar="SECONDS",
                   help="stop the job when a worker that ended a training step (ap.optimizer_step) goes this long "
                        "without ending another: a hang ends instead of waiting for ever, naming the rank that "
                        "hangs and its line (default: no limit)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="start every worker again, up to N times, when one fails (torchrun's elastic agent; on XLA "
                        "around torch_xla's launcher): a script with ap.Checkpointer resumes from its newest "
                        "checkpoint (default 0)")
    p.add_argument("--startup-timeout", type=int, default=None, metavar="SECONDS",
                   help="stop the job when a worker has not ended its first training step this long after the "
                        "launch (start-up, imports, data, a first compilation; default with --timeout: the larger "
                        "of --timeout and 600, else no limit)")
    p.add_argument("--diagnose", action="store_true",
                   help="run each worker under `accelport diagnose` (an unported script too): rank 0 says the "
                        "job's findings once, with the rank that holds the others back (on XLA backends the "
                        "process that starts the replicas does, watching each)")
    p.add_argument("--output", metavar="FILE.json", help="with --diagnose: write the job's findings as JSON")
    p.add_argument("--report", metavar="FILE.html", help="with --diagnose: write the job's report page")
    hosts = p.add_argument_group("several hosts (torchrun rendezvous; the same values on every host; "
                                 "refused with --nnodes 1)")
    hosts.add_argument("--nnodes", default="1", help="number of hosts, or MIN:MAX (default 1)")
    hosts.add_argument("--node-rank", type=int, default=None, help="this host's rank, with --master-addr")
    hosts.add_argument("--master-addr", default=None, help="address of the host with --node-rank 0")
    hosts.add_argument("--master-port", type=int, default=None, help="port on the master host (default 29500)")
    hosts.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                       help="where hosts meet (c10d rendezvous): ranks are assigned, no --node-rank needed")
    hosts.add_argument("--rdzv-backend", default=None, help="rendezvous backend (default c10d)")
    hosts.add_argument("--rdzv-id", default=None, help="job id shared by the hosts of one job")
    hosts.add_argument("--rdzv-timeout", type=int, default=None, metavar="SECONDS",
                       help="how long a host waits for the others before the launch fails (default 600)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the command and environment that would run, and start nothing")
    p.add_argument("--json", action="store_true",
                   help="machine-readable output: the dry run, an error, or the job's end (exit status, goodput)")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run)


def _backend(name: str | None, dry_run: bool) -> Any:
    from accelport.errors import BackendUnavailableError, UnknownBackendError, UsageError
    from accelport.runtime.selection import named, quoted, resolve
    from accelport.runtime.state import RUNTIME

    host = RUNTIME.host()
    try:
        if name is not None:  # quoted as ap.use quotes it: a long name cut, and redacted
            return named(host.backends, name, f"--backend {quoted(name, RUNTIME.environ)}", RUNTIME.environ)[0]
        return resolve(host, None, RUNTIME.environ, matrix=RUNTIME.matrix())[0]
    except UnknownBackendError as exc:
        raise UsageError(str(exc)) from None  # a typo on the command line: exit 2
    except BackendUnavailableError as exc:
        # A dry run may prepare a command for another machine (a TPU host, say).
        if dry_run and exc.name in host.backends:
            return host.backends[exc.name]
        raise


def _diagnose_options(args: argparse.Namespace) -> list[str] | None:
    """accelport diagnose's options for each worker under --diagnose (outputs as absolute paths, checked here);
    None without --diagnose."""
    from accelport.cli.diagnose import output_path
    from accelport.errors import UsageError

    given = [(o, v) for o, v in (("--output", args.output), ("--report", args.report)) if v is not None]
    if not args.diagnose:
        if given:
            raise UsageError(f"launch: {given[0][0]} writes what --diagnose finds; add --diagnose")
        return None
    options: list[str] = []
    for option, value in given:
        try:
            path = output_path(option, value)
        except UsageError as exc:
            raise UsageError(str(exc).replace("diagnose:", "launch:", 1)) from None
        options += [option, str(path)]
    return options


def run(args: argparse.Namespace) -> int:
    from accelport.cli import emit_json
    from accelport.launch.plan import Rendezvous, build_plan
    from accelport.launch.run import WorkerFailedError, run_plan
    from accelport.launch.stop import LaunchStopped

    rdzv = Rendezvous(nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                      master_port=args.master_port, rdzv_endpoint=args.rdzv_endpoint,
                      rdzv_backend=args.rdzv_backend, rdzv_id=args.rdzv_id, rdzv_timeout=args.rdzv_timeout)
    diagnose = _diagnose_options(args)
    backend = _backend(args.backend, args.dry_run)
    plan = build_plan(backend, args.script, args.script_args, nprocs=args.nprocs, rdzv=rdzv, timeout=args.timeout,
                      startup_timeout=args.startup_timeout, oversubscribe=args.oversubscribe,
                      max_restarts=args.max_restarts, diagnose=diagnose)
    if args.dry_run:
        if args.json:
            emit_json(plan.to_dict())
        else:
            assignments = [f"{k}={shlex.quote(v)}" for k, v in plan.env.items()]
            print(" ".join(["env", *assignments, shlex.join(plan.command)]))
            if plan.parent_env_function:
                call = ", ".join(f"{k}={v}" for k, v in plan.parent_env_kwargs.items())
                print(f"# first, on each host: {plan.parent_env_function}({call}); its variables are added")
            if not plan.available:
                print(f"# backend {plan.backend} is not available here: {plan.reason}")
            for note in plan.notes:
                print(f"# {note}")
        return 0
    try:
        goodput = run_plan(plan)
    except LaunchStopped as exc:
        goodput = getattr(exc, "goodput", None)
        if args.json:
            emit_json({"stopped": str(exc), "kind": "LaunchStopped", **exc.to_dict(), "goodput": goodput})
        else:
            print(f"accelport: {exc}", file=sys.stderr)
            _say_goodput(goodput)
        return exc.exit_status
    except WorkerFailedError as exc:
        goodput = getattr(exc, "goodput", None)
        if args.json:
            emit_json({"error": str(exc), "kind": "WorkerFailedError", **exc.to_dict(), "goodput": goodput})
        else:
            first = exc.first
            where = f" on {first.host}" if first.host else ""
            print(f"accelport: error: rank {first.rank}{where} {first.headline}", file=sys.stderr)
            for other in exc.failures:
                if other is not first:
                    print(f"accelport:   then rank {other.rank}: {other.error}", file=sys.stderr)
            _say_goodput(goodput)
        return exc.exit_status
    if args.json:
        emit_json({"exit_status": 0, "goodput": goodput})
    else:
        _say_goodput(goodput)
    return 0


def _say_goodput(goodput: dict[str, Any] | None) -> None:
    """The job's closing lines about its wall time, where rank 0 kept an account (ap.Checkpointer)."""
    if goodput is None:
        return
    from accelport.goodput import render

    for line in render(goodput):
        print(f"accelport: {line}", file=sys.stderr)
