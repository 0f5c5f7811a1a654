"""Shared fixtures: every test starts from a fresh accelport runtime and a clean environment."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

import accelport
from accelport import _packages
from accelport.runtime.state import RUNTIME

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the mark must be there by then
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test parametrised on a lazy (torch_xla) backend runs in the xla environment: mark it ``xla``."""
    lazy: dict[str, bool] | None = None
    for item in items:
        name = getattr(getattr(item, "callspec", None), "params", {}).get("ap_backend")
        if name is None:
            continue
        if lazy is None:
            from accelport.plugins.host import create_manager

            lazy = {n: b.lazy for n, b in create_manager().backends.items()}
        if lazy.get(name):
            item.add_marker(pytest.mark.xla)


@pytest.fixture(autouse=True)
def fresh_runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key in list(os.environ):
        if key.startswith("ACCELPORT_"):
            monkeypatch.delenv(key)
    RUNTIME.reset()
    _packages.cache_clear()
    yield
    RUNTIME.reset()
    _packages.cache_clear()


@pytest.fixture
def install_plugin(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    """Install a real (temporary) distribution whose ``accelport`` entry point is ``module_name``.

    It is found by importlib.metadata exactly as a pip-installed plugin would be.
    ``source=None`` installs the entry point without the module (an import failure).
    """

    def install(name: str, module_name: str, source: str | None, dist: str = "fake-plugin") -> None:
        site = tmp_path / f"site-{dist}-{module_name}"
        info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[accelport]\n{name} = {module_name}\n")
        if source is not None:
            (site / f"{module_name}.py").write_text(source)
        monkeypatch.syspath_prepend(str(site))
        monkeypatch.delitem(sys.modules, module_name, raising=False)
        RUNTIME.reset()

    return install


def builtin_backends() -> list[str]:
    """Names of the backends the built-in plugins register, in registration order."""
    from accelport.plugins.host import create_manager

    return list(create_manager({"ACCELPORT_DISABLE_PLUGIN_AUTOLOAD": "1"}).backends)


def train_tiny(steps: int = 30, seed: int = 0) -> list[float]:
    """Train a tiny regression model through the public API; return the losses."""
    import torch

    torch.manual_seed(seed)
    dev = accelport.device()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    w = torch.randn(8, 1)
    data = []
    for _ in range(steps):
        x = torch.randn(16, 8)
        data.append((x, x @ w))
    losses = []
    for x, y in accelport.loader(data):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        accelport.optimizer_step(opt)
        opt.zero_grad()
        losses.append(float(loss.detach().to("cpu")))
    return losses
