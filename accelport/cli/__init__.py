"""The ``accelport`` command. Each subcommand lives in its own module and registers here.

Nothing escapes as a traceback: a known problem prints one line saying what to
do (exit 1, or 2 for a usage error); with ``--json`` even failures print valid
JSON (``{"error": ..., "kind": ...}``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from accelport.errors import UsageError

if TYPE_CHECKING:
    from accelport.redact import Redactor

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
    "accelport.cli.compare",
    "accelport.cli.verify_resume",
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


class _Output:
    """Where the CLI writes, and the one pass every line goes through on the way out.

    Text to stdout and stderr is redacted line by line (:class:`accelport.redact.Redactor`).
    With ``--json``, the JSON document is the only thing on stdout: whatever else writes
    to file descriptor 1 meanwhile (a plugin's print, a launched worker, C code) goes
    to stderr instead, so the output always parses.
    """

    def __init__(self) -> None:
        from accelport.redact import Redactor

        self.redactor = Redactor(os.environ)
        self.json_stream: TextIO = sys.stdout

    def emit_json(self, obj: Any) -> None:
        text = json.dumps(self.redactor.tree(_plain(obj)), indent=2, sort_keys=False, allow_nan=False)
        self.json_stream.write(text + "\n")
        self.json_stream.flush()

    @contextlib.contextmanager
    def session(self, as_json: bool, wrap: bool = True) -> Iterator[None]:
        saved_out, saved_err = sys.stdout, sys.stderr
        # A command's own output is printed escaped, whatever PYTHONIOENCODING says; a script
        # run by `accelport diagnose` (wrap=False) keeps Python's error handler, as under python.
        for stream in (saved_out, saved_err) if wrap else ():
            try:
                stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
            except (AttributeError, ValueError, OSError):
                pass
        json_fd = None
        self.json_stream = saved_out
        if as_json and _writes_to_fd(saved_out, 1):
            saved_out.flush()
            try:
                json_fd = os.dup(1)
                os.dup2(2, 1)  # fd 1 now writes to stderr: children and C code too
                encoding = getattr(saved_out, "encoding", None) or "utf-8"
                self.json_stream = open(json_fd, "w", encoding=encoding, errors="backslashreplace", closefd=False)
            except OSError:  # no usable file descriptors: keep Python's streams apart only
                json_fd, self.json_stream = None, saved_out
        if wrap:
            sys.stdout = _RedactingStream(saved_err if as_json else saved_out, self.redactor)
            sys.stderr = _RedactingStream(saved_err, self.redactor)
        try:
            yield
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:  # a script run by diagnose may have closed or replaced its streams
                    stream.flush()
                except (ValueError, OSError, AttributeError):
                    pass
            sys.stdout, sys.stderr = saved_out, saved_err
            if json_fd is not None:
                self.json_stream.flush()
                sys.stdout.flush()
                os.dup2(json_fd, 1)
                os.close(json_fd)
                self.json_stream = saved_out


class _RedactingStream(io.TextIOBase):
    """A text stream that redacts each complete line before it reaches ``target``."""

    def __init__(self, target: TextIO, redactor: Redactor) -> None:
        self._target, self._redactor, self._pending = target, redactor, ""

    def write(self, text: str) -> int:
        self._pending += text
        if "\n" in self._pending:
            *lines, self._pending = self._pending.split("\n")
            self._target.write("".join(self._redactor.text(line) + "\n" for line in lines))
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self._target.write(self._redactor.text(self._pending))
            self._pending = ""
        self._target.flush()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._target, "encoding", "utf-8")

    def isatty(self) -> bool:
        return self._target.isatty()

    def fileno(self) -> int:
        return self._target.fileno()


def _writes_to_fd(stream: Any, fd: int) -> bool:
    """Whether ``stream`` is the process's file descriptor ``fd`` (not a caller's StringIO)."""
    try:
        return bool(stream.fileno() == fd)
    except (AttributeError, OSError, ValueError):
        return False


def _plain(obj: Any) -> Any:
    """``obj`` with anything JSON cannot hold written with str()."""
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_plain(v) for v in obj]
    return str(obj)


_OUTPUT = _Output.__new__(_Output)  # replaced by main(); emit_json works before it too


def emit_json(obj: Any) -> None:
    """Print ``obj`` as JSON, redacted, on the command's real stdout (see :class:`_Output`)."""
    if not hasattr(_OUTPUT, "redactor"):
        _OUTPUT.__init__()  # type: ignore[misc]
    _OUTPUT.emit_json(obj)


#: The most characters of one line of an error message that are shown.
ERROR_LINE_LIMIT = 2000


def fail(kind: str, message: str, as_json: bool, code: int) -> int:
    """Say an error once, as JSON (``{"error", "kind"}`` on stdout) or as text on stderr; return ``code``.

    The message is redacted and each line cut at :data:`ERROR_LINE_LIMIT` here, not only by the
    output session: a usage error is said before that session starts, and argparse quotes what
    was typed whole (a 100 KB value, a token given as an argument).
    """
    from accelport.redact import Redactor

    redactor = Redactor(os.environ, limit=ERROR_LINE_LIMIT)
    message = "\n".join(redactor.text(line) for line in message.split("\n"))
    if as_json:
        emit_json({"error": message, "kind": kind})
    else:
        print(f"accelport: error: {message}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    global _OUTPUT
    _OUTPUT = _Output()
    from accelport.runtime.state import RUNTIME
    from accelport.settings import plugin_timeout

    # A plugin that hangs must not hang a command: the CLI bounds every plugin call.
    RUNTIME.limit_plugin_calls(plugin_timeout(os.environ))
    args_list = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in args_list  # until the arguments are parsed: a usage error is JSON too
    parsed: list[argparse.Namespace] = []

    def parse() -> int:
        parser = build_parser()
        parsed.append(parser.parse_args(_json_after_command(args_list)))
        if not getattr(parsed[0], "func", None):
            if parsed[0].json_before_command:  # JSON was asked for: an error in JSON, not the help text
                commands = ", ".join(module.rsplit(".", 1)[-1].replace("_", "-") for module in COMMANDS)
                return fail("usage", f"give a command: accelport --json COMMAND (one of {commands})", True, 2)
            parser.print_help()
            return 2
        return 0

    code = _guarded(parse, as_json)
    if code or not parsed:
        return code
    args = parsed[0]
    # Parsed, the answer is exact: `accelport launch train.py --json` passes --json to the script.
    as_json = bool(getattr(args, "json", False)) or getattr(args, "format", None) == "json"

    def run() -> int:
        with warnings.catch_warnings(record=as_json):
            if not as_json and not getattr(args, "keep_warning_filters", False):
                warnings.simplefilter("default")
            return int(args.func(args) or 0)

    # `accelport diagnose` runs the user's own script: its output is its own, byte for byte.
    with _OUTPUT.session(as_json, wrap=args.command != "diagnose"):
        return _guarded(run, as_json)


def _guarded(step: Callable[[], int], as_json: bool) -> int:
    """Run ``step``; any failure becomes one line (or one JSON object) and an exit status."""
    from accelport.errors import AccelportError

    try:
        return step()
    except UsageError as exc:  # before AccelportError, of which it is one
        return fail("usage", str(exc), as_json, 2)
    except AccelportError as exc:
        return fail(type(exc).__name__, str(exc), as_json, 1)
    except KeyboardInterrupt:
        return fail("interrupted", "interrupted", as_json, 130)
    except BrokenPipeError:
        # The reader went away (`accelport matrix | head`): not an error of ours. Point
        # stdout at devnull so the interpreter's final flush does not complain either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.__stdout__.fileno() if sys.__stdout__ else 1)
        return 0
    except Exception as exc:  # the last line of defence: never a traceback
        return fail(
            "internal",
            f"unexpected {type(exc).__name__}: {exc} (this is a bug in accelport; please report it "
            "with the output of `accelport doctor --markdown`)",
            as_json,
            1,
        )
