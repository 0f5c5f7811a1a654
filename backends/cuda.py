"""cuda: NVIDIA GPUs through PyTorch's CUDA build.

The probe reads package metadata and the driver's files only: calling
``torch.cuda.is_available()`` here would initialise CUDA in this process, and a
process that forks afterwards (DataLoader workers, ``mp.Process``) cannot use
the GPU. When the backend is used, ``prepare()`` counts devices through
``torch.cuda.device_count()``, which asks NVML first (as
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` makes ``is_available()`` do) and so leaves
CUDA uninitialised until the first tensor reaches the GPU.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from accelport import _packages, platform
from accelport.contract import Probe
from accelport.eager import EagerBackend
from accelport.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from collections.abc import Callable

    from accelport.contract import Backend


def visible_gpus(spec: str | None, present: int) -> int:
    """How many of ``present`` GPUs ``CUDA_VISIBLE_DEVICES=spec`` leaves visible.

    Follows CUDA's rule: the list is read up to the first entry that is not a
    valid device (a negative or out-of-range index); UUIDs (``GPU-...``,
    ``MIG-...``) each count as one. Unset means all of them.
    """
    if spec is None:
        return present
    count = 0
    for part in spec.split(","):
        part = part.strip()
        if re.fullmatch(r"\d+", part):
            if int(part) >= present:
                break
        elif not re.match(r"(GPU|MIG)-", part):
            break
        count += 1
    return min(count, present)


class CudaBackend(EagerBackend):
    name = "cuda"
    platform = "nvidia-gpu"
    description = "NVIDIA GPUs (eager PyTorch, NCCL for several processes)."
    device_type = "cuda"
    dist_backend = "nccl"
    compile_backend = "inductor"
    autocast_device_type = "cuda"
    device_module = "cuda"
    sync_api = "module"  # torch.cuda.synchronize, torch.cuda.memory_allocated, ...
    pin_memory = True

    def _probe(self) -> Probe:
        return probe_cuda()


def probe_cuda(root: str | None = None, environ: Mapping[str, str] | None = None) -> Probe:
    """The cuda probe, readable against a fake root (tests) or this machine."""
    import os

    env = os.environ if environ is None else environ
    torch_version = _packages.version("torch")
    if torch_version is None:
        return Probe(False, "torch is not installed: pip install torch", 0)
    details = {"torch": torch_version, "torch_build": _packages.torch_build() or "unknown"}
    found = platform.detect(root, env)
    if found.name != "nvidia-gpu":
        return Probe(False, "no NVIDIA GPU found (no /proc/driver/nvidia/gpus, no /dev/nvidia<N>)", 0, details)
    if details["torch_build"] == "cpu":
        return Probe(False, f"torch {torch_version} is a CPU-only build; install a CUDA build of torch "
                            "(https://pytorch.org/get-started/locally/)", 0, details)
    spec = env.get("CUDA_VISIBLE_DEVICES")
    visible = visible_gpus(spec, found.device_count)
    if spec is not None:
        details["CUDA_VISIBLE_DEVICES"] = spec
    if visible == 0:
        return Probe(False, f"CUDA_VISIBLE_DEVICES={spec!r} hides all {found.device_count} NVIDIA GPU(s) "
                            "from this process", 0, details)
    chip = f" ({found.chip})" if found.chip else ""
    shown = f"{visible} of {found.device_count}" if visible != found.device_count else f"{visible}"
    return Probe(True, f"{shown} NVIDIA GPU(s){chip} with torch {torch_version}", visible, details)


@hookimpl
def accelport_register_backends(register: Callable[[type[Backend]], None]) -> None:
    register(CudaBackend)
