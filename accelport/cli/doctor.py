"""``accelport doctor``: a safe, complete environment check (see accelport.doctor)."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="check this environment without touching any device",
        description="What accelport will do here and what to fix. Exit status: 0 no problem, "
        "1 at least one problem, 2 usage error.",
    )
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="stable machine-readable keys")
    fmt.add_argument("--markdown", action="store_true", help="a block to paste into a bug report")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from accelport.cli import emit_json
    from accelport.doctor.gather import gather
    from accelport.doctor.render import exit_status, render_markdown, render_text

    report = gather()
    if args.json:
        emit_json(report)
    elif args.markdown:
        print(render_markdown(report))
    else:
        print(render_text(report))
    return exit_status(report)
