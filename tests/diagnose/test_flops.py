"""A step's FLOPs against analytic counts, counted once per batch signature (a new shape counts again)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import accelport as ap
from accelport.observe import flops as flops_mod
from accelport.observe.flops import FlopWatch
from accelport.runtime.state import RUNTIME


def counted(step: Any, *, lazy: bool = False, batch: Any = None) -> flops_mod.StepCount:
    """Count one step (``step()`` runs its forward and backward) as the tracker's boundaries drive it."""
    watch = FlopWatch(lazy)
    watch.batch(("sig",), batch)
    step()
    watch.step_end(("sig",))
    return watch.counts[("sig",)]


def mlp_flops(rows: int, dims: list[int]) -> int:
    """Forward 2*rows*in*out per layer; backward the same for each weight, and for each input but the first."""
    layers = list(zip(dims, dims[1:], strict=False))
    forward = sum(2 * rows * a * b for a, b in layers)
    return forward + forward + sum(2 * rows * a * b for a, b in layers[1:])


def test_an_mlp_counts_as_its_matmuls() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(32, 8)
    count = counted(lambda: model(x).sum().backward())
    assert count.flops == mlp_flops(32, [8, 16, 4])
    assert count.source == "flop_counter"
    # The forward pass's matmuls and the dtype the matmuls ran in, for the causes of a low MFU.
    assert [(rows, inner, cols) for rows, inner, cols, _ in count.forward] == [(32, 8, 16), (32, 16, 4)]
    assert set(count.by_dtype) == {"fp32"} and count.by_dtype["fp32"] == count.flops


def test_a_conv_net_counts_its_convolutions() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 16 * 16, 10))
    x = torch.randn(2, 3, 16, 16)
    count = counted(lambda: model(x).sum().backward())
    conv = 2 * (2 * 16 * 16) * 8 * (3 * 3 * 3)  # output positions x out channels x (in channels x kernel)
    linear = 2 * 2 * (8 * 16 * 16) * 10
    # The convolution's weight gradient costs its forward again (the input needs none); the linear layer's
    # weight and input gradients each cost its forward.
    assert count.flops == 2 * conv + 3 * linear
    assert (2 * 16 * 16, 27, 8) in [(r, i, c) for r, i, c, _ in count.forward]


@pytest.mark.parametrize("how", ["sdpa", "by hand"])
def test_attention_counts_its_two_matmuls_each_way(how: str) -> None:
    b, h, length, e = 2, 4, 16, 32
    q, k, v = (torch.randn(b, h, length, e, requires_grad=True) for _ in range(3))

    def attend() -> torch.Tensor:
        if how == "sdpa":  # (on the host: the kernel FlopCounterMode's own registry counts as 0)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return torch.softmax(q @ k.transpose(-1, -2) / e ** 0.5, dim=-1) @ v

    matmul = 2 * b * h * length * length * e
    assert counted(lambda: attend()).flops == 2 * matmul  # q k^T and p v
    # Backward: the gradients of the attention weights, q, k and v, one matmul each; the fused kernel's
    # backward computes q k^T again (torch's formula counts it: sdpa_backward_flop_count).
    backward = 5 * matmul if how == "sdpa" else 4 * matmul
    assert counted(lambda: attend().sum().backward()).flops == 2 * matmul + backward


def test_a_lazy_backend_counts_the_same_without_changing_the_traced_graph() -> None:
    # The pass-through mode runs each operator as it is (FlopCounterMode's decompositions would give XLA a
    # different graph to compile); the formulas are the same.
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(32, 8)
    count = counted(lambda: model(x).sum().backward(), lazy=True)
    assert count.flops == mlp_flops(32, [8, 16, 4])
    assert count.source == "flop_counter:xla_trace"


def test_a_compiled_model_compiles_each_new_shape_while_its_step_is_counted() -> None:
    # Counting must not change the run it counts: a dispatch mode torch.compile does not ignore makes dynamo
    # run the counted step eagerly (no compilation, no recompilation to diagnose). Compiled, the extern
    # matmul kernels still pass through the count: the same FLOPs as the eager step's.
    ap.use("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    compiled = ap.compile(model, dynamic=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(4 + i, 8) for i in range(3)]
    for x in ap.loader(batches):
        compiled(x).sum().backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
    watch = RUNTIME.tracker.flops
    assert watch is not None and watch.problem is None
    m = ap.metrics()
    assert m.compilations == 3  # one graph per batch size, each compiled on its counted step
    assert sorted(c.flops for c in watch.counts.values()) == [mlp_flops(rows, [8, 16, 4]) for rows in (4, 5, 6)]


def test_a_new_shape_counts_again_and_a_seen_one_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    starts: list[Any] = []
    real = flops_mod._Counting.__init__

    def counting(self: Any, lazy: bool, signature: Any) -> None:
        starts.append(signature)
        real(self, lazy, signature)

    monkeypatch.setattr(flops_mod._Counting, "__init__", counting)
    ap.use("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(16, 8) for _ in range(3)] + [torch.randn(64, 8) for _ in range(9)]
    for x in ap.loader(batches):
        model(x).sum().backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
    watch = RUNTIME.tracker.flops
    assert watch is not None
    # One counted step per shape over 12 steps, each with its own count (the first batch came before the run
    # was bound, at the first step's end: its step is no loop without a loader's).
    assert len(starts) == 2 and ("no loader",) not in starts
    assert sorted(c.flops for c in watch.counts.values()) == [mlp_flops(16, [8, 16, 1]), mlp_flops(64, [8, 16, 1])]
    m = ap.metrics()
    # Weighted by the steps each shape ran (the tracker's count: the watch hears of neither shape's later steps).
    assert sorted(RUNTIME.tracker.steps_by_signature().values()) == [3, 9]
    assert m.flops_per_step == round((3 * mlp_flops(16, [8, 16, 1]) + 9 * mlp_flops(64, [8, 16, 1])) / 12)
    assert m.achieved_flops is not None and m.achieved_flops > 0
    assert m.mfu is None  # cpu: no peak, the achieved FLOP/s only


def test_a_loop_without_a_loader_is_counted_once() -> None:
    ap.use("cpu")
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 8)
    for _ in range(5):
        model(x).sum().backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
    watch = RUNTIME.tracker.flops
    assert watch is not None and len(watch.counts) == 1
    assert ap.metrics().flops_per_step == 2 * (2 * 16 * 8 * 4)  # forward, and the weight gradient


def test_a_run_bound_after_its_first_batch_counts_the_next_one() -> None:
    # Under accelport diagnose the backend (and this watch) is chosen at the first step's end, after its
    # batch came: the watch's first boundary is that step's end, with the batch's signature.
    watch = FlopWatch(lazy=False)
    model = torch.nn.Linear(8, 4)
    x = torch.randn(16, 8)
    sig = ((16, 8),)
    watch.step_end(sig)
    for _ in range(3):
        watch.batch(sig)
        model(x).sum().backward()
        watch.step_end(sig)
    assert [c.flops for c in watch.counts.values()] == [2 * (2 * 16 * 8 * 4)]
