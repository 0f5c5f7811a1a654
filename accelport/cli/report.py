"""``accelport report run.jsonl [-o report.html]``: a self-contained page about a recorded run."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser(
        "report",
        help="turn an ACCELPORT_METRICS_FILE log into one HTML page",
        description="Write a self-contained HTML page (no network) with a per-step chart of where time went, "
        "compilation events, and the diagnoses with their fixes.",
    )
    p.add_argument("metrics_file", help="the JSON-lines file written by ACCELPORT_METRICS_FILE")
    p.add_argument("-o", "--output", help="where to write the page (default: next to the input, .html)")
    p.add_argument("--checkpoints", metavar="DIR",
                   help="add the job's goodput from ap.Checkpointer's account in DIR (its checkpoint directory; "
                        "default: ACCELPORT_CHECKPOINT_DIR where it is set and holds one)")
    p.add_argument("--job", metavar="OUTPUT.json",
                   help="the --output accelport diagnose wrote for a job of several ranks (the metrics file being "
                        "rank 0's): the page says the job's findings and a row per rank")
    p.add_argument("--json", action="store_true", help="print the result (path, diagnoses, goodput) as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os

    from accelport.cli import emit_json
    from accelport.diagnose.report import skipped_note, write_report
    from accelport.redact import Redactor

    goodput = _goodput(args.checkpoints)
    # The page is a file, not this command's output: it gets the same pass, knowing this environment's secrets.
    written = write_report(args.metrics_file, args.output, redactor=Redactor(os.environ), goodput=goodput,
                           job=args.job)
    findings = written.findings
    if args.json:
        emit_json({"report": written.path, "diagnoses": [f.to_dict() for f in findings], "runs": written.runs,
                   "lines": [written.first_line, written.last_line], "skipped_lines": written.skipped_lines,
                   "goodput": goodput})
    else:
        print(f"wrote {written.path}: {len(findings)} diagnosis(es)")
        if written.runs > 1:
            print(f"  {args.metrics_file} holds {written.runs} runs; the page is about the last one "
                  f"(lines {written.first_line} to {written.last_line})")
        if written.skipped_lines:
            print(f"  {skipped_note(args.metrics_file, written.skipped_lines)}")
        for f in findings:
            print(f"  [{f.kind}] {f.message}")
        if goodput is not None:
            from accelport.goodput import render

            for line in render(goodput):
                print(f"  [goodput] {line}")
    return 0


def _goodput(directory: str | None) -> dict[str, Any] | None:
    """The goodput account in ``directory`` (given: an error if it holds none), else in ACCELPORT_CHECKPOINT_DIR."""
    import os

    from accelport.errors import UsageError
    from accelport.goodput import JOURNAL, account_of_directory

    if directory is None:
        directory = (os.environ.get("ACCELPORT_CHECKPOINT_DIR") or "").strip() or None
        return account_of_directory(directory) if directory else None
    found = account_of_directory(directory)
    if found is None:
        raise UsageError(f"report: --checkpoints {directory}: no goodput account there ({JOURNAL}, written by "
                         "ap.Checkpointer's rank 0 beside its checkpoints); give the directory the job's "
                         "ap.Checkpointer saved in")
    return found
