"""``accelport diagnose`` on scripts written as their users write them (plain PyTorch, Lightning, the HuggingFace
Trainer): what a finding says is where the fault is, and its fix is in the script's own terms.

Each script under ``scripts/`` never imports accelport.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from tests.diagnose_cli.runs import SCRIPTS, run


def line_of(script: pathlib.Path, text: str) -> int:
    return next(n for n, line in enumerate(script.read_text().splitlines(), 1) if text in line)


def diagnosed(tmp_path: pathlib.Path, script: pathlib.Path, *args: str, env: dict[str, str] | None = None
              ) -> tuple[Any, dict[str, Any], str]:
    """The run, its --output JSON and its stderr with every run of whitespace one space."""
    out = tmp_path / "found.json"
    done = run("--output", str(out), str(script), *args, env=env)
    return done, json.loads(out.read_text()), " ".join(done.stderr.split())


def test_a_nan_in_the_first_batch_of_a_dataloader_is_named_as_the_input(tmp_path: pathlib.Path) -> None:
    # The backend (and with it the step checks) is chosen at the end of step 1, after its batch came.
    done, result, said = diagnosed(tmp_path, SCRIPTS / "cpu_nan_first_batch.py")
    assert done.returncode == 0 and done.stdout == "done\n", done.stderr
    [found] = result["findings"]
    assert (found["kind"], found["step"], found["evidence"]["source"]) == ("non-finite", 1, "input")
    assert "it came from the input batch (input 0: 1 of 128 values are NaN or Inf)" in found["message"]
    assert "neither through" not in said and found["fix"].startswith("Bad data")


def test_weights_updated_by_hand_say_from_which_backward_pass_in_english(tmp_path: pathlib.Path) -> None:
    done, _, said = diagnosed(tmp_path, SCRIPTS / "cpu_real.py", "--case", "manual-sgd", "--steps", "40")
    assert done.returncode == 0, done.stderr
    assert "from the 32nd backward pass on, each was taken as a step" in said and "32th" not in said


def test_a_slow_dataset_under_lightning_is_named_at_its_getitem_not_its_collate_fn(tmp_path: pathlib.Path) -> None:
    import pytest

    pytest.importorskip("lightning", reason="lightning is in the test environment (noxfile.py); not here")
    script = SCRIPTS / "lightning_fit_loader.py"
    done, result, said = diagnosed(tmp_path, script)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("done 20"), done.stderr
    [found] = result["findings"]
    assert found["kind"] == "input-bound"
    # Each sample is slow; the collate_fn only stacks them.
    assert found["evidence"]["where"] == f"{script}:{line_of(script, 'def __getitem__')}"
    # The script has no train_dataloader(): it hands its DataLoader to trainer.fit.
    assert "the one handed to trainer.fit" in found["fix"] and "in train_dataloader()" not in found["fix"]
