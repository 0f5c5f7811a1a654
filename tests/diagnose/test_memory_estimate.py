"""ap.memory_estimate: a step of a copy on the meta device, the budget exact, a verdict per chip, bad input refused."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import accelport as ap
from accelport.diagnose.memory import USABLE, EstimateError

GiB = 1 << 30


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 10))


PARAMS = (64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10) * 4
# Saved for backward at batch 32: the first Linear's input (32, 64) and the two ReLU outputs (32, 256), which
# the next Linear saves as its input too (one storage, counted once).
ACTIVATIONS = (32 * 64 + 2 * 32 * 256) * 4


def test_adamw_budget_is_exact_and_the_model_is_left_as_it_was() -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    est = ap.memory_estimate(model, opt, torch.randn(32, 64))
    assert est.ran_on == "meta" and est.batch_size == 32
    assert (est.parameter_bytes, est.gradient_bytes) == (PARAMS, PARAMS)
    assert est.optimizer_state_bytes == 2 * PARAMS + 6 * 4  # exp_avg, exp_avg_sq, a float32 step per tensor
    assert est.activation_bytes == ACTIVATIONS
    assert est.total_bytes == 4 * PARAMS + 24 + ACTIVATIONS
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert opt.state == {} and all(p.grad is None for p in model.parameters())
    assert est.blocks == 3 and est.largest_block_bytes == (256 * 256 + 256) * 4


def test_sgd_momentum_and_bf16() -> None:
    model = mlp().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    est = ap.memory_estimate(model, opt, torch.randn(32, 64, dtype=torch.bfloat16))
    half = PARAMS // 2
    assert (est.parameter_bytes, est.gradient_bytes, est.optimizer_state_bytes) == (half, half, half)
    assert est.activation_bytes == ACTIVATIONS // 2


def test_a_model_too_large_for_one_chip_gets_the_fewest_devices_per_chip() -> None:
    layers, width = 48, 8192
    with torch.device("meta"):  # 12.9 GB of parameters, never allocated
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    est = ap.memory_estimate(model, opt, torch.randn(4, width), chip="v5e")
    layer = (width * width + width) * 4
    params = layers * layer
    static = 4 * params + layers * 2 * 4  # parameters, gradients, two moments; a step counter per tensor
    activations = layers * 4 * width * 4  # each Linear saves its (4, 8192) input
    assert (est.static_bytes, est.activation_bytes) == (static, activations)

    def fewest(capacity: int) -> int:
        if static + activations <= capacity * USABLE:
            return 1
        return next(n for n in (2, 4, 8, 16, 32) if math.ceil(static / n) + layer + activations <= capacity * USABLE)

    verdicts = {v.device: v for v in est.verdicts}
    for chip, capacity in (("v5e", 16 * GiB), ("v4", 32 * GiB), ("v5p", 95 * GiB), ("7x", 96 * GiB),
                           ("trn2", 24 * GiB)):
        assert verdicts[chip].capacity_bytes == capacity
        assert verdicts[chip].devices == fewest(capacity), chip
    assert (verdicts["v5e"].devices, verdicts["v4"].devices, verdicts["v5p"].devices) == (4, 2, 1)
    assert verdicts["v5e"].bytes_per_device == math.ceil(static / 4) + layer + activations
    text = str(est)
    assert "fits TPU v5e with ap.shard over 4 devices" in text and "fits one TPU v5p device" in text
    assert "fits TPU7x (Ironwood) with ap.shard over" not in text  # 96 GiB per device: one is enough
    assert est.device == "v5e" and est.fixes[0].kind == "shard" and est.fixes[0].numbers["devices"] == 4
    assert est.to_dict()["verdicts"][0]["text"]


def test_an_op_without_a_meta_kernel_runs_on_a_cpu_copy() -> None:
    class Gate(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scale = 2.0 if x.sum().item() > 0 else 1.0  # a host read: impossible on meta
            return self.inner(x) * scale

    model = Gate()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    est = ap.memory_estimate(model, opt, torch.randn(32, 64))
    assert est.ran_on == "cpu"
    assert (est.parameter_bytes, est.optimizer_state_bytes) == (PARAMS, 2 * PARAMS + 24)
    assert est.activation_bytes == ACTIVATIONS  # (the scaling saves only a scalar: not a tensor of the batch)
    assert opt.state == {}


@pytest.mark.parametrize(("args", "words"), [
    (lambda m, o: (m, o, torch.randn(32, 63)), "cannot run one step on this sample batch ((32, 63) float32): "
                                               "RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
    (lambda m, o: (m, o, (torch.randn(32, 64), torch.randn(32, 10))), "model(*batch) for a tuple"),
    (lambda m, o: ("model", o, torch.randn(32, 64)), "needs the model (a torch.nn.Module), not str"),
    (lambda m, o: (m, torch.optim.SGD(mlp().parameters(), lr=0.1), torch.randn(32, 64)),
     "the optimizer does not step this model's parameters"),
    (lambda m, o: (m, o, [1, 2, 3]), "needs a sample batch holding tensors"),
    (lambda m, o: (m, o, torch.randn(32, 64)), None),
])
def test_bad_input_gets_a_specific_error(args: Any, words: str | None) -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if words is None:
        ap.memory_estimate(*args(model, opt))
        return
    with pytest.raises(EstimateError) as raised:
        ap.memory_estimate(*args(model, opt))
    assert words in str(raised.value)
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, ap.AccelportError)


def test_a_meta_model_with_a_batch_it_cannot_take_names_the_shapes() -> None:
    with torch.device("meta"):
        model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(EstimateError, match=r"did not run on the meta device with this batch \(\(8, 65\) float32\)"):
        ap.memory_estimate(model, opt, torch.randn(8, 65))


def test_an_unknown_chip_lists_the_known_ones() -> None:
    model = mlp()
    with pytest.raises(ValueError, match="v5e"):
        ap.memory_estimate(model, torch.optim.AdamW(model.parameters()), torch.randn(2, 64), chip="v9z")


def test_activations_too_large_for_any_count_get_the_count_with_checkpointing() -> None:
    layers, width, batch = 8, 8192, 65536
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    est = ap.memory_estimate(model, torch.optim.AdamW(model.parameters()), torch.randn(batch, width).to("meta"))
    activations = layers * batch * width * 4  # 16 GiB: each Linear saves its input
    assert est.activation_bytes == activations
    v5e = {v.device: v for v in est.verdicts}["v5e"]
    assert v5e.devices is None  # 16 GiB of activations on every device, however many share the rest
    # By hand: one block's activations (2 GiB) with the static part (8 GiB and a little) fit one 16 GiB device.
    assert est.static_bytes + activations // layers <= 16 * GiB * USABLE
    assert v5e.checkpointed_devices == 1
    assert v5e.text().endswith("with activation checkpointing on the model's 8 blocks it fits alone")
