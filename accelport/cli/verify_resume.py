"""``accelport verify-resume``: kill a script at a step, start it again, and say whether it resumed bit for bit.

    accelport verify-resume -- train.py --epochs 1                   # killed at half the run's steps
    accelport verify-resume --kill-at 30 --signal TERM --output resume.json -- train.py
    accelport verify-resume --restarts 2 -m mypkg.train --epochs 1

Each run happens in an empty working directory of its own (the restarts share the killed run's, where its
checkpoint is), so relative paths in the arguments land there; give data by absolute path. The checks and
the comparison are :mod:`accelport.diagnose.resume_check`'s; this module reads the arguments, starts each
watched run (:func:`child_main`, in a process of its own) and says the result.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from accelport.errors import AccelportError, UsageError

__all__ = ["register", "run", "child_main"]

#: What starts one watched run: this module's :func:`child_main` in a fresh interpreter.
LAUNCHER = ("-c", "import sys; from accelport.cli.verify_resume import child_main; sys.exit(child_main(sys.argv[1:]))")

_WIDTH = 110
_INDENT = " " * 9


def register(sub: Any) -> None:
    p = sub.add_parser(
        "verify-resume",
        help="kill a training script at a step, start it again, and say whether it resumed exactly "
             "(and what it forgot to restore)",
        usage="accelport verify-resume [--kill-at STEP] [--signal KILL|TERM] [--restarts N] [--nprocs N "
              "[--kill-rank R]] [--output FILE.json] [--json] [--] SCRIPT [ARGS ...] | -m MODULE [ARGS ...]",
        description="Run the command uninterrupted (twice: a script that differs from itself is said to be "
                    "nondeterministic, never blamed on its resume), then again killed at the end of optimizer "
                    "step STEP and started again with the same command in the same directory. Each run has an "
                    "empty working directory of its own, so relative paths land there; give data by absolute "
                    "path. Per step, the batch, the weights, the optimizer's state, the learning rates and the "
                    "random states are compared from the step the run resumed at, and the first that differs is "
                    "named with the line the checkpoint code lacks. Exit status 0 when the resume is identical, "
                    "1 otherwise.",
    )
    p.add_argument("--kill-at", metavar="STEP",
                   help="kill the run once optimizer step STEP (counted from 1) has ended, after the script's own "
                        "code at the end of that step (its save) ran (default: half the uninterrupted run's steps)")
    p.add_argument("--signal", metavar="KILL|TERM", default="KILL",
                   help="the signal it is killed with: KILL (default; nothing runs after it) or TERM (the script's "
                        "own SIGTERM handler runs: a save on preemption)")
    p.add_argument("--restarts", metavar="N", default="1",
                   help="how many times it is started again (default 1); each restart but the last is killed again "
                        "after STEP steps of its own")
    p.add_argument("--nprocs", metavar="N", default="1",
                   help="run the script on N ranks under `accelport launch` (torchrun), each rank compared with its "
                        "own uninterrupted run (default 1: one process)")
    p.add_argument("--kill-rank", metavar="R", default=None,
                   help="with --nprocs: the rank killed at --kill-at (default 0); torchrun then stops the others")
    p.add_argument("--output", metavar="FILE.json", help="write the verdict and the first difference as JSON there")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE",
                   help="run a module as `python -m MODULE ARGS` would")
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS ...]",
                   help="the training script and its arguments")
    p.set_defaults(func=run)


def _whole(option: str, value: str, least: int, what: str) -> int:
    text = str(value).strip()
    if not text.lstrip("+-").isdigit():
        raise UsageError(f"verify-resume: {option} {value}: not a whole number; give {what}")
    number = int(text)
    if number < least:
        raise UsageError(f"verify-resume: {option} {value}: {what}")
    return number


def _command(args: argparse.Namespace) -> Any:
    """The command to run, checked: UsageError (what to do) where it cannot run."""
    from accelport.diagnose.resume_check import Command

    if args.module is not None:
        argv = [*args.module, *args.argv]
        if not argv:
            raise UsageError("verify-resume: -m needs a module name: accelport verify-resume -m MODULE [ARGS ...]")
        _check_module(argv[0])
        return Command(None, argv[0], tuple(argv[1:]), os.getcwd())
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise UsageError("verify-resume: give the script to check: accelport verify-resume [OPTIONS] -- SCRIPT "
                         "[ARGS ...] (or -m MODULE [ARGS ...])")
    script = argv[0]
    if not os.path.exists(script):
        raise UsageError(f"verify-resume: {script}: no such file; give the path of the training script "
                         "(or -m MODULE for a module)")
    if os.path.isdir(script) and not os.path.isfile(os.path.join(script, "__main__.py")):
        raise UsageError(f"verify-resume: {script} is a directory, not a Python script; give the script in it "
                         "(e.g. DIR/train.py)")
    if not os.access(script, os.R_OK):
        raise UsageError(f"verify-resume: {script} cannot be read (permission denied)")
    # Absolute: each run starts in a directory of its own. The arguments stay as typed.
    return Command(os.path.abspath(script), None, tuple(argv[1:]), os.getcwd(), typed=script)


def _check_module(name: str) -> None:
    import importlib.util

    sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        found = None
    except Exception as exc:  # "" or ".x", or a package on the way whose import fails
        raise UsageError(f"verify-resume: -m {name}: error while finding the module ({type(exc).__name__}: {exc}); "
                         "give the module's full name") from None
    finally:
        sys.path.pop(0)
    if found is None:
        raise UsageError(f"verify-resume: -m {name}: no module of that name can be imported from here "
                         f"({os.getcwd()}); check the spelling and that its package is installed or in this directory")


def _output(value: str | None) -> str | None:
    from accelport.safe_io import output_target

    if value is None:
        return None
    if not value.strip():
        raise UsageError("verify-resume: --output needs a file name")
    path = os.path.abspath(value)
    if os.path.isdir(path):
        raise UsageError(f"verify-resume: --output {value} is a directory; give the path of a file to write")
    if not os.path.isdir(os.path.dirname(path)):
        raise UsageError(f"verify-resume: --output {value}: the directory {os.path.dirname(value)} does not exist; "
                         "create it first or write somewhere else")
    try:
        output_target(value, what="verify-resume: --output")
    except AccelportError as exc:
        raise UsageError(str(exc)) from None
    return path


def _write(path: str, obj: Any) -> None:
    from accelport.redact import Redactor
    from accelport.safe_io import write_atomic

    plain = Redactor(os.environ).tree(json.loads(json.dumps(obj, default=str)))
    write_atomic(path, (json.dumps(plain, indent=2, allow_nan=False) + "\n").encode("utf-8"), what="--output")


def _wrapped(text: str, first: str) -> list[str]:
    return textwrap.wrap(text, _WIDTH, initial_indent=first, subsequent_indent=_INDENT,
                         break_long_words=False, break_on_hyphens=False) or [first.rstrip()]


def render(shown: str, result: Any) -> list[str]:
    """The result in plain lines."""
    lines = [f"accelport verify-resume: {shown}: {result.verdict}"]
    who = f"{result.ranks} ranks; rank {result.kill_rank} " if result.ranks > 1 else ""
    how = (f"the uninterrupted run took {result.steps} step(s); {who}killed with SIG{result.signal} at the end of "
           f"step {result.kill_at}")
    if result.resumed_at is not None and result.verdict != "nondeterministic":
        how += f"; resumed at step {result.resumed_at}"
    if result.restarts > 1:
        how += f"; {result.restarts} restarts"
    lines += _wrapped(how, "  ")
    diff = result.first_difference
    if diff is not None:
        where = f" on rank {diff.rank}" if diff.rank is not None else ""
        lines += _wrapped(f"first difference at step {diff.step}{where}: {diff.what}: {diff.detail}", "  ")
        if diff.also:
            lines += _wrapped(f"also differs at that step: {', '.join(diff.also)}", _INDENT)
    elif result.verdict == "identical":
        lines += _wrapped(f"every step from {result.resumed_at} on matched the uninterrupted run bit for bit (batch, "
                          "weights, optimizer state, learning rates, random states)", "  ")
    if result.fix:
        lines += _wrapped(result.fix, "  fix: ")
    for note in result.notes:
        lines += _wrapped(note, "  [note] ")
    return lines


def run(args: argparse.Namespace) -> int:
    from accelport.diagnose.resume_check import SIGNALS, verify

    output = _output(args.output)
    command = _command(args)
    kill_at = _whole("--kill-at", args.kill_at, 1, "steps count from 1 (the first optimizer step is step 1); give "
                     "the step after which to kill the run") if args.kill_at is not None else None
    restarts = _whole("--restarts", args.restarts, 1, "give 1 or more restarts")
    nprocs = _whole("--nprocs", args.nprocs, 1, "give the number of ranks, 1 or more")
    kill_rank = 0
    if args.kill_rank is not None:
        if nprocs == 1:
            raise UsageError(f"verify-resume: --kill-rank {args.kill_rank} needs --nprocs 2 or more (the ranks of the "
                             "job); one process is always the one killed")
        kill_rank = _whole("--kill-rank", args.kill_rank, 0, "ranks count from 0")
        if kill_rank >= nprocs:
            raise UsageError(f"verify-resume: --kill-rank {kill_rank}: the job has ranks 0 to {nprocs - 1} "
                             f"(--nprocs {nprocs})")
    signame = str(args.signal).strip().upper().removeprefix("SIG")
    if signame not in SIGNALS:
        raise UsageError(f"verify-resume: --signal {args.signal}: give KILL or TERM")

    def say(line: str) -> None:
        print(f"accelport verify-resume: {line}", file=sys.stderr, flush=True)

    import tempfile

    try:
        with tempfile.TemporaryDirectory(prefix="accelport-verify-resume-child-") as child_dir:
            launcher: tuple[str, ...] = (sys.executable, *LAUNCHER)
            if nprocs > 1:  # each rank runs the watched child under the launch, as a script of its own
                child = os.path.join(child_dir, "verify_resume_child.py")
                with open(child, "w") as f:
                    f.write(LAUNCHER[1] + "\n")
                launcher = (sys.executable, "-m", "accelport", "launch", "--nprocs", str(nprocs), child)
            result = verify(command, launcher, kill_at=kill_at, signame=signame, restarts=restarts, say=say,
                            nprocs=nprocs, kill_rank=kill_rank)
    except AccelportError as exc:
        if output is not None:
            kind = "usage" if isinstance(exc, UsageError) else type(exc).__name__
            _write(output, {"error": str(exc), "kind": kind, "command": command.shown})
        if isinstance(exc, UsageError) and not str(exc).startswith("verify-resume:"):
            raise UsageError(f"verify-resume: {exc}") from None
        raise
    out = {**result.to_dict(), "command": command.shown}
    if output is not None:
        _write(output, out)
    for line in render(command.shown, result):
        print(line, file=sys.stderr)
    if output is not None:
        print(f"  [note] wrote {args.output}", file=sys.stderr)
    if args.json:
        from accelport.cli import emit_json

        emit_json(out)
    return 0 if result.verdict == "identical" else 1


def child_main(argv: Sequence[str]) -> int:
    """The watched process: ``RECORD KILL_AT SIGNAL (SCRIPT | -m MODULE) ARGS...`` (KILL_AT 0: no kill). Runs the
    script watched, as ``python`` would, and ends as it ended."""
    from accelport.diagnose.resume_check import KILL_RANK_ENV, SIGNALS, StepRecorder, record_path
    from accelport.runtime.watch import Watcher, run_watched

    record, kill_at, name, *command = argv
    record = record_path(record, os.environ)
    if record != argv[0] and os.environ.get("RANK", "0") != os.environ.get(KILL_RANK_ENV, "0"):
        kill_at = "0"  # a job of several ranks: only the rank named is killed (torchrun then stops the others)
    # The kill is one with the default action unless the script installs a handler: not one this process
    # inherited from whatever started it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signum = SIGNALS[name] if int(kill_at) else None
    recorder = StepRecorder(record, kill_at=int(kill_at) or None, signum=signum)
    watcher = Watcher(recorder=recorder)
    if command[0] == "-m":
        outcome = run_watched(watcher, module=command[1], args=command[2:])
    else:
        outcome = run_watched(watcher, script=command[0], args=command[1:])
    if outcome.forked:
        os._exit(outcome.exit_status)
    sys.stdout.flush()
    sys.stderr.flush()
    if outcome.ended_by is not None:
        signal.signal(outcome.ended_by, signal.SIG_DFL)
        os.kill(os.getpid(), outcome.ended_by)
    return outcome.exit_status
