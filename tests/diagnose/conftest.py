"""The eager accelerators' stand-ins (tests/backends/test_standins.py), for the diagnosis tests."""

from __future__ import annotations

import pytest
import torch

from accelport.eager import EagerBackend
from tests.backends.test_standins import STANDINS, Runtime, select


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Runtime:
    monkeypatch.setattr(torch, "neuron", None, raising=False)  # registers the attribute for restoring
    return Runtime(monkeypatch)


@pytest.fixture(params=sorted(STANDINS))
def standin(request: pytest.FixtureRequest, runtime: Runtime) -> EagerBackend:
    return select(STANDINS[request.param]())
