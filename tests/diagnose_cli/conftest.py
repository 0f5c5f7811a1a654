"""The in-process runs of ``accelport diagnose`` read no accelport setting the caller exported."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _no_accelport_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("ACCELPORT_"):
            monkeypatch.delenv(name)
