"""``accelport diagnose --find-nan`` on an unmodified torch_xla script, for real on XLA:CPU: the checked steps run op by
op (a sync per checked tensor), and the forward op that made the first Inf is named, with a repro that runs on cpu."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from accelport.cli import main
from tests.conftest import REPO

pytestmark = pytest.mark.xla

SCRIPT = pathlib.Path(REPO) / "tests" / "diagnose_cli" / "scripts" / "xla_find_nan.py"


def test_a_log_of_zero_in_the_forward_pass_is_found_op_by_op(tmp_path: pathlib.Path,
                                                             capfd: pytest.CaptureFixture[str]) -> None:
    import torch_xla.debug.metrics as met

    met.clear_all()  # (counted from the process's start, as in the script's own process)
    out = tmp_path / "findings.json"
    assert main(["diagnose", "--find-nan", "--output", str(out), str(SCRIPT)]) == 0
    captured = capfd.readouterr()
    assert captured.out == "trained\n"
    result = json.loads(out.read_text())
    assert result["backend"] == "xla" and result["steps"] == 5
    [found] = result["findings"]
    origin = found["evidence"]["origin"]
    assert (found["kind"], found["step"], origin["kind"]) == ("non-finite", 3, "op")
    assert (origin["op"], origin["direction"], origin["made"]) == ("aten.log.default", "forward", "Inf")
    line = next(n for n, text in enumerate(SCRIPT.read_text().splitlines(), 1) if "# LOG" in text)
    assert origin["where"] == f"{SCRIPT}:{line}" and origin["module"] == "model.1 (Head)"
    assert origin["inputs"][0]["zeros"] > 0 and origin["inputs"][0]["neginf"] == 0
    # Said: the checked steps ran op by op.
    assert "On xla the checked steps ran op by op, a sync per checked tensor." in found["message"]
    assert "on xla each checked step ran op by op" in " ".join(captured.err.split())
    # The repro, next to --output's file, runs with plain python and torch on cpu.
    script, data = origin["repro"]
    assert pathlib.Path(script).parent == tmp_path and pathlib.Path(data).parent == tmp_path
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELPORT_", "PJRT_", "XLA_"))}
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr
    assert "inputs: 0 NaN, 0 Inf" in done.stdout and "NOT FINITE" in done.stdout, done.stdout
