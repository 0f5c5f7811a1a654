"""host-sync on the eager accelerators (cuda, tpu, neuron), through the constants-swapped stand-ins.

There is no GPU, TPU or Trainium here: each backend's own code runs with its tensors
on the host (tests/backends/test_standins.py), so its tensors' device type is "cpu"
and the reads counted are those of "cpu" tensors, exactly as they would be of
"cuda" ones. On the real cpu backend the host is the device: nothing is counted.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo

import accelport as ap
from accelport.eager import EagerBackend
from accelport.observe import tracer
from tests.backends.test_standins import select

HERE = os.path.abspath(__file__)


def train(steps: int, inside: Callable[[Any], None] | None = None) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1).to(ap.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(steps)]
    # prefetch=0: batches come straight from the list, so the data wait stays far below the
    # input-bound threshold even when a busy machine is slow to schedule a prefetch thread.
    for x, y in ap.loader(data, prefetch=0):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if inside is not None:
            inside(loss)
        ap.optimizer_step(opt)
        opt.zero_grad()


def test_item_in_every_step_is_a_host_sync_on_an_accelerator(standin: EagerBackend) -> None:
    with pytest.warns(ap.DiagnosticWarning, match=r"\[host-sync\] 1\.0 device-to-host transfers per step"):
        train(20, inside=lambda loss: loss.item())
    assert [d.kind for d in ap.diagnostics()] == ["host-sync"]
    (found,) = ap.diagnostics()
    assert "makes the host wait there until the device has run everything queued" in found.text
    assert "ap.after_step(fn, loss)" in found.text and "cuts the graph" not in found.text
    assert ap.metrics().device_to_host == 20  # counted, where the backend itself has no counter


def test_trace_mode_names_the_line(standin: EagerBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELPORT_DIAGNOSTICS", "trace")
    from accelport.runtime.state import RUNTIME

    RUNTIME.reset()
    select(type(standin)())

    def read(loss: Any) -> None:
        print(loss, end="\r")  # one read per print, however many elements torch formats

    with pytest.warns(ap.DiagnosticWarning, match="host-sync"):
        train(20, inside=read)
    (found,) = ap.diagnostics()
    line = read.__code__.co_firstlineno + 1
    assert found.evidence["sites"] == [f"{HERE}:{line}"] and f"It happens at {HERE}:{line}" in found.text
    assert found.evidence["transfers_per_step"] == 1.0


def test_logging_through_after_step_or_now_and_then_is_silent(standin: EagerBackend) -> None:
    logged: list[float] = []
    every: list[int] = []

    def log(loss: Any) -> None:
        ap.after_step(logged.append, loss)
        every.append(1)
        if len(every) % 10 == 0:
            float(loss)  # a read every tenth step is fine

    with warnings.catch_warnings():
        warnings.simplefilter("error", ap.DiagnosticWarning)
        train(30, inside=log)
    assert ap.diagnostics() == [] and len(logged) == 30
    assert ap.metrics().device_to_host == 3  # ap.after_step's own reads are not counted


def test_on_cpu_nothing_is_counted() -> None:
    ap.use("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ap.DiagnosticWarning)
        train(20, inside=lambda loss: loss.item())
    assert ap.diagnostics() == [] and ap.metrics().device_to_host is None


def test_counting_never_breaks_a_compiled_graph(standin: EagerBackend) -> None:
    # The counting wrappers on torch.Tensor are taken off while dynamo compiles; the eager
    # part after a graph break runs them without dynamo compiling them.
    import torch._dynamo.utils as du

    torch._dynamo.reset()
    assert "cpu" in tracer._counts  # counting, on the stand-in's device type

    def step(x: torch.Tensor) -> torch.Tensor:
        y = x.to(torch.float64) * 2
        return y.cpu() + 1

    def breaks(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        if y.sum().item() > 0:
            y = y + 1
        return y.to(torch.float32)

    f, g = torch.compile(step, backend="eager"), torch.compile(breaks, backend="eager")
    before, earlier = tracer.reads("cpu"), du.get_compilation_metrics()  # (a ring of 64: kept by identity)
    for _ in range(3):
        f(torch.randn(4))
        g(torch.randn(4))
    compiled = [m for m in du.get_compilation_metrics() if not any(m is e for e in earlier)]
    assert [m.co_name for m in compiled].count("step") == 1  # one graph, no break
    sites = {(frame.filename, frame.name) for b in du.graph_break_reasons for frame in b.user_stack}
    assert sites == {(HERE, "breaks")}  # only the user's .item(), never a wrapper
    assert tracer.reads("cpu") - before >= 3  # and the eager part's .item() was counted
    torch._dynamo.reset()
