"""``accelport backends``: every registered backend, available or not, and which one is selected."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("backends", help="list every backend with its probe result and the selection")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import accelport as ap
    from accelport.errors import AccelportError
    from accelport.runtime.selection import resolve
    from accelport.runtime.state import RUNTIME

    infos = ap.backends()
    host = RUNTIME.host()
    try:
        selected, reason = resolve(host, RUNTIME.explicit, RUNTIME.environ, matrix=RUNTIME.matrix())
        selection: dict[str, Any] = {"name": selected.name, "reason": reason}
    except AccelportError as exc:
        selection = {"name": None, "reason": str(exc)}
    failed = [{"plugin": f.name, "stage": f.stage, "error": f.error} for f in host.failed]
    if args.json:
        from accelport.cli import emit_json

        emit_json({"backends": [i.to_dict() for i in infos], "selected": selection, "failed_plugins": failed})
        return 0 if selection["name"] else 1
    width = max((len(i.name) for i in infos), default=4)
    for i in infos:
        mark = "*" if i.selected else " "
        state = "available" if i.available else "unavailable"
        print(f"{mark} {i.name:<{width}}  {state:<11}  {i.reason}")
    print()
    print(f"selected: {selection['name'] or 'none'}: {selection['reason']}")
    for f in failed:
        print(f"plugin {f['plugin']} disabled ({f['stage']}): {f['error']}")
    return 0 if selection["name"] else 1
