"""MFU with a chip's peak from the compatibility matrix, and the causes of a low one, each on a model built to have
it and silent on one without.

There is no TPU, Trainium or NVIDIA GPU here: the stand-ins (tests/backends/test_standins.py) are the real backend
classes with their tensors on the host CPU, on a fake TPU VM, Trainium or NVIDIA host (tests/fakes.py) read through
ACCELPORT_SYSROOT, so the chip is detected as on the hardware.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import accelport as ap
from accelport.compat.load import build
from accelport.observe.flops import FlopWatch, efficiency
from accelport.runtime.state import RUNTIME
from tests import fakes
from tests.backends.test_standins import STANDINS, Runtime, select

V5E = build(environ={}).peak_for("v5e")


def train(model: torch.nn.Module, batches: list[Any], dtype: torch.dtype = torch.float32) -> None:
    model = model.to(ap.device(), dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for x in ap.loader(batches):
        x = x["input"] if isinstance(x, dict) else x
        model(x if x.dtype == dtype else x.to(dtype)).float().pow(2).mean().backward()
        ap.optimizer_step(opt)
        opt.zero_grad()


def mlp(hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 256))


@pytest.mark.parametrize(("standin", "host", "chip", "peak", "per_chip"), [
    ("tpu", lambda root: fakes.tpu_vm(root, "v5e", chips=4), "TPU v5e", 197e12, 1),
    # Torch sees four devices (logical NeuronCores) per Trainium2 chip: each has a quarter of its peak; float32
    # has a peak of its own there.
    ("neuron", lambda root: fakes.neuron_host(root, 16, "trn2.48xlarge"), "Trainium2", 181e12, 4),
    ("cuda", lambda root: fakes.nvidia_host(root, 8, "NVIDIA H100 80GB HBM3"), "NVIDIA H100 SXM", 67e12, 1),
])
def test_mfu_is_the_achieved_flops_over_the_chips_peak(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                       standin: str, host: Any, chip: str, peak: float,
                                                       per_chip: int) -> None:
    monkeypatch.setattr(torch, "neuron", None, raising=False)
    Runtime(monkeypatch)  # the device runtimes' functions recorded, not called
    monkeypatch.setenv("ACCELPORT_SYSROOT", str(host(tmp_path / "host")))
    select(STANDINS[standin]())
    train(mlp(256), [torch.randn(256, 256) for _ in range(8)])
    eff = RUNTIME.efficiency()
    m = ap.metrics()
    assert eff["chip"] == chip and eff["peak_flops"] == peak / per_chip
    assert eff["flops_source"] == "flop_counter" and eff["flops_per_step"] == m.flops_per_step > 0
    assert m.achieved_flops is not None and m.mfu == pytest.approx(m.achieved_flops / (peak / per_chip))
    assert eff["peak_dtype"] == ("bf16" if standin == "tpu" else "fp32")  # (v5e has no float32 peak)
    assert sorted(eff) == sorted(["flops_per_step", "achieved_flops", "mfu", "peak_flops", "peak_dtype", "chip",
                                  "flops_source", "causes"])


def test_a_device_bound_verdict_says_the_mfu_and_its_causes(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    monkeypatch.setattr(torch, "neuron", None, raising=False)
    Runtime(monkeypatch)
    monkeypatch.setenv("ACCELPORT_SYSROOT", str(fakes.tpu_vm(tmp_path / "host", "v5e")))
    select(STANDINS["tpu"]())
    train(mlp(200), [torch.randn(64, 256) for _ in range(12)])
    eff = RUNTIME.efficiency()
    verdict, fix = ap.metrics().time_verdict, ap.metrics().time_fix
    assert {c["kind"] for c in eff["causes"]} == {"float32", "tile", "small-batch"}
    if verdict.startswith("device-bound"):  # (on a busy machine the host's share may lead: then no MFU line)
        assert "of the TPU v5e's bf16 peak" in verdict
        assert "float32" in fix and "200 (-> 256)" in fix and "64 rows" in fix


def count(model: torch.nn.Module, x: torch.Tensor, batch: Any = None) -> Any:
    """One step of ``model`` on ``x`` counted as the tracker counts it."""
    watch = FlopWatch(lazy=False)
    watch.batch(("s",), batch)
    model(x).float().pow(2).mean().backward()
    watch.step_end(("s",))
    return watch.summary()


def kinds(model: torch.nn.Module, x: torch.Tensor, batch: Any = None) -> set[str]:
    found = efficiency(count(model, x, batch), 1e-3, V5E)
    return {c["kind"] for c in found["causes"]}


def healthy(hidden: int = 256) -> torch.nn.Module:
    return mlp(hidden).to(torch.bfloat16)


def test_a_model_without_a_cause_is_silent() -> None:
    x = torch.randn(256, 256, dtype=torch.bfloat16)
    mask = {"attention_mask": torch.ones(16, 16, dtype=torch.long)}
    assert kinds(healthy(), x, mask) == set()


def test_float32_matmuls_on_a_bf16_chip() -> None:
    found = efficiency(count(mlp(256), torch.randn(256, 256)), 1e-3, V5E)
    [cause] = found["causes"]
    assert cause["kind"] == "float32" and cause["share"] == 1.0
    assert "197 TFLOP/s" in cause["text"] and "ap.autocast(torch.bfloat16)" in cause["fix"]
    assert found["peak_dtype"] == "bf16"  # (v5e publishes no float32 peak: the MFU is against bf16's)


def test_dimensions_off_the_tile() -> None:
    found = efficiency(count(healthy(200), torch.randn(256, 256, dtype=torch.bfloat16)), 1e-3, V5E)
    [cause] = found["causes"]
    assert cause["kind"] == "tile" and cause["dims"] == [200] and cause["tile"] == 128
    assert cause["share"] == pytest.approx(1 - 200 / 256)  # each matmul pads 200 to 256 on one side
    assert "200 (-> 256)" in cause["fix"]


def test_padding_the_attention_mask_shows() -> None:
    mask = torch.ones(16, 16, dtype=torch.long)
    mask[:, 6:] = 0  # 10 of 16 positions are padding
    assert kinds(healthy(), torch.randn(256, 256, dtype=torch.bfloat16), {"attention_mask": mask}) == {"padding"}


def test_padding_of_batches_ap_data_built_shows_through_their_mask() -> None:
    collate = ap.data.BucketCollate(buckets=(16,), mask="attention_mask")
    batch = collate([{"input": torch.ones(6)} for _ in range(16)])  # 10 of 16 positions padding, as above
    found = efficiency(count(healthy(), torch.randn(256, 256, dtype=torch.bfloat16), batch), 1e-3, V5E)
    [cause] = found["causes"]
    assert cause["kind"] == "padding" and cause["share"] == pytest.approx(10 / 16)


def test_a_batch_too_small_to_fill_the_chip() -> None:
    found = efficiency(count(healthy(), torch.randn(32, 256, dtype=torch.bfloat16)), 1e-3, V5E)
    [cause] = found["causes"]
    assert cause["kind"] == "small-batch" and cause["rows"] == 32 and "at least 128 rows" in cause["fix"]
