"""``accelport diagnose`` on unmodified torch_xla scripts written as their users write them, for real on XLA:CPU:
what it says is the script's, never accelport's own doing.

The scripts (tests/diagnose_cli/scripts/xla_*.py) never import accelport; they run in this process through the
CLI's ``main``, with torch_xla's counters cleared first (diagnose counts them from the process's start).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from accelport.cli import main
from tests.conftest import REPO

pytestmark = pytest.mark.xla

SCRIPTS = pathlib.Path(REPO) / "tests" / "diagnose_cli" / "scripts"


def line_of(script: pathlib.Path, text: str) -> int:
    return next(n for n, line in enumerate(script.read_text().splitlines(), 1) if text in line)


def diagnose(tmp_path: pathlib.Path, capfd: pytest.CaptureFixture[str], script: pathlib.Path, *options: str,
             status: int = 0) -> tuple[dict[str, Any], str, str]:
    """The --output JSON, the script's stdout and stderr (every run of whitespace one space)."""
    import torch_xla.debug.metrics as met

    met.clear_all()
    out = tmp_path / f"{script.stem}{len(list(tmp_path.iterdir()))}.json"
    assert main(["diagnose", *options, "--output", str(out), str(script)]) == status
    captured = capfd.readouterr()
    return json.loads(out.read_text()), captured.out, " ".join(captured.err.split())


def test_the_nan_searchs_own_reads_are_not_the_scripts_host_reads(tmp_path: pathlib.Path,
                                                                   capfd: pytest.CaptureFixture[str]) -> None:
    script = SCRIPTS / "xla_mnist_logged.py"
    plain, _, _ = diagnose(tmp_path, capfd, script)
    searched, out, said = diagnose(tmp_path, capfd, script, "--find-nan-from", "1")
    assert out.rstrip().endswith("done") and searched["steps"] == plain["steps"] == 12
    # Every step was checked op by op, a host read per checked tensor: none of them is the script's.
    assert "steps 1 to 12 were checked op by op" in said
    assert searched["findings"] == plain["findings"] == [], said
    assert searched["metrics"]["device_to_host"] == plain["metrics"]["device_to_host"]


def test_out_of_memory_at_the_sync_that_runs_a_steps_graph_names_that_step(tmp_path: pathlib.Path,
                                                                          capfd: pytest.CaptureFixture[str]) -> None:
    script = SCRIPTS / "xla_oom_step.py"
    result, out, said = diagnose(tmp_path, capfd, script, status=1)
    # Step 4 made the tensor; its graph runs (and fails) at the sync before step 5's batch: step 4 failed.
    assert "step 3 loss" in out and "step 4 loss" not in out
    assert "Out of memory allocating" in said and "Traceback (most recent call last)" in said
    [found] = result["findings"]
    assert (found["kind"], found["step"]) == ("out-of-memory", 4)
    assert found["message"].startswith("step 4 ran out of memory")
    assert "At step 3, the last good one" in found["message"] and found["evidence"]["budget_step"] == 3


def test_a_batch_size_drawn_at_random_is_fixed_by_padding_not_by_drop_last(tmp_path: pathlib.Path,
                                                                          capfd: pytest.CaptureFixture[str]) -> None:
    script = SCRIPTS / "xla_random_batch.py"
    result, out, _ = diagnose(tmp_path, capfd, script)
    [found] = result["findings"]
    assert found["kind"] == "recompilation" and "along the batch dimension (dim 0)" in found["message"]
    # Not a last short batch: drop_last would leave every other size as it is.
    assert found["fix"].startswith("The batch size varies from batch to batch (")
    assert found["fix"].index("pad every batch up to one size") < found["fix"].index("drop_last=True")
