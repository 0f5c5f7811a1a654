"""Memory on XLA:CPU: what torch_xla 2.9's get_memory_info does here (it raises), what accelport reads instead
(the process's resident memory: XLA:CPU's buffers are host memory), and a real out-of-memory error of XLA:CPU
explained at the sync that raises it. Runs in the xla environment: ``PJRT_DEVICE=CPU pytest -m xla``.
"""

from __future__ import annotations

import pytest

import accelport as ap
from accelport.diagnose.memory import EstimateError

pytestmark = pytest.mark.xla


def test_get_memory_info_raises_unimplemented_on_xla_cpu_and_the_process_memory_is_read_instead() -> None:
    import torch
    import torch_xla.core.xla_model as xm

    backend = ap.use("xla")
    device = ap.device()
    with pytest.raises(RuntimeError, match="UNIMPLEMENTED: GetAllocatorStats is not supported"):
        xm.get_memory_info(device)  # as torch_xla 2.9 does on XLA:CPU: no allocator statistics
    reading = backend.memory_reading()
    assert reading["resident"] == 1 and reading["memory_bytes"] > 100 << 20  # torch and torch_xla are loaded
    assert reading["capacity_bytes"] >= reading["memory_bytes"]
    model = torch.nn.Linear(16, 4).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(8, 16, device=device)).sum().backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
    m = ap.metrics()
    assert m.memory_bytes and m.memory_bytes > 100 << 20
    params = (16 * 4 + 4) * 4
    assert (m.parameter_bytes, m.optimizer_state_bytes) == (params, 2 * params + 2 * 4)
    assert m.activation_bytes is None  # no device peak on XLA:CPU, only the process's


def test_an_xla_cpu_out_of_memory_error_at_the_sync_is_explained_and_goes_on_unchanged() -> None:
    import torch

    ap.use("xla")
    device = ap.device()
    model = torch.nn.Linear(16, 4).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(8, 16, device=device)).sum().backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
    # torch_xla 2.9's own case (test/test_ops_error_message.py): 4 PiB, refused while preparing the graph. The
    # sync that runs it returns (execution is asynchronous); the error comes where its value is read: here in
    # the read ap.after_step makes right after the sync.
    huge = torch.rand(1024, 1024, 1024, 1024, 1024, device=device).sum()
    ap.after_step(lambda value: None, huge)
    with pytest.raises(RuntimeError) as raised:
        ap.sync()
    assert "Out of memory allocating" in str(raised.value)
    [found] = [d for d in ap.diagnostics() if d.kind == "out-of-memory"]
    assert found.evidence["vendor"] == "xla" and found.evidence["requested_bytes"] >= 1 << 50
    assert "larger than the whole device" in found.message
    assert found.evidence["parameter_bytes"] == (16 * 4 + 4) * 4
    del huge


def test_memory_estimate_refuses_a_model_on_the_xla_device() -> None:
    import torch

    ap.use("xla")
    model = torch.nn.Linear(16, 4).to(ap.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(EstimateError, match="the model's tensors are on xla: pass the model as built on the cpu"):
        ap.memory_estimate(model, opt, torch.randn(8, 16))
