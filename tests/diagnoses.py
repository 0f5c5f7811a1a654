"""What the tests of diagnosis share: the kinds found so far, a loop that must stay silent, the rules on records."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import accelport as ap
from accelport.diagnose.engine import Diagnostics
from accelport.diagnose.rule import RunView
from accelport.diagnose.rules import BUILTIN_RULES


def kinds() -> list[str]:
    """The kinds ``ap.diagnostics()`` holds, in the order they were found."""
    return [d.kind for d in ap.diagnostics()]


def silent(run: Callable[[], None]) -> None:
    """Run a loop that must not produce a single diagnosis (a DiagnosticWarning fails it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ap.DiagnosticWarning)
        run()
    assert ap.diagnostics() == []


def engine(environ: dict[str, str] | None = None) -> Diagnostics:
    """The built-in rules as a replay runs them: on step records alone, no live sensor."""
    return Diagnostics([("diagnostics", rule) for rule in BUILTIN_RULES], RunView(environ=environ or {}))
