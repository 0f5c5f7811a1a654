"""What the tests of diagnosis share: the kinds found so far, and a loop that must stay silent."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import accelport as ap


def kinds() -> list[str]:
    """The kinds ``ap.diagnostics()`` holds, in the order they were found."""
    return [d.kind for d in ap.diagnostics()]


def silent(run: Callable[[], None]) -> None:
    """Run a loop that must not produce a single diagnosis (a DiagnosticWarning fails it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ap.DiagnosticWarning)
        run()
    assert ap.diagnostics() == []
