"""The ``accelport`` command. Each subcommand lives in its own module and registers here.

Nothing escapes as a traceback: a known problem prints one line saying what to
do (exit 1, or 2 for a usage error); with ``--json`` even failures print valid
JSON (``{"error": ..., "kind": ...}``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from accelport.errors import UsageError

__all__ = ["main", "COMMANDS", "UsageError", "emit_json", "fail"]

#: Subcommand modules; each defines ``register(subparsers)`` that adds its parser
#: and sets ``func(args) -> int`` as the default.
COMMANDS: tuple[str, ...] = (
    "accelport.cli.backends",
    "accelport.cli.doctor",
    "accelport.cli.launch",
    "accelport.cli.matrix",
    "accelport.cli.ci_matrix",
    "accelport.cli.report",
    "accelport.cli.diagnose",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would print and exit; we decide the format
        # fail() prints "accelport: error: "; a subcommand's parser adds its own name
        # ("ci-matrix: argument --format: ..."), the top-level parser nothing more.
        command = self.prog.partition(" ")[2]
        raise UsageError(f"{command}: {message}" if command else message)


def build_parser() -> argparse.ArgumentParser:
    from accelport import __version__

    parser = _Parser(
        prog="accelport",
        description="One PyTorch training script on TPU, Trainium, GPU and CPU.",
    )
    parser.add_argument("--version", action="version", version=f"accelport {__version__}")
    # `accelport --json backends` means `accelport backends --json` (every command has --json):
    # main() moves it after the command. Declared here for the help text.
    parser.add_argument("--json", action="store_true", dest="json_before_command",
                        help="machine-readable output: the same as the command's --json")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for module in COMMANDS:
        importlib.import_module(module).register(sub)
    return parser


def _json_after_command(args: list[str]) -> list[str]:
    """``accelport --json doctor ...`` as ``accelport doctor --json ...``: argparse then checks it
    against the command's own options (``--markdown``) as it would after the command."""
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "--":
        i += 1  # the top-level options before the command (--json, --version)
    leading = args[:i]
    if "--json" not in leading or i == len(args):
        return args  # no command: the top-level parser answers (help, or its own errors)
    rest = [a for a in leading if a != "--json"]
    return [*rest, args[i], "--json", *args[i + 1:]]


def emit_json(obj: Any) -> None:
    """Print ``obj`` as JSON; anything not serialisable is written with str()."""
    print(json.dumps(obj, indent=2, sort_keys=False, default=str))


def fail(kind: str, message: str, as_json: bool, code: int) -> int:
    """Say an error once, as JSON (``{"error", "kind"}`` on stdout) or as text on stderr; return ``code``."""
    if as_json:
        emit_json({"error": message, "kind": kind})
    else:
        print(f"accelport: error: {message}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    from accelport.errors import AccelportError

    args_list = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in args_list  # until the arguments are parsed: a usage error is JSON too
    try:
        parser = build_parser()
        args = parser.parse_args(_json_after_command(args_list))
        # Parsed, the answer is exact: `accelport launch train.py --json` passes --json to the script.
        as_json = bool(getattr(args, "json", False)) or getattr(args, "format", None) == "json"
        if not getattr(args, "func", None):
            if args.json_before_command:  # JSON was asked for: an error in JSON, not the help text
                commands = ", ".join(module.rsplit(".", 1)[-1].replace("_", "-") for module in COMMANDS)
                return fail("usage", f"give a command: accelport --json COMMAND (one of {commands})", True, 2)
            parser.print_help()
            return 2
        with warnings.catch_warnings(record=as_json) as caught:
            if not as_json and not getattr(args, "keep_warning_filters", False):
                warnings.simplefilter("default")
            code = int(args.func(args) or 0)
        del caught
        return code
    except UsageError as exc:  # before AccelportError, of which it is one
        return fail("usage", str(exc), as_json, 2)
    except AccelportError as exc:
        return fail(type(exc).__name__, str(exc), as_json, 1)
    except KeyboardInterrupt:
        return fail("interrupted", "interrupted", as_json, 130)
    except BrokenPipeError:
        # The reader went away (`accelport matrix | head`): not an error of ours. Point
        # stdout at devnull so the interpreter's final flush does not complain either.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # the last line of defence: never a traceback
        return fail(
            "internal",
            f"unexpected {type(exc).__name__}: {exc} (this is a bug in accelport; please report it "
            "with the output of `accelport doctor --markdown`)",
            as_json,
            1,
        )
