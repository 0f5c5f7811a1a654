"""The dynamo surfaces the compiled-function diagnosis reads, pinned on the xla environment's torch (2.9).

The checks live in tests/diagnose/dynamo_surfaces.py; the default environment runs the
same ones on torch 2.13 (tests/diagnose/test_dynamo_surfaces.py). Each runs in a fresh
interpreter: dynamo's counters and config are process-wide, and the XLA tests before
these (torch_xla imported, models compiled) must not change what they see.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.diagnose.dynamo_surfaces import CHECKS

pytestmark = pytest.mark.xla


@pytest.mark.parametrize("check", [*CHECKS, "check_torch_xla_turns_automatic_dynamic_off"])
def test_dynamo_surface_on_torch_2_9(check: str) -> None:
    code = f"from tests.diagnose import dynamo_surfaces as s\ns.{check}()\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{check} failed:\n{out.stderr[-3000:]}"
