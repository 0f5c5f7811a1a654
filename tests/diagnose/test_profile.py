"""A profile of chosen steps on cpu: ap.profile, ACCELPORT_PROFILE, accelport diagnose --profile.

The traces are read as their viewers read them (``json.load`` of torch.profiler's Chrome trace).
Profiling never breaks training: every bad input is a specific message and the run goes on.
"""

from __future__ import annotations

import glob
import json
import os
import re
import warnings
from typing import Any

import pytest
import torch

import accelport as ap
from accelport.observe.profile import Window, parse_window, window_of
from accelport.runtime.state import RUNTIME
from tests.diagnose_cli.runs import run


def train(steps: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = [(torch.randn(8, 16), torch.randn(8, 1)) for _ in range(steps)]
    for x, y in ap.loader(data):
        torch.nn.functional.mse_loss(model(x), y).backward()
        ap.optimizer_step(opt)
        opt.zero_grad()


def trace_of(directory: Any) -> dict[str, Any]:
    (path,) = glob.glob(os.path.join(str(directory), "*.pt.trace.json"))
    with open(path) as f:
        return json.load(f)


def step_markers(trace: dict[str, Any]) -> list[str]:
    return sorted({e["name"] for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")})


def profile_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, ap.ProfileWarning)]


def test_ap_profile_traces_exactly_the_window_and_says_what_it_held(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    metrics_file = tmp_path / "run.jsonl"
    monkeypatch.setenv("ACCELPORT_METRICS_FILE", str(metrics_file))
    ap.use("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile = ap.profile(steps=range(5, 8), dir=tmp_path / "prof")
        assert profile.state == "waiting"
        train(10)
    trace = trace_of(tmp_path / "prof")
    assert step_markers(trace) == ["ProfilerStep#5", "ProfilerStep#6", "ProfilerStep#7"]
    ops = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "cpu_op"}
    assert {"aten::addmm", "aten::mse_loss"} <= ops
    assert profile.state == "done" and profile.files == [str(p) for p in (tmp_path / "prof").iterdir()]
    result = profile.result
    assert result is not None and result["steps"] == [5, 7] and result["profiler"] == "torch.profiler"
    assert "aten::addmm" in {op["name"] for op in result["top_ops"]} and len(result["top_ops"]) <= 10
    assert not any(op["name"].startswith("ProfilerStep") for op in result["top_ops"])
    assert set(result["breakdown"]) <= {"data", "transfer", "device", "other"} and result["seconds"] > 0
    assert 0.0 <= result["device_idle_share"] <= 1.0
    (said,) = profile_warnings(caught)
    assert said.startswith("profile of steps 5 to 7 on cpu (torch.profiler): 1 file(s) under ")
    assert "top operators by self time:" in said and "device idle " in said
    # The metrics file carries it on the window's last step, for the report.
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert [r["step"] for r in records if "profile" in r] == [7]


def test_accelport_profile_is_the_same_without_a_line_of_code(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("ACCELPORT_PROFILE", " 1:3 ")
    monkeypatch.setenv("ACCELPORT_PROFILE_DIR", str(tmp_path / "prof"))
    RUNTIME.reset()
    ap.use("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(4)
    assert step_markers(trace_of(tmp_path / "prof")) == ["ProfilerStep#1", "ProfilerStep#2"]
    assert profile_warnings(caught)[0].startswith("profile of steps 1 to 2 on cpu")


@pytest.mark.parametrize(("text", "words"), [
    ("10:5", "ACCELPORT_PROFILE 10:5: the window holds no step: it stops at 5, not after its first step 10 "
             "(did you mean 5:10?)"),
    ("abc", "ACCELPORT_PROFILE 'abc' is not a window of steps: give FIRST:STOP, two whole numbers"),
    ("0:4", "ACCELPORT_PROFILE 0:4: steps count from 1"),
])
def test_a_bad_window_is_said_and_the_run_goes_on(text: str, words: str, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("ACCELPORT_PROFILE", text)
    monkeypatch.chdir(tmp_path)
    RUNTIME.reset()
    with pytest.warns(ap.ProfileWarning) as caught:
        ap.use("cpu")  # (the run starts here, and so does its profile)
        train(6)
    (said,) = [str(w.message) for w in caught]
    assert said.startswith(f"accelport: {words}") and said.endswith("The run goes on unprofiled.")
    assert ap.metrics().steps == 6 and not os.path.exists(tmp_path / "accelport-profile")


def test_a_window_the_run_never_reaches_is_said_at_its_end(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ap.use("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile = ap.profile(steps=range(1000, 1010), dir=tmp_path / "prof")
        train(50)
        RUNTIME.tracker.end_run()  # (what the process's exit does)
    (said,) = profile_warnings(caught)
    assert said == ("accelport: ap.profile(steps=range(1000, 1010)): the run ended after step 50, before the window's "
                    "first step 1000: nothing was profiled; give a window of steps the run reaches (it took 50).")
    assert profile.state == "off" and not list((tmp_path / "prof").iterdir())


def test_a_directory_that_cannot_be_written_is_said_and_nothing_is_profiled(tmp_path) -> None:  # type: ignore[no-untyped-def]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    ap.use("cpu")
    with pytest.warns(ap.ProfileWarning, match=r"traces cannot be written to .*a-file/sub: it cannot be created "
                                                r"\(Not a directory\)") as caught:
        profile = ap.profile(steps=range(2, 4), dir=blocker / "sub")
        train(5)
    assert len(caught) == 1 and profile.state == "off" and ap.metrics().steps == 5


def test_a_profiler_that_cannot_write_its_trace_leaves_the_run_going(tmp_path) -> None:  # type: ignore[no-untyped-def]
    target = tmp_path / "prof"
    ap.use("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile = ap.profile(steps=range(2, 4), dir=target)
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for step, (x, y) in enumerate(ap.loader([(torch.randn(2, 4), torch.randn(2, 1))] * 6), start=1):
            if step == 3:  # while the profiler records: its directory is replaced by a file
                target.rmdir()
                target.write_text("")
            torch.nn.functional.mse_loss(model(x), y).backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
    (said,) = profile_warnings(caught)
    assert re.match(r"accelport: ap\.profile\(steps=range\(2, 4\)\): torch\.profiler failed to stop at step 3: "
                    r"RuntimeError: writing the trace failed \(RuntimeError: Can't create directory: ", said), said
    assert profile.state == "off" and ap.metrics().steps == 6


def test_a_profiler_that_fails_to_start_leaves_the_run_going(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # A stand-in for a profiler that cannot start (no CUPTI on a GPU, a runtime that refuses).
    def refuse(self: Any) -> None:
        raise RuntimeError("the profiler's runtime is not available")

    monkeypatch.setattr(torch.profiler.profile, "start", refuse)
    ap.use("cpu")
    with pytest.warns(ap.ProfileWarning, match=r"torch\.profiler failed to start at step 1: RuntimeError: the "
                                                r"profiler's runtime is not available; the run goes on unprofiled"):
        profile = ap.profile(steps=range(2, 4), dir=tmp_path / "prof")
        train(5)
    assert profile.state == "off" and ap.metrics().steps == 5


def test_a_later_window_replaces_one_not_yet_started_and_says_so(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ap.use("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = ap.profile(steps=range(2, 4), dir=tmp_path / "first")
        second = ap.profile(steps=range(5, 7), dir=tmp_path / "second")
        train(8)
    said = profile_warnings(caught)
    assert said[0] == ("accelport: ap.profile(steps=range(5, 7)) replaces ap.profile(steps=range(2, 4)), which had "
                       "not started: one window at a time, so steps 2 to 3 will not be profiled; to profile both, "
                       "call ap.profile for the later window once the earlier one has ended, or give one window "
                       "that covers both.")
    assert said[1].startswith("profile of steps 5 to 6 on cpu") and len(said) == 2
    assert first.state == "off" and first.problem == ("ap.profile(steps=range(5, 7)) replaced it before its first "
                                                      "step 2: one window at a time")
    assert second.state == "done" and step_markers(trace_of(tmp_path / "second")) == ["ProfilerStep#5",
                                                                                     "ProfilerStep#6"]
    assert not os.path.exists(tmp_path / "first") or not os.listdir(tmp_path / "first")


def test_windows_are_read_as_range_first_stop() -> None:
    assert parse_window("100:110", "--profile") == Window(100, 110) == window_of(range(100, 110))
    assert window_of((100, 110)) == Window(100, 110)
    assert Window(5, 8).describe() == "steps 5 to 7" and 7 in Window(5, 8) and 8 not in Window(5, 8)
    with pytest.raises(ValueError, match="must be consecutive"):
        window_of(range(1, 10, 2))
    with pytest.raises(TypeError, match=r"takes range\(FIRST, STOP\) or a \(FIRST, STOP\) pair"):
        window_of("5:8")


# -- accelport diagnose --profile -----------------------------------------------------------------------

SCRIPT = """
import sys, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
data = torch.utils.data.TensorDataset(torch.randn(8 * int(sys.argv[1]), 16), torch.randn(8 * int(sys.argv[1]), 1))
for x, y in torch.utils.data.DataLoader(data, batch_size=8):
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
sys.exit(3)
"""


@pytest.fixture
def script(tmp_path) -> str:  # type: ignore[no-untyped-def]
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return str(path)


def test_diagnose_profile_writes_a_trace_of_the_window(script: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    done = run("--profile", "5:8", "--profile-dir", "traces", "--output", "out.json", "--report", "run.html",
               script, "12", cwd=tmp_path)
    assert done.returncode == 3, done.stderr  # the script's own status
    trace = trace_of(tmp_path / "traces")
    assert step_markers(trace) == ["ProfilerStep#5", "ProfilerStep#6", "ProfilerStep#7"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in trace["traceEvents"])
    assert "  [prof] profile of steps 5 to 7 on cpu (torch.profiler): 1 file(s) under " in done.stderr
    assert "top operators by self time:" in done.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["profile"]["steps"] == [5, 7] and out["profile"]["top_ops"]
    assert "profile of steps 5 to 7" in (tmp_path / "run.html").read_text()


@pytest.mark.parametrize(("args", "words"), [
    (["--profile", "10:5"], "--profile 10:5: the window holds no step: it stops at 5, not after its first step 10 "
                            "(did you mean 5:10?)"),
    (["--profile", "abc"], "--profile 'abc' is not a window of steps: give FIRST:STOP, two whole numbers"),
    (["--profile", "1000:1010"], "--profile 1000:1010: the run ended after step 50, before the window's first step "
                                 "1000: nothing was profiled; give a window of steps the run reaches (it took 50)"),
    (["--profile", "2:4", "--profile-dir", "a-file/sub"], "--profile-dir a-file/sub: traces cannot be written there: "
                                                           "it cannot be created (Not a directory)"),
])
def test_diagnose_says_why_it_did_not_profile_and_the_script_runs_as_ever(script: str, tmp_path, args: list[str],
                                                                         words: str) -> None:
    (tmp_path / "a-file").write_text("")
    done = run(*args, "--output", "out.json", script, "50", cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    notes = " ".join(line.strip() for line in done.stderr.splitlines())
    assert words in notes, done.stderr
    assert "[prof]" not in done.stderr and "took 50 optimizer step(s)" in done.stderr
    assert not os.path.exists(tmp_path / "accelport-profile") or not os.listdir(tmp_path / "accelport-profile")
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["exit_status"] == 3 and out["steps"] == 50
