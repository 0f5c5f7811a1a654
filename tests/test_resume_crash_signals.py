"""Checkpointer(stop_on=...) refuses the signals of a crash: caught, they would turn the crash into a hang."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

import accelport as ap
from accelport.errors import UsageError


@pytest.mark.parametrize("name", ["SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "segv", int(signal.SIGSEGV)])
def test_crash_signals_are_refused_naming_those_allowed(tmp_path: Path, name: str | int) -> None:
    before = signal.getsignal(signal.SIGSEGV)
    with pytest.raises(UsageError, match=r"SIG[A-Z]+ means the process crashed, and a crash cannot be saved at "
                                            r"the next step .* use SIGTERM, SIGINT, SIGHUP, SIGUSR1 or SIGUSR2"):
        ap.Checkpointer(tmp_path, stop_on=("SIGTERM", name))
    assert signal.getsignal(signal.SIGSEGV) == before  # nothing installed
