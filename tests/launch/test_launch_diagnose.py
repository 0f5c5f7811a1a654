"""`accelport launch --diagnose`: each worker under `accelport diagnose`, one job summary from rank 0 (cpu, gloo)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from tests.diagnose_cli.runs import SCRIPTS
from tests.launch.test_launch import launch

JOB = str(SCRIPTS / "ddp_job.py")


def test_an_unported_script_under_launch_diagnose_names_the_straggler_in_one_summary(tmp_path: Path) -> None:
    out, page = tmp_path / "job.json", tmp_path / "job.html"
    done = launch("--nprocs", "2", "--diagnose", "--output", str(out), "--report", str(page), JOB,
                  "--slow-rank", "1", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summaries = [line for line in done.stderr.splitlines() if line.startswith("accelport diagnose:")]
    assert len(summaries) == 1 and "a job of 2 ranks" in summaries[0], done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [f["evidence"]["rank"] for f in result["findings"] if f["kind"] == "straggler"] == [1]
    assert [r["steps"] for r in result["ranks"]] == [12, 12]
    assert page.read_text().count("<tr class=rank>") == 2


def test_a_ported_script_under_launch_diagnose_is_judged_as_one_job(tmp_path: Path) -> None:
    out = tmp_path / "job.json"
    done = launch("--nprocs", "2", "--diagnose", "--output", str(out), str(SCRIPTS.parent.parent / "scripts" /
                                                                           "train_dp.py"), str(tmp_path), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["rank"] for r in result["ranks"]] == [0, 1] and result["job"]["ranks_missing"] == []
    assert all(r["steps"] > 0 and r["exit_status"] == 0 for r in result["ranks"])


def test_a_rank_that_raises_under_launch_diagnose_is_named_with_its_own_error(tmp_path: Path) -> None:
    out = tmp_path / "job.json"
    done = launch("--nprocs", "2", "--diagnose", "--output", str(out), JOB, "--fail-rank", "1", timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    # The script's own error, not the exit status diagnose ended the worker with.
    assert "accelport: error: rank 1" in done.stderr and "RuntimeError: rank 1 failed after its steps" in done.stderr
    assert [r["exit_status"] for r in json.loads(out.read_text())["ranks"]] == [0, 1]


def test_diagnose_outputs_need_diagnose_and_a_writable_place(tmp_path: Path) -> None:
    done = launch("--output", str(tmp_path / "x.json"), JOB)
    assert done.returncode == 2 and "add --diagnose" in done.stderr and "Traceback" not in done.stderr
    done = launch("--diagnose", "--output", str(tmp_path / "none" / "x.json"), JOB)
    assert done.returncode == 2 and "launch: --output" in done.stderr and "does not exist" in done.stderr


def test_the_dry_run_shows_each_worker_under_diagnose(tmp_path: Path) -> None:
    out = tmp_path / "job.json"
    done = launch("--nprocs", "2", "--diagnose", "--output", str(out), "--dry-run", JOB, "--slow-rank", "1")
    assert done.returncode == 0, done.stderr
    command = shlex.split(done.stdout.splitlines()[0])
    at = command.index("accelport.launch.worker")
    assert command[at + 1:at + 6] == ["--diagnose", "--diagnose-arg", "--output", "--diagnose-arg", str(out)]
    assert command[at + 6:] == [JOB, "--slow-rank", "1"]


def test_eight_ranks_on_two_cores_finish_with_one_summary_of_eight(tmp_path: Path) -> None:
    """--oversubscribe: 8 workers share the cores; every one is judged, and rank 0 says the job once."""
    out = tmp_path / "job.json"
    done = launch("--nprocs", "8", "--oversubscribe", "--diagnose", "--output", str(out), JOB, "--steps", "4",
                  timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["rank"] for r in result["ranks"]] == list(range(8)) and result["job"]["ranks_missing"] == []
    assert all(r["steps"] == 4 for r in result["ranks"])
    assert sum(line.startswith("accelport diagnose:") for line in done.stderr.splitlines()) == 1


def test_the_ddp_hang_under_launch_timeout_ends_and_rank_0_names_the_rank_that_hangs(tmp_path: Path) -> None:
    """Rank 1 has one batch more (uneven inputs, kept under DDP): it hangs in its extra step's all-reduce. --timeout
    stops the job; rank 0, which ended its steps and waits for rank 1's run, says the job with rank 1 placed."""
    out = tmp_path / "job.json"
    done = launch("--nprocs", "2", "--timeout", "20", "--diagnose", "--output", str(out), JOB, "--extra-step-rank",
                  "1", "--ddp-uneven", timeout=600)
    assert done.returncode != 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(f["kind"], f["evidence"]["rank"], f["evidence"]["what"]) for f in result["findings"]] == [
        ("rank-divergence", 1, "steps")]
    said = " ".join(done.stderr.split())
    assert "rank 1 never ended: it was inside the backward pass of its step 13" in said, said[-3000:]
    # The launcher places rank 1 at the script's line, and says rank 0's script had ended (not accelport's line).
    assert "ddp_job.py:" in said and "loss.backward()" in said
    assert "rank 0" in said and "its script is not running" in said and "__main__.py" not in said, said[-3000:]
