"""One account of a run: the same run gives the same numbers in ap.metrics(), the metrics file, the report and
accelport diagnose's summary; work between the training steps is its own time category.

Each case is a script written as a user writes it. Nothing here compares durations: the evaluation's work is
made large so that it is visible, and the tests say which category it lands in.
"""

from __future__ import annotations

import json
import pathlib
import textwrap
from typing import Any

import torch

import accelport as ap
from accelport.diagnose.report import load_records, render_html
from accelport.diagnose.timing import explain
from tests.diagnose_cli.runs import run

EPOCHS, TRAIN_STEPS, EVAL_BATCHES = 2, 4, 6


def records_of(path: pathlib.Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def train_and_evaluate() -> None:
    """A ported loop with an evaluation loop after each epoch (no backward, no optimizer step, another batch size)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8 * TRAIN_STEPS, 256),
                                                                       torch.randn(8 * TRAIN_STEPS, 1)), batch_size=8)
    test = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64 * EVAL_BATCHES, 256)),
                                       batch_size=64)
    for _ in range(EPOCHS):
        model.train()
        for x, y in ap.loader(train):
            torch.nn.functional.mse_loss(model(x), y).backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            for (x,) in ap.loader(test):
                for _ in range(20):  # a large evaluation
                    x = torch.tanh(x @ model[0].weight)
                float(model(x).sum())


def test_an_evaluation_each_epoch_is_work_between_steps_not_the_next_steps(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    metrics_file = tmp_path / "run.jsonl"
    monkeypatch.setenv("ACCELPORT_METRICS_FILE", str(metrics_file))
    ap.use("cpu")
    train_and_evaluate()
    m = ap.metrics()
    records = records_of(metrics_file)
    steps = {r["step"]: r for r in records}
    assert sorted(steps) == list(range(1, EPOCHS * TRAIN_STEPS + 1))
    # The first step of the second epoch comes after the first evaluation: that is work between the steps.
    after_eval = steps[TRAIN_STEPS + 1]["breakdown"]
    assert "between_steps" in after_eval, after_eval
    assert all("between_steps" not in r["breakdown"] for s, r in steps.items() if s != TRAIN_STEPS + 1)
    assert "between_steps" in m.time_breakdown
    assert "between_steps" in m.time_summary
    # Each step's categories still add up to its time.
    for r in records:
        assert abs(sum(r["breakdown"].values()) - r["seconds"]) <= max(0.02 * r["seconds"], 50e-6)
    # The evaluation's batches are no step's: one batch shape, in ap.metrics() and in the report alike.
    assert m.batch_signatures == 1
    page = render_html(load_records(str(metrics_file)), [], "run")
    assert "1 distinct batch shapes" in page


def test_an_evaluations_wait_for_its_data_is_not_the_training_loops(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A slow evaluation loader (0.8 s of sleeps) between two steps: between_steps, not the steps' data wait."""
    import time

    class Slow(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> torch.Tensor:
            time.sleep(0.1)
            return torch.randn(4)

    metrics_file = tmp_path / "run.jsonl"
    monkeypatch.setenv("ACCELPORT_METRICS_FILE", str(metrics_file))
    ap.use("cpu")
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, x in enumerate(ap.loader([torch.randn(2, 4) for _ in range(6)])):
        model(x).sum().backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
        if i == 2:
            with torch.no_grad():
                for batch in ap.loader(torch.utils.data.DataLoader(Slow(), batch_size=2)):
                    model(batch)
    m = ap.metrics()
    step_four = records_of(metrics_file)[3]
    assert step_four["step"] == 4 and step_four["breakdown"]["between_steps"] >= 0.8
    # The training batches come from a list: their waits are all the loop's wait for data.
    assert step_four["data_wait_seconds"] < 0.4 and m.data_wait_seconds < 0.4
    assert m.time_breakdown["between_steps"] >= 0.8


def test_a_verdict_judges_the_training_steps_not_the_work_between_them() -> None:
    total = {"device": 1.0, "other": 0.1, "between_steps": 30.0}
    lines = explain(total, 10, first={"device": 0.1})
    assert lines[0].endswith("between_steps 3000.0 (96%)")
    assert lines[1].startswith("device-bound")


def test_a_run_of_one_batch_shape_is_not_told_to_see_which_input_changes_shape() -> None:
    total = {"compile": 5.0, "device": 1.0}
    one = explain(total, 10, first={"compile": 0.5}, lazy=True, shapes=1)
    assert one[1].startswith("compile-bound")
    assert "changes shape" not in one[2] and "one batch shape" in one[2]
    several = explain(total, 10, first={"compile": 0.5}, lazy=True, shapes=3)
    assert "which input changes shape" in several[2]


def test_gradient_bytes_is_the_steps_budget_after_zero_grad() -> None:
    ap.use("cpu")
    model = torch.nn.Linear(32, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 32), torch.randn(64, 8))
    for x, y in ap.loader(torch.utils.data.DataLoader(data, batch_size=16)):
        torch.nn.functional.mse_loss(model(x), y).backward()
        ap.optimizer_step(opt)
        opt.zero_grad()  # (set_to_none: no gradient exists when the metrics are read)
    m = ap.metrics()
    assert m.gradient_bytes == m.parameter_bytes == (32 * 8 + 8) * 4


COMPILED_EVAL = """
import torch
import accelport as ap

torch.manual_seed(0)
model = ap.compile(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)),
                   dynamic=False)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 1)),
                                    batch_size=16)
test = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(50, 16)), batch_size=50)
for epoch in range(2):
    for x, y in ap.loader(train):
        torch.nn.functional.mse_loss(model(x), y).backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
    with torch.no_grad():
        for (x,) in ap.loader(test):  # another batch size: its own compilation, after the last step too
            print("eval", float(model(x).sum()))
final = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(7, 16)), batch_size=7)
with torch.no_grad():
    for (x,) in ap.loader(final):  # after the last step: one more compilation
        print("final", float(model(x).sum()))
print("COMPILATIONS", ap.metrics().compilations)
"""


def test_compilations_are_counted_once_and_the_same_everywhere(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(COMPILED_EVAL))
    # Run as ported (ACCELPORT_METRICS_FILE) ...
    plain = run(str(script), diagnose=False, cwd=tmp_path, env={"ACCELPORT_METRICS_FILE": "plain.jsonl",
                                                                "ACCELPORT_BACKEND": "cpu"})
    assert plain.returncode == 0, plain.stderr
    said = int(plain.stdout.split("COMPILATIONS ")[1].split()[0])
    assert said == 3  # the training step's, the evaluation's, the final batch's
    plain_records = records_of(tmp_path / "plain.jsonl")
    assert sum(r.get("compilations", 0) for r in plain_records) == said
    assert f"{said} compilations" in render_html(load_records(str(tmp_path / "plain.jsonl")), [], "run")
    # ... and under accelport diagnose: its summary, its metrics file and its report say the same.
    done = run("--metrics-file", "d.jsonl", "--report", "d.html", "--output", "d.json", str(script), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split("COMPILATIONS ")[1].split()[0]) == said
    assert json.loads((tmp_path / "d.json").read_text())["metrics"]["compilations"] == said
    assert sum(r.get("compilations", 0) for r in records_of(tmp_path / "d.jsonl")) == said
    assert f"{said} compilations" in (tmp_path / "d.html").read_text()


HAND_UPDATED = """
import torch

torch.manual_seed(0)
data = torch.randint(0, 100, (40000,))
model = torch.nn.Sequential(torch.nn.Embedding(100, 64), torch.nn.Linear(64, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 100))
lr = 0.1
for i in range(0, 50 * 64, 64):
    x = data[i:i + 64].view(8, 8)
    y = data[i + 1:i + 65].view(8, 8)
    model.zero_grad()
    out = model(x)
    loss = torch.nn.functional.cross_entropy(out.view(-1, 100), y.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)
"""


def test_a_loop_that_updates_its_weights_by_hand_keeps_its_forward_in_the_step(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The word language model's loop: each backward pass ends a step, and the forward pass of the next one
    # (and the hand-made update) is the step's start, never the script's own code after it ("other").
    script = tmp_path / "wlm.py"
    script.write_text(textwrap.dedent(HAND_UPDATED))
    done = run("--metrics-file", "steps.jsonl", str(script), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    records = records_of(tmp_path / "steps.jsonl")
    assert len(records) > 2 and records[0]["breakdown"], records[0]
    assert all(set(r["breakdown"]) <= {"device", "device+other"} for r in records[1:]), \
        [r["breakdown"] for r in records[1:]]
    assert "host-bound:" not in done.stdout


COMPILED_NO_LOADER = """
import torch

torch.manual_seed(0)
data = torch.randint(0, 64, (10000,))


def get_batch():
    ix = torch.randint(len(data) - 33, (8,))
    return torch.stack([data[i:i + 32] for i in ix]), torch.stack([data[i + 1:i + 33] for i in ix])


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 64)
        self.head = torch.nn.Linear(64, 64)

    def forward(self, x, y):
        logits = self.head(torch.relu(self.emb(x)))
        return torch.nn.functional.cross_entropy(logits.view(-1, 64), y.view(-1))


model = torch.compile(Model())
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
X, Y = get_batch()
for it in range(6):
    loss = model(X, Y)
    X, Y = get_batch()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
"""


def test_torch_compile_without_a_dataloader_says_its_compile_time(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # nanoGPT's loop: torch.compile, batches sliced from a tensor. Its first step holds the compilation.
    script = tmp_path / "nano.py"
    script.write_text(textwrap.dedent(COMPILED_NO_LOADER))
    done = run("--metrics-file", "steps.jsonl", "--output", "out.json", str(script), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    first = records_of(tmp_path / "steps.jsonl")[0]
    assert first["compilations"] >= 1 and first["breakdown"].get("compile", 0) > 0, first
    summary = json.loads((tmp_path / "out.json").read_text())["metrics"]["time_summary"]
    assert " compile " in summary, summary
