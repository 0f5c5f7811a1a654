"""An optimizer that runs the forward and backward itself (LBFGS: ``opt.step(closure)``) spends its step on the
step's own work, not on the script's code: the backward inside the closure ends in the body."""

from __future__ import annotations

import json
import time

import torch

from accelport.observe.steptime import StepClock, watch_backward
from tests.diagnose_cli.runs import run


def test_a_backward_inside_the_optimizer_step_ends_in_the_body() -> None:
    clock = StepClock()
    watch_backward(clock)  # (as the step tracker does: torch.autograd.backward tells the clock)
    model = torch.nn.Linear(4, 1)
    x = torch.randn(2, 4)
    clock.close(time.perf_counter())  # the first step of a loop without batches starts here
    clock.body()  # the optimizer step starts (its pre-hook): opt.step(closure)
    model(x).sum().backward()  # the closure's backward: the optimizer goes on with its own work after it
    model(x).sum().backward()  # a second evaluation of the closure
    assert "tail" not in clock.close(time.perf_counter())  # (nothing in the step was the script's own code)
    # Outside an optimizer step a backward still ends in the script's own code, until the step starts.
    model(x).sum().backward()
    clock.body()
    assert "tail" in clock.close(time.perf_counter())


LBFGS = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
x, y = torch.randn(512, 64), torch.randn(512, 1)
opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=10)
for _ in range(5):
    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss
    opt.step(closure)
"""


def test_an_lbfgs_loop_under_diagnose_is_its_own_compute_not_host_bound(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "lbfgs.py"
    script.write_text(LBFGS)
    done = run("--metrics-file", "steps.jsonl", "--output", "out.json", str(script), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    metrics = json.loads((tmp_path / "out.json").read_text())["metrics"]
    # Each step is ten evaluations of the closure and LBFGS's own updates; between two steps the loop only
    # defines its closure. (Was: everything after the closure's first backward counted as the script's code,
    # "host-bound" with advice to log less.)
    assert metrics["time_verdict"].startswith("device-bound: "), metrics["time_verdict"]
    assert "host-bound" not in done.stderr and "logging" not in done.stderr, done.stderr
    records = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert len(records) == 5 and all("device" in r["breakdown"] for r in records[1:])
