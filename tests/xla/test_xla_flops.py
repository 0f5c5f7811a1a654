"""On XLA a step's FLOPs are counted on the traced operators, without changing the graph XLA compiles."""

from __future__ import annotations

import pytest

import accelport as ap

pytestmark = pytest.mark.xla


def test_counting_a_step_on_xla_adds_no_compilation() -> None:
    import torch

    ap.use("xla")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(ap.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(32, 8) for _ in range(8)]
    for x in ap.loader(batches):
        model(x).sum().backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
    m = ap.metrics()
    forward = 2 * 32 * (8 * 16 + 16 * 4)
    assert m.flops_per_step == 2 * forward + 2 * 32 * 16 * 4  # (the first layer's input needs no gradient)
    from accelport.runtime.state import RUNTIME

    assert RUNTIME.efficiency()["flops_source"] == "flop_counter:xla_trace"
    # One graph, as without counting; FlopCounterMode's decompositions would trace a second one for the counted
    # step (2 compilations on torch_xla 2.9's XLA:CPU).
    assert m.compilations == 1
