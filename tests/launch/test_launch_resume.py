"""`accelport launch` with ap.Checkpointer on 2 cpu processes (gloo): a worker killed and the group restarted
(--max-restarts), SIGTERM to the launch (every rank saves, status 75, a second launch resumes), a sharded
checkpoint of 2 ranks resumed alone; every resumed run bit-identical to an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from accelport.cli import main
from accelport.launch.plan import build_plan
from accelport.launch.stop import EXIT_PREEMPTED
from accelport.resume import find_checkpoints
from tests.conftest import DEFAULT_SIGNALS, REPO
from tests.launch.test_launch import XlaStandIn, cpu

JOB = str(Path(REPO) / "tests" / "scripts" / "resume_job.py")


def _command(*args: str) -> list[str]:
    return [sys.executable, "-c", DEFAULT_SIGNALS, "-m", "accelport", "launch", "--backend", "cpu", *args]


def _env(**extra: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("ACCELPORT_", "TORCHELASTIC_"))} | extra


def launch(*args: str, timeout: float = 600, **extra: str) -> subprocess.CompletedProcess[str]:
    """`accelport launch --backend cpu ...` as a user runs it; the timeout only guards a hang."""
    return subprocess.run(_command(*args), capture_output=True, text=True, env=_env(**extra), timeout=timeout,
                          cwd=REPO)


def finals(out: Path) -> list[dict[str, Any]]:
    import torch

    return [torch.load(out / f"final-rank{r}.pt") for r in (0, 1)]


def assert_identical(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    import torch

    for ra, rb in zip(a, b, strict=True):
        assert ra.keys() == rb.keys()
        for key in ra:
            assert torch.equal(ra[key], rb[key]), key


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("full")
    done = launch("--nprocs", "2", JOB, str(out), str(out / "ckpt"))
    assert done.returncode == 0, done.stderr
    return out


def test_a_rank_killed_at_step_23_is_restarted_and_the_job_ends_bit_identical(uninterrupted: Path,
                                                                               tmp_path: Path) -> None:
    done = launch("--nprocs", "2", "--max-restarts", "1", JOB, str(tmp_path), str(tmp_path / "ckpt"),
                  "--kill-at", "23", "--kill-rank", "1")
    assert done.returncode == 0, done.stderr
    assert "exitcode: -9" in done.stderr  # rank 1 really died (torchrun's report), and the group was restarted
    assert len(list(tmp_path.glob("seen-rank1-*.json"))) == 2
    assert_identical(finals(uninterrupted), finals(tmp_path))
    # The control: the ranks read different shards, so each one's data position had to be its own.
    starts = [json.loads(p.read_text())["start"] for p in tmp_path.glob("seen-rank*-*.json")]
    assert sorted(starts) == [0, 0, 20, 20]


def test_a_job_killed_twice_under_max_restarts_gives_its_goodput_and_the_lost_steps_exactly(
        uninterrupted: Path, tmp_path: Path) -> None:
    before = time.time()
    done = launch("--json", "--nprocs", "2", "--max-restarts", "2", JOB, str(tmp_path), str(tmp_path / "ckpt"),
                  "--kill-at", "23,47", "--kill-rank", "0")
    measured = time.time() - before
    assert done.returncode == 0, done.stderr
    assert_identical(finals(uninterrupted), finals(tmp_path))
    goodput = json.loads(done.stdout)["goodput"]  # the only thing on stdout: the workers' output goes to stderr
    # Rank 0 (whose steps the account counts) died after the updates of steps 23 and 47, before ending them:
    # it had ended 22 and 46, past the checkpoints of 20 and 40 its next attempt resumed from.
    assert [(r["attempt"], r["resumed_from"], r["reached"], r["ended"]) for r in goodput["per_run"]] == [
        (0, 0, 22, "killed"), (1, 20, 46, "killed"), (2, 40, 60, "finished")]
    assert (goodput["productive_steps"], goodput["recomputed_steps"], goodput["restarts"], goodput["failures"]) == (
        60, 8, 2, 2)
    # Within the launch's own wall time, which the test's holds; the parts add up to it (what is left is "other").
    assert 0 < goodput["wall_s"] <= measured and 0 < goodput["goodput"] < 1
    parts = ("productive_s", "recomputed_s", "start_up_s", "restart_s", "save_blocked_s", "other_s")
    assert sum(goodput[p] for p in parts) >= goodput["wall_s"] - 1e-6
    assert sum(goodput[p] for p in parts if p != "other_s") <= goodput["wall_s"] + 3 * 0.02  # clock ticks
    assert goodput["restart_s"] > 0 and goodput["start_up_s"] > 0 and goodput["save_cost_s"] > 0
    assert goodput["best_interval_s"] is not None and goodput["best_every_steps"] >= 1
    # And said in words, without --json.
    text = launch("--nprocs", "1", JOB, str(tmp_path / "again"), str(tmp_path / "again" / "ckpt"), "--steps", "10")
    assert text.returncode == 0, text.stderr
    assert "accelport: goodput " in text.stderr and "productive " in text.stderr and "(10 steps)" in text.stderr


def test_sigterm_to_the_launch_saves_on_every_rank_and_a_second_launch_resumes_bit_identical(
        uninterrupted: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    # The ranks act on the stop at a step they agree on, about every 0.25 s of steps: at 10 ms or more a
    # step, that is at most 25 steps after 25, before the job's 60th (a faster machine only agrees sooner).
    # Without a floor, 35 steps of a few ms can end the script before any agreement.
    proc = subprocess.Popen(_command("--nprocs", "2", JOB, str(tmp_path), str(ckpt), "--pause-at", "25",
                                     "--step-seconds", "0.01"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
    deadline = time.monotonic() + 600  # only guards a hang
    while not all((tmp_path / f"ready-rank{r}").exists() for r in (0, 1)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the job never reached step 25"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "accelport: stopped by SIGTERM: every rank saved its checkpoint (step" in err
    newest = [f for f in find_checkpoints(ckpt) if f.complete][-1]
    assert newest.step >= 25 and newest.world_size == 2  # at a step boundary both ranks agreed on
    assert {p.name for p in Path(newest.path).iterdir()} >= {"state", "rank-0.pt", "rank-1.pt", "checkpoint.json"}
    again = launch("--nprocs", "2", JOB, str(tmp_path), str(ckpt))
    assert again.returncode == 0, again.stderr
    assert_identical(finals(uninterrupted), finals(tmp_path))


@pytest.mark.parametrize("background", [False, True])
def test_a_sharded_checkpoint_of_2_ranks_resumes_on_1(tmp_path: Path, background: bool) -> None:
    import torch

    ckpt = tmp_path / "ckpt"
    (tmp_path / "two").mkdir()
    two = launch("--nprocs", "2", JOB, str(tmp_path / "two"), str(ckpt), "--shard", "--steps", "20",
                 *(["--every", "5", "--background"] if background else []))
    assert two.returncode == 0, two.stderr
    saved = torch.load(tmp_path / "two" / "final-rank0.pt")  # gathered whole from the shards
    assert (ckpt / "step-00000020" / "state" / ".metadata").exists()  # DCP: a shard file per rank
    # In the background (DCP's async save), each checkpoint completed at a later step or at close().
    assert [(f.step, f.complete) for f in find_checkpoints(ckpt)] == ([(10, True), (15, True), (20, True)]
                                                                      if background else [(10, True), (20, True)])
    alone = tmp_path / "alone"
    alone.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELPORT_", "TORCHELASTIC_"))}
    done = subprocess.run([sys.executable, JOB, str(alone), str(ckpt), "--steps", "20"], capture_output=True,
                          text=True, env=env, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "the checkpoint was written by 2 rank(s), this run has 1" in done.stderr
    restored = torch.load(alone / "final-rank0.pt")
    for key in saved:
        assert torch.equal(saved[key], restored[key]), key
    on = subprocess.run([sys.executable, JOB, str(alone), str(ckpt), "--steps", "26"], capture_output=True,
                        text=True, env=env, timeout=300, cwd=REPO)
    assert on.returncode == 0, on.stderr  # and it trains on from there, the optimizer state resharded
    assert json.loads(sorted(alone.glob("seen-rank0-*.json"), key=lambda p: p.stat().st_mtime)[-1].read_text())[
        "start"] == 20


def test_a_stopped_launch_whose_script_saves_nothing_exits_as_the_signal(tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text("import pathlib, sys, time\npathlib.Path(sys.argv[1]).touch()\ntime.sleep(600)\n")
    ready = tmp_path / "ready"
    proc = subprocess.Popen(_command("--nprocs", "1", str(script), str(ready)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
    deadline = time.monotonic() + 300
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM: no worker saved a checkpoint" in err


def test_a_stop_that_comes_as_the_scripts_end_is_a_launch_that_ended_well(tmp_path: Path) -> None:
    # The request reaches the workers, but their scripts return before any step boundary acts on it
    # (here: they never call ckpt.step() again), as when the ranks' next agreement is past the run's end.
    script = tmp_path / "ends.py"
    script.write_text("import pathlib, sys, time\nimport accelport as ap\n"
                      "ckpt = ap.Checkpointer(sys.argv[2])\n"
                      "pathlib.Path(sys.argv[1] + str(ap.rank())).touch()\n"
                      "while not ckpt.stop_requested:\n    time.sleep(0.05)\n"
                      "ckpt.close()\n")
    ready = tmp_path / "ready"
    proc = subprocess.Popen(_command("--nprocs", "2", str(script), str(ready), str(tmp_path / "ckpt")),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
    deadline = time.monotonic() + 300  # only guards a hang
    while not all(Path(f"{ready}{r}").exists() for r in (0, 1)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "stopped by SIGTERM as the job ended: every rank had finished its script" in err
    assert "no worker saved" not in err


def test_a_stop_outcome_counts_saved_finished_and_lost_workers(tmp_path: Path) -> None:
    from accelport.launch.heartbeat import write_json
    from accelport.launch.stop import record_stop, stopped_launch

    write_json(str(tmp_path / "done-rank0.json"), {"rank": 0, "steps": 60})
    write_json(str(tmp_path / "done-rank1.json"), {"rank": 1, "steps": 60})
    ended = stopped_launch(str(tmp_path), signal.SIGTERM, 2)
    assert ended.exit_status == 0 and ended.to_dict()["finished"] == [0, 1]
    assert "after 60 steps" in str(ended)
    one_short = stopped_launch(str(tmp_path), signal.SIGTERM, 3)  # a third worker neither saved nor finished
    assert one_short.exit_status == 143 and "no worker saved a checkpoint" in str(one_short)
    record_stop(str(tmp_path), 1, {"step": 27, "path": "/ckpt/step-00000027"})
    mixed = stopped_launch(str(tmp_path), signal.SIGTERM, 2)  # rank 1 saved, rank 0 had finished: no resume point
    assert mixed.exit_status == 143 and mixed.to_dict()["finished"] == [0]
    record_stop(str(tmp_path), 0, {"step": 27, "path": "/ckpt/step-00000027"})
    both = stopped_launch(str(tmp_path), signal.SIGTERM, 2)
    assert both.exit_status == EXIT_PREEMPTED and "every rank saved its checkpoint (step 27" in str(both)


def test_max_restarts_is_passed_to_torchrun_and_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from torch.distributed.run import parse_args

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    plan = build_plan(cpu(), str(script), nprocs=1, max_restarts=2)
    assert parse_args(plan.command[3:]).max_restarts == 2 and plan.max_restarts == 2
    assert "--max-restarts" not in build_plan(cpu(), str(script), nprocs=1).command
    xla = build_plan(XlaStandIn(), str(script), environ={"PJRT_DEVICE": "CPU"}, nprocs=1, max_restarts=1)
    assert xla.max_restarts == 1 and any("torch_xla's launcher has no restarts" in n for n in xla.notes)
    assert main(["launch", "--max-restarts", "-1", "--dry-run", str(script)]) == 2
    assert "--max-restarts must be 0 or more" in capsys.readouterr().err
