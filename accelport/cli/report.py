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
    p.add_argument("--json", action="store_true", help="print the result (path, diagnoses) as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from accelport.cli import emit_json
    from accelport.diagnose.report import write_report

    path, findings = write_report(args.metrics_file, args.output)
    if args.json:
        emit_json({"report": path, "diagnoses": [f.to_dict() for f in findings]})
    else:
        print(f"wrote {path}: {len(findings)} diagnosis(es)")
        for f in findings:
            print(f"  [{f.kind}] {f.message}")
    return 0
