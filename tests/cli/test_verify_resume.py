"""``accelport verify-resume``: a resume that forgets one thing is named for it; a correct one is identical.

The scripts are under ``tests/scripts/resume/``: ``train.py`` saves with torch.save every step and resumes
with torch.load, leaving out what ``--forget`` names; ``checkpointer.py`` resumes with ap.Checkpointer;
``unseeded.py`` seeds from os.urandom. Each check is real subprocesses (the runs, killed at an exact step
from inside themselves); the comparison's own rules are also checked on records made by hand.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

from accelport.diagnose.resume_check import Run, StepRecorder, compare
from tests.conftest import default_signals

SCRIPTS = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "resume"
TRAIN = str(SCRIPTS / "train.py")


def verify_resume(*args: str, cwd: pathlib.Path) -> tuple[subprocess.CompletedProcess[str], Any]:
    """``accelport verify-resume --json ARGS`` in a subprocess: the process and its JSON."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")}
    # The timeout guards against a hang; it measures nothing.
    done = subprocess.run([sys.executable, "-m", "accelport", "verify-resume", "--json", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=900, env=env, preexec_fn=default_signals)
    return done, json.loads(done.stdout)


# -- what each forgotten state is called -----------------------------------------------------------------


@pytest.mark.parametrize(("forget", "step", "what", "fix"), [
    ("optimizer", 9, "optimizer state", "optimizer.load_state_dict"),
    # The optimizer's groups bring back step 9's rate; the fresh LambdaLR sets step 10's wrong.
    ("scheduler", 10, "learning rate", "LambdaLR's scheduler.state_dict()"),
    ("loader", 9, "data order", "loader.generator.get_state()"),
    ("rng", 9, "rng", "torch.set_rng_state"),
    ("skip", 9, "batch skipped", "one batch too many"),
    ("repeat", 9, "batch repeated", "one batch too few"),
    ("model", 9, "parameters", "model.load_state_dict"),
    ("scaler", 9, "gradient scaler", "scaler.load_state_dict"),
])
def test_a_resume_that_forgets_one_state_is_named_for_it(tmp_path: pathlib.Path, forget: str, step: int, what: str,
                                                         fix: str) -> None:
    done, result = verify_resume("--kill-at", "8", "--", TRAIN, "--forget", forget, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert result["verdict"] == "differs"
    assert result["resumed_at"] == 9  # the checkpoint of step 8, found by the weights (or, forgotten, the optimizer)
    assert result["first_difference"]["step"] == step
    assert result["first_difference"]["what"] == what
    assert fix in result["fix"]
    assert f"first difference at step {step}: {what}" in done.stderr


def test_a_correct_hand_written_resume_is_identical_and_its_relative_paths_land_in_the_runs_own_directory(
        tmp_path: pathlib.Path) -> None:
    output = tmp_path / "resume.json"
    done, result = verify_resume("--kill-at", "3", "--output", str(output), "--", TRAIN, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert result["verdict"] == "identical" and result["first_difference"] is None
    assert result["resumed_at"] == 4 and result["steps"] == 12
    assert json.loads(output.read_text()) == result
    assert sorted(os.listdir(tmp_path)) == ["resume.json"]  # ckpt.pt went to the runs' own directories
    assert f"accelport verify-resume: {TRAIN}: identical" in done.stderr.splitlines()  # (the script as typed)


def test_an_ap_checkpointer_resume_is_identical_after_sigterm_and_two_restarts(tmp_path: pathlib.Path) -> None:
    done, result = verify_resume("--kill-at", "3", "--signal", "TERM", "--restarts", "2", "--",
                                 str(SCRIPTS / "checkpointer.py"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert result["verdict"] == "identical"
    # SIGTERM is a stop request: the checkpointer saves at the end of the next step and exits 75.
    assert [(r["resumed_at"], r["resumed"]) for r in result["resumes"]] == [(5, True), (9, True)]
    assert result["resumed_at"] == 5


def test_an_ap_checkpointer_killed_at_the_last_step_of_a_pass_resumes_identical(tmp_path: pathlib.Path) -> None:
    # Step 6 is the last of the first pass (24 samples, batches of 4): the next pass's shuffled order is drawn
    # from the generator as the first pass's sampler left it when it ran out.
    done, result = verify_resume("--kill-at", "6", "--", str(SCRIPTS / "checkpointer.py"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert result["verdict"] == "identical" and result["resumed_at"] == 7, result


def test_a_script_that_differs_from_itself_is_nondeterministic_not_a_bad_resume(tmp_path: pathlib.Path) -> None:
    done, result = verify_resume("--", str(SCRIPTS / "unseeded.py"), cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert result["verdict"] == "nondeterministic"
    assert result["first_difference"]["step"] == 1
    assert result["first_difference"]["what"] == "parameters"
    assert "before any resume: the initial weights" in result["first_difference"]["detail"]


def test_a_restart_that_never_loads_its_checkpoint_is_said_to_have_not_resumed(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "forgets.py"
    script.write_text((SCRIPTS / "unseeded.py").read_text().replace(
        'int.from_bytes(os.urandom(4), "little")', "0").replace('if os.path.exists("ckpt.pt")', "if False"))
    done, result = verify_resume("--", str(script), cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert result["verdict"] == "not resumed" and result["resumed_at"] == 1
    assert "never resumed" in result["notes"][-1]


# -- several ranks: each compared with its own uninterrupted run, one verdict ----------------------------------

DDP = str(SCRIPTS / "ddp_train.py")


def test_a_correct_resume_of_two_ddp_ranks_is_identical_with_rank_1_killed(tmp_path: pathlib.Path) -> None:
    done, result = verify_resume("--nprocs", "2", "--kill-rank", "1", "--kill-at", "5", "--", DDP, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert result["verdict"] == "identical" and result["resumed_at"] == 6
    assert (result["ranks"], result["kill_rank"]) == (2, 1)
    assert [(p["rank"], p["verdict"]) for p in result["per_rank"]] == [(0, "identical"), (1, "identical")]
    assert "2 ranks; rank 1 killed with SIGKILL at the end of step 5" in done.stderr


def test_the_rank_that_restored_another_ranks_random_state_is_named_not_the_one_it_misled(
        tmp_path: pathlib.Path) -> None:
    done, result = verify_resume("--nprocs", "2", "--kill-at", "5", "--", DDP, "--forget", "rank-rng", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    first = result["first_difference"]
    assert (result["verdict"], first["step"], first["what"], first["rank"]) == ("differs", 6, "rng", 1)
    # Rank 0 restored its own state, and its weights differ only because the ranks average their gradients.
    assert [(p["rank"], p["what"]) for p in result["per_rank"]] == [(0, "parameters"), (1, "rng")]
    assert any("rank 0 computed other weights at step 6 from the same inputs" in n for n in result["notes"])
    assert "each its own: rank 1 restored a random state that is not the one it saved" in result["fix"]
    assert "first difference at step 6 on rank 1: rng" in done.stderr


# -- frameworks' own resumes ----------------------------------------------------------------------------------


def test_the_hf_trainers_resume_is_identical_and_ignore_data_skip_is_named_as_the_data_order(
        tmp_path: pathlib.Path) -> None:
    pytest.importorskip("transformers", reason="transformers is in the test environment (noxfile.py); not here")
    script = str(SCRIPTS / "hf_trainer.py")
    done, result = verify_resume("--kill-at", "5", "--", script, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert result["verdict"] == "identical" and result["resumed_at"] == 6 and result["steps"] == 12
    done, result = verify_resume("--kill-at", "5", "--", script, "--ignore-data-skip", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    first = result["first_difference"]
    assert (first["step"], first["what"]) == (6, "data order")
    assert "got the batch the uninterrupted run had at step 1" in first["detail"]  # the epoch started over


def test_lightnings_ckpt_path_resume_mid_epoch_starts_the_epochs_data_over(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("lightning", reason="lightning is in the test environment (noxfile.py); not here")
    done, result = verify_resume("--kill-at", "3", "--", str(SCRIPTS / "lightning_ckpt.py"), cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert result["resumed_at"] == 4  # the weights, optimizer and step count came back from last.ckpt
    first = result["first_difference"]
    assert (first["step"], first["what"]) == (4, "data order")
    assert "got the batch the uninterrupted run had at step 1" in first["detail"]


# -- bad input ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "said"), [
    ((), "give the script to check"),
    (("--", "no_such_script.py"), "no_such_script.py: no such file"),
    (("--kill-at", "0", "--", TRAIN), "steps count from 1"),
    (("--kill-at", "two", "--", TRAIN), "not a whole number"),
    (("--signal", "HUP", "--", TRAIN), "give KILL or TERM"),
    (("--restarts", "0", "--", TRAIN), "1 or more restarts"),
    (("-m",), "-m needs a module name"),
    (("--kill-rank", "1", "--", TRAIN), "--kill-rank 1 needs --nprocs 2 or more"),
    (("--nprocs", "2", "--kill-rank", "2", "--", TRAIN), "the job has ranks 0 to 1 (--nprocs 2)"),
    (("--nprocs", "0", "--", TRAIN), "give the number of ranks, 1 or more"),
])
def test_bad_input_is_a_specific_error_before_anything_runs(tmp_path: pathlib.Path, args: tuple[str, ...],
                                                            said: str) -> None:
    done, result = verify_resume(*args, cwd=tmp_path)
    assert done.returncode == 2
    assert result["kind"] == "usage" and said in result["error"]
    assert "Traceback" not in done.stderr


def test_a_kill_past_the_runs_end_says_how_many_steps_it_has(tmp_path: pathlib.Path) -> None:
    done, result = verify_resume("--kill-at", "6", "--", str(SCRIPTS / "unseeded.py"), cwd=tmp_path)
    assert done.returncode == 2
    assert "past the run's end" in result["error"] and "took 6 optimizer step(s)" in result["error"]
    assert "between 1 and 5" in result["error"]


def test_a_script_that_fails_by_itself_is_said_with_its_own_error(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text("raise SystemExit('no data here')\n")
    done, result = verify_resume("--", str(script), cwd=tmp_path)
    assert done.returncode == 1
    assert result["kind"] == "RunFailed"
    assert "exited with status 1 by itself" in result["error"] and "no data here" in result["error"]


# -- the rules of the comparison, on records made by hand ------------------------------------------------------


def _step(n: int, **changed: Any) -> dict[str, Any]:
    record = {"kind": "step", "step": n, "batch": f"b{n}", "params_before": f"p{n - 1}",
              "optimizer_before": f"o{n - 1}", "lr": [0.1], "hyper": "h", "scaler": None,
              "rng": {"torch": f"r{n}", "random": "x"},
              "params": f"p{n}", "optimizer": f"o{n}"}
    return {**record, **changed}


def _run(label: str, steps: list[dict[str, Any]], killed_at: int | None = None) -> Run:
    return Run(label, steps, 0, killed_at, killed_at is None, None, "", {"optimizer_class": "SGD"})


def test_a_random_state_no_step_drew_from_is_a_note_and_an_unseeded_one_is_left_out() -> None:
    reference = [_step(n) for n in range(1, 7)]
    again = [{**r, "rng": {**r["rng"], "random": "other"}} for r in reference]  # Python's random, never seeded
    resumed = [_step(n, rng={"torch": "moved", "random": "y"}) for n in range(4, 7)]
    result = compare(_run("a", reference), _run("b", again), [_run("c", reference[:3], 3), _run("d", resumed)],
                     kill_at=3, signame="KILL")
    assert result.verdict == "identical" and result.resumed_at == 4
    assert len(result.notes) == 1
    assert "torch's CPU generator" in result.notes[0] and "Python's random" not in result.notes[0]


def test_the_first_difference_is_the_cause_entering_the_step_not_what_it_made() -> None:
    reference = [_step(n) for n in range(1, 7)]
    resumed = [_step(4, lr=[0.5], params="x4", optimizer="y4"), *[_step(n, params_before="?") for n in (5, 6)]]
    result = compare(_run("a", reference), _run("b", reference), [_run("c", reference[:3], 3), _run("d", resumed)],
                     kill_at=3, signame="KILL")
    assert result.verdict == "differs"
    assert result.first_difference is not None
    assert (result.first_difference.step, result.first_difference.what) == (4, "learning rate")
    assert result.first_difference.also == ["parameters", "optimizer state"]


def test_a_resumed_run_that_ends_early_skipped_batches() -> None:
    reference = [_step(n) for n in range(1, 7)]
    result = compare(_run("a", reference), _run("b", reference), [_run("c", reference[:3], 3),
                                                                  _run("d", reference[3:5])],
                     kill_at=3, signame="KILL")
    assert result.verdict == "differs" and result.first_difference is not None
    assert (result.first_difference.step, result.first_difference.what) == (6, "batch skipped")


# -- the watcher records nothing unless asked -------------------------------------------------------------------


def test_the_watcher_adds_module_hooks_only_for_a_recorder_and_takes_them_out(tmp_path: pathlib.Path) -> None:
    import torch.nn.modules.module as module

    from accelport.runtime.watch import Watcher

    before = (len(module._global_forward_pre_hooks), len(module._global_forward_hooks))
    plain = Watcher(environ={})
    plain.install()
    try:
        assert (len(module._global_forward_pre_hooks), len(module._global_forward_hooks)) == before
    finally:
        plain.uninstall()
    recorder = StepRecorder(str(tmp_path / "steps.jsonl"))
    recording = Watcher(environ={}, recorder=recorder)
    recording.install()
    try:
        assert (len(module._global_forward_pre_hooks), len(module._global_forward_hooks)) == (before[0] + 1,
                                                                                              before[1] + 1)
    finally:
        recording.uninstall()
    assert (len(module._global_forward_pre_hooks), len(module._global_forward_hooks)) == before
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [line["kind"] for line in lines] == ["start", "end"]


def test_a_module_is_run_as_python_m_runs_it_from_the_directory_verify_resume_started_in(
        tmp_path: pathlib.Path) -> None:
    (tmp_path / "resume_train.py").write_text(pathlib.Path(TRAIN).read_text())
    done, result = verify_resume("--kill-at", "3", "-m", "resume_train", "--epochs", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (result["verdict"], result["resumed_at"], result["steps"]) == ("identical", 4, 6)
    assert result["command"] == "-m resume_train"
    assert "ckpt.pt" not in os.listdir(tmp_path)  # the runs' own directories got it
