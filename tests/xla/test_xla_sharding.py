"""``ap.shard`` on XLA:CPU: torch_xla's SPMD FSDP over 4 host devices, for real (tests/scripts/xla_shard.py).

SPMD and the device count are fixed when torch_xla's runtime starts, so each
sharded run is a fresh process with ``CPU_NUM_DEVICES=4``; what runs in this
process has one XLA device.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import accelport as ap
from tests.conftest import REPO

pytestmark = pytest.mark.xla

SCRIPT = Path(REPO) / "tests" / "scripts" / "xla_shard.py"


def run(tmp_path: Path, mode: str, **env: str) -> dict[str, Any]:
    import torch

    environ = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELPORT_", "XLA_"))}
    environ.update({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", **env})
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), mode], capture_output=True, text=True,
                          env=environ, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(tmp_path / "result.pt", weights_only=False)  # type: ignore[no-any-return]


def eager_losses() -> list[float]:
    """The same model and batches, eagerly on the host."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("xla_shard", SCRIPT)
    job = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(job)  # type: ignore[union-attr]
    model = job.make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in job.batches():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mode", ["device", "host"])
def test_spmd_fsdp_over_four_host_devices_trains_like_eager(tmp_path: Path, mode: str) -> None:
    import torch

    # "device": the model on ap.device() first, with ACCELPORT_SPMD=1; "host": ap.shard places it.
    got = run(tmp_path, mode, **({"ACCELPORT_SPMD": "1"} if mode == "device" else {}))
    assert got["wrapper"] == "SpmdFullyShardedDataParallel"
    # Every parameter split four ways along one dimension (the input batch too).
    assert set(got["specs"].values()) <= {"{devices=[4,1]0,1,2,3}", "{devices=[1,4]0,1,2,3}", "{devices=[4]0,1,2,3}"}
    assert got["input_spec"] == "{devices=[4,1]0,1,2,3}"
    torch.testing.assert_close(got["losses"], eager_losses(), rtol=1e-4, atol=1e-5)
    assert got["parameter_bytes"] == got["full_parameter_bytes"] // 4
    assert got["optimizer_state_bytes"] == got["full_parameter_bytes"] // 4  # SGD momentum: one buffer each
    # The checkpoint is one file with the model's own names, which the eager model loads.
    assert got["saved_keys"] == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]
    assert got["plain"] == {"step": 4} and got["reloaded_equal"] and got["portable"]
    assert got["errors"]["twice"].startswith("ShardingError: ap.shard: this SpmdFullyShardedDataParallel is "
                                             "already sharded")
    assert "torch_xla's SPMD FSDP has no mixed-precision policy" in got["errors"]["bf16"]


def test_a_model_on_the_device_before_spmd_is_refused_with_what_to_do(tmp_path: Path) -> None:
    got = run(tmp_path, "late")
    assert got["late"].startswith("ShardingError: ap.shard on 'xla': tensors are already on the XLA device")
    assert "ACCELPORT_SPMD=1" in got["late"]


def test_one_xla_device_leaves_the_model_unchanged() -> None:
    import torch

    ap.use("xla")
    model = torch.nn.Linear(4, 4)
    assert ap.shard(model) is model
    assert ap.metrics().parameter_bytes == 4 * 4 * 4 + 4 * 4


def test_a_model_on_another_device_than_the_backends_is_refused() -> None:
    import torch

    ap.use("xla")
    on_xla = torch.nn.Linear(4, 4).to(ap.device())
    ap.use("cpu")
    with pytest.raises(ap.ShardingError, match=r"tensors are on xla, but backend 'cpu' shards on cpu devices: "
                                               r"move it there first with model.to\(ap.device\(\)\)"):
        ap.shard(on_xla)
