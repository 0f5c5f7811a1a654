"""The exit hook's last hand-over of the steps: it runs once, whenever the backend was chosen."""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.diagnose_cli.runs import run

_STEPS = 50  # past the first steps, each handed over at once: the last ones wait in a quiet stretch

_SCRIPT = f"""
import atexit
import accelport as ap
import torch

ap.use("cpu")

def train():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range({_STEPS}):
        model(torch.randn(2, 4)).sum().backward()
        ap.optimizer_step(opt)
        opt.zero_grad()

def choose_and_train():
    ap.use("cpu")  # chosen again inside an exit hook, which runs before accelport's own
    train()

if WHEN == "in an exit hook":
    atexit.register(choose_and_train)
else:
    train()
print("trained", flush=True)
"""


@pytest.mark.parametrize("when", ["in the script", "in an exit hook"])
def test_every_step_reaches_the_metrics_file_once_when_the_process_exits(tmp_path: pathlib.Path, when: str) -> None:
    # A backend chosen while the exit hooks run registers accelport's hook once more, which Python never runs
    # then: the hook registered before still hands the steps over (the last 10 would be lost), and runs once.
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT.replace("WHEN", repr(when)))
    metrics = tmp_path / "metrics.jsonl"
    out = run(str(script), cwd=tmp_path, diagnose=False,
              env={"ACCELPORT_METRICS_FILE": str(metrics)})
    assert out.returncode == 0 and out.stdout.strip() == "trained", out.stdout + out.stderr
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, _STEPS + 1)), steps
