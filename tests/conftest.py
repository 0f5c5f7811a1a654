"""Shared fixtures: every test starts from a fresh accelport runtime and a clean environment.

The suite's verdicts must not depend on where it was started from: a cluster job's
launcher variables (``WORLD_SIZE``, torchrun's ``PET_*`` defaults), accelport's own
settings, or stop signals the run inherited ignored or blocked (``nohup``, ``make test &``
in a script, some CI runners). The environment is scrubbed once, before anything runs,
and child processes start with their stop signals at the default action.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import pytest

import accelport
from accelport import _packages
from accelport.runtime.state import RUNTIME

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: What a process of a distributed launch inherits (torchrun's, a cluster's job): in the suite's own
#: environment it would make every in-process backend join a process group, or change torchrun's defaults
#: (``PET_<OPTION>``: ``PET_REDIRECTS=3`` hides every worker's output) and its shutdown timeout.
_LAUNCH_VARIABLES = frozenset({"WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                               "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                               "MASTER_PORT"})
_LAUNCH_PREFIXES = ("ACCELPORT_", "TORCHELASTIC_", "TORCH_ELASTIC_", "PET_")
#: The signals that stop a process, which a test's child must answer as a user's process would.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
#: ``[sys.executable, "-c", DEFAULT_SIGNALS, ...]`` runs ``python ...`` with the stop signals unblocked and at
#: their default action, whatever the test run inherited (a blocked mask and ignored dispositions both
#: survive exec).
DEFAULT_SIGNALS = ("import os, signal, sys\n"
                   f"stops = ({', '.join(f'signal.{s.name}' for s in STOP_SIGNALS)})\n"
                   "signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)\n"
                   "for s in stops:\n"
                   "    signal.signal(s, signal.SIG_DFL)\n"
                   "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n")


def default_signals(ignore: tuple[int, ...] = ()) -> None:
    """In a child before it starts (``preexec_fn``): the stop signals unblocked and at their default action
    (``ignore``: these ignored)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN if signum in ignore else signal.SIG_DFL)


def scrub_environment(environ: dict[str, str] | os._Environ[str]) -> None:
    """Remove what a launch or a user's shell exported that would change the suite's verdicts, and put this
    checkout first on PYTHONPATH: a script run by path imports this accelport, not another clone's."""
    for key in list(environ):
        if key in _LAUNCH_VARIABLES or key.startswith(_LAUNCH_PREFIXES) or key == "PYTHONSAFEPATH":
            del environ[key]
    paths = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != REPO]
    environ["PYTHONPATH"] = os.pathsep.join([REPO, *paths])


def pytest_configure(config: pytest.Config) -> None:
    scrub_environment(os.environ)  # before any fixture, module-scoped ones included


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
