"""cuda: NVIDIA GPUs through PyTorch's CUDA build."""

from __future__ import annotations

from accelport import _packages
from accelport.eager import EagerBackend
from accelport.contract import Probe
from accelport.hookspecs import hookimpl
from accelport.platform import detect


class CudaBackend(EagerBackend):
    name = "cuda"
    platform = "nvidia-gpu"
    description = "NVIDIA GPUs (eager PyTorch, NCCL for several processes)."
    device_type = "cuda"
    dist_backend = "nccl"
    compile_backend = "inductor"
    autocast_device_type = "cuda"
    sync_api = "module"
    pin_memory = True

    def _probe(self) -> Probe:
        # Never torch.cuda.is_available() here: it initialises CUDA in this process
        # (a forked worker then cannot use the GPU). The driver's files say enough.
        torch_version = _packages.version("torch")
        if torch_version is None:
            return Probe(False, "torch is not installed: pip install torch", 0)
        if "+cpu" in torch_version:
            return Probe(False, f"torch {torch_version} is a CPU-only build; install a CUDA build of torch", 0,
                         {"torch": torch_version})
        found = detect()
        if found.name != "nvidia-gpu":
            return Probe(False, "no NVIDIA GPU found (no /proc/driver/nvidia/gpus, no /dev/nvidia<N>)", 0,
                         {"torch": torch_version})
        chip = f" ({found.chip})" if found.chip else ""
        return Probe(True, f"{found.device_count} NVIDIA GPU(s){chip} with torch {torch_version}",
                     found.device_count, {"torch": torch_version})


@hookimpl
def accelport_register_backends(register):  # type: ignore[no-untyped-def]
    register(CudaBackend)
