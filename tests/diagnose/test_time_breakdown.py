"""Where each step's time goes (cpu and the eager stand-ins): the step clock, the records, the verdict.

Injected times are sleeps of tens of milliseconds, judged one-sided: a sleep never ends early, so each
category holds at least what was injected into it; a busy machine only adds (the wake-up waits for a
core), and never as much as half of the other category's sleep, which is what a mischarge would move.
The rest of a step (forward, backward, bookkeeping) is a few milliseconds on any machine here.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

import accelport as ap
from accelport.contract import TIME_CATEGORIES, TIME_PHASES
from accelport.diagnose import advice
from accelport.diagnose.timing import explain, verdict
from accelport.eager import EagerBackend
from accelport.observe.steptime import StepClock, carve_compile, categories, joined
from tests.conftest import REPO
from tests.diagnose_cli.runs import run

SAMPLE_SLEEP = 0.02  # per sample, 4 samples a batch: 80 ms of data per step
STEP_SLEEP = 0.08  # the loop's own code after the optimizer step
STEPS = 8
COLLECTIVE_SLEEP = 0.25  # the slower replica's, per step


class Slow(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 4 * STEPS

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(SAMPLE_SLEEP)
        return torch.full((8,), float(i)), torch.ones(1)


def charged(measured: float, injected: float) -> bool:
    """At least the injected sleep (less 2% for the clocks' grain), and less than half a sleep more."""
    return 0.98 * injected <= measured <= injected + 0.5 * min(4 * SAMPLE_SLEEP, STEP_SLEEP)


def adds_up(record: dict[str, Any]) -> bool:
    total = sum(record["breakdown"].values())
    return abs(total - record["seconds"]) <= max(0.02 * record["seconds"], 50e-6)


def train_ported(metrics_file: Any) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for x, y in ap.loader(torch.utils.data.DataLoader(Slow(), batch_size=4)):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
        time.sleep(STEP_SLEEP)
    return [json.loads(line) for line in metrics_file.read_text().splitlines()]


def test_a_ported_loop_says_where_its_steps_time_went(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    metrics_file = tmp_path / "run.jsonl"
    monkeypatch.setenv("ACCELPORT_METRICS_FILE", str(metrics_file))
    ap.use("cpu")
    records = train_ported(metrics_file)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(adds_up(r) for r in records), [(r["seconds"], r["breakdown"]) for r in records]
    assert all(set(r["breakdown"]) <= {"data", "transfer", "compile", "device", "other"} for r in records)
    # The loop's sleep comes after the optimizer step: the next step's "other" (step 1 has none before it).
    data = statistics.median(r["breakdown"]["data"] for r in records)
    other = statistics.median(r["breakdown"]["other"] for r in records[1:])
    assert charged(data, 4 * SAMPLE_SLEEP), data
    assert charged(other, STEP_SLEEP), other
    m = ap.metrics()
    assert sum(m.time_breakdown.values()) == pytest.approx(m.step_seconds, rel=0.02)
    assert m.time_breakdown_per_step == pytest.approx({k: v / STEPS for k, v in m.time_breakdown.items()})
    assert m.time_breakdown["data"] == pytest.approx(m.data_wait_seconds)
    line, judged = m.time_summary, m.time_verdict
    assert line.startswith("time per step ") and " data " in line and " other " in line
    assert judged.startswith(("input-bound:", "host-bound:")), judged  # data and other, each about half


def test_the_same_loop_unmodified_under_accelport_diagnose(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "train.py"
    script.write_text(f"""
import time, torch

class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return {4 * STEPS}

    def __getitem__(self, i):
        time.sleep({SAMPLE_SLEEP})
        return torch.full((8,), float(i)), torch.ones(1)

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for x, y in torch.utils.data.DataLoader(Slow(), batch_size=4):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    time.sleep({STEP_SLEEP})
""")
    done = run("--metrics-file", "steps.jsonl", "--output", "out.json", str(script), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert len(records) == STEPS and all(adds_up(r) for r in records)
    assert charged(statistics.median(r["breakdown"]["data"] for r in records), 4 * SAMPLE_SLEEP)
    assert charged(statistics.median(r["breakdown"]["other"] for r in records[1:]), STEP_SLEEP)
    said = [line for line in done.stderr.splitlines() if line.startswith("  [time] time per step ")]
    assert len(said) == 1 and " data " in said[0], done.stderr
    metrics = json.loads((tmp_path / "out.json").read_text())["metrics"]
    assert sum(metrics["time_breakdown"].values()) == pytest.approx(metrics["step_seconds"], rel=0.02)
    assert metrics["time_summary"] == said[0][len("  [time] "):]
    assert metrics["time_verdict"].startswith(("input-bound: ", "host-bound: "))


def test_a_compiled_model_that_recompiles_every_step_spends_its_time_compiling() -> None:
    # torch.compile with inductor, a new batch size every step and dynamic=False: each step compiles its
    # forward and backward graphs (hundreds of milliseconds to seconds) for a model that runs in microseconds.
    # In a process of its own: dynamo's compile records are the process's, and a run's first step is charged
    # what was compiled before it (under diagnose, the script's first compilation comes before the run binds).
    code = """
import json, torch
import accelport as ap
ap.use("cpu")
torch.manual_seed(0)
model = ap.compile(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)),
                   dynamic=False)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for x, y in ap.loader([(torch.randn(4 + i, 8), torch.randn(4 + i, 1)) for i in range(4)]):
    torch.nn.functional.mse_loss(model(x), y).backward()
    ap.optimizer_step(opt)
    opt.zero_grad()
m = ap.metrics()
print(json.dumps({k: getattr(m, k) for k in ("compilations", "time_breakdown", "compile_seconds", "step_seconds",
                                             "time_verdict")}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    m = json.loads(done.stdout.splitlines()[-1])
    assert m["compilations"] == 4
    breakdown = m["time_breakdown"]
    assert max(breakdown, key=lambda k: breakdown[k]) == "compile", breakdown
    assert breakdown["compile"] == pytest.approx(m["compile_seconds"], rel=0.02)
    assert sum(breakdown.values()) == pytest.approx(m["step_seconds"], rel=0.02)
    assert m["time_verdict"].startswith("compile-bound: "), m["time_verdict"]


def timed_read(tensor: torch.Tensor) -> float:
    start = time.perf_counter()
    tensor.tolist()
    return time.perf_counter() - start


def test_an_accelerator_says_device_and_host_sync_joined_and_times_its_host_reads(standin: EagerBackend) -> None:
    # A host read on an accelerator waits for the device: its time is the device's and the read's at
    # once. A big read after the optimizer step (logging) goes there, not to the script's own code.
    big = torch.zeros(4_000_000)
    model = torch.nn.Linear(8, 1).to(ap.device())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(6)]
    reads = []
    for x, y in ap.loader(data, prefetch=0):
        torch.nn.functional.mse_loss(model(x), y).backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
        reads.append(timed_read(big))  # timed as it happens: a busy machine slows the read and its charge alike
    m = ap.metrics()
    assert "device+host_sync" in m.time_breakdown and "device" not in m.time_breakdown
    assert "host_sync" not in m.time_breakdown
    # Five reads after the steps' ends fell inside steps 2 to 6 (the last one is after the run); at least
    # three of them are charged here, by their own measure (the clock's, taken as they ran).
    assert m.time_breakdown["device+host_sync"] >= sum(sorted(reads[:5])[:3]), (m.time_breakdown, reads)
    assert m.time_breakdown.get("other", 0.0) < m.time_breakdown["device+host_sync"]
    assert "device-bound or sync-bound" in m.time_verdict and "--profile" in m.time_fix


def test_a_replica_waiting_for_a_slower_one_says_collective(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = os.path.join(REPO, "tests", "scripts", "time_collective.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")}
    done = subprocess.run([sys.executable, "-m", "accelport", "launch", "--backend", "cpu", "--nprocs", "2",
                           "--oversubscribe", script, str(tmp_path), str(COLLECTIVE_SLEEP), "8"], capture_output=True,
                          text=True, env=env, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    fast, slow = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # Rank 0 waits in ap.optimizer_step's all-reduce while rank 1 sleeps, every step but the first few
    # milliseconds of work: most of the sleep (the first step's set-up evens out by the end).
    # The sleep is long beside what a busy machine can delay one rank's work by (tens of milliseconds).
    assert fast["per_step"].get("collective", 0.0) >= 0.6 * COLLECTIVE_SLEEP, fast
    assert fast["verdict"].startswith("sync-bound: ") and fast["fix"].startswith("The replicas wait for each other")
    assert slow["per_step"]["other"] >= 0.8 * COLLECTIVE_SLEEP, slow
    assert slow["per_step"].get("collective", 0.0) < fast["per_step"]["collective"]


# -- the clock and the arithmetic, without timing -------------------------------------------------------


def test_the_clock_charges_each_moment_to_one_phase() -> None:
    clock = StepClock()
    clock.arrived(now=10.0, blocked=3.0, data=2.0, transfer=0.5)  # the first step starts at 7.0
    assert clock.started and clock.parts == {"data": 2.0, "transfer": 0.5, "sched": 0.5}
    parts = clock.close(now=12.0)  # forward, backward and optimizer: the body
    assert parts == {"data": 2.0, "transfer": 0.5, "sched": 0.5, "body": 2.0}
    assert sum(parts.values()) == 12.0 - 7.0
    clock.arrived(now=13.0, blocked=0.25, data=0.25, transfer=0.0)  # before the batch: the script's code
    parts = clock.close(now=14.0)
    assert parts == {"tail": 0.75, "data": 0.25, "body": 1.0}
    # A wait that began before the step did (a loader that syncs first finishes the step before during it):
    # only its part after the step's start is this step's, data first.
    clock.arrived(now=14.5, blocked=1.0, data=0.75, transfer=0.25)
    parts = clock.close(now=15.0)
    assert parts == {"data": 0.5, "body": 0.5} and sum(parts.values()) == 15.0 - 14.0


def test_a_clock_that_is_not_phased_tells_training_batches_by_its_own_threads_backward_passes() -> None:
    # (XLA's clock: the body, the tail and a step's start are one category, so a backward is only counted.)
    import threading

    from accelport.observe.steptime import watch_backward

    clock = StepClock()
    clock.phased = False
    watch_backward(clock)
    x = torch.ones(3, requires_grad=True)

    def backward() -> None:
        (x * 2).sum().backward()

    assert clock.arrived(now=1.0, blocked=0.0, data=0.0, transfer=0.0) is False  # the first batch
    other = threading.Thread(target=backward)  # another thread's backward is not the loop's training work
    other.start()
    other.join()
    assert clock.arrived(now=2.0, blocked=0.0, data=0.0, transfer=0.0) is True  # the batch before: between steps
    backward()  # a micro-batch of an accumulation: no optimizer step yet
    assert clock.arrived(now=3.0, blocked=0.0, data=0.0, transfer=0.0) is False
    clock.body()  # an optimizer step whose end comes after the next batch
    assert clock.arrived(now=4.0, blocked=0.0, data=0.0, transfer=0.0) is False


def test_a_backward_whose_clock_stops_being_phased_inside_it_still_ends() -> None:
    # (Under accelport diagnose the backend, and so the clock's kind, may be chosen during a backward.)
    from accelport.observe.steptime import watch_backward

    clock = StepClock()
    watch_backward(clock)
    x = torch.ones(3, requires_grad=True)
    x.register_hook(lambda grad: setattr(clock, "phased", False))
    (x * 2).sum().backward()
    assert not clock.in_backward


def test_phases_become_categories_as_the_backend_says() -> None:
    parts = {"data": 1.0, "transfer": 0.5, "sched": 0.25, "body": 2.0, "tail": 1.0, "read": 0.5}
    assert categories(parts, TIME_PHASES) == {"data": 1.0, "transfer": 0.5, "other": 1.25, "device+other": 2.0,
                                              "host_sync": 0.5}
    assert joined(["host_sync", "device"]) == "device+host_sync"
    assert joined(["compile", "device+host_sync"]) == "compile+device+host_sync"
    assert all(part in TIME_CATEGORIES for part in "compile+device+host_sync".split("+"))


def test_compile_time_is_carved_from_where_compilers_run() -> None:
    lazy = {"pre": "other", "body": "other", "tail": "other", "sync": "device", "read": "host_sync"}
    one = {"device": 3.0, "other": 1.0}
    carve_compile(one, 2.0, lazy)
    assert one == {"device": 1.0, "other": 1.0, "compile": 2.0}
    # It may have been in the sync or in a host read, both of which hold time: not guessed.
    both = {"device": 3.0, "host_sync": 1.0, "other": 1.0}
    carve_compile(both, 2.0, lazy)
    assert both == {"device+host_sync": 2.0, "other": 1.0, "compile": 2.0}
    # Steps read together, each of which may or may not have compiled: joined, not split.
    together = {"device": 3.0, "other": 1.0}
    carve_compile(together, 2.0, lazy, split=False)
    assert together == {"compile+device": 3.0, "other": 1.0}
    over = {"device": 1.0, "other": 1.0}
    carve_compile(over, 5.0, lazy)
    assert over == {"compile": 2.0}  # never more than the step held


def test_the_verdict_reuses_the_fixes_of_the_kinds_it_points_at() -> None:
    first = {"data": 0.1, "compile": 5.0, "device": 0.1}
    lines = explain({"data": 4.1, "compile": 5.0, "device": 1.1}, 11, first=first, loader={"num_workers": 0})
    assert lines[0].startswith("time per step 927.3 ms: data 372.7 (40%), compile 454.5 (49%)")
    assert lines[1] == "input-bound: 80% of the step time after the first step waits for the next batch (10 step(s))"
    assert lines[2] == advice.data_workers("accelport", 0, os.cpu_count() or 1)[:-1] + " (as input-bound says)."
    sync = explain({"host_sync": 3.0, "device": 1.0}, 4)
    assert sync[1].startswith("sync-bound: 75% of the step time of the run")
    assert sync[2] == advice.host_reads("accelport")[:-1] + " (as host-sync says)."
    # In the script's own terms, as the kinds say them (a raw torch_xla loop: a step closure).
    assert "xm.add_step_closure" in explain({"host_sync": 3.0, "device": 1.0}, 4, style="torch_xla")[2]
    assert verdict({"device+host_sync": 3.0, "other": 1.0})[0] == "device-bound or sync-bound"
    assert verdict({"other": 3.0, "device": 1.0})[0] == "host-bound"
    assert explain({}, 0) == []
