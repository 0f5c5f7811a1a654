"""accelport's profile window never fights a torch profiler the script runs itself.

Two torch profilers at once kill the process (SIGSEGV: no summary, no ``--output``) or leave the
script's own profile empty, so every run here is a subprocess: the script's profile must have
its events, the run must end with the script's own status, and accelport must say which of its
steps it did not profile and why.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from tests.diagnose_cli.runs import run

#: A loop of 12 steps whose own torch.profiler records steps START to STOP (``plain``: started and stopped
#: around them; ``schedule``: started at START with a warmup of 3 steps, so it is prepared before it records).
#: It prints what its profile held, then exits with status 3.
SCRIPT = """
import json, sys, torch
from torch.profiler import ProfilerActivity, profile, schedule
PORTED = sys.argv[4] == "ported"
if PORTED:
    import accelport as ap
    ap.use("cpu")
    ap.profile(steps=range(5, 8), dir="traces")
start, stop, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
data = torch.utils.data.TensorDataset(torch.randn(8 * 12, 16), torch.randn(8 * 12, 1))
loader = torch.utils.data.DataLoader(data, batch_size=8)
if mode == "schedule":
    prof = profile(activities=[ProfilerActivity.CPU],
                   schedule=schedule(wait=0, warmup=3, active=stop - start - 2, repeat=1))
else:
    prof = profile(activities=[ProfilerActivity.CPU])
for step, (x, y) in enumerate(ap.loader(loader) if PORTED else loader, start=1):
    if step == start:
        prof.start()
    torch.nn.functional.mse_loss(model(x), y).backward()
    ap.optimizer_step(opt) if PORTED else opt.step()
    opt.zero_grad()
    if mode == "schedule" and start <= step <= stop:
        prof.step()
    if step == stop:
        prof.stop()
ops = {e.key for e in prof.key_averages()}
print("SCRIPT PROFILE " + json.dumps(sorted(ops)), flush=True)
sys.exit(3)
"""


@pytest.fixture
def script(tmp_path) -> str:  # type: ignore[no-untyped-def]
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return str(path)


def script_profile(stdout: str) -> set[str]:
    (line,) = [line for line in stdout.splitlines() if line.startswith("SCRIPT PROFILE ")]
    return set(json.loads(line[len("SCRIPT PROFILE "):]))


def notes(stderr: str) -> str:
    return " ".join(line.strip() for line in stderr.splitlines())


def no_trace(directory: Any) -> bool:
    return not os.path.exists(directory) or not os.listdir(directory)


SKIPPED_AT_START = ("--profile 5:8: the script's own torch profiler was recording (or about to) when step 5 began; "
                    "two torch profilers at once crash the process or leave one profile empty, so accelport did "
                    "not start its own: steps 5 to 7 not profiled by accelport, the script's profile left to "
                    "record alone")


@pytest.mark.parametrize(("start", "stop", "mode"), [
    (2, 5, "plain"),  # recording when the window begins, stopped inside it (was: SIGSEGV at the window's end)
    (1, 12, "plain"),  # recording all along (was: the script's profile empty)
    (3, 9, "schedule"),  # in its warmup when the window begins (was: "Profiler is already enabled" in the script)
])
def test_a_window_that_would_begin_while_the_script_profiles_is_skipped(script: str, tmp_path, start: int,
                                                                          stop: int, mode: str) -> None:
    done = run("--profile", "5:8", "--profile-dir", "traces", "--output", "out.json", script, str(start), str(stop),
               mode, "diagnosed", cwd=tmp_path)
    assert done.returncode == 3, done.stderr  # the script's own status: it ran to its end
    assert {"aten::addmm", "aten::mse_loss"} <= script_profile(done.stdout)
    assert SKIPPED_AT_START in notes(done.stderr), done.stderr
    assert "[prof]" not in done.stderr and no_trace(tmp_path / "traces")
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["exit_status"] == 3 and out["steps"] == 12
    assert out["profile"]["state"] == "off" and out["profile"]["asked"] == "5:8"
    assert out["profile"]["problem"] == SKIPPED_AT_START


def test_a_script_profiler_started_inside_the_window_wins(script: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    done = run("--profile", "5:8", "--profile-dir", "traces", "--output", "out.json", script, "6", "9", "plain",
               "diagnosed", cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert {"aten::addmm", "aten::mse_loss"} <= script_profile(done.stdout)  # (was: empty)
    said = ("--profile 5:8: the script started its own torch profiler during step 6, while accelport's profile of "
            "steps 5 to 7 was recording; two torch profilers at once crash the process or leave one profile empty, "
            "so accelport stopped its own (no trace written) and let the script's profile record: steps 5 to 7 not "
            "profiled by accelport")
    assert said in notes(done.stderr), done.stderr
    assert "[prof]" not in done.stderr and no_trace(tmp_path / "traces")
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["exit_status"] == 3 and out["profile"]["state"] == "off" and out["profile"]["problem"] == said


def test_a_script_profiler_after_the_window_leaves_both_whole(script: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    done = run("--profile", "5:8", "--profile-dir", "traces", "--output", "out.json", script, "9", "11", "plain",
               "diagnosed", cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert {"aten::addmm", "aten::mse_loss"} <= script_profile(done.stdout)
    assert "  [prof] profile of steps 5 to 7 on cpu (torch.profiler): 1 file(s) under " in done.stderr
    assert json.loads((tmp_path / "out.json").read_text())["profile"]["steps"] == [5, 7]


def test_ap_profile_yields_to_the_script_profiler_with_a_warning(script: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    done = run(script, "6", "9", "plain", "ported", diagnose=False, cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert {"aten::addmm", "aten::mse_loss"} <= script_profile(done.stdout)
    text = notes(done.stderr)
    assert ("ProfileWarning: accelport: ap.profile(steps=range(5, 8)): the script started its own torch profiler "
            "during step 6, while accelport's profile of steps 5 to 7 was recording;") in text, done.stderr
    assert no_trace(tmp_path / "traces")
