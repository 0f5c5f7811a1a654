"""cpu: the host processor, always there when torch is installed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from accelport import _packages
from accelport.contract import Probe
from accelport.eager import EagerBackend
from accelport.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from collections.abc import Callable

    from accelport.contract import Backend


class CpuBackend(EagerBackend):
    name = "cpu"
    platform = "cpu"
    description = "The host CPU (eager PyTorch); the reference every other backend is tested against."
    device_type = "cpu"
    dist_backend = "gloo"
    compile_backend = "inductor"
    autocast_device_type = "cpu"
    sync_api = "none"
    transfer_batches = False  # the host is the device
    per_process_device = False

    def _probe(self) -> Probe:
        torch_version = _packages.version("torch")
        if torch_version is None:
            return Probe(False, "torch is not installed: pip install torch", 0)
        return Probe(True, f"torch {torch_version} runs on the host CPU", 1, {"torch": torch_version})


@hookimpl
def accelport_register_backends(register: Callable[[type[Backend]], None]) -> None:
    register(CpuBackend)
