"""``accelport diagnose``: run a script you have not ported, and say why it is slow.

    accelport diagnose train.py --batch-size 64                    # the script and its own arguments
    accelport diagnose --report run.html --output findings.json -- train.py --epochs 1
    accelport diagnose -m mypkg.train --epochs 1                   # a module, as with python -m
    accelport diagnose -m torch.distributed.run --nproc-per-node 8 train.py   # a whole job: one summary

The script runs in this process as ``__main__`` (:func:`accelport.runtime.watch.run_watched`),
watched by :class:`accelport.runtime.watch.Watcher`; its output, its exit status and its
traceback are its own. The findings come at the end, on stderr.

The outputs never harm the user's files: each is checked before the script runs (not the
script or the module's file, not another output, not a FIFO or a directory) and written
whole or not at all (:func:`accelport.safe_io.write_atomic`), also when the run ends by
SIGTERM. Everything accelport itself says goes through one redaction pass
(:class:`accelport.redact.Redactor`) on its way out: stderr here is the script's too, so the
CLI's redacting stream cannot stand in front of it.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import io
import json
import os
import shutil
import signal
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from accelport.errors import AccelportError, UsageError
from accelport.safe_io import output_target, replace_with, same_file, temp_beside, write_atomic

if TYPE_CHECKING:
    from accelport.diagnose.job import JobPlace, JobResult, ProgressReporter, RankRun
    from accelport.observe.profile import StepProfile
    from accelport.redact import Redactor
    from accelport.runtime.watch import Outcome, Watcher
    from accelport.runtime.workers import WorkerRuns

__all__ = ["register", "run", "render_summary"]

_ICON = {"ok": "ok  ", "note": "note", "warning": "WARN", "problem": "FAIL"}
_INDENT = " " * 9
_WIDTH = 110
_MISSING = object()


def register(sub: Any) -> None:
    p = sub.add_parser(
        "diagnose",
        help="run an unmodified training script and say why it is slow (diagnose first, then port)",
        usage="accelport diagnose [--output FILE.json] [--report FILE.html] [--metrics-file FILE.jsonl] "
              "[--backend NAME] [--find-nan] [--find-nan-from STEP] [--find-nan-dir DIR] "
              "[--profile FIRST:STOP [--profile-dir DIR]] [--ranks R[,R...]] [--] SCRIPT [ARGS ...] | "
              "-m MODULE [ARGS ...]",
        description="Run a PyTorch or torch_xla training script as `python SCRIPT ARGS` would (same process, "
                    "argv, working directory, streams and exit status), watch its optimizer steps, syncs and "
                    "data loading, and print the same diagnoses a ported script gets, with the fix and the "
                    "line, on stderr at the end. Everything after SCRIPT (or -m MODULE) is the script's. "
                    "A job: -m torch.distributed.run [torchrun's options] SCRIPT (or torchrun ... -m accelport "
                    "diagnose SCRIPT) watches every rank and rank 0 says the job's findings once.",
    )
    p.add_argument("--output", metavar="FILE.json",
                   help="write the findings, metrics, steps, backend and exit status as JSON (also on failure "
                        "and on SIGTERM)")
    p.add_argument("--report", metavar="FILE.html", help="write the page `accelport report` makes for the run")
    p.add_argument("--metrics-file", metavar="FILE.jsonl",
                   help="write one JSON line per step there, as ACCELPORT_METRICS_FILE does; it replaces the "
                        "file when the run ends")
    p.add_argument("--backend", metavar="NAME",
                   help="read this backend's counters (default: the one for the device being trained on)")
    p.add_argument("--find-nan", action="store_true",
                   help="find the operation that made the first NaN or Inf (op, forward/backward/optimizer, module, "
                        "line) and write a minimal repro of it: every op of the checked steps is checked as it "
                        "runs, about 10 times slower (on XLA op by op, a sync each); from step 1")
    p.add_argument("--find-nan-from", metavar="STEP",
                   help="check from STEP on (the step the non-finite finding named); implies --find-nan")
    p.add_argument("--find-nan-dir", metavar="DIR",
                   help="where --find-nan writes the repro (default: --output's directory, else the working "
                        "directory); one that cannot be written is said, and the run goes on")
    p.add_argument("--profile", metavar="FIRST:STOP",
                   help="profile steps FIRST to STOP-1 with the backend's own profiler (torch.profiler, or "
                        "torch_xla's on XLA) and say what they held; a window the run never reaches, a "
                        "directory that cannot be written or a profiler that fails is said, and the script "
                        "runs on unprofiled")
    p.add_argument("--profile-dir", metavar="DIR",
                   help="where --profile writes its traces (default: ./accelport-profile)")
    p.add_argument("--ranks", metavar="R[,R...]",
                   help="in a job of several ranks, the ranks --find-nan and --profile act on (default: every "
                        "rank), e.g. --ranks 1 or --ranks 0,3; every rank is still watched")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE",
                   help="run a module as `python -m MODULE ARGS` would")
    # One list, read by _plan(): a "--" before the script separates it from these options, one
    # after it is the script's own argument (argparse would drop either).
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS ...]",
                   help="the training script and its arguments")
    # The script's warnings are filtered as under plain `python`, not as for accelport's own commands.
    p.set_defaults(func=run, keep_warning_filters=True)


# -- what to run and where to write, checked before the script runs ---------------------------


@dataclass
class _Plan:
    target: str  # the script, or "-m MODULE": what the summary names
    script: str | None
    module: str | None
    args: list[str]
    backend: str | None
    # Absolute paths, fixed before the script runs (it may change directory).
    output: str | None
    report: str | None
    metrics_file: str | None
    #: --find-nan: the first step checked (None: no search), and where the repro goes.
    find_nan: int | None = None
    find_nan_dir: str | None = None
    #: The window of steps to profile (None: none, or one that cannot be: ``notes`` says why).
    profile: StepProfile | None = None
    #: What is worth saying at the end about the options (a --profile that cannot be done).
    notes: list[str] = field(default_factory=list)
    #: Where the workers the script starts itself write their runs (accelport.runtime.workers).
    workers_dir: str | None = None


def _plan(args: argparse.Namespace) -> _Plan:
    """What to run and where to write, every check done; UsageError (the value as typed) if not."""
    if args.json:
        raise UsageError("diagnose: stdout belongs to the script; write the findings as JSON with --output FILE.json")
    inputs: list[tuple[str, str]] = []
    if args.module is not None:
        # -m takes the rest of the line, but argparse ends it at a "--": that one is the module's argument.
        module_argv = [*args.module, *args.argv]
        if not module_argv:
            raise UsageError("diagnose: -m needs a module name: accelport diagnose -m MODULE [ARGS ...]")
        module, script, script_args = module_argv[0], None, module_argv[1:]
        origin = _module_file(module)
        if origin is not None:
            inputs.append((f"the file of module {module}", origin))
        target = f"-m {module}"
        launched = _launched_script(module, script_args)
        if launched is not None:  # `accelport launch --diagnose` on torch_xla: the summary names the user's script
            inputs.append(("the script", _script_file(launched)))
            target = launched
    else:
        command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not command:
            raise UsageError("diagnose: give the script to run: accelport diagnose SCRIPT [ARGS ...] "
                             "(or -m MODULE [ARGS ...])")
        module, script, script_args = None, command[0], command[1:]
        inputs.append(("the script", _script_file(script)))
        target = script
    outputs = []
    for option, value in (("--output", args.output), ("--report", args.report),
                          ("--metrics-file", args.metrics_file)):
        path = output_path(option, value)
        if path is not None:
            outputs.append((option, str(value), path))
    _check_apart(outputs, inputs)
    backend = None
    if args.backend is not None:
        _check_backend(args.backend)
        backend = args.backend.strip().lower()
    paths = {option: path for option, _, path in outputs}
    find_nan = _find_nan(args)
    find_nan_dir = None
    if find_nan is not None:
        where = args.find_nan_dir or (os.path.dirname(paths["--output"]) if "--output" in paths else os.getcwd())
        find_nan_dir = os.path.abspath(where)
    plan = _Plan(target, script, module, list(script_args), backend, paths.get("--output"), paths.get("--report"),
                 paths.get("--metrics-file"), find_nan, find_nan_dir)
    _plan_profile(plan, args.profile, args.profile_dir)
    _plan_ranks(plan, args.ranks, os.environ)
    return plan


def _plan_ranks(plan: _Plan, ranks: str | None, environ: Mapping[str, str]) -> None:
    """--ranks: a rank of a job not named searches for no NaN and profiles nothing (the rest of its watch goes on).
    One process (no job) is rank 0 of 1: named or not, it is the one asked about, and --ranks is refused only
    where no rank it names could exist."""
    from accelport.diagnose.job import job_rank

    if ranks is None:
        return
    chosen = set()
    for part in ranks.split(","):
        text = part.strip()
        if not text.isdigit():
            raise UsageError(f"diagnose: --ranks {ranks}: give rank numbers from 0, separated by commas "
                             "(e.g. --ranks 1 or --ranks 0,3)")
        chosen.add(int(text))
    if plan.find_nan is None and plan.profile is None:
        plan.notes.append(f"--ranks {ranks} chooses the ranks --find-nan and --profile act on; neither was given")
        return
    place = job_rank(environ)
    if place is None:
        return  # one process, or the parent of a torchrun job (each rank reads --ranks itself)
    rank, world = place
    beyond = sorted(r for r in chosen if r >= world)
    if beyond and rank == 0:
        plan.notes.append(f"--ranks names rank(s) {', '.join(map(str, beyond))}, beyond this job's {world} ranks")
    if rank not in chosen:
        plan.find_nan = None
        plan.profile = None


#: The modules that are torchrun: diagnosing one of them diagnoses every rank it starts.
TORCHRUN_MODULES = ("torch.distributed.run",)


def _torchrun_argv(plan: _Plan, args: argparse.Namespace) -> list[str] | None:
    """For ``diagnose -m torch.distributed.run ...`` (or the torchrun command as the script): the argv of a
    torchrun that starts each rank under ``accelport diagnose`` with this command's options; None for any other
    script. UsageError where torchrun's own command line cannot be run so."""
    if plan.module not in TORCHRUN_MODULES and not (
            plan.script is not None and os.path.basename(plan.script) == "torchrun"):
        return None
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.exit_on_error = False

    def refuse(message: str) -> NoReturn:  # (instead of torchrun's usage text and an exit)
        raise _TorchrunArgs(message)

    parser.error = refuse  # type: ignore[method-assign]
    try:
        parsed = parser.parse_args(plan.args)
    except (argparse.ArgumentError, _TorchrunArgs) as exc:
        raise UsageError(f"diagnose: torchrun's arguments: {exc}; give torchrun's options as torchrun takes them "
                         "(python -m torch.distributed.run --help), then the training script and its arguments") \
            from None
    if parsed.no_python:
        raise UsageError("diagnose: torchrun --no-python runs a program that is not a Python script, which "
                         "diagnose cannot watch; drop --no-python and give the training script")
    at = _script_index(parser, plan.args, parsed.training_script)
    options = [a for a in plan.args[:at] if a not in ("-m", "--module", "--run-path", "--run_path", "--")]
    ours: list[str] = []
    for option, value in (("--output", plan.output), ("--report", plan.report),
                          ("--metrics-file", plan.metrics_file), ("--backend", plan.backend),
                          ("--find-nan-dir", plan.find_nan_dir), ("--profile", args.profile),
                          ("--profile-dir", args.profile_dir), ("--ranks", args.ranks)):
        if value is not None:
            ours += [option, str(value)]
    if plan.find_nan is not None:
        ours += ["--find-nan-from", str(plan.find_nan)]
    rest = plan.args[at + 1:]
    script = (["-m", parsed.training_script] if parsed.module else ["--", parsed.training_script])
    return ["-m", "torch.distributed.run", *options, "-m", "accelport", "diagnose", *ours, *script, *rest]


class _TorchrunArgs(Exception):
    """torchrun's parser refused its arguments (its message)."""


def _script_index(parser: argparse.ArgumentParser, argv: Sequence[str], script: str) -> int:
    """Where the training script stands in torchrun's argv: the first place that parses as it (an option's
    value that happens to equal it does not)."""
    for i, arg in enumerate(argv):
        if arg != script:
            continue
        try:
            if parser.parse_args([*argv[:i], "\0script"]).training_script == "\0script":
                return i
        except (argparse.ArgumentError, _TorchrunArgs):
            continue
    raise UsageError(f"diagnose: cannot tell where the training script {script} stands in torchrun's arguments; "
                     "give torchrun's options first, then the script")


def _find_nan(args: argparse.Namespace) -> int | None:
    """The first step --find-nan checks (None: no search): --find-nan-from, --find-nan, else ACCELPORT_FIND_NAN."""
    from accelport.observe.nan_search import ENV, parse_first_step

    if args.find_nan_from is not None:
        value = args.find_nan_from.strip()
        if not value.lstrip("+-").isdigit():
            raise UsageError(f"diagnose: --find-nan-from {args.find_nan_from}: not a step number; give the step the "
                             "non-finite finding named (e.g. --find-nan-from 1230), or --find-nan to check from the "
                             "first step")
        if int(value) < 1:
            raise UsageError(f"diagnose: --find-nan-from {args.find_nan_from}: steps count from 1 (the first "
                             "optimizer step is step 1); give the step the non-finite finding named, or --find-nan")
        return int(value)
    if args.find_nan:
        return 1
    if args.find_nan_dir is not None:
        raise UsageError("diagnose: --find-nan-dir says where --find-nan writes its repro; add --find-nan (or "
                         "--find-nan-from STEP)")
    try:
        return parse_first_step(os.environ.get(ENV))
    except ValueError as exc:
        raise UsageError(f"diagnose: {ENV}={os.environ.get(ENV)}: {exc}") from None


def _plan_profile(plan: _Plan, window: str | None, directory: str | None) -> None:
    """The --profile window and its directory, checked before the script runs. Never an error: profiling must
    not keep the script from running, so what is wrong is a note and the script runs unprofiled."""
    from accelport.observe.profile import DEFAULT_DIR, StepProfile, directory_problem, parse_window

    if window is None:
        if directory is not None:
            plan.notes.append(f"--profile-dir {directory} was given without --profile FIRST:STOP, so nothing was "
                              "profiled")
        return
    try:
        steps = parse_window(window, "--profile")
    except ValueError as exc:
        plan.notes.append(f"{exc}. The script ran unprofiled")
        return
    where = os.path.abspath(directory if directory is not None and directory.strip() else DEFAULT_DIR)
    problem = directory_problem(where)
    if problem is not None:
        shown = directory if directory is not None else DEFAULT_DIR
        plan.notes.append(f"--profile-dir {shown}: traces cannot be written there: {problem}; nothing was "
                          "profiled (give --profile-dir a directory that can be written). The script ran unprofiled")
        return
    plan.profile = StepProfile(steps, where, f"--profile {steps}")


def _script_file(script: str) -> str:
    """The file Python reads to run ``script`` (a directory's ``__main__.py``; a zipapp itself)."""
    from accelport.runtime.watch import entry_spec

    if not os.path.exists(script):
        raise UsageError(f"diagnose: {script}: no such file; give the path of the training script "
                         "(or -m MODULE for a module)")
    try:
        spec = entry_spec(script)
    except LookupError:
        if os.path.isdir(script):
            raise UsageError(f"diagnose: {script} is a directory, not a Python script; give the script in it "
                             "(e.g. DIR/train.py) or, for a package, -m PACKAGE.MODULE") from None
        raise UsageError(f"diagnose: {script} is a zip archive without a __main__ module, so Python cannot run "
                         "it; give the script to run (python -m zipapp makes an archive with one)") from None
    if spec is not None:
        origin = spec.origin or ""
        return origin if os.path.isfile(origin) else os.path.abspath(script)
    if not os.access(script, os.R_OK):
        raise UsageError(f"diagnose: {script} cannot be read (permission denied)")
    return os.path.abspath(script)


def _launched_script(module: str, args: Sequence[str]) -> str | None:
    """The script that accelport launch's worker module runs (after its own options, as its ``main`` reads them),
    or None for any other module, or where there is none."""
    if module != "accelport.launch.worker":
        return None
    rest = list(args)
    while rest and rest[0].startswith("--"):
        del rest[:2 if rest[0] in ("--engine", "--diagnose-arg") else 1]
    return rest[0] if rest else None


def _module_file(name: str) -> str | None:
    """The file ``python -m name`` runs (None for one that is no file), found as Python finds it: from
    the working directory first (but under -P); UsageError, in Python's words, where it cannot run."""
    import importlib.util

    def find(module: str) -> Any:
        try:
            return importlib.util.find_spec(module)
        except ModuleNotFoundError:  # a package on the way that is not there
            return None
        except Exception as exc:  # "" or ".x", or a package on the way whose import fails
            raise UsageError(f"diagnose: -m {name}: error while finding the module ({type(exc).__name__}: "
                             f"{exc}); give the module's full name, and check that its package imports") from None

    first = not getattr(sys.flags, "safe_path", False)
    if first:
        sys.path.insert(0, os.getcwd())
    try:
        spec = find(name)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = find(f"{name}.__main__")
            if spec is None:
                raise UsageError(f"diagnose: -m {name}: {name!r} is a package and cannot be executed directly "
                                 f"(it has no __main__ module); give the module in it that trains "
                                 f"(-m {name}.MODULE)")
    finally:
        if first:
            sys.path.pop(0)
    if spec is None:
        raise UsageError(f"diagnose: -m {name}: no module of that name can be imported from here "
                         f"({os.getcwd()}); check the spelling and that its package is installed or in "
                         "this directory")
    origin = spec.origin or ""
    return origin if os.path.isfile(origin) else None


def output_path(option: str, value: str | None) -> str | None:
    """The absolute path for an output option: a regular file (or none yet) in a directory that can be written."""
    if value is None:
        return None
    if not value.strip():
        raise UsageError(f"diagnose: {option} needs a file name")
    path = os.path.abspath(value)
    if os.path.isdir(path):
        raise UsageError(f"diagnose: {option} {value} is a directory; give the path of a file to write")
    if not os.path.isdir(os.path.dirname(path)):
        # (the directory as typed: abspath would fold the "//" of a URL someone typed, and its secret with it)
        raise UsageError(f"diagnose: {option} {value}: the directory {os.path.dirname(value)} does not exist; "
                         "create it first or write somewhere else")
    try:  # a FIFO would hang the write after the script ran; a device would be replaced
        real = output_target(value, what=f"diagnose: {option}")
    except AccelportError as exc:
        raise UsageError(str(exc)) from None
    if not os.access(os.path.dirname(real), os.W_OK | os.X_OK):
        raise UsageError(f"diagnose: {option} {value}: the directory {os.path.dirname(real)} cannot be written "
                         "(permission denied); write somewhere else")
    return path


def _check_apart(outputs: Sequence[tuple[str, str, str]], inputs: Sequence[tuple[str, str]]) -> None:
    """No output is an input (the script, the module's file) or another output, also through a link."""
    for i, (option, value, path) in enumerate(outputs):
        for what, source in inputs:
            if same_file(path, source):
                raise UsageError(f"diagnose: {option} {value} is {what} ({source}), which writing it would "
                                 f"destroy; give {option} another path")
        for other, other_value, other_path in outputs[:i]:
            if same_file(path, other_path):
                raise UsageError(f"diagnose: {other} {other_value} and {option} {value} are the same file, and "
                                 "one would overwrite the other; give each its own path")


def _check_backend(name: str) -> None:
    from accelport.errors import UnknownBackendError
    from accelport.plugins.host import create_manager
    from accelport.runtime.selection import quoted

    known = create_manager().backends
    if name.strip().lower() not in known:  # quoted as ap.use quotes it: a long name cut, and redacted
        raise UsageError(f"diagnose: --backend: {UnknownBackendError(quoted(name, os.environ), known, '--backend')}")


def _records_file(plan: _Plan) -> str | None:
    """Where the watcher writes the step records: beside --metrics-file (renamed onto it at the end), a
    temporary file for --report alone, or nowhere."""
    if plan.metrics_file is not None:
        try:
            return temp_beside(output_target(plan.metrics_file, what="diagnose: --metrics-file"))
        except OSError as exc:
            raise UsageError(f"diagnose: --metrics-file {plan.metrics_file}: cannot write in its directory "
                             f"({exc.strerror or exc})") from None
    if plan.report is not None:
        fd, path = tempfile.mkstemp(prefix="accelport-diagnose-", suffix=".jsonl")
        os.close(fd)
        return path
    return None


# -- what was found, said at the end ----------------------------------------------------------


def _wrapped(text: str, first: str) -> list[str]:
    return textwrap.wrap(text, _WIDTH, initial_indent=first, subsequent_indent=_INDENT,
                         break_long_words=False, break_on_hyphens=False) or [first.rstrip()]


def render_summary(target: str, watcher: Watcher, outcome: Outcome, written: Sequence[str],
                   redactor: Redactor) -> str:
    """The findings in doctor's plain style: severity and what was seen, the run's totals, the fix, the script's
    line; then how much of the run was judged (never "ok" where something was not).

    Each piece goes through ``redactor`` whole, before it is wrapped: no credential, and no
    control character (a newline in a path) that would forge a line.
    """
    from accelport.runtime.watch import where

    shown = redactor.text
    findings = watcher.findings
    on = f" on {watcher.backend_name}" if watcher.backend_name else ""
    found = f": {len(findings)} finding(s)" if findings else ""
    if outcome.ended_by is not None:
        ended = f"was ended by {signal.Signals(outcome.ended_by).name} (status {outcome.exit_status})"
    else:
        ended = f"exited with status {outcome.exit_status}"
    took = f"{watcher.steps} optimizer step(s)"
    if watcher.manual_steps:
        took += f" and {watcher.backwards} backward passes ({watcher.manual_steps} taken as steps)"
    lines = [shown(f"accelport diagnose: {target} took {took}{on} and {ended}{found}")]
    for f in findings:
        lines += _wrapped(shown(f"{f.kind} at step {f.step}: {f.message}"), f"  [{_ICON[f.severity]}] ")
        if f.totals_text:
            lines += _wrapped(shown(f.totals_text), f"{_INDENT}over the run: ")
        if f.fix:
            lines += _wrapped(shown(f.fix), f"{_INDENT}fix: ")
        site = where(f, watcher.sites)
        if site and f"{site.file}:{site.line}" not in f.message:
            label = f" ({site.label})" if site.label else ""
            lines += _wrapped(shown(f"{site.file}:{site.line}{label}"), f"{_INDENT}at ")
    severity, text = verdict(watcher, outcome)
    if text:
        lines += _wrapped(shown(text), f"  [{_ICON[severity]}] ")
    lines += _time_lines(watcher, shown)
    for note in [*watcher.notes, *_pattern_notes(watcher), *watcher.rule_failures]:
        lines += _wrapped(shown(note), f"  [{_ICON['note']}] ")
    if written:
        lines.append(shown(f"  [{_ICON['note']}] wrote {', '.join(written)}"))
    return "\n".join(lines)


def verdict(watcher: Watcher, outcome: Outcome) -> tuple[str, str]:
    """How much of the run was judged, in one line: (severity, text); "ok" only where every check ran on every
    step of a run that ended well and nothing was found. Empty text where the findings say it all."""
    steps = watcher.steps + watcher.manual_steps
    findings = watcher.findings
    failed = outcome.ended_by is not None or outcome.exit_status != 0
    if watcher.unavailable is not None:
        name, why = watcher.unavailable
        return "note", f"nothing was judged: the counters of {name} cannot be read here ({why})"
    if not steps:
        return "note", _no_steps(watcher)
    if watcher.stopped is not None:
        at, why = watcher.stopped
        so_far = "the findings above are" if findings else "no finding was made"
        return "note", (f"watching stopped at step {at} ({why}); {so_far} from the steps before it, and nothing "
                        "after it was judged")
    unjudged = watcher.unjudged
    pending = "; not judged: " + ", ".join(f"{kind} ({why})" for kind, why in unjudged.items()) if unjudged else ""
    if failed:
        how = (f"was ended by {signal.Signals(outcome.ended_by).name}" if outcome.ended_by is not None
               else f"ended with status {outcome.exit_status}")
        so_far = "the findings above are from them" if findings else "no finding in them"
        return "note", f"the script {how} after {steps} step(s): {so_far}{pending}"
    if findings:
        return ("note", f"the findings above cover {steps} step(s){pending}") if unjudged else ("ok", "")
    if unjudged and len(unjudged) >= len(watcher.kinds):
        return "note", f"too few steps to judge: {steps} step(s){pending}"
    if unjudged:
        return "note", f"no finding in {steps} step(s){pending}"
    return "ok", f"no finding after {steps} step(s) with every check running"


def _no_steps(watcher: Watcher) -> str:
    """Why no step was judged: training in other processes, too few backward passes, or no step at all."""
    if watcher.spawned:
        launcher, site, nprocs = watcher.spawned[0]
        many = f"{nprocs} processes" if nprocs else "a process per device"
        at = f" at {site.file}:{site.line}" if site else ""
        single = ("torch_xla.launch(fn, debug_single_process=True)" if launcher == "torch_xla.launch" else
                  f"{launcher}(fn, nprocs=1)" if launcher == "xmp.spawn" else "the script's own one-process option")
        return (f"nothing was judged: the script trains in {many} it starts with {launcher}{at}, and diagnose "
                f"watches this process only. Run it in one process to have it diagnosed: {single}, or the "
                "script's own option for one process")
    if watcher.backwards:
        return (f"nothing was judged: {watcher.backwards} backward pass(es) and no optimizer step; a loop that "
                f"updates its weights by hand is taken as one after {watcher.MANUAL_AFTER} backward passes")
    return ("no optimizer step ran in this process, so nothing was diagnosed: diagnose watches optimizer.step() of "
            "torch.optim optimizers (also inside xm.optimizer_step) and, in a loop that updates its weights by "
            "hand, its backward passes")


def _ordinal(n: int) -> str:
    """'1st', '2nd', '3rd', '11th', '32nd'."""
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _pattern_notes(watcher: Watcher) -> list[str]:
    """What the script does that changes what could be watched, and what to change."""
    notes = []
    if watcher.manual_steps:
        notes.append(
            f"this script updates its weights without a torch.optim optimizer ({watcher.backwards} backward passes, "
            f"no optimizer.step()): from the {_ordinal(watcher.MANUAL_AFTER)} backward pass on, each was taken as a "
            "step, so the checks of time, compilation, host reads and data ran; the checks of gradients and weights "
            "(non-finite, precision) need an optimizer: torch.optim.SGD(model.parameters(), lr=lr) with "
            "optimizer.step() computes the same update as p.data.add_(p.grad, alpha=-lr)")
    if watcher.spawned and (watcher.steps or watcher.manual_steps):
        launcher, site, nprocs = watcher.spawned[0]
        at = f" at {site.file}:{site.line}" if site else ""
        notes.append(f"the script also started {nprocs or 'one per device'} process(es) with {launcher}{at}: "
                     "what they did was not watched, only this process")
    return notes
def _time_lines(watcher: Watcher, shown: Callable[[str], str]) -> list[str]:
    """Where a step's time went and the verdict, then what a --profile window held."""
    lines: list[str] = []
    said = watcher.time_summary()
    if said:
        lines.append(shown(f"  [time] {said[0]}"))
        if len(said) > 2:
            lines += _wrapped(shown(said[1]), _INDENT)
            lines += _wrapped(shown(said[2]), f"{_INDENT}fix: ")
    profile = watcher.tracker.profile
    if profile is not None and profile.result is not None:
        from accelport.observe.profile import describe

        first, *rest = describe(profile.result)
        lines.append(shown(f"  [prof] {first}"))  # (whole: it ends with the traces' directory)
        lines += [shown(_INDENT + line[2:]) for line in rest]  # (its own lines: the operators' columns kept)
    return lines


def _setup(plan: _Plan) -> dict[str, Any]:
    """What ran, and with which versions: what ``accelport compare`` says first where two runs differ in it.
    The versions are of the packages the script loaded (none imported here)."""
    import platform

    from accelport import __version__

    def loaded(name: str) -> str | None:
        version = getattr(sys.modules.get(name), "__version__", None)
        return str(version) if version is not None else None

    return {"script": plan.target, "args": list(plan.args), "torch": loaded("torch"),
            "torch_xla": loaded("torch_xla"), "python": platform.python_version(), "accelport": __version__}


def _result(watcher: Watcher, outcome: Outcome, plan: _Plan | None = None) -> dict[str, Any]:
    findings = [watcher.finding_dict(f) for f in watcher.findings]
    severity, text = verdict(watcher, outcome)
    steps = watcher.steps + watcher.manual_steps
    out = {"findings": findings, "metrics": watcher.metrics(), "steps": watcher.steps,
            "backend": watcher.backend_name, "exit_status": outcome.exit_status,
            "verdict": {"judged_every_step": severity == "ok", "steps_judged": steps, "text": text,
                        "not_judged": watcher.unjudged},
            "notes": [*watcher.notes, *_pattern_notes(watcher), *watcher.rule_failures]}
    if plan is not None:
        out["setup"] = _setup(plan)
    out["efficiency"] = watcher.efficiency()  # (how much of the chip a step used: accelport compare reads it)
    profile = watcher.tracker.profile
    if profile is not None:  # what --profile did: its result, or why there is none
        out["profile"] = profile.result if profile.result is not None else {
            "state": profile.state, "problem": profile.problem, "asked": str(profile.window)}
    return out


def _json(obj: Any, redactor: Redactor) -> bytes:
    plain = json.loads(json.dumps(obj, default=str))  # what JSON holds, so that every string is redacted
    return (json.dumps(redactor.tree(plain), indent=2, allow_nan=False) + "\n").encode("utf-8")


def _write_outputs(plan: _Plan, result: Callable[[], Mapping[str, Any]], records: str | None, findings: Sequence[Any],
                   title: str, redactor: Redactor, *, ranks: Sequence[Mapping[str, Any]] = (), whose: str = ""
                   ) -> tuple[list[str], list[str], str | None]:
    """Write the outputs the plan asks for: --output (``result()``), --report (the page ``accelport report`` draws of
    the steps in ``records``, with ``findings`` and a job's ``ranks``) and --metrics-file (those steps, in one
    rename: never appended to an earlier run's, never half there). ``whose``: whose steps they are, said where
    it matters (a job's). Returns (what was written, what failed, why there is no page or None)."""
    written: list[str] = []
    problems: list[str] = []
    no_page = None
    if plan.output is not None:
        try:
            write_atomic(plan.output, _json(result(), redactor), what="--output")
            written.append(plan.output)
        except AccelportError as exc:
            problems.append(str(exc))
    if plan.report is not None:
        if records is None or not os.path.isfile(records) or os.path.getsize(records) == 0:
            no_page = f"no report page: {whose + ' steps were not' if whose else 'no step was'} recorded, and " \
                      "the page draws the steps"
        else:
            # (imported in run() already, before the script's directory went on sys.path)
            from accelport.diagnose.report import ReportError, load_records, render_html

            try:
                # The page's own pass redacts every text on it (the title's path too), then escapes it.
                page = render_html(load_records(records), findings, title=title, redactor=redactor, ranks=ranks)
                write_atomic(plan.report, page.encode("utf-8"), what="--report")
                written.append(plan.report)
            except ReportError as exc:
                problems.append(f"no report page: {exc}")
            except AccelportError as exc:
                problems.append(str(exc))
    if plan.metrics_file is not None and records is not None:
        try:
            replace_with(records, output_target(plan.metrics_file, what="--metrics-file"))
            written.append(f"{plan.metrics_file}{f' ({whose} steps)' if whose else ''}")
        except (OSError, AccelportError) as exc:
            problems.append(f"cannot write --metrics-file {plan.metrics_file}: "
                            f"{getattr(exc, 'strerror', None) or exc}")
    return written, problems, no_page


def _conclude(plan: _Plan, watcher: Watcher, outcome: Outcome, records: str | None, redactor: Redactor,
              stderr: Any, stopped: Callable[[], bool] = lambda: False) -> bool:
    """Write the outputs and say what was found; whether writing one failed. A rank of a torchrun job hands
    its run to rank 0, which says the job's (:mod:`accelport.diagnose.job`)."""
    from accelport.diagnose.job import JobPlace, job_rank

    if watcher.error is not None and os.environ.get("ACCELPORT_LAUNCH_DIR") and not outcome.forked \
            and not watcher.spawned:
        # A worker of `accelport launch --diagnose`: the launcher names this rank's failure by the script's own
        # error, not by the exit status diagnose gives it. (A process that started workers is no rank: on XLA the
        # launch's worker starts the replicas, and each records its own failure.)
        from accelport.launch.worker import record_failure

        ranked = job_rank(os.environ)
        record_failure(ranked[0] if ranked else 0, watcher.error)
    place = JobPlace.from_environ(os.environ)
    if place is not None and not outcome.forked:
        done = _conclude_rank(plan, watcher, outcome, records, redactor, stderr, place, stopped)
        if done is not None:
            return done
    ranked = job_rank(os.environ)  # (a rank said alone: which one)
    target = f"{plan.target} (rank {ranked[0]} of {ranked[1]})" if ranked else plan.target
    if ranked is not None and ranked[0] != 0:
        # The outputs are the job's, at the same paths on every rank: rank 0 writes them, the others say theirs.
        if plan.output or plan.report or plan.metrics_file:
            watcher.notes.append("the outputs (--output, --report, --metrics-file) are rank 0's to write: this "
                                 "rank's run is said here only")
        plan.output = plan.report = plan.metrics_file = None
    own_steps = watcher.steps + watcher.manual_steps
    # (The page and --metrics-file: a worker's steps where this process took none, else this process's own.)
    started = _worker_runs(plan, records if not own_steps else None)
    workers, unwatched = started.runs, started.unwatched
    if workers or (watcher.spawned and not own_steps):
        # The script trained in workers it started: each was watched, and is a rank of the job. (Where none left a
        # run, killed before their function ended, the job is said with every rank not judged.)
        start = started.start if started.start is not None else len(watcher.spawned) - 1
        spawned = watcher.spawned[start] if 0 <= start < len(watcher.spawned) else None
        counts = [spawned[2]] if spawned is not None and isinstance(spawned[2], int) else []
        world = max([1, len(workers), *(r.rank + 1 for r in workers), *(r + 1 for r in unwatched), *counts])
        missing = sorted(set(range(world)) - {r.rank for r in workers})
        if started.others:  # (in the notes of --output too)
            watcher.notes.extend(_other_starts(watcher, started))
        return _say_job(plan, watcher, outcome, records, redactor, stderr, workers, world, missing,
                        unwatched=unwatched, whose=f"rank {started.records[0]}'s" if started.records else
                        "this process's", lost="no run came back from its worker: killed before its function "
                        "ended (a worker writes its run when the function ends, or at a SIGTERM)")
    written, problems, no_page = _write_outputs(plan, lambda: _result(watcher, outcome, plan), records,
                                                watcher.findings, f"accelport diagnose: {plan.target}", redactor)
    if no_page:
        watcher.notes.append(no_page)
    _flush(sys.stdout)  # the script's output first, then what was found
    _say(stderr, render_summary(target, watcher, outcome, written, redactor))
    for problem in problems:
        _say(stderr, f"accelport: error: {redactor.text(problem)}")
    return bool(problems)


def _conclude_rank(plan: _Plan, watcher: Watcher, outcome: Outcome, records: str | None, redactor: Redactor,
                   stderr: Any, place: JobPlace, stopped: Callable[[], bool]) -> bool | None:
    """A rank of a torchrun job: ranks other than 0 hand their run to rank 0 and say nothing; rank 0 gathers
    every rank's, judges the job and writes the outputs. None where the job view cannot be had (this rank
    then says its own run, labelled with its rank)."""
    from accelport.diagnose.job import gather, progress_of, publish, wait_seconds
    from accelport.runtime.workers import rank_run

    own = rank_run(watcher, outcome.exit_status, place.rank)
    if place.rank != 0:
        problem = publish(place, own)
        if problem is None:
            return False
        watcher.notes.append(f"this rank's run could not be handed to rank 0 ({problem}): it is said here alone")
        return None
    # (rank 0's own script failed or was stopped: torchrun ends the others soon, so they are not waited for long)
    failed = outcome.ended_by is not None or outcome.exit_status != 0
    wait, unusable = wait_seconds(os.environ, failed)
    if unusable:
        watcher.notes.append(unusable)
    runs, missing, problem = gather(place, own, wait, stopped)
    if problem is not None:
        watcher.notes.append(f"the other ranks' runs could not be read ({problem}): rank 0's is said alone")
        return None
    return _say_job(plan, watcher, outcome, records, redactor, stderr, runs, place.world_size, missing,
                    progress_of(place, missing))


def _say_job(plan: _Plan, watcher: Watcher, outcome: Outcome, records: str | None, redactor: Redactor,
             stderr: Any, runs: Sequence[RankRun], world_size: int, missing: Sequence[int],
             progress: Mapping[int, Mapping[str, Any]] | None = None, unwatched: Sequence[int] = (),
             whose: str = "rank 0's", lost: str | None = None) -> bool:
    """Judge a job from its ranks' runs, write the outputs and say it; whether writing one failed.
    ``unwatched``: missing ranks that ran as further device threads of a watched process; ``whose``: whose
    steps ``records`` holds (the page and --metrics-file draw them)."""
    from accelport.diagnose.job import judge

    job = judge(runs, world_size, missing, progress)
    job.unwatched = [r for r in unwatched if r in job.missing]
    if lost is not None:
        job.lost = lost
    said = _job_result(job)
    written, problems, no_page = _write_outputs(
        plan, lambda: {**_result(watcher, outcome, plan), **said}, records, job.findings,
        f"accelport diagnose: {plan.target} ({whose} steps; the job's findings)", redactor, ranks=said["ranks"],
        whose=whose)
    if no_page:
        job.notes.append(no_page)
    _flush(sys.stdout)
    _say(stderr, render_job(plan.target, job, watcher, written, redactor))
    for problem in problems:
        _say(stderr, f"accelport: error: {redactor.text(problem)}")
    return bool(problems)


def _worker_runs(plan: _Plan, records: str | None) -> WorkerRuns:
    """The runs of the workers the script started, each watched in its own process, and the ranks that ran
    unwatched beside a watched one (torch_xla's further device threads); their directory removed. Where the
    workers trained, ``records`` (this process's step records, for the page and --metrics-file) gets the steps
    of the job's first rank instead."""
    from accelport.runtime.workers import WorkerRuns, read_workers

    if plan.workers_dir is None:
        return WorkerRuns()
    started = read_workers(plan.workers_dir)
    copied = None
    if records is not None and started.runs and started.records is not None:
        try:
            shutil.copyfile(started.records[1], records)
            copied = started.records
        except OSError:
            pass  # (then there is no page, and the summary says why)
    started.records = copied  # whose steps ``records`` now holds, where a worker's
    shutil.rmtree(plan.workers_dir, ignore_errors=True)
    plan.workers_dir = None
    return started


def _other_starts(watcher: Watcher, started: WorkerRuns) -> list[str]:
    """A script that started workers more than once: which start is judged, and what the others did."""
    def called(start: int | None) -> str:
        if start is None or start >= len(watcher.spawned):
            return "a start of workers"
        launcher, site, _ = watcher.spawned[start]
        return f"{launcher}" + (f" at {site.file}:{site.line}" if site else "") + f" ({_ordinal(start + 1)} start)"

    others = "; ".join(f"{called(n)}: {workers} worker(s), {steps} optimizer step(s)"
                       for n, workers, steps in started.others)
    return [f"the script started workers {len(started.others) + 1} times: the job judged is {called(started.start)}, "
            f"whose workers took the most optimizer steps; not judged: {others}"]


def _job_result(job: JobResult) -> dict[str, Any]:
    """The job's part of --output: its findings (with evidence.rank), one entry per rank, what was judged."""
    runs = job.runs
    severity, text = job_verdict(job)
    ranks = [{"rank": r.rank, "host": r.host, "pid": r.pid, "steps": r.steps, "exit_status": r.exit_status,
              "time_breakdown": {k: round(v, 6) for k, v in job.by_rank.get(r.rank, {}).items()},
              "findings": list(r.findings), "straggler": r.rank == job.straggler} for r in runs]
    return {"findings": [f.to_dict() for f in job.findings], "ranks": ranks,
            "job": {"world_size": job.world_size, "ranks_judged": [r.rank for r in runs],
                    "ranks_missing": list(job.missing), "ranks_unwatched": list(job.unwatched),
                    "straggler": job.straggler,
                    "time_breakdown_per_step": {k: round(v, 6) for k, v in job.breakdown.items()},
                    "time_verdict": _job_time_verdict(job)},
            "verdict": {"judged_every_step": severity == "ok", "steps_judged": sum(r.steps for r in runs),
                        "text": text, "not_judged": _not_judged(job), "ranks_missing": list(job.missing)}}


def _job_time_verdict(job: JobResult) -> str:
    from accelport.diagnose.timing import verdict as time_verdict

    if job.straggler is not None:
        found = next(f for f in job.findings if f.kind == "straggler")
        return f"straggler-bound: rank {job.straggler}'s {found.evidence['category']}"
    kind, share, _ = time_verdict(job.breakdown)
    return f"{kind}: {share:.0%} of the job's step time" if kind else ""


def job_verdict(job: JobResult) -> tuple[str, str]:
    """How much of the job was judged, in one line; "ok" only where every rank was judged, ended well and
    nothing was found."""
    judged = ", ".join(str(r.rank) for r in job.runs)
    failed = [r for r in job.runs if r.exit_status != 0]
    lost = [r for r in job.missing if r not in job.unwatched]
    if job.missing:
        said = []
        if job.unwatched:
            said.append(f"rank(s) {', '.join(map(str, job.unwatched))} (each a further device thread of a process "
                        "whose first device thread was watched: torch_xla runs a thread per device of a process, and "
                        "one thread per process is watched; run one device per process to have each rank watched)")
        if lost:
            said.append(f"rank(s) {', '.join(map(str, lost))} ({job.lost})")
        head = f"judged ranks {judged} of {job.world_size}" if judged else f"no rank of {job.world_size} was judged"
        return "note", f"{head}; not judged: " + "; ".join(said)
    if failed:
        return "note", ("the job did not end well: " + ", ".join(f"rank {r.rank} exited with status {r.exit_status}"
                                                                   for r in failed))
    if not any(r.steps for r in job.runs):
        return "note", "no rank took an optimizer step, so nothing was diagnosed"
    unjudged = _not_judged(job)
    pending = "; not judged: " + ", ".join(f"{kind} ({why})" for kind, why in unjudged.items()) if unjudged else ""
    if job.findings:
        return ("note", f"the findings above cover every rank{pending}") if unjudged else ("ok", "")
    if unjudged:
        return "note", f"no finding on {_every_rank(job)}{pending}"
    return "ok", f"no finding on {_every_rank(job)} with every check running"


def _every_rank(job: JobResult) -> str:
    return "the one rank" if job.world_size == 1 else f"any of the {job.world_size} ranks"


def _not_judged(job: JobResult) -> dict[str, str]:
    """The kinds some rank could not judge, and why (as the first such rank said it)."""
    out: dict[str, str] = {}
    for run in job.runs:
        for kind, why in run.not_judged.items():
            out.setdefault(kind, why)
    return out


def render_job(target: str, job: JobResult, watcher: Watcher, written: Sequence[str], redactor: Redactor) -> str:
    """The job's summary: its findings (each once, naming its ranks), its verdict, the job's time per step
    with waiting charged to collective, one row per rank with the straggler marked."""
    from accelport.observe.steptime import breakdown_line

    shown = redactor.text
    hosts = len({r.host for r in job.runs})
    steps = sorted({r.steps for r in job.runs})
    if not steps:
        each = ""
    elif len(steps) == 1:
        each = f"{steps[0]} optimizer step(s) {'on each rank judged' if job.missing else 'each'}"
    else:
        each = f"{steps[0]}-{steps[-1]} optimizer steps"
    backends = sorted({r.backend for r in job.runs if r.backend})
    on = f" on {', '.join(backends)}" if backends else ""
    found = f": {len(job.findings)} finding(s)" if job.findings else ""
    ranks = "rank" if job.world_size == 1 else "ranks"
    on_hosts = f" on {hosts} host(s)" if hosts else ""
    took = f", took {each}" if each else ": no rank's run came back"
    lines = [shown(f"accelport diagnose: {target}, a job of {job.world_size} {ranks}{on_hosts}{took}{on}{found}")]
    for f in job.findings:
        lines += _wrapped(shown(f"{f.kind}: {f.message}"), f"  [{_ICON[f.severity]}] ")
        if f.fix:
            lines += _wrapped(shown(f.fix), f"{_INDENT}fix: ")
        where = (f.evidence or {}).get("where")
        if where and str(where) not in f.message:
            lines += _wrapped(shown(str(where)), f"{_INDENT}at ")
    severity, text = job_verdict(job)
    if text:
        lines += _wrapped(shown(text), f"  [{_ICON[severity]}] ")
    if job.breakdown:
        per_step = sum(job.breakdown.values())
        lines.append(shown(f"  [time] job {breakdown_line(job.breakdown, per_step, 1)}"))
        said = _job_time_verdict(job)
        if said:
            lines += _wrapped(shown(said + " (the ranks' mean after the first step; waiting for other ranks is "
                                    "collective)"), _INDENT)
    for run in job.runs:
        parts = job.by_rank.get(run.rank, {})
        total = sum(parts.values())
        row = breakdown_line(parts, total, 1) if parts else "no step timed"
        mark = "  <- straggler" if run.rank == job.straggler else ""
        lines += _wrapped(shown(f"rank {run.rank} ({run.host}, pid {run.pid}): {run.steps} step(s), status "
                                f"{run.exit_status}; {row}{mark}"), "  [rank] ")
    for note in [*job.notes, *watcher.notes, *watcher.rule_failures]:
        lines += _wrapped(shown(note), f"  [{_ICON['note']}] ")
    if written:
        lines.append(shown(f"  [{_ICON['note']}] wrote {', '.join(written)}"))
    return "\n".join(lines)


# -- running it ---------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from accelport.redact import Redactor
    from accelport.runtime.watch import Watcher, run_watched

    redactor = Redactor(os.environ)
    try:
        plan = _plan(args)
        launcher = _torchrun_argv(plan, args)
        records = _records_file(plan) if launcher is None else None
    except UsageError as exc:
        # Printed on the script's stderr, which no redacting stream guards: the one pass is here.
        raise UsageError(redactor.text(str(exc))) from None
    if launcher is not None:
        # torchrun starts one `python -m accelport diagnose` per rank; rank 0 says the job's summary. This process
        # becomes torchrun, so its exit status and its handling of signals are torchrun's.
        _flush(sys.stdout)
        _flush(sys.stderr)
        os.execv(sys.executable, [sys.executable, *launcher])
    if plan.report is not None:
        # Imported before the script's directory goes on sys.path (an html.py there is the script's).
        import accelport.diagnose.report  # noqa: F401
    stderr = sys.stderr  # accelport's messages go where stderr was, whatever the script makes of sys.stderr
    saved_builtins = dict(vars(builtins))
    command = ("--", plan.script) if plan.script is not None else ("-m", str(plan.module))
    from accelport.diagnose.job import RankStore
    from accelport.runtime.workers import watch_workers

    plan.workers_dir = tempfile.mkdtemp(prefix="accelport-workers-")
    # Ranks a scheduler started without torchrun: rank 0 hosts the store their summaries travel through.
    rank_store = RankStore.for_environ(os.environ)
    watcher = Watcher(backend=plan.backend, metrics_file=records, redactor=redactor, find_nan=plan.find_nan,
                      find_nan_dir=plan.find_nan_dir, command=(*command, *plan.args), profile=plan.profile,
                      workers=watch_workers(plan.workers_dir, plan.backend, steps=records is not None),
                      imports=rank_store.imports() if rank_store is not None else None)
    watcher.notes += plan.notes

    def conclude(outcome: Outcome) -> bool:
        try:
            with _own_builtins(saved_builtins):
                return _conclude(plan, watcher, outcome, records, redactor, stderr, lambda: ending.pending)
        finally:
            _remove(records)  # (published already where it was the metrics file)

    ending = _Terminate(watcher, conclude)
    pid = os.getpid()
    problems = False
    reporter = _progress_reporter(watcher)
    ending.install()
    try:
        outcome = run_watched(watcher, script=plan.script, module=plan.module, args=plan.args)
        ending.script_ended()
        if reporter is not None:
            reporter.stop()
        if not outcome.forked:  # (in a process the script forked, the script ended there: nothing to say)
            problems = conclude(outcome)
    finally:
        if os.getpid() == pid:
            ending.uninstall()
            _remove(records)
            if plan.workers_dir is not None:
                shutil.rmtree(plan.workers_dir, ignore_errors=True)
    _leave_streams_flushable()
    if ending.pending:
        _die_of(signal.SIGTERM)
    if outcome.ended_by is not None:
        _die_of(outcome.ended_by)
    if not outcome.forked and problems and outcome.exit_status == 0:
        return 1
    return outcome.exit_status


def _progress_reporter(watcher: Watcher) -> ProgressReporter | None:
    """A rank of a torchrun job says its progress while it runs (started here), so a rank that never ends is
    placed; None elsewhere."""
    from accelport.diagnose.job import JobPlace, ProgressReporter

    place = JobPlace.from_environ(os.environ)
    if place is None:
        return None
    clock = watcher.tracker.clock
    reporter = ProgressReporter(place, lambda: {"steps": watcher.steps + watcher.manual_steps,
                                                "in_backward": clock.in_backward,
                                                "in_collective": watcher.waiting_in()})
    reporter.start()
    return reporter


class _Terminate:
    """SIGTERM (a scheduler's kill) while the script runs: the findings so far are written, then the process
    ends by SIGTERM, as it would have without accelport.

    Installed only where SIGTERM would have ended the script (its disposition is the default): an
    ignored one stays ignored, and a handler the script installs replaces this one, so the script's
    runs. Once the script has ended, a SIGTERM waits until the outputs are written.
    """

    #: A worker the script forks inherits this handler: it is the parent's, which that worker may replace.
    parent_only = True

    def __init__(self, watcher: Watcher, conclude: Callable[[Outcome], object]) -> None:
        self._watcher = watcher
        self._conclude = conclude
        self._pid = os.getpid()
        self._running = True
        self._installed = False
        self.pending = False

    def install(self) -> None:
        try:
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                signal.signal(signal.SIGTERM, self)
                self._installed = True
        except (AttributeError, ValueError, OSError):  # not the main thread, or no SIGTERM on this system
            pass

    def uninstall(self) -> None:
        if self._installed and signal.getsignal(signal.SIGTERM) is self:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self._installed = False

    def script_ended(self) -> None:
        self._running = False

    def __call__(self, signum: int, frame: Any) -> None:
        from accelport.runtime.watch import Outcome

        if os.getpid() == self._pid and not self._running:
            self.pending = True
            return
        try:
            if os.getpid() == self._pid:  # (a process the script forked ends at once, as it would have)
                self._running = False
                self._watcher.finish()
                self._conclude(Outcome(128 + signum, signum))
        except BaseException:  # whatever failed, the process still ends as SIGTERM ends it
            pass
        finally:
            _die_of(signum)
            os._exit(128 + signum)  # (where the signal could not be raised: its status)


def _die_of(signum: int) -> None:
    """End as Python ends when a signal's default action ends it (SIGINT: after an unhandled Ctrl-C):
    killed by that signal, so a calling shell or scheduler sees it."""
    for stream in (sys.stdout, sys.stderr):
        _flush(stream)
    try:
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)  # to this thread: delivered before it returns
    except (AttributeError, OSError, ValueError):  # not the main thread, or no such signal: the status says it
        pass


@contextlib.contextmanager
def _own_builtins(saved: dict[str, Any]) -> Iterator[None]:
    """accelport's code with the builtins it started with (the script may have replaced ``open`` or
    ``print``); the script's come back after, for its atexit handlers."""
    names = vars(builtins)
    changed = {name: names.get(name, _MISSING) for name, value in saved.items()
               if names.get(name, _MISSING) is not value}
    names.update({name: saved[name] for name in changed})
    try:
        yield
    finally:
        for name, value in changed.items():
            if value is _MISSING:
                names.pop(name, None)
            else:
                names[name] = value


def _say(stream: Any, text: str) -> None:
    """A line of accelport's on the stderr it started with; where the script closed that, on descriptor 2."""
    try:
        stream.write(text + "\n")
        stream.flush()
        return
    except Exception:
        pass
    try:
        os.write(2, (text + "\n").encode("utf-8", "backslashreplace"))
    except OSError:
        pass


def _flush(stream: Any) -> None:
    try:
        stream.flush()
    except Exception:  # closed, replaced by something without flush(), or a pipe gone
        pass


def _leave_streams_flushable() -> None:
    """A stream the script closed, removed or broke is set aside, so the CLI's last flush has nothing to
    fail on (Python passes over a closed one at exit the same way)."""
    for name in ("stdout", "stderr"):
        try:
            getattr(sys, name).flush()
        except Exception:
            setattr(sys, name, io.StringIO())


def _remove(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass
