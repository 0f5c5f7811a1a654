"""Memory on real loops (cpu): the static budget counted exactly from the tensors, per step in the records and
the metrics file, and memory-growth on a loop that keeps its losses with their autograd graphs, while the
healthy loops (floats kept, detached losses, a one-time allocation) stay silent.

The growth loops (memory_loops.py) keep megabytes per step (a 4 MiB activation in each kept graph), so that
the process's resident memory, which the rest of a busy machine cannot change, grows far past its noise;
each runs in a process of its own, where no memory an earlier test freed is reused first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import accelport as ap
from accelport.diagnose.report import render_html
from accelport.observe.memory import parse_size
from tests.diagnose_cli.runs import allocator_free

REPO = str(Path(__file__).resolve().parents[2])


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def mlp(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(dtype)


def step_once(model: torch.nn.Module, opt: torch.optim.Optimizer, dtype: torch.dtype = torch.float32) -> None:
    x, y = torch.randn(8, 32, dtype=dtype), torch.randn(8, 4, dtype=dtype)
    torch.nn.functional.mse_loss(model(x), y).backward()
    ap.optimizer_step(opt)


# -- the static budget, exact -------------------------------------------------------------------------------


def test_adamw_on_fp32_parameters_holds_gradients_as_large_and_twice_their_size_in_state() -> None:
    ap.use("cpu")
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step_once(model, opt)
    m = ap.metrics()
    params = (32 * 64 + 64 + 64 * 4 + 4) * 4  # 9232 bytes, by hand
    assert m.parameter_bytes == params == nbytes(model.parameters())
    assert m.gradient_bytes == params  # one gradient per parameter, same dtype
    # exp_avg and exp_avg_sq per parameter, and a float32 step counter (4 bytes) for each of the 4 tensors.
    assert m.optimizer_state_bytes == 2 * params + 4 * 4
    opt.zero_grad()  # set_to_none: the gradients are gone now, but the step's budget holds them
    assert ap.metrics().gradient_bytes == params


def test_sgd_with_momentum_keeps_one_buffer_per_parameter() -> None:
    ap.use("cpu")
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step_once(model, opt)
    params = (32 * 64 + 64 + 64 * 4 + 4) * 4
    m = ap.metrics()
    assert (m.parameter_bytes, m.gradient_bytes, m.optimizer_state_bytes) == (params, params, params)


def test_bf16_parameters_count_two_bytes_each() -> None:
    ap.use("cpu")
    model = mlp(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step_once(model, opt, torch.bfloat16)
    elements = 32 * 64 + 64 + 64 * 4 + 4
    m = ap.metrics()
    assert (m.parameter_bytes, m.gradient_bytes, m.optimizer_state_bytes) == (2 * elements,) * 3


def test_every_read_record_carries_the_memory_and_the_metrics_file_writes_it(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run.jsonl"
    monkeypatch.setenv("ACCELPORT_METRICS_FILE", str(path))
    ap.use("cpu")
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [(torch.randn(8, 32), torch.randn(8, 4)) for _ in range(12)]
    for x, y in ap.loader(data):
        torch.nn.functional.mse_loss(model(x), y).backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 12
    params = (32 * 64 + 64 + 64 * 4 + 4) * 4
    for line in lines:  # the first 40 steps are all read
        memory = line["memory"]
        assert memory["resident"] == 1 and memory["memory_bytes"] > 10 << 20  # this process: torch is loaded
        assert memory["capacity_bytes"] >= memory["memory_bytes"]
        assert memory["parameter_bytes"] == params and memory["gradient_bytes"] == params
        assert memory["optimizer_state_bytes"] == 2 * params + 16
    page = render_html(lines, [])
    assert "Memory, per step" in page and "parameters, gradients and optimizer state" in page


def test_parse_size_reads_the_runtimes_sizes() -> None:
    assert parse_size("3.15 GiB") == int(3.15 * (1 << 30))
    assert parse_size("180.59M") == int(180.59 * (1 << 20))
    assert parse_size("4.000GB") == 4 << 30
    assert parse_size("6400000000") == 6400000000
    assert parse_size("512 bytes") == 512
    assert parse_size("a lot") is None


# -- memory-growth ---------------------------------------------------------------------------------------------


#: glibc serves a 4 MiB buffer from its heap once one of that size was freed (its mmap threshold rises), and a
#: small tensor kept between two such buffers (a detached loss) then stops the heap from shrinking: the
#: process's memory really grows by megabytes a step (measured: 1 GB after 300 steps of the "detach" loop,
#: flat with a fixed threshold). The loops run with a fixed threshold and no other allocator setting the test
#: run inherited (another glibc tunable, a preloaded allocator), so what they keep decides alone.
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": "1048576"}


def run_loop(loop: str) -> list[dict[str, Any]]:
    """The diagnoses of one of memory_loops.py's loops, run in a process of its own."""
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("memory_loops.py")), loop],
                         capture_output=True, text=True, timeout=600, cwd=REPO,
                         env={**allocator_free(os.environ), "PYTHONPATH": REPO, **FIXED_MMAP})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["steps"] == 60
    return result["diagnoses"]


def test_losses_kept_with_their_graph_grow_memory_and_the_list_is_named() -> None:
    [found] = run_loop("list")
    assert found["kind"] == "memory-growth" and found["step"] <= 60
    assert found["evidence"]["growth_bytes_per_step"] >= 3 << 20  # 4 MiB a step and more, whatever else runs
    [kept] = [k for k in found["evidence"]["kept"] if k["name"] == "losses"]
    assert kept["kind"] == "container" and kept["after"] > kept["before"]
    assert kept["where"] == "memory_loops.py, main()"
    assert "losses (memory_loops.py, main()) holds" in found["message"]
    assert "loss.item()" in found["fix"] and "ap.after_step" in found["fix"]  # a ported loop's spelling


@pytest.mark.parametrize("loop", ["sum", "sum-in-place"])
def test_a_running_sum_of_losses_is_named_as_a_graph_that_grows(loop: str) -> None:
    [found] = run_loop(loop)
    assert found["kind"] == "memory-growth"
    [kept] = [k for k in found["evidence"]["kept"] if k["name"] == "total"]
    assert kept["kind"] == "graph" and kept["after"] > kept["before"]
    assert "total (memory_loops.py, main()) is a tensor whose autograd graph grew" in found["message"]
    assert "a running sum" in found["message"] and "total += loss.item()" in found["fix"]


@pytest.mark.parametrize("loop", ["item", "detach", "once-at-5", "once-at-20", "healthy"])
def test_floats_detached_losses_a_one_time_allocation_and_a_healthy_loop_stay_silent(loop: str) -> None:
    assert run_loop(loop) == []
