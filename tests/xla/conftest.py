"""Shared by the XLA:CPU tests: XLA on the host, and no setting that changes what is measured."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def xla_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    if not os.environ.get("PJRT_DEVICE"):
        monkeypatch.setenv("PJRT_DEVICE", "CPU")
    # Deprecated bf16 switches would be diagnosed; Neuron cache settings move the compile cache.
    for key in ("XLA_USE_BF16", "XLA_DOWNCAST_BF16", "NEURON_CC_FLAGS", "NEURON_COMPILE_CACHE_URL"):
        monkeypatch.delenv(key, raising=False)
