"""The goodput account (accelport.goodput): what ap.Checkpointer's rank 0 journals, and what the account makes of
it. Real runs (killed with SIGKILL, stopped with SIGTERM, finished) are counted in steps, which no load on the
machine can change; seconds are checked only against each other and against the wall time that holds them."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

import accelport as ap
from accelport.goodput import JOURNAL, PROGRESS, account, account_of_directory, read_runs, render
from accelport.launch.stop import EXIT_PREEMPTED
from tests.test_resume import job, start_job, wait_for

PARTS = ("productive_s", "recomputed_s", "start_up_s", "restart_s", "save_blocked_s", "other_s")


def _lines(path: Path, *events: dict[str, Any]) -> None:
    with open(path / JOURNAL, "a") as f:
        for event in events:
            f.write(json.dumps(event) + "\n")


def _start(run: str, at: float, resumed: int, *, up: float = 5.0, every: int = 10) -> dict[str, Any]:
    return {"event": "start", "run": run, "process_start": at, "time": at + up, "resumed_from": resumed,
            "every_steps": every, "every_seconds": None, "attempt": 0}


def _save(run: str, step: int, busy: float, blocked: float, at: float) -> dict[str, Any]:
    return {"event": "save", "run": run, "step": step, "busy_s": busy, "blocked_s": blocked, "time": at}


def _progress(run: str, step: int, busy: float, blocked: float, at: float) -> dict[str, Any]:
    return {"event": "progress", "run": run, "step": step, "busy_s": busy, "blocked_s": blocked, "time": at}


def test_the_account_of_a_job_killed_once_splits_its_wall_time_exactly(tmp_path: Path) -> None:
    # Run a: starts at 0, restored at 5, 1 s per step; saves at 10 and 20 (1 s each); killed after step 27 at 34.
    # Run b: starts at 40 (6 s of restart), restored at 45 from step 20, ends at step 40 at 67.
    _lines(tmp_path, _start("a", 0.0, 0), _save("a", 10, 10.0, 1.0, 16.0), _save("a", 20, 20.0, 1.0, 27.0),
           _progress("a", 27, 27.0, 2.0, 34.0), _start("b", 40.0, 20), _save("b", 30, 10.0, 1.0, 56.0),
           _save("b", 40, 20.0, 1.0, 67.0),
           {"event": "end", "run": "b", "how": "finished", "step": 40, "busy_s": 20.0, "blocked_s": 2.0, "time": 67.0})
    result = account(read_runs(str(tmp_path)))
    assert result is not None
    assert result["wall_s"] == 67.0
    assert (result["productive_steps"], result["recomputed_steps"]) == (40, 7)  # steps 21 to 27 were done twice
    assert result["productive_s"] == 40.0 and result["recomputed_s"] == 7.0
    assert result["start_up_s"] == 10.0 and result["restart_s"] == 6.0 and result["save_blocked_s"] == 4.0
    assert result["other_s"] == 0.0
    assert math.isclose(sum(result[p] for p in PARTS), result["wall_s"])
    assert result["goodput"] == pytest.approx(40 / 67)
    assert (result["restarts"], result["failures"], result["saves"], result["save_cost_s"]) == (1, 1, 4, 1.0)
    # Young/Daly: sqrt(2 x 1 s per save x 67 s between failures) = 11.6 s = 12 steps of 1 s.
    assert result["best_interval_s"] == pytest.approx(math.sqrt(2 * 1.0 * 67.0))
    assert result["best_every_steps"] == 12 and result["interval_s"] == 10.0
    text = "\n".join(render(result))
    assert "goodput 59.7% of 67.0 s over 2 runs (1 restart(s))" in text
    assert "recomputed 7 step(s) lost past the last checkpoint (7.00 s)" in text
    assert "every 10 steps (10.0 s) now; about 11.6 s, 12 steps would maximise goodput" in text


def test_a_stop_request_loses_no_step_and_is_no_failure_for_the_interval(tmp_path: Path) -> None:
    _lines(tmp_path, _start("a", 0.0, 0), _save("a", 10, 10.0, 1.0, 16.0), _save("a", 13, 13.0, 1.0, 20.0),
           {"event": "end", "run": "a", "how": "stopped", "step": 13, "busy_s": 13.0, "blocked_s": 2.0, "time": 20.0},
           _start("b", 30.0, 13), _save("b", 20, 7.0, 1.0, 43.0),
           {"event": "end", "run": "b", "how": "finished", "step": 20, "busy_s": 7.0, "blocked_s": 1.0, "time": 43.0})
    result = account(read_runs(str(tmp_path)))
    assert result is not None
    assert (result["recomputed_steps"], result["productive_steps"]) == (0, 20)
    assert (result["stops"], result["failures"]) == (1, 0)
    assert result["best_interval_s"] is None
    assert "no failure lost work in this job (a stop request saves first)" in result["best_interval_unknown"]
    assert "the best one cannot be told from this job" in "\n".join(render(result))


def test_a_job_that_ended_killed_counts_its_unsaved_steps_as_lost(tmp_path: Path) -> None:
    _lines(tmp_path, _start("a", 0.0, 0), _save("a", 10, 10.0, 1.0, 16.0), _progress("a", 14, 14.0, 1.0, 20.0))
    result = account(read_runs(str(tmp_path)))
    assert result is not None
    assert (result["productive_steps"], result["recomputed_steps"]) == (10, 4)
    assert result["per_run"][0]["ended"] == "killed"


def test_a_line_cut_short_is_skipped_and_the_rest_is_read(tmp_path: Path) -> None:
    _lines(tmp_path, _start("a", 0.0, 0), _save("a", 10, 10.0, 1.0, 16.0))
    with open(tmp_path / JOURNAL, "a") as f:
        f.write('{"event": "save", "run": "a", "st')  # a full disk cut the last line
    runs = read_runs(str(tmp_path))
    assert len(runs) == 1 and runs[0]["step"] == 10
    assert account_of_directory(str(tmp_path / "nothing-here")) is None


def _job_account(ckpt: Path) -> dict[str, Any]:
    result = account_of_directory(str(ckpt))
    assert result is not None
    return result


def test_a_real_job_killed_twice_gives_the_lost_steps_exactly(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    before = time.time()
    # resume_job.py kills itself after the update of step 23 (first attempt) and 47 (second), before its
    # ckpt.step(): the steps it ended were 22 and 46, past the checkpoints of steps 20 and 40.
    for attempt in ("0", "1"):
        killed = job(str(tmp_path), str(ckpt), "--kill-at", "23,47", TORCHELASTIC_RESTART_COUNT=attempt)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
    done = job(str(tmp_path), str(ckpt), "--kill-at", "23,47", TORCHELASTIC_RESTART_COUNT="2")
    assert done.returncode == 0, done.stderr
    measured = time.time() - before
    result = _job_account(ckpt)
    assert [r["ended"] for r in result["per_run"]] == ["killed", "killed", "finished"]
    assert [(r["resumed_from"], r["reached"], r["lost_steps"]) for r in result["per_run"]] == [
        (0, 22, 2), (20, 46, 6), (40, 60, 0)]
    assert (result["productive_steps"], result["recomputed_steps"], result["restarts"], result["failures"]) == (
        60, 8, 2, 2)
    assert result["saves"] == 2 + 2 + 2  # steps 10, 20; 30, 40; 50, 60
    assert 0 < result["wall_s"] <= measured and 0 < result["goodput"] < 1
    # A process's start is known to a clock tick (10 ms) and the uptime's hundredth: that much per run.
    assert result["wall_s"] - 1e-6 <= sum(result[p] for p in PARTS) <= result["wall_s"] + 3 * 0.02
    assert all(result[p] >= 0 for p in PARTS) and result["recomputed_s"] > 0
    assert result["best_interval_s"] == pytest.approx(
        math.sqrt(2 * result["save_cost_s"] * result["wall_s"] / 2))


def test_a_stop_request_ends_the_run_as_stopped_and_the_next_one_appends(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    proc = start_job(str(tmp_path), str(ckpt), "--pause-at", "14")
    wait_for(tmp_path / "ready-rank0", proc)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_PREEMPTED, err
    (tmp_path / "ready-rank0").unlink()
    done = job(str(tmp_path), str(ckpt))
    assert done.returncode == 0, done.stderr
    result = _job_account(ckpt)
    assert [(r["ended"], r["resumed_from"], r["reached"]) for r in result["per_run"]] == [
        ("stopped", 0, 14), ("finished", 14, 60)]
    assert (result["recomputed_steps"], result["stops"], result["failures"]) == (0, 1, 0)


def test_a_new_job_after_a_finished_one_starts_a_new_account(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    assert job(str(tmp_path), str(ckpt), "--steps", "12").returncode == 0
    for step in Path(ckpt).glob("step-*"):  # the user clears the checkpoints to train from scratch
        import shutil

        shutil.rmtree(step)
    assert job(str(tmp_path), str(ckpt), "--steps", "12").returncode == 0
    result = _job_account(ckpt)
    assert result["runs"] == 1 and result["productive_steps"] == 12


def test_a_script_that_never_calls_close_is_said_to_have_exited(tmp_path: Path) -> None:
    script = tmp_path / "noclose.py"
    script.write_text(
        "import sys, torch, accelport as ap\n"
        "ap.use('cpu')\n"
        "m = torch.nn.Linear(2, 2); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "ck = ap.Checkpointer(sys.argv[1], every_steps=4, stop_on=())\n"
        "for _ in range(ck.restore(model=m, optimizer=opt), 6):\n"
        "    m(torch.ones(1, 2)).sum().backward(); ap.optimizer_step(opt); ck.step()\n")
    import sys

    done = subprocess.run([sys.executable, str(script), str(tmp_path / "ck")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    runs = read_runs(str(tmp_path / "ck"))
    assert [(r["end"], r["step"]) for r in runs] == [("exited", 6)]
    assert (tmp_path / "ck" / PROGRESS).stat().st_size == 16 + 2 * 40  # the run, two slots: never grown


def test_in_process_the_busy_and_blocked_seconds_add_up_and_saves_are_not_steps(tmp_path: Path) -> None:
    import torch

    ap.use("cpu")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ap.Checkpointer(tmp_path, every_steps=2, stop_on=()) as ckpt:
        ckpt.restore(model=model, optimizer=opt)
        for _ in range(5):
            model(torch.ones(1, 4)).sum().backward()
            ap.optimizer_step(opt)
            ckpt.step()
        ckpt.save()  # a save outside step(): blocked, not busy
    result = account_of_directory(str(tmp_path))
    assert result is not None and result == ckpt.goodput()
    run = read_runs(str(tmp_path))[0]
    assert [s["step"] for s in run["saves"]] == [2, 4, 5]
    assert run["end"] == "finished"
    assert run["blocked_s"] == pytest.approx(sum(s["blocked_s"] for s in run["saves"]), abs=1e-5)
    assert result["productive_steps"] == 5 and result["recomputed_steps"] == 0


def test_the_report_page_shows_the_jobs_goodput_from_the_checkpoint_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from accelport.cli import main

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _lines(ckpt, _start("a", 0.0, 0), _save("a", 10, 10.0, 1.0, 16.0), _progress("a", 27, 27.0, 1.0, 34.0),
           _start("b", 40.0, 10), _save("b", 40, 30.0, 1.0, 77.0),
           {"event": "end", "run": "b", "how": "finished", "step": 40, "busy_s": 30.0, "blocked_s": 1.0, "time": 77.0})
    metrics = tmp_path / "run.jsonl"
    metrics.write_text("".join(json.dumps({"step": n, "time": float(n), "backend": "cpu", "lazy": False,
                                           "seconds": 0.01}) + "\n" for n in range(1, 6)))
    assert main(["report", str(metrics), "--checkpoints", str(ckpt), "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert (said["goodput"]["recomputed_steps"], said["goodput"]["productive_steps"]) == (17, 40)
    page = (tmp_path / "run.html").read_text()
    section = page[page.index("<h2>Goodput</h2>"):page.index("<h2>Diagnoses</h2>")]
    assert "over its 2 run(s)" in section and "recomputed 17 step(s) lost past the last checkpoint" in section
    assert "<td>productive steps</td>" not in section  # (each row has its colour swatch first)
    assert re.search(r"recomputed steps</td><td>17\.00 s</td><td>22%</td>", section), section
    # A directory with no account is a specific error, not a page without the section.
    assert main(["report", str(metrics), "--checkpoints", str(tmp_path), "--json"]) == 2
    assert "no goodput account there (goodput.jsonl" in json.loads(capsys.readouterr().out)["error"]


def test_a_filesystem_that_cannot_map_the_progress_file_still_gets_the_events(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import accelport.goodput

    def refuse(path: str, run: str) -> None:
        raise OSError(19, "No such device")  # (ENODEV: what mmap says on a filesystem without it)

    monkeypatch.setattr(accelport.goodput, "_mapped", refuse)
    ap.use("cpu")
    model = torch.nn.Linear(2, 2)
    with ap.Checkpointer(tmp_path, every_steps=2, stop_on=()) as ckpt:
        ckpt.restore(model=model)
        for _ in range(4):
            ckpt.step()
    (run,) = read_runs(str(tmp_path))
    assert [s["step"] for s in run["saves"]] == [2, 4] and (run["end"], run["step"]) == ("finished", 4)
    assert not (tmp_path / PROGRESS).exists() or (tmp_path / PROGRESS).stat().st_size == 0
