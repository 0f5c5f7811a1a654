"""out-of-memory: the finding is made before the error goes on, unchanged; its numbers against a hand computation.

The cuda, tpu and neuron errors are raised by the stand-ins (tests/backends/test_standins.py: the real backend
classes, tensors on the host) with their vendor's exception type and text (accelport.observe.memory.SIGNATURES
says where each comes from; TorchTPU's and the Neuron runtime's are partly established). The cpu one is real:
torch's CPU allocator refusing 4 PiB.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import accelport as ap
from accelport.diagnose.memory import USABLE, Budget, fixes
from accelport.eager import EagerBackend
from accelport.observe.memory import SIGNATURES, out_of_memory
from tests.backends.test_standins import CudaConstantsOnCpu, NeuronConstantsOnCpu, Runtime, TpuConstantsOnCpu, select
from tests.diagnose_cli.runs import run

REPO = str(Path(__file__).resolve().parents[2])
CUDA_TEXT = ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 64.00 MiB of which "
             "3.12 MiB is free. Of the allocated memory 60.20 MiB is allocated by PyTorch, and 1.02 MiB is reserved by "
             "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
             "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
             "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
# The hand computation: three Linear(1024, 1024) blocks trained by AdamW, batches of 64.
LAYER = (1024 * 1024 + 1024) * 4  # one block's parameters, bytes
PARAMS = 3 * LAYER
STATE = 2 * PARAMS + 6 * 4  # exp_avg and exp_avg_sq, and a float32 step counter per parameter tensor (6)
STATIC = PARAMS + PARAMS + STATE  # the gradients are there at the end of a step, before zero_grad
ACTIVATIONS = 32 << 20  # the step's peak less the static part, as the stand-in's allocator reports it
CAPACITY = 64 << 20  # what the error says the device has
BATCH = 64


class FailingAdamW(torch.optim.AdamW):
    """AdamW whose step ``fail_at`` raises CUDA's out-of-memory error (where a GPU's state allocation fails)."""

    def __init__(self, params: Any, fail_at: int) -> None:
        super().__init__(params, lr=1e-3)
        self.fail_at, self.calls, self.raised = fail_at, 0, None

    def step(self, closure: Any = None) -> Any:
        self.calls += 1
        if self.calls == self.fail_at:
            self.raised = torch.OutOfMemoryError(CUDA_TEXT)
            raise self.raised
        return super().step(closure)


def blocks() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                               torch.nn.ReLU(), torch.nn.Linear(1024, 1024))


def test_cuda_out_of_memory_is_explained_with_the_fixes_by_what_they_save(runtime: Runtime,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    select(CudaConstantsOnCpu())
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: STATIC)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: STATIC + ACTIVATIONS)
    model = blocks()
    opt = FailingAdamW(model.parameters(), fail_at=5)
    data = [torch.randn(BATCH, 1024) for _ in range(8)]
    with pytest.raises(torch.OutOfMemoryError) as raised:
        for x in ap.loader(data):
            model(x).pow(2).mean().backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
    assert raised.value is opt.raised and str(raised.value) == CUDA_TEXT  # unchanged
    assert ap.metrics().steps == 4
    [found] = [d for d in ap.diagnostics() if d.kind == "out-of-memory"]
    assert found.severity == "problem" and found.step == 5
    e = found.evidence
    assert (e["vendor"], e["error"]) == ("cuda", "torch.OutOfMemoryError")
    assert e["requested_bytes"] == 20 << 20 and e["capacity_bytes"] == CAPACITY
    assert (e["parameter_bytes"], e["gradient_bytes"], e["optimizer_state_bytes"]) == (PARAMS, PARAMS, STATE)
    assert e["activation_bytes"] == ACTIVATIONS and e["batch_size"] == BATCH and e["budget_step"] == 4

    # By hand, each fix's numbers (a device counts as holding USABLE of its memory).
    usable = int(CAPACITY * USABLE)
    shard_devices = next(n for n in (2, 4, 8, 16) if math.ceil(STATIC / n) + LAYER + ACTIVATIONS <= usable)
    assert shard_devices == 4
    shard_after = math.ceil(STATIC / 4) + LAYER  # the static part over 4, and the largest block gathered whole
    kept = math.ceil(ACTIVATIONS / 3)  # one of the 3 blocks' activations, held while backward recomputes it
    per_sample = ACTIVATIONS / BATCH
    fit = int((usable - STATIC) // per_sample)
    float32 = PARAMS + PARAMS + 2 * PARAMS  # parameters, gradients, exp_avg and exp_avg_sq (not the counters)
    expected = sorted([
        ("shard", STATIC - shard_after, {"devices": 4, "static_bytes_per_device": shard_after}),
        ("checkpoint", ACTIVATIONS - kept, {"activation_bytes": ACTIVATIONS, "blocks": 3}),
        ("batch", int((BATCH - fit) * per_sample), {"batch_size": fit, "accumulation_steps": math.ceil(BATCH / fit)}),
        ("bf16", float32 // 2, {"float32_bytes": float32}),
    ], key=lambda fix: -fix[1])
    assert [(f["fix"], f["saves_bytes"]) for f in e["fixes"]] == [(kind, saves) for kind, saves, _ in expected]
    for fix, (_, _, numbers) in zip(e["fixes"], expected, strict=True):
        assert {k: fix[k] for k in numbers} == numbers
    assert fit == 19  # (60.4 MB usable - 50.4 MB static) / 0.5 MiB per sample
    # What the message says, in that order.
    [site] = e["sites"]  # the line that raised it: FailingAdamW.step's raise, in this file
    assert site.startswith(f"{__file__}:")
    assert f"step 5 ran out of memory at {site} (torch.OutOfMemoryError, \"CUDA out of memory. Tried to allocate " \
           "20.00 MiB. GPU 0 has a total capacity of 64.00 MiB of which 3.12 MiB is free.\")" in found.message
    assert "The failing allocation asked for 20.0 MiB. At step 4, the last good one, the device held 12.0 MiB of " \
           "parameters, 12.0 MiB of gradients, 24.0 MiB of optimizer state and 32.0 MiB of activations" \
           in found.message
    # The fixes, in the ported loop's own terms.
    assert found.fix.startswith("Fixes, most saved first: 1) ap.shard(model) over 4 devices: ")
    assert found.fix.index("1) ap.shard(model)") < found.fix.index("2) bf16 weights") < \
        found.fix.index("3) a batch of 19 instead of 64") < found.fix.index("4) wrap each of the model's 3")
    assert "accumulating gradients over 4 micro-batches before ap.optimizer_step(opt)" in found.fix
    assert "rounds away" in found.fix  # bf16's precision caveat


@pytest.mark.parametrize(("backend", "module", "text", "requested"), [
    # TorchTPU 0.2.0's string (the rest of its message is not established: see SIGNATURES).
    (TpuConstantsOnCpu, "accelerator", "RESOURCE_EXHAUSTED: the TPU ran out of memory while awaiting the "
     "materialization of value 17", None),
    # The Neuron runtime's line (the exception torch-neuronx raises with it is not established).
    (NeuronConstantsOnCpu, "neuron", "ERROR  TDRV:log_dev_mem   Failed to allocate 4.000GB (alignment: none, "
     "usage: tensors) on ND 0:NC 4", 4 << 30),
], ids=["tpu", "neuron"])
def test_tpu_and_neuron_errors_at_a_sync_are_found_and_go_on_unchanged(
        runtime: Runtime, monkeypatch: pytest.MonkeyPatch, backend: type[EagerBackend], module: str, text: str,
        requested: int | None) -> None:
    chosen = select(backend())
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
    error = RuntimeError(text)

    def sync(*args: Any) -> None:
        raise error

    monkeypatch.setattr(getattr(torch, module), "synchronize", sync)
    with pytest.raises(RuntimeError) as raised:
        ap.sync()
    assert raised.value is error
    [found] = [d for d in ap.diagnostics() if d.kind == "out-of-memory"]
    assert found.evidence["vendor"] == chosen.name and found.evidence["requested_bytes"] == requested
    assert found.evidence["parameter_bytes"] == 9 * 4 and found.evidence["optimizer_state_bytes"] == 9 * 4
    assert found.step == 4


def test_another_error_is_no_finding(runtime: Runtime) -> None:
    select(CudaConstantsOnCpu())
    model = torch.nn.Linear(8, 1)

    class Broken(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 9x1)")

    opt = Broken(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        ap.optimizer_step(opt)
    assert ap.diagnostics() == []


@pytest.mark.parametrize(("exc", "vendor", "requested"), [
    (torch.OutOfMemoryError(CUDA_TEXT), "cuda", 20 << 20),
    (ValueError("XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 21.95G of 15.48G "
                "hbm. Exceeded hbm capacity by 6.47G."), "xla", int(21.95 * (1 << 30))),
    (RuntimeError("Bad StatusOr access: RESOURCE_EXHAUSTED: Attempting to reserve 10.51G at the bottom of memory. "
                  "That was not possible. There are 8.97G free, 0B reserved, and 8.97G reservable."), "xla",
     int(10.51 * (1 << 30))),
    (RuntimeError("Error preparing computation: Out of memory allocating 4503599761588224 bytes."), "xla",
     4503599761588224),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                  "tried to allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)"), "cpu", 1 << 40),
    (MemoryError(), "cpu", None),
])
def test_each_vendors_error_is_recognised_with_what_it_asked_for(exc: BaseException, vendor: str,
                                                                 requested: int | None) -> None:
    found = out_of_memory(exc)
    assert found is not None and (found.vendor, found.requested_bytes) == (vendor, requested)
    assert found.source in {s.source for s in SIGNATURES}


@pytest.mark.parametrize("exc", [
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    ValueError("Ran out of patience"),
    TypeError("RESOURCE_EXHAUSTED"),  # the right words in an exception type no runtime raises them with
])
def test_other_errors_are_not_out_of_memory(exc: BaseException) -> None:
    assert out_of_memory(exc) is None


def test_a_real_cpu_allocation_failure_in_the_scripts_own_code_is_explained_before_its_traceback() -> None:
    script = str(Path(__file__).with_name("oom_script.py"))
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600, cwd=REPO,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")},
                              "PYTHONPATH": REPO})
    assert out.returncode == 1
    finding = out.stderr.index(f"[out-of-memory] PROBLEM: step 4 ran out of memory at {script}:16 (RuntimeError, "
                               "\"[enforce fail")
    traceback = out.stderr.index("Traceback (most recent call last):")
    assert finding < traceback
    assert "The failing allocation asked for 4.0 PiB." in out.stderr
    assert "larger than the whole device" in out.stderr
    assert out.stderr.rstrip().splitlines()[-1].startswith("RuntimeError: [enforce fail at alloc_cpu.cpp")
    assert "scratch = torch.empty(1 << 50)" in out.stderr[traceback:]


def test_accelport_diagnose_keeps_the_scripts_status_and_traceback(tmp_path: Path) -> None:
    script = str(Path(REPO) / "tests" / "diagnose_cli" / "scripts" / "cpu_oom.py")
    plain = run(script, diagnose=False)
    output = tmp_path / "findings.json"
    watched = run("--output", str(output), script)
    assert plain.returncode == watched.returncode == 1
    traceback = plain.stderr[plain.stderr.index("Traceback"):]
    assert traceback in watched.stderr  # the script's own traceback, as python printed it
    assert "[FAIL] out-of-memory at step 5: step 5 ran out of memory at" in watched.stderr
    result = json.loads(output.read_text())
    assert result["exit_status"] == 1 and result["steps"] == 4
    [found] = [f for f in result["findings"] if f["kind"] == "out-of-memory"]
    assert found["severity"] == "problem" and found["evidence"]["requested_bytes"] == 20 << 20
    assert found["evidence"]["sites"] == [f"{script}:14"]  # the script's line that raised it
    assert found["message"].startswith(f"step 5 ran out of memory at {script}:14 (torch.OutOfMemoryError")
    assert found["fix"].startswith("Checkpoint the model's blocks")  # the activations filled it: not measured here
    params = (64 * 256 + 256 + 256 * 8 + 8) * 4
    assert (found["evidence"]["parameter_bytes"], found["evidence"]["optimizer_state_bytes"]) == \
        (params, 2 * params + 4 * 4)
    assert found["evidence"]["capacity_bytes"] == int(15.77 * (1 << 30))


@pytest.mark.parametrize(("style", "shard", "accumulate"), [
    ("accelport", "ap.shard(model) over 4 devices:", "before ap.optimizer_step(opt)"),
    ("torch", "ap.shard(model) over 4 devices (the portable call", "before optimizer.step()"),
    ("torch_xla", "ap.shard(model) over 4 devices (the portable call", "before xm.optimizer_step(opt)"),
    ("transformers", "FSDP over 4 devices (TrainingArguments(fsdp=\"full_shard\"))",
     "TrainingArguments(gradient_accumulation_steps=4)"),
    ("lightning", "FSDP over 4 devices (Trainer(strategy=\"fsdp\", devices=4))", "Trainer(accumulate_grad_batches=4)"),
])
def test_the_fixes_are_spelled_as_the_script_trains(style: str, shard: str, accumulate: str) -> None:
    # The cuda case above, by hand: 48 MiB static (12 + 12 + 24), 32 MiB of activations for 64 samples, 64 MiB.
    budget = Budget(12 << 20, 12 << 20, 24 << 20, ACTIVATIONS, CAPACITY, BATCH, 48 << 20, 3, 4 << 20)
    by_kind = {fix.kind: fix for fix in fixes(budget, style)}
    assert shard in by_kind["shard"].text and by_kind["shard"].numbers["devices"] == 4
    assert accumulate in by_kind["batch"].text and by_kind["batch"].numbers["batch_size"] == 19
    # The numbers do not depend on the spelling.
    assert [(f.kind, f.saves_bytes) for f in fixes(budget, style)] == \
        [(f.kind, f.saves_bytes) for f in fixes(budget)]
