"""Training that goes wrong on real loops: non-finite gradients with their source, bf16 updates that
round away; healthy loops stay silent. On cpu (checked as each step ends) and on the eager
accelerators' own code through the constants-swapped stand-ins (read later, in blocks).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import accelport as ap
from accelport.eager import EagerBackend
from accelport.observe.numerics import CHECK_EVERY, PRECISION_EVERY, PRECISION_FIRST, check_batch, param_names
from tests.diagnoses import kinds, silent


class Net(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 1)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


class RootBias(Net):
    """A parameter enters through a square root; once ``hot``, of 0, where its gradient is Inf.

    The loss stays finite: only that parameter's gradient is not.
    """

    def __init__(self) -> None:
        super().__init__()
        self.tail = torch.nn.Module()  # a child registered last: its parameter comes last
        self.tail.root = torch.nn.Parameter(torch.ones(1))
        self.hot = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offset = 0.0 if self.hot else 1.0
        root = self.tail.root
        return super().forward(x) + torch.sqrt(root - root.detach() + offset)


def data(steps: int, *, scale: float = 1.0, nan_at: int | None = None,
         dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=g)
    out = []
    for i in range(steps):
        x = torch.randn(32, 8, generator=g) * scale
        y = x @ w
        if i + 1 == nan_at:
            x[3, 2] = float("nan")
        out.append((x, y) if dtype == torch.float32 else (x.to(dtype), y.to(dtype)))
    return out


def linear(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A loss linear in the model's output (a WGAN critic's): the last bias's gradient is a constant."""
    return out.sum()


def train(model: torch.nn.Module, batches: list[Any], lr: float = 0.01, *, optimizer: str = "sgd",
          inside: Callable[[int, Any, Any], None] | None = None,
          autocast: torch.dtype | None = None, loss_fn: Callable[..., torch.Tensor] = torch.nn.functional.mse_loss,
          loader: bool = True) -> None:
    model = model.to(ap.device())
    opt: torch.optim.Optimizer = (torch.optim.SGD(model.parameters(), lr=lr) if optimizer == "sgd"
                                  else torch.optim.AdamW(model.parameters(), lr=lr))
    # loader=False: the batches go in as they are, as in a script without ap.loader or a DataLoader
    # (on the host, which is the device of cpu and of the stand-ins).
    source = ap.loader(batches) if loader else iter(batches)
    for i, (x, y) in enumerate(source):
        if autocast is not None:
            with ap.autocast(autocast):
                out = model(x)
            loss = loss_fn(out.float(), y)
        else:
            loss = loss_fn(model(x), y)
        loss.backward()
        if inside is not None:
            inside(i, model, opt)
        ap.optimizer_step(opt)
        opt.zero_grad()


# -- cpu: checked as each step ends ---------------------------------------------------------------


def test_a_nan_in_one_input_batch_names_that_step_and_the_input() -> None:
    ap.use("cpu")
    with pytest.warns(ap.DiagnosticWarning, match=r"\[non-finite\] PROBLEM: "):
        train(Net(), data(30, nan_at=7))
    assert kinds() == ["non-finite"]
    (found,) = ap.diagnostics()
    assert found.evidence["first_step"] == 7 and found.evidence["source"] == "input" and found.step == 7
    assert "at step 7: it came from the input batch (input 0: 1 of 256 values are NaN or Inf)" in found.text
    assert "Bad data" in found.text and found.severity == "problem"


def test_a_learning_rate_that_diverges_names_the_loss_and_the_fixes() -> None:
    ap.use("cpu")
    with pytest.warns(ap.DiagnosticWarning, match="non-finite"):
        train(Net(), data(30, scale=10.0), lr=5.0)
    (found,) = ap.diagnostics()
    assert found.evidence["source"] == "loss" and 2 <= found.evidence["first_step"] <= 10
    assert "it came from the loss (every gradient is NaN or Inf" in found.text
    assert "learning rate too high" in found.text and "clip_grad_norm_" in found.text
    assert "without a Python branch on the returned norm" in found.text and "fp32" in found.text


def test_one_parameters_gradient_is_named_by_its_module_path() -> None:
    ap.use("cpu")

    def heat(i: int, model: Any, opt: Any) -> None:
        model.hot = i >= 4  # (after step 5's backward: step 6 is the first with an Inf gradient)

    with pytest.warns(ap.DiagnosticWarning, match="non-finite"):
        train(RootBias(), data(20), inside=heat)
    (found,) = ap.diagnostics()
    assert found.evidence["source"] == "gradient" and found.evidence["first_step"] == 6
    assert "the gradient of tail.root" in found.text and found.evidence["names"] == ["tail.root"]


def test_bf16_weights_with_a_tiny_learning_rate_stall_and_are_named() -> None:
    ap.use("cpu")
    steps = PRECISION_FIRST + PRECISION_EVERY + 2
    with pytest.warns(ap.DiagnosticWarning, match=r"\[precision\]"):
        train(Net(torch.bfloat16), data(steps, dtype=torch.bfloat16), lr=1e-5)
    assert kinds() == ["precision"]
    (found,) = ap.diagnostics()
    assert found.step == PRECISION_FIRST + PRECISION_EVERY + 1  # the second sample in a row
    assert set(found.evidence["params"]) >= {"hidden.weight", "out.weight"}
    assert all(share >= 0.5 for share in found.evidence["unchanged_share"].values())
    assert "of hidden.weight (bfloat16)" in found.text
    assert "ap.autocast" in found.text and "NEURON_RT_STOCHASTIC_ROUNDING_EN=1" in found.text
    assert "Kahan" in found.text


@pytest.mark.parametrize("case", ["bf16 autocast, fp32 weights", "fp32, a small learning rate",
                                  "a learning-rate schedule of Python floats", "bf16 weights, AdamW"])
def test_healthy_loops_are_silent(case: str) -> None:
    ap.use("cpu")
    steps = PRECISION_FIRST + 2 * PRECISION_EVERY + 2  # two full precision samples
    if case == "bf16 autocast, fp32 weights":
        silent(lambda: train(Net(), data(steps), autocast=torch.bfloat16))
    elif case == "fp32, a small learning rate":
        silent(lambda: train(Net(), data(steps), lr=1e-6))
    elif case == "a learning-rate schedule of Python floats":
        def schedule(i: int, model: Any, opt: Any) -> None:
            for group in opt.param_groups:
                group["lr"] = 0.02 * min(1.0, (i + 1) / 20) / (1 + i / 50)

        silent(lambda: train(Net(), data(steps), inside=schedule))
    else:  # AdamW moves every weight by about lr, far above half a bf16 step at these sizes
        silent(lambda: train(Net(torch.bfloat16), data(steps, dtype=torch.bfloat16), lr=1e-2, optimizer="adamw"))
    assert ap.metrics().steps == steps


def test_each_step_is_looked_at_through_a_sum_not_isfinite(monkeypatch: pytest.MonkeyPatch) -> None:
    # isfinite().all() costs five times a sum read back (and a NaN or Inf survives the sum).
    calls: list[int] = []
    real = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: calls.append(1) or real(t))
    ap.use("cpu")
    train(Net(), data(20))
    assert calls == [] and ap.diagnostics() == []


def test_what_the_loader_thread_says_about_a_host_batch() -> None:
    x = torch.zeros(4, 3)
    assert check_batch((x, torch.arange(4))) is None
    x[1, 1] = float("inf")
    assert check_batch({"ids": torch.arange(4), "pixels": x}) == "input 'pixels': 1 of 12 values are NaN or Inf"
    assert check_batch([torch.ones(2), (torch.ones(1), x)]) == "input 1[1]: 1 of 12 values are NaN or Inf"


def test_parameters_are_named_from_the_module_that_holds_them_even_compiled() -> None:
    net = Net()
    compiled = torch.compile(net)  # (not called: the wrapper's names carry _orig_mod.)
    names = param_names(list(net.parameters()))
    assert list(names.values()) == ["hidden.weight", "hidden.bias", "out.weight", "out.bias"]
    assert compiled is not None


# -- eager accelerators, through the stand-ins: read in blocks, never per step ---------------------


def test_on_accelerators_a_nan_batch_is_found_late_but_named_exactly(standin: EagerBackend) -> None:
    watch_reads: list[int] = []
    with pytest.warns(ap.DiagnosticWarning, match="non-finite"):
        train(Net(), data(CHECK_EVERY + 10, nan_at=5),
              inside=lambda i, m, o: watch_reads.append(ap.metrics().device_to_host or 0))
    (found,) = ap.diagnostics()
    # Read CHECK_EVERY steps later, but the first bad step and its input are exact.
    assert found.evidence["first_step"] == 5 and found.evidence["source"] == "input"
    assert "input 0: 1 of 256 values" in found.text
    # No host read inside the steps: the checks read through after_step's path, not the user's.
    assert watch_reads == [0] * len(watch_reads) and "host-sync" not in kinds()


def test_on_accelerators_a_diverging_loss_is_reported_from_the_gradients(standin: EagerBackend) -> None:
    with pytest.warns(ap.DiagnosticWarning, match="non-finite"):
        train(Net(), data(CHECK_EVERY + 4, scale=10.0), lr=5.0)
    (found,) = ap.diagnostics()
    assert found.evidence["source"] == "gradients" and found.evidence["first_step"] <= 10
    assert "the inputs were finite" in found.text.lower() and "(seen in out.bias)" in found.text


def test_on_accelerators_healthy_training_is_silent(standin: EagerBackend) -> None:
    silent(lambda: train(Net(), data(2 * CHECK_EVERY + 3)))
    assert math.isfinite(ap.metrics().step_seconds)


def test_on_accelerators_gradients_kept_in_place_still_name_the_first_bad_step(standin: EagerBackend) -> None:
    # zero_grad(set_to_none=False): each step's gradient is the same tensor, written over;
    # every one kept must be a copy, the very first too.
    # The inputs stay finite: only the gradients tell the first bad step.
    model = RootBias().to(ap.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.warns(ap.DiagnosticWarning, match="non-finite"):
        for i, (x, y) in enumerate(ap.loader(data(12))):
            model.hot = i >= 2  # step 3 is the first with an Inf gradient
            torch.nn.functional.mse_loss(model(x), y).backward()
            ap.optimizer_step(opt)
            opt.zero_grad(set_to_none=False)
    (found,) = ap.diagnostics()
    assert found.evidence["first_step"] == 3 and found.evidence["source"] == "gradients"


def test_a_nan_in_an_earlier_accumulated_batch_is_not_blamed_on_the_loss_alone() -> None:
    ap.use("cpu")
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.warns(ap.DiagnosticWarning, match="non-finite"):
        for i, (x, y) in enumerate(ap.loader(data(12, nan_at=5))):  # batch 5: the first of step 3's two
            torch.nn.functional.mse_loss(model(x), y).backward()
            if i % 2 == 1:
                ap.optimizer_step(opt)
                opt.zero_grad()
    (found,) = ap.diagnostics()
    assert found.evidence["first_step"] == 3 and found.evidence["source"] == "loss"
    assert "or an earlier one of the 2 batches accumulated into this step held NaN or Inf" in found.text


def test_only_host_tensors_of_a_batch_are_looked_at() -> None:
    # A batch already on a device would be read back every step; a layout without a cheap
    # sum (nested) is passed over; complex values are checked like real ones.
    on_device = torch.full((4, 3), float("nan"), device="meta")
    nested = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
    assert check_batch([on_device, nested]) is None
    assert check_batch([torch.tensor([1 + 0j, complex("nan+0j")])]) == "input 0: 1 of 2 values are NaN or Inf"


# -- a loss linear in the model's output, inputs that no loader brought ------------------------------
# There the canary (the last bias) has a constant gradient whatever the weights hold: the values of a
# weight are checked too. Inputs that were never looked at leave the source open.


def first_bad_update(batches: list[Any], lr: float, loss_fn: Callable[..., torch.Tensor]) -> int:
    """The same training in plain torch, without accelport: the first step whose update left a
    parameter NaN or Inf."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step, (x, y) in enumerate(batches, 1):
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            return step
    raise AssertionError("the weights stayed finite")


def test_a_loss_linear_in_the_output_still_names_a_nan_batch_at_its_step() -> None:
    ap.use("cpu")
    with pytest.warns(ap.DiagnosticWarning, match=r"\[non-finite\] PROBLEM: "):
        train(Net(), data(30, nan_at=7), loss_fn=linear)
    (found,) = ap.diagnostics()
    assert found.evidence["first_step"] == 7 and found.evidence["source"] == "input"
    assert "it came from the input batch (input 0: 1 of 256 values are NaN or Inf)" in found.text


def test_a_loss_linear_in_the_output_that_diverges_is_found_at_the_step_the_weights_turn() -> None:
    ap.use("cpu")
    with pytest.warns(ap.DiagnosticWarning, match="non-finite"):
        train(Net(), data(60), lr=0.2, loss_fn=linear)
    turned = first_bad_update(data(60), 0.2, linear)
    (found,) = ap.diagnostics()
    assert found.evidence["first_step"] == turned and found.evidence["source"] == "gradient"
    assert "the gradients became NaN or Inf at step" in found.text
    assert found.evidence["names"] and "out.bias" not in found.evidence["names"]  # its gradient stays finite


def test_weights_that_overflow_in_the_update_with_finite_gradients_name_the_update() -> None:
    ap.use("cpu")
    with pytest.warns(ap.DiagnosticWarning, match="non-finite"):
        train(Net(), data(5, scale=100.0), lr=1e37)  # finite gradients of hundreds: lr * grad > 3.4e38
    (found,) = ap.diagnostics()
    assert (found.evidence["first_step"], found.evidence["source"]) == (1, "update")
    assert found.text.startswith("the weights became NaN or Inf at step 1: it came from the optimizer's update")
    assert "turned NaN or Inf in the update, its gradient finite" in found.text


@pytest.mark.parametrize("loss_fn", [torch.nn.functional.mse_loss, linear], ids=["mse", "linear"])
def test_a_nan_input_that_no_loader_brought_is_not_blamed_on_the_loss(loss_fn: Callable[..., Any]) -> None:
    ap.use("cpu")
    with pytest.warns(ap.DiagnosticWarning, match="non-finite"):
        train(Net(), data(30, nan_at=7), loss_fn=loss_fn, loader=False)
    (found,) = ap.diagnostics()
    assert found.evidence["first_step"] == 7 and found.evidence["source"] == "unknown"
    assert "from an unknown source" in found.text
    assert "the inputs of this step were not seen: they came neither through ap.loader nor through a DataLoader" \
        in found.text
    assert "Check the inputs first: torch.isfinite(x).all() on each batch" in found.text
    assert "it came from the loss" not in found.text and "A learning rate too high" not in found.text


def test_a_batch_of_token_ids_counts_as_seen_its_nan_loss_is_the_loss() -> None:
    # Integer ids hold no NaN: a batch of them rules the inputs out as well as a finite float batch.
    ap.use("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(i)) for i in range(6)]
    with pytest.warns(ap.DiagnosticWarning, match="non-finite"):
        for step, ids in enumerate(ap.loader(batches), 1):
            (model(ids).mean() * (float("nan") if step == 3 else 1.0)).backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
    (found,) = ap.diagnostics()
    assert (found.evidence["first_step"], found.evidence["source"]) == (3, "loss")
    assert "were not seen" not in found.text


def test_healthy_loops_with_a_loss_linear_in_the_output_are_silent() -> None:
    ap.use("cpu")
    silent(lambda: train(Net(), data(PRECISION_FIRST + PRECISION_EVERY + 2), lr=1e-4, loss_fn=linear))
    silent(lambda: train(Net(), data(30), loader=False))


def test_on_accelerators_a_loss_linear_in_the_output_names_a_nan_batch_exactly(standin: EagerBackend) -> None:
    with pytest.warns(ap.DiagnosticWarning, match="non-finite"):
        train(Net(), data(CHECK_EVERY + 10, nan_at=5), loss_fn=linear)
    (found,) = ap.diagnostics()
    assert found.evidence["first_step"] == 5 and found.evidence["source"] == "input"


def test_on_accelerators_a_loss_linear_in_the_output_that_diverges_shows_in_the_weights(
        standin: EagerBackend) -> None:
    with pytest.warns(ap.DiagnosticWarning, match="non-finite"):
        train(Net(), data(2 * CHECK_EVERY + 4), lr=0.2, loss_fn=linear)
    turned = first_bad_update(data(2 * CHECK_EVERY + 4), 0.2, linear)
    (found,) = ap.diagnostics()
    # The weights are read with the canary, every CHECK_EVERY steps: the first bad step is known to a block.
    ev = found.evidence
    assert ev["source"] == "gradients" and ev["first_step"] is None
    assert ev["finite_at_step"] < turned <= ev["found_by_step"] and ev["found_by_step"] % CHECK_EVERY == 0
    assert ev["names"] == ["out.weight"]
    assert (f"the weights became NaN or Inf after step {ev['finite_at_step']} and by step {ev['found_by_step']} "
            f"(on {standin.name} they are read every {CHECK_EVERY} steps and at the end of each loop): "
            "it showed in the weights (the values of out.weight)") in found.text
    assert "The inputs were finite" in found.text


def test_on_accelerators_a_nan_input_that_no_loader_brought_is_not_called_finite(standin: EagerBackend) -> None:
    with pytest.warns(ap.DiagnosticWarning, match="non-finite"):
        train(Net(), data(CHECK_EVERY + 10, nan_at=5), loader=False)
    (found,) = ap.diagnostics()
    assert found.evidence["first_step"] == 5 and found.evidence["source"] == "unknown"
    assert "the inputs of these steps were not seen" in found.text
    assert "The inputs were finite" not in found.text and "Check the inputs first" in found.text


CRITIC = Path(__file__).resolve().parent / "critic_script.py"


@pytest.mark.parametrize(("feed", "source"), [("loader", "input"), ("slices", "unknown")])
def test_accelport_diagnose_finds_the_nan_of_an_unmodified_critic_script(tmp_path: Path, feed: str,
                                                                         source: str) -> None:
    # A WGAN-style critic, plain PyTorch: its last bias's gradient is the same at every step.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")}
    out = subprocess.run([sys.executable, "-m", "accelport", "diagnose", "--output", str(tmp_path / "found.json"),
                          str(CRITIC), "--feed", feed], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == f"done {feed} False\n"  # the script's own output: its weights ended NaN
    [found] = json.loads((tmp_path / "found.json").read_text())["findings"]
    assert (found["kind"], found["step"], found["evidence"]["source"]) == ("non-finite", 6, source)
    assert "[FAIL] non-finite at step 6" in out.stderr


@pytest.mark.xla
def test_on_xla_a_loss_linear_in_the_output_is_found_without_an_extra_graph_or_transfer() -> None:
    # Runs in the xla environment. The weight is read whole with the canary, after the loop's syncs.
    from accelport.observe.numerics import CHECK_EVERY_LAZY

    ap.use("xla")
    start = ap.metrics()
    with pytest.warns(ap.DiagnosticWarning, match="non-finite"):
        train(Net(), data(CHECK_EVERY_LAZY + 8, nan_at=6), loss_fn=linear)
    (found,) = ap.diagnostics()
    assert found.evidence["first_step"] == 6 and found.evidence["source"] == "input"
    m = ap.metrics()
    assert m.compilations - start.compilations <= 2 and m.device_to_host - start.device_to_host == 0


@pytest.mark.xla
def test_on_xla_a_loss_linear_in_the_output_that_diverges_shows_in_the_weights() -> None:
    ap.use("xla")
    with pytest.warns(ap.DiagnosticWarning, match="non-finite"):
        train(Net(), data(60), lr=0.2, loss_fn=linear)  # read at the loop's end
    (found,) = ap.diagnostics()
    ev = found.evidence
    assert (ev["source"], ev["found_by_step"], ev["finite_at_step"]) == ("gradients", 60, 0)
    assert ev["names"] == ["out.weight"]
    assert found.text.startswith("the weights became NaN or Inf after step 0 and by step 60 (on xla they are "
                                    "read every few hundred steps")


SHARDED_IN_PLACE = """
import os, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from accelport.observe.numerics import NumericsWatch

class Accelerator:  # a stand-in for an eager accelerator's backend: the checks read later, in blocks
    lazy, sync_api, name = False, "cuda", "stand-in"
    def diagnostic_read(self, fn, tensors):
        fn(*[t.detach().clone() for t in tensors])

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
watch = NumericsWatch(Accelerator())
for step in range(1, 7):
    x = torch.randn(3, 4)
    if step == 3:
        x[0, 0] = float("nan")
    model(x).pow(2).mean().backward()
    opt.step()
    watch.step_end(step, opt)
    opt.zero_grad(set_to_none=False)
assert type(model[1].bias.grad).__name__ == "DTensor"
watch.read()
print(watch.nonfinite.step, watch.nonfinite.source)
dist.destroy_process_group()
"""


def test_sharded_gradients_kept_in_place_name_the_first_bad_step(tmp_path: Any) -> None:
    import socket

    with socket.socket() as s:  # a free port for the one-rank process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "sharded.py"
    script.write_text(SHARDED_IN_PLACE)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PORT": str(port)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["3", "unknown"]  # (the inputs went in by hand: not looked at)
