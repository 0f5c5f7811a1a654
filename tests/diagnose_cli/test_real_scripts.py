"""``accelport diagnose`` on scripts written as real ones are: what it says must hold for scripts nobody wrote for it.

Each script under ``scripts/`` never imports accelport, and each has one thing a careless diagnosis gets wrong:
a warning filter set to "error", weights updated by hand, a crash, a padding collate_fn, a loop that lives in a
framework (HuggingFace Trainer, Lightning). What is checked: nothing says "ok" about a run it did not judge
whole, the numbers are the run's, the fix is in the script's own terms, the line is the user's.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import pytest

from tests.diagnose_cli.runs import SCRIPTS, run

REAL = SCRIPTS / "cpu_real.py"


def line_of(script: pathlib.Path, text: str) -> int:
    return next(n for n, line in enumerate(script.read_text().splitlines(), 1) if text in line)


def diagnosed(tmp_path: pathlib.Path, script: pathlib.Path, *args: str, env: dict[str, str] | None = None
              ) -> tuple[Any, dict[str, Any], str]:
    """The run, its --output JSON and its stderr with every run of whitespace one space (the summary wraps its
    lines; "[ok  ]" reads "[ok ]" there)."""
    out = tmp_path / "found.json"
    done = run("--output", str(out), str(script), *args, env=env)
    return done, json.loads(out.read_text()), " ".join(done.stderr.split())


def clean(summary: str) -> None:
    """Said once and said well: no fix said twice over, no doubled period, each kind's line once."""
    assert "Fix:" not in summary and not re.search(r"[^.]\.\.(?!\.)", summary), summary
    kinds = re.findall(r"\] ([a-z-]+) at step \d+:", summary)
    assert len(kinds) == len(set(kinds)), summary


def test_a_warning_filter_set_to_error_neither_stops_diagnosis_nor_breaks_the_script(tmp_path: pathlib.Path) -> None:
    # (30 steps: memory-growth judges from step 30, so every check judges the whole run.)
    done, result, said = diagnosed(tmp_path, REAL, "--case", "error-filter", "--steps", "30")
    assert done.returncode == 0 and done.stdout == "done\n", done.stderr
    # The finding is made and said (accelport's warning is never raised into the script's loop).
    assert [(f["kind"], f["step"]) for f in result["findings"]] == [("non-finite", 6)]
    assert "watching stopped" not in said and result["verdict"]["judged_every_step"] is True
    clean(said)


def test_weights_updated_by_hand_are_watched_through_the_backward_passes(tmp_path: pathlib.Path) -> None:
    done, result, said = diagnosed(tmp_path, REAL, "--case", "manual-sgd", "--steps", "60")
    assert done.returncode == 0 and done.stdout.startswith("done "), done.stderr
    # No optimizer: from the 32nd backward pass on, each is a step, so the slow dataset is found ...
    assert [f["kind"] for f in result["findings"]] == ["input-bound"]
    assert "took 0 optimizer step(s) and 60 backward passes (29 taken as steps) on cpu" in said
    # ... and the summary says what could not be checked without an optimizer, and the optimizer to use.
    assert "updates its weights without a torch.optim optimizer (60 backward passes" in said
    assert "torch.optim.SGD(model.parameters(), lr=lr) with optimizer.step() computes the same update" in said
    assert "non-finite (no optimizer step: the gradients were not checked)" in said
    assert result["verdict"]["judged_every_step"] is False and "[ok ]" not in said
    clean(said)


def test_a_crash_at_step_3_is_never_an_all_clear(tmp_path: pathlib.Path) -> None:
    done, result, said = diagnosed(tmp_path, REAL, "--case", "crash")
    assert done.returncode == 1 and "RuntimeError: the checkpoint directory went away" in done.stderr
    assert "[ok ]" not in said and result["findings"] == []
    assert ("the script ended with status 1 after 3 step(s): no finding in them; not judged: recompilation "
            "(needs 10 steps), input-bound (needs 10 steps), memory-growth (needs 30 steps)") in said
    verdict = result["verdict"]
    assert verdict["judged_every_step"] is False and verdict["steps_judged"] == 3
    assert verdict["not_judged"] == {"recompilation": "needs 10 steps", "input-bound": "needs 10 steps",
                                     "memory-growth": "needs 30 steps"}


def test_a_loss_that_diverges_until_the_script_fails_is_never_an_all_clear(tmp_path: pathlib.Path) -> None:
    done, result, said = diagnosed(tmp_path, REAL, "--case", "overflow")
    assert done.returncode == 1 and "OverflowError: math range error" in done.stderr
    assert "[ok ]" not in said and "the script ended with status 1 after" in said
    assert result["verdict"]["judged_every_step"] is False


def test_counters_that_cannot_be_read_here_are_said_not_ok(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "tpu.json"
    done = run("--backend", "tpu", "--output", str(out), str(SCRIPTS / "cpu_healthy.py"), "--steps", "12")
    said = " ".join(done.stderr.split())
    assert done.returncode == 0, done.stderr
    assert "[ok ]" not in said and "nothing was judged: the counters of tpu cannot be read here" in said
    assert json.loads(out.read_text())["verdict"]["judged_every_step"] is False


def test_a_padding_collate_fn_is_shown_as_where_the_batches_are_built_with_buckets_for_every_length(
        tmp_path: pathlib.Path) -> None:
    done, result, said = diagnosed(tmp_path, REAL, "--case", "collate-pad", "--steps", "40")
    assert done.returncode == 0, done.stderr
    by_kind = {f["kind"]: f for f in result["findings"]}
    limit = by_kind["compile-limit"]
    # The dimension that changed, and the fix for it: buckets for a sequence length, from every length the
    # run saw (the longest, 40, came after the finding was made), not a fixed batch size.
    assert "changed size along dim 1" in limit["message"] and "BucketCollate(buckets=(" in limit["fix"]
    buckets = re.search(r"BucketCollate\(buckets=\(([\d, ]+)\)", limit["fix"])
    assert buckets is not None and max(int(b) for b in buckets.group(1).split(",")) >= 40
    pad = f"{REAL}:{line_of(REAL, 'def pad_batch')}"
    assert limit["evidence"]["where"] == pad
    assert f"at {pad} (collate_fn pad_batch, where the batches are built)" in said
    # The run's totals are dynamo's own counts (the script prints them), not the moment the finding fired.
    graphs = int(re.search(r"dynamo unique_graphs (\d+)", done.stdout).group(1))  # type: ignore[union-attr]
    assert result["metrics"]["compilations"] == graphs == limit["totals"]["compilations"]
    assert result["metrics"]["batch_signatures"] == limit["totals"]["distinct_batch_shapes"] > 8
    clean(said)


# -- loops that live in a framework -------------------------------------------------------------------

HF = SCRIPTS / "hf_trainer.py"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture
def transformers() -> None:
    pytest.importorskip("transformers", reason="transformers is in the test environment (noxfile.py); not here")


def test_a_slow_dataset_under_the_hf_trainer_names_its_own_options(tmp_path: pathlib.Path, transformers: None) -> None:
    # 12 steps (the rule judges from step 10), each waiting 800 ms for its batch. One compute thread: on a
    # busy machine, torch's threads spinning for a descheduled peer would make the compute look like the cause.
    done, result, said = diagnosed(tmp_path, HF, "--case", "slow", "--steps", "12",
                                   env={**OFFLINE, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0 and done.stdout.rstrip().endswith("done 12"), done.stderr
    [found] = result["findings"]
    assert found["kind"] == "input-bound"
    # The Trainer's own option, not num_workers of a DataLoader the script never builds, nor ap.loader.
    assert "TrainingArguments(dataloader_num_workers=" in found["fix"] and "ap." not in found["fix"]
    # The user's dataset, never a frame of accelerate's or transformers'.
    getitem = f"{HF}:{line_of(HF, 'def __getitem__')}"
    assert found["evidence"]["where"] == getitem
    assert "site-packages" not in json.dumps(result["findings"])
    clean(said)


def test_a_nan_batch_under_the_hf_trainer_is_the_input_not_the_learning_rate(tmp_path: pathlib.Path,
                                                                            transformers: None) -> None:
    done, result, said = diagnosed(tmp_path, HF, "--case", "nan", env=OFFLINE)
    assert done.returncode == 0, done.stderr
    [found] = result["findings"]
    assert found["kind"] == "non-finite" and found["evidence"]["source"] == "input"
    assert "input 'inputs_embeds': 1 of" in found["message"] and "Bad data" in found["fix"]
    assert "clip" not in found["fix"]  # the Trainer clips already; the data is the cause
    assert found["evidence"]["where"].startswith(f"{HF}:")
    clean(said)


def test_a_healthy_hf_trainer_run_is_silent(tmp_path: pathlib.Path, transformers: None) -> None:
    # (30 steps: memory-growth judges from step 30, so the all-clear covers every check.)
    done, result, said = diagnosed(tmp_path, HF, "--case", "healthy", "--steps", "30", env=OFFLINE)
    assert done.returncode == 0 and result["findings"] == [], said
    assert "[ok ] no finding after 30 step(s) with every check running" in said, result["verdict"]


def test_a_slow_dataset_under_lightning_names_its_dataloader_options(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("lightning", reason="lightning is in the test environment (noxfile.py); not here")
    script = SCRIPTS / "lightning_slow.py"
    done, result, said = diagnosed(tmp_path, script)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("done 20"), done.stderr
    [found] = result["findings"]
    assert found["kind"] == "input-bound" and "persistent_workers=True) where the script builds" in found["fix"]
    assert found["evidence"]["where"] == f"{script}:{line_of(script, 'def __getitem__')}"
    clean(said)
