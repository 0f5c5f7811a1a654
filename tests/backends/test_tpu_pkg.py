"""Our assumptions about TorchTPU, checked against the real torch-tpu package (no TPU needed).

These run in the ``tpu`` test environment (torch 2.13 + torch-tpu + libtpu from the
registry). Every check that imports torch runs in a subprocess with a timeout:
with torch-tpu installed, ``import torch`` autoloads TorchTPU, and TorchTPU's
runtime hangs or aborts on a machine without a TPU if anything initialises it.
Nothing here does: the TPU runtime starts only when a tensor reaches a ``tpu``
device, and no TPU device is registered on a machine without TPU chips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.tpu_pkg

TIMEOUT = 300  # seconds: importing torch with TorchTPU takes several seconds on a busy 2-core machine


def run_python(code: str, *, autoload: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ACCELPORT_", "TPU_", "PJRT_")) and k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    if not autoload:
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=TIMEOUT)
    assert out.returncode == 0, f"exit {out.returncode}\nstdout: {out.stdout[-2000:]}\nstderr: {out.stderr[-2000:]}"
    return out


def last_json(out: subprocess.CompletedProcess[str]) -> dict:  # type: ignore[type-arg]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_torch_tpu_is_installed_here() -> None:
    import importlib.metadata as md

    assert md.version("torch-tpu") and md.version("libtpu"), "run these tests in the tpu environment (nox -s tpu)"


def test_backends_finds_torch_tpu_by_metadata_without_importing_it() -> None:
    out = run_python(
        "import contextlib, io, json, sys\n"
        "from accelport.cli import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    code = main(['backends', '--json'])\n"
        "from accelport import _packages\n"
        "from accelport._backends.tpu import probe_tpu\n"
        "probe = probe_tpu()\n"
        "print(json.dumps({'code': code, 'cli': json.loads(buf.getvalue()),\n"
        "    'loaded': sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'torch_tpu', 'libtpu'}),\n"
        "    'entry_points': _packages.entry_point_names('torch.backends'), 'details': dict(probe.details)}))\n"
    )
    data = last_json(out)
    assert data["code"] == 0 and data["loaded"] == []  # neither torch nor torch_tpu nor libtpu was imported
    assert "torch_tpu" in data["entry_points"]  # the autoload entry point, seen through metadata
    tpu = {b["name"]: b for b in data["cli"]["backends"]}["tpu"]
    assert not tpu["available"]
    assert tpu["reason"].startswith("no TPU chips found")
    assert "not installed" not in tpu["reason"] and "libtpu" not in tpu["reason"]  # the packages pair up
    assert data["cli"]["selected"]["name"] == "cpu"
    details = data["details"]
    assert details["torch range"] == ">=2.11.0,<=2.15.0"  # torch-tpu 0.2.0's own Requires-Dist
    assert details["libtpu range"] == ">=0.0.50"
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in details["autoload"]


def test_import_torch_still_works_and_autoloads_torch_tpu() -> None:
    data = last_json(run_python(
        "import json, sys, torch\n"
        "print(json.dumps({'torch': torch.__version__, 'torch_tpu': 'torch_tpu' in sys.modules,\n"
        "    'available': torch.accelerator.is_available(), 'count': torch.accelerator.device_count()}))\n"
    ))
    assert data["torch"].startswith("2.") and data["torch_tpu"] is True
    assert data["available"] is False and data["count"] == 0  # no TPU: nothing registered, nothing started


def test_autoload_switched_off_keeps_torch_tpu_out_of_import_torch() -> None:
    data = last_json(run_python(
        "import json, sys, torch\nprint(json.dumps({'torch_tpu': 'torch_tpu' in sys.modules}))\n",
        autoload=False))
    assert data["torch_tpu"] is False


def test_tpu_is_among_torch_compile_backends() -> None:
    data = last_json(run_python(
        "import json, torch, torch._dynamo\nprint(json.dumps(torch._dynamo.list_backends()))\n"))
    assert "tpu" in data


def test_asking_for_the_tpu_backend_gives_the_probe_reason_and_imports_nothing() -> None:
    data = last_json(run_python(
        "import json, sys\nimport accelport as ap\n"
        "try:\n    ap.use('tpu')\n    err = None\n"
        "except ap.BackendUnavailableError as exc:\n    err = exc.reason\n"
        "print(json.dumps({'reason': err, 'torch': 'torch' in sys.modules}))\n"))
    assert data["reason"] and data["reason"].startswith("no TPU chips found")
    assert data["torch"] is False


def test_the_portable_loop_trains_on_cpu_with_torch_tpu_installed() -> None:
    # Without TPU_SKIP_MDS_QUERY=1 the first backward() here would start libtpu (autograd asks
    # TorchTPU for its device count) and wait minutes for the GCE metadata server; accelport sets
    # it when its plugins load, before any backward.
    data = last_json(run_python(
        "import json, os, sys, torch\nimport accelport as ap\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Linear(4, 1).to(ap.device())\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "w = torch.randn(4, 1)\n"
        "data = [(x, x @ w) for x in (torch.randn(16, 4) for _ in range(60))]\n"
        "losses = []\n"
        "for x, y in ap.loader(data):\n"
        "    loss = torch.nn.functional.mse_loss(model(x), y)\n"
        "    loss.backward()\n"
        "    ap.optimizer_step(opt)\n"
        "    opt.zero_grad()\n"
        "    losses.append(loss.item())\n"
        "print(json.dumps({'backend': ap.backend().name, 'first': losses[0], 'last': losses[-1],\n"
        "    'torch_tpu': 'torch_tpu' in sys.modules, 'skip': os.environ.get('TPU_SKIP_MDS_QUERY')}))\n"))
    assert data["backend"] == "cpu" and data["torch_tpu"] is True and data["skip"] == "1"
    assert data["last"] < 0.1 * data["first"]
