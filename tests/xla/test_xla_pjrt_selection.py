"""PJRT_DEVICE asks for XLA: with torch_xla installed, setting it alone selects the xla backend."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.xla


def test_pjrt_device_cpu_selects_xla_on_the_host() -> None:
    env = {k: v for k, v in os.environ.items() if k != "ACCELPORT_BACKEND"}
    env["PJRT_DEVICE"] = "CPU"
    out = subprocess.run([sys.executable, "-c", "import accelport as ap\nap.device()\nprint(ap.backend().reason)"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("xla was chosen because PJRT_DEVICE=CPU asks for XLA"), out.stdout
