"""xla: torch_xla on a Cloud TPU, or on the host CPU with PJRT_DEVICE=CPU (XLA:CPU)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from accelport.lazy import LazyBackend, doctor_findings
from accelport.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from collections.abc import Callable

    from accelport.contract import Backend
    from accelport.doctor.finding import DoctorContext, Finding


class XlaBackend(LazyBackend):
    name = "xla"
    platform = "gcp-tpu"
    description = ("PyTorch/XLA (torch_xla) on Cloud TPU, or XLA:CPU with PJRT_DEVICE=CPU; "
                   "torch_xla's last release is 2.9, TorchTPU ('tpu') replaces it.")
    packages = ("torch", "torch_xla", "libtpu")
    pjrt_devices = ("TPU", "CPU")
    runtime_module = "libtpu"
    runtime_hint = "pip install 'torch_xla[tpu]' (it pins the matching libtpu)"
    hardware = "TPU chips (Google PCI devices in /sys/bus/pci, /dev/accel*)"


@hookimpl
def accelport_register_backends(register: Callable[[type[Backend]], None]) -> None:
    register(XlaBackend)


@hookimpl
def accelport_doctor_checks(context: DoctorContext) -> list[Finding] | None:
    return doctor_findings(XlaBackend, context) or None
