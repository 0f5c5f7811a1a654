"""Where each step's time goes on XLA:CPU, and a profile of chosen steps with torch_xla's profiler.

Real loops on torch_xla's compiler and runtime: a loop that recompiles every step spends its
time compiling, one whose graph is heavy spends it waiting for the device in the sync. Both by
far (a compilation costs hundreds of milliseconds against a few for the rest; a 1024-wide MLP on
a batch of 512 runs for tens of milliseconds against one or two of tracing), so a busy machine
does not change which category is largest. Runs in the xla environment.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import statistics
import warnings
from typing import Any

import pytest

import accelport as ap
from tests.diagnose_cli.runs import SCRIPTS, run

pytestmark = pytest.mark.xla


def adds_up(record: dict[str, Any]) -> bool:
    total = sum(record["breakdown"].values())
    return abs(total - record["seconds"]) <= max(0.02 * record["seconds"], 50e-6)


def train(model: Any, batches: list[Any], inside: Any = None) -> None:
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    for x, y in ap.loader(batches):
        loss = torch.nn.functional.mse_loss(model(x), y)
        if inside is not None:
            inside(loss)
        loss.backward()
        ap.optimizer_step(opt)
        opt.zero_grad()


def mlp(width: int, hidden: int) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 1)).to(ap.device())


def recompiling(width: int, steps: int) -> list[Any]:
    import torch

    return [(torch.randn(4 + i, width), torch.randn(4 + i, 1)) for i in range(steps)]  # a new shape every step


def records_of(path: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_loop_that_recompiles_every_step_spends_its_time_compiling(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("ACCELPORT_METRICS_FILE", str(tmp_path / "run.jsonl"))
    ap.use("xla")
    train(mlp(13, 24), recompiling(13, 8))
    m = ap.metrics()
    assert max(m.time_breakdown, key=lambda k: m.time_breakdown[k]) == "compile", m.time_breakdown
    assert m.time_breakdown["compile"] == pytest.approx(m.compile_seconds, rel=0.05)
    assert sum(m.time_breakdown.values()) == pytest.approx(m.step_seconds, rel=0.02)
    assert m.time_verdict.startswith("compile-bound: "), m.time_verdict
    records = records_of(tmp_path / "run.jsonl")
    assert all(adds_up(r) for r in records)
    assert all(max(r["breakdown"], key=lambda k: r["breakdown"][k]) == "compile" for r in records)


def test_a_healthy_loop_with_a_heavy_graph_spends_its_time_on_the_device(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import torch

    monkeypatch.setenv("ACCELPORT_METRICS_FILE", str(tmp_path / "run.jsonl"))
    ap.use("xla")
    width = 1024
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, 1)).to(ap.device())
    train(model, [(torch.randn(512, width), torch.randn(512, 1)) for _ in range(6)])
    m = ap.metrics()
    assert m.time_verdict.startswith("device-bound: "), (m.time_breakdown, m.time_verdict)
    assert m.time_fix and "ap.compile(model)" not in m.time_fix  # (advice for eager devices)
    records = records_of(tmp_path / "run.jsonl")
    assert all(adds_up(r) for r in records)
    later = records[1:]  # the first step holds the compilation
    medians = {k: statistics.median(r["breakdown"].get(k, 0.0) for r in later) for k in ("device", "other", "data")}
    assert max(medians, key=lambda k: medians[k]) == "device", medians


def test_host_reads_inside_the_step_are_host_sync(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("ACCELPORT_METRICS_FILE", str(tmp_path / "run.jsonl"))
    ap.use("xla")
    import torch

    batches = [(torch.randn(8, 11), torch.randn(8, 1)) for _ in range(8)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.DiagnosticWarning)
        train(mlp(11, 20), batches, inside=lambda loss: loss.item())
    records = records_of(tmp_path / "run.jsonl")
    assert all(adds_up(r) for r in records)
    # Each .item() runs the forward graph and waits for it: a read of the loop's own thread.
    assert all(r["breakdown"].get("host_sync", 0.0) > 0 for r in records[1:]), [r["breakdown"] for r in records]
    assert "host_sync" in ap.metrics().time_breakdown


def test_an_accumulations_micro_batches_are_their_steps_not_work_between_steps(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # On XLA a backward does not part the step's phases (they are all host time), so it was not watched: a
    # micro-batch with a backward and no optimizer step after it looked like an evaluation's batch, and half
    # of every step of a loop accumulating over two was said to be work between the steps.
    import torch

    path = tmp_path / "run.jsonl"
    monkeypatch.setenv("ACCELPORT_METRICS_FILE", str(path))

    def accumulating(evaluate_every: int) -> list[dict[str, Any]]:
        before = len(records_of(path)) if path.exists() else 0
        ap.use("xla")
        model = mlp(12, 32)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        batches = [(torch.randn(16, 12), torch.randn(16, 1)) for _ in range(24)]
        for i, (x, y) in enumerate(ap.loader(batches)):
            if evaluate_every and i % evaluate_every == evaluate_every - 1:
                with torch.no_grad():  # an evaluation's batch: no backward, no step
                    model(x).sum()
                continue
            torch.nn.functional.mse_loss(model(x), y).backward()
            if i % 2 == 1:
                ap.optimizer_step(opt)
                opt.zero_grad()
        ap.diagnostics()  # (every step recorded)
        return records_of(path)[before:]

    records = accumulating(0)
    assert len(records) == 12 and all(adds_up(r) for r in records)
    assert not [r["breakdown"] for r in records if "between_steps" in r["breakdown"]]
    # The same loop with an evaluation's batch now and then still says that batch's time is between steps.
    records = accumulating(6)
    assert any("between_steps" in r["breakdown"] for r in records), [r["breakdown"] for r in records]


def test_diagnose_says_where_a_raw_torch_xla_loops_time_went(tmp_path) -> None:  # type: ignore[no-untyped-def]
    done = run("--metrics-file", "steps.jsonl", "--output", "out.json", str(SCRIPTS / "xla_healthy.py"),
               cwd=tmp_path, env={"PJRT_DEVICE": "CPU"})
    assert done.returncode == 0, done.stderr
    records = records_of(tmp_path / "steps.jsonl")
    assert records and all(adds_up(r) for r in records)
    known = {"data", "transfer", "compile", "device", "host_sync", "other", "compile+device"}
    assert all(set(r["breakdown"]) <= known for r in records), [r["breakdown"] for r in records]
    assert all(r["breakdown"].get("device", 0.0) > 0 for r in records[1:])  # the loader's syncs wait for it
    (said,) = [line for line in done.stderr.splitlines() if line.startswith("  [time] time per step ")]
    metrics = json.loads((tmp_path / "out.json").read_text())["metrics"]
    assert metrics["time_summary"] == said[len("  [time] "):] and metrics["time_verdict"]


def test_a_profile_of_chosen_steps_with_torch_xlas_profiler(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ap.use("xla")
    with pytest.warns(ap.ProfileWarning, match=r"profile of steps 3 to 4 on xla \(torch_xla\.debug\.profiler\): "
                                                r"2 file\(s\) under ") as caught:
        profile = ap.profile(steps=range(3, 5), dir=tmp_path)
        train(mlp(9, 18), recompiling(9, 6))
    assert len(caught) == 1 and "has no key_averages()" in str(caught[0].message)
    assert profile.state == "done" and profile.result is not None and profile.result["steps"] == [3, 4]
    (xplane,) = glob.glob(str(tmp_path / "plugins" / "profile" / "*" / "*.xplane.pb"))
    (chrome,) = glob.glob(str(tmp_path / "plugins" / "profile" / "*" / "*.trace.json.gz"))
    assert sorted(profile.files) == sorted([xplane, chrome])
    with gzip.open(chrome) as f:
        events = json.load(f)["traceEvents"]
    names = {e.get("name") for e in events}
    assert "FusionCompiler::Compile" in names  # XLA compiled the window's new graphs while it traced
    assert os.path.getsize(xplane) > 0
    # The window's breakdown is its steps' (each compiled: a new batch shape).
    assert max(profile.result["breakdown"], key=lambda k: profile.result["breakdown"][k]) == "compile"


def test_a_profiler_that_cannot_start_leaves_the_run_going(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch_xla.debug.profiler as xp

    ap.use("xla")
    xp.start_trace(str(tmp_path / "mine"))  # the script's own trace: torch_xla takes one at a time
    try:
        with pytest.warns(ap.ProfileWarning, match=r"torch_xla\.debug\.profiler failed to start at step 1: "
                                                    r"RuntimeError: Profile has already been started"):
            profile = ap.profile(steps=range(2, 4), dir=tmp_path / "ours")
            train(mlp(7, 14), recompiling(7, 4))
    finally:
        xp.stop_trace()
    assert profile.state == "off" and ap.metrics().steps == 4


def test_diagnose_times_torch_xlas_host_collectives_as_collective(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """xm.mesh_reduce blocks the host until every process arrives: its 30 ms a step (a slow reduce function
    standing for a slower peer) is the collective's, not the host's own work."""
    done = run("--output", "out.json", str(SCRIPTS / "xla_mesh_reduce.py"), cwd=tmp_path, env={"PJRT_DEVICE": "CPU"})
    assert done.returncode == 0, done.stderr
    assert "steps seen 9" in done.stdout
    metrics = json.loads((tmp_path / "out.json").read_text())["metrics"]
    per_step = {c: s / (metrics["steps"] or 1) for c, s in metrics["time_breakdown"].items()}
    assert per_step.get("collective", 0.0) >= 0.025, metrics["time_breakdown"]
    assert per_step.get("other", 0.0) < per_step["collective"], metrics["time_breakdown"]
