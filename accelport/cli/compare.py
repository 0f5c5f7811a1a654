"""``accelport compare A.json B.json [...] [--report F.html] [--json]``: did the change help, and by how much.

    accelport diagnose --output before.json -- train.py
    accelport diagnose --output after.json -- train.py --bucket
    accelport compare before.json after.json --report compare.html

Each run is compared with the first (the baseline); see :mod:`accelport.diagnose.compare`.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from accelport.errors import AccelportError, UsageError

__all__ = ["register", "run"]


def register(sub: Any) -> None:
    p = sub.add_parser(
        "compare",
        help="compare runs side by side: per-step time, compilations, memory, MFU and findings, with a verdict",
        usage="accelport compare A.json B.json [C.json ...] [--report FILE.html] [--json]",
        description="Compare the --output files of `accelport diagnose` (or metrics files: --metrics-file, "
                    "ACCELPORT_METRICS_FILE) side by side, each with the first (the baseline): the differences "
                    "in setup first (script, backend, versions, arguments), then per-step time and each time "
                    "category, compilations, host reads, data wait, memory peak and MFU with the ratio, the "
                    "findings fixed, new and still there, and a verdict in one line.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="a run's file: the baseline first")
    p.add_argument("--report", metavar="FILE.html", help="also write the comparison as one HTML page")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.set_defaults(func=run)


def _report_path(value: str, runs: list[str]) -> str:
    """Where --report writes: a file (new or regular) in a directory that exists, and none of the runs."""
    from accelport.safe_io import output_target, same_file

    if not value.strip():
        raise UsageError("compare: --report needs a file name")
    path = os.path.abspath(value)
    if os.path.isdir(path):
        raise UsageError(f"compare: --report {value} is a directory; give the path of an HTML file to write")
    if not os.path.isdir(os.path.dirname(path)):
        raise UsageError(f"compare: --report {value}: the directory {os.path.dirname(value)} does not exist; "
                         "create it first or write somewhere else")
    for source in runs:
        if same_file(path, source):
            raise UsageError(f"compare: --report {value} is the run {source}, which writing it would destroy; "
                             "give --report another path")
    try:
        output_target(value, what="compare: --report")
    except AccelportError as exc:
        raise UsageError(str(exc)) from None
    return path


def run(args: argparse.Namespace) -> int:
    from accelport.cli import emit_json
    from accelport.diagnose.compare import compare, render_page, render_text, to_dict

    report = _report_path(args.report, args.runs) if args.report is not None else None
    comparison = compare(args.runs)
    written = None
    if report is not None:
        from accelport.diagnose.report import escaper
        from accelport.redact import Redactor
        from accelport.safe_io import write_atomic

        # The page is a file, not this command's output: it gets the same pass, knowing this environment's secrets.
        page = render_page(comparison, escaper(Redactor(os.environ)))
        write_atomic(report, page.encode("utf-8"), what="compare: --report")
        written = report
    if args.json:
        emit_json({**to_dict(comparison), "report": written})
    else:
        print(render_text(comparison))
        if written:
            print(f"wrote {written}")
    return 0
