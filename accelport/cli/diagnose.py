"""``accelport diagnose``: run a script you have not ported, and say why it is slow.

    accelport diagnose train.py --batch-size 64                    # the script and its own arguments
    accelport diagnose --report run.html --output findings.json -- train.py --epochs 1
    accelport diagnose -m mypkg.train --epochs 1                   # a module, as with python -m

The script runs in this process as ``__main__`` (:func:`accelport.diagnose.watch.run_watched`),
watched by :class:`accelport.diagnose.watch.Watcher`; its output, its exit status and its
traceback are its own. The findings come at the end, on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import textwrap
from collections.abc import Sequence
from typing import Any

from accelport.errors import UsageError
from accelport.redact import redact

__all__ = ["register", "run", "render_summary"]

#: Kinds whose findings mean the run computes something wrong or nothing at all, not only slowly.
_ICON = {"ok": "ok  ", "note": "note", "warning": "WARN", "problem": "FAIL"}
_INDENT = " " * 9
_WIDTH = 110


def register(sub: Any) -> None:
    p = sub.add_parser(
        "diagnose",
        help="run an unmodified training script and say why it is slow (diagnose first, then port)",
        usage="accelport diagnose [--output FILE.json] [--report FILE.html] [--metrics-file FILE.jsonl] "
              "[--backend NAME] [--] SCRIPT [ARGS ...] | -m MODULE [ARGS ...]",
        description="Run a PyTorch or torch_xla training script as `python SCRIPT ARGS` would (same process, "
                    "argv, working directory, streams and exit status), watch its optimizer steps, syncs and "
                    "data loading, and print the same diagnoses a ported script gets, with the fix and the "
                    "line, on stderr at the end. Everything after SCRIPT (or -m MODULE) is the script's.",
    )
    p.add_argument("--output", metavar="FILE.json",
                   help="write the findings, metrics, steps, backend and exit status as JSON (also on failure)")
    p.add_argument("--report", metavar="FILE.html", help="write the page `accelport report` makes for the run")
    p.add_argument("--metrics-file", metavar="FILE.jsonl",
                   help="write one JSON line per step there (replaced), as ACCELPORT_METRICS_FILE does")
    p.add_argument("--backend", metavar="NAME",
                   help="read this backend's counters (default: the one for the device being trained on)")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE",
                   help="run a module as `python -m MODULE ARGS` would")
    p.add_argument("script", nargs="?", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    # The script's warnings are filtered as under plain `python`, not as for accelport's own commands.
    p.set_defaults(func=run, keep_warning_filters=True)


def _shown(value: str) -> str:
    """A path or name the user typed, as printed: each part redacted on its own, so the path stays readable."""
    return "/".join(redact("argument", part) for part in value.split("/"))


def _output_path(option: str, value: str | None) -> str | None:
    """The absolute path for an output option, checked before the script runs (it may change directory)."""
    if value is None:
        return None
    if not value.strip():
        raise UsageError(f"diagnose: {option} needs a file name")
    path = os.path.abspath(value)
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        raise UsageError(f"diagnose: {option} {_shown(value)} is a directory; give the path of a file to write")
    if not os.path.isdir(folder):
        raise UsageError(f"diagnose: {option} {_shown(value)}: the directory {_shown(folder)} does not exist; "
                         "create it first or write somewhere else")
    return path


def _check_script(script: str) -> None:
    if not os.path.exists(script):
        raise UsageError(f"diagnose: {_shown(script)}: no such file; give the path of the training script "
                         "(or -m MODULE for a module)")
    if os.path.isdir(script) and not os.path.isfile(os.path.join(script, "__main__.py")):
        raise UsageError(f"diagnose: {_shown(script)} is a directory, not a Python script; give the script in it "
                         "(e.g. DIR/train.py) or, for a package, -m PACKAGE.MODULE")
    if not os.path.isdir(script) and not os.access(script, os.R_OK):
        raise UsageError(f"diagnose: {_shown(script)} cannot be read (permission denied)")


def _check_module(name: str) -> None:
    import importlib.util

    # Found as `python -m` finds it: from the working directory first.
    sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(f"{name}.__main__")
            if spec is None:
                raise UsageError(f"diagnose: -m {_shown(name)} is a package without a __main__ module; give the "
                                 "module in it that trains (-m PACKAGE.MODULE)")
    except (ImportError, ValueError):
        spec = None
    finally:
        sys.path.pop(0)
    if spec is None:
        raise UsageError(f"diagnose: -m {_shown(name)}: no module of that name can be imported from here "
                         f"({_shown(os.getcwd())}); check the spelling and that its package is installed or in "
                         "this directory")


def _check_backend(name: str) -> None:
    from accelport.errors import UnknownBackendError
    from accelport.plugins.host import create_manager

    known = create_manager().backends
    if name.strip().lower() not in known:
        raise UsageError(f"diagnose: --backend: {UnknownBackendError(name, known, '--backend')}")


def _wrapped(text: str, first: str) -> list[str]:
    return textwrap.wrap(text, _WIDTH, initial_indent=first, subsequent_indent=_INDENT,
                         break_long_words=False, break_on_hyphens=False) or [first.rstrip()]


def render_summary(target: str, watcher: Any, exit_status: int, written: Sequence[str]) -> str:
    """The findings in doctor's plain style: severity and what was seen, the fix, the script's line."""
    from accelport.diagnose.watch import where

    findings = watcher.findings
    on = f" on {watcher.backend_name}" if watcher.backend_name else ""
    found = f": {len(findings)} finding(s)" if findings else ""
    lines = [f"accelport diagnose: {_shown(target)} took {watcher.steps} optimizer step(s){on} and exited with "
             f"status {exit_status}{found}"]
    for f in findings:
        seen, _, fix = f.message.partition(": ")
        lines += _wrapped(f"{f.kind} at step {f.step}: {seen}", f"  [{_ICON[f.severity]}] ")
        if fix:
            lines += _wrapped(fix, f"{_INDENT}fix: ")
        site = where(f, watcher.sites)
        if site:
            lines.append(f"{_INDENT}at {site[0]}:{site[1]}")
    if not findings:
        if watcher.steps:
            lines.append(f"  [{_ICON['ok']}] no finding: nothing in this run looks slow or wrong")
        else:
            lines += _wrapped("no optimizer step ran in this process, so nothing was diagnosed: diagnose watches "
                              "optimizer.step() of torch.optim optimizers (also inside xm.optimizer_step); "
                              "training in processes the script starts (torch_xla.launch, xmp.spawn) is not "
                              "watched", f"  [{_ICON['note']}] ")
    for note in watcher.notes:
        lines += _wrapped(note, f"  [{_ICON['note']}] ")
    if written:
        lines.append(f"  [{_ICON['note']}] wrote {', '.join(_shown(p) for p in written)}")
    return "\n".join(lines)


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def run(args: argparse.Namespace) -> int:
    from accelport.diagnose.watch import Watcher, run_watched

    if args.json:
        raise UsageError("diagnose: stdout belongs to the script; write the findings as JSON with --output FILE.json")
    module_argv = args.module
    if module_argv is not None:  # (-m takes the rest of the line: no script can follow it)
        if not module_argv:
            raise UsageError("diagnose: -m needs a module name: accelport diagnose -m MODULE [ARGS ...]")
        module, script, script_args = module_argv[0], None, module_argv[1:]
        _check_module(module)
    elif args.script is None:
        raise UsageError("diagnose: give the script to run: accelport diagnose SCRIPT [ARGS ...] "
                         "(or -m MODULE [ARGS ...])")
    else:
        module, script = None, args.script
        script_args = args.script_args[1:] if args.script_args[:1] == ["--"] else args.script_args
        _check_script(script)
    output = _output_path("--output", args.output)
    report = _output_path("--report", args.report)
    metrics_file = _output_path("--metrics-file", args.metrics_file)
    if args.backend is not None:
        _check_backend(args.backend)

    # The report is drawn from the step records: kept in a temporary file unless asked for.
    scratch = None
    if report is not None and metrics_file is None:
        scratch = tempfile.mkdtemp(prefix="accelport-diagnose-")
        metrics_file = os.path.join(scratch, "steps.jsonl")
    if metrics_file is not None and os.path.exists(metrics_file):
        os.remove(metrics_file)  # this run's steps, not appended to an earlier run's
    watcher = Watcher(backend=args.backend.strip().lower() if args.backend else None, metrics_file=metrics_file)
    target = script if script is not None else f"-m {module}"
    outcome = run_watched(watcher, script=script, module=module, args=script_args)

    written: list[str] = []
    problems: list[str] = []
    try:
        if output is not None:
            try:
                _write(output, json.dumps(_result(watcher, outcome.exit_status), indent=2, default=str) + "\n")
                written.append(output)
            except OSError as exc:
                problems.append(f"cannot write --output {_shown(output)}: {exc.strerror or exc}")
        if report is not None:
            if metrics_file is None or not os.path.exists(metrics_file):
                watcher.notes.append("no report page: no step was recorded, and the page draws the steps")
            else:
                problem = _write_report(report, metrics_file, watcher, target)
                if problem:
                    problems.append(problem)
                else:
                    written.append(report)
        if metrics_file is not None and scratch is None and os.path.exists(metrics_file):
            written.append(metrics_file)
    finally:
        if scratch is not None:
            import shutil

            shutil.rmtree(scratch, ignore_errors=True)
    try:
        sys.stdout.flush()  # the script's output first, then what was found
    except (OSError, ValueError):
        pass
    print(render_summary(target, watcher, outcome.exit_status, written), file=sys.stderr)
    for problem in problems:
        print(f"accelport: error: {problem}", file=sys.stderr)
    if outcome.interrupted:
        _die_of_sigint()
    if problems and outcome.exit_status == 0:
        return 1
    return outcome.exit_status


def _result(watcher: Any, exit_status: int) -> dict[str, Any]:
    from accelport.diagnose.watch import where

    findings = []
    for f in watcher.findings:
        item = f.to_dict()
        site = where(f, watcher.sites)
        if site:
            item["evidence"]["where"] = f"{site[0]}:{site[1]}"
        findings.append(item)
    return {"findings": findings, "metrics": watcher.metrics(), "steps": watcher.steps,
            "backend": watcher.backend_name, "exit_status": exit_status}


def _write_report(report: str, records_path: str, watcher: Any, target: str) -> str | None:
    """Write the report page (the one ``accelport report`` draws, with the live findings); why not, or None."""
    from accelport.diagnose.report import ReportError, load_records, render_html

    try:
        records = load_records(records_path)
        _write(report, render_html(records, watcher.findings, title=f"accelport diagnose: {target}"))
    except ReportError as exc:
        return f"no report page: {exc}"
    except OSError as exc:
        return f"cannot write --report {_shown(report)}: {exc.strerror or exc}"
    return None


def _die_of_sigint() -> None:
    """End as Python does after an unhandled Ctrl-C: killed by SIGINT, so a calling shell stops too."""
    try:
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except (OSError, ValueError):  # not the main thread, or no such signal here: the status says 130
        pass
