"""neuron: AWS Trainium through TorchNeuron, the native ``neuron`` device (torch-neuronx >= 2.13).

The eager family with TorchNeuron's constants. The pip name ``torch-neuronx``
covers two libraries: 2.13 and later is TorchNeuron (this backend); 2.9 and
earlier is the XLA-based library, which the ``neuron-xla`` backend drives. The
installed version decides (``_packages.torch_neuronx_kind``), never the name.

Unconfirmed off hardware (no Neuron machine or SDK was available to test against): an official
``torch.neuron.synchronize()`` (seen only in public code), so ``sync()`` calls it
when present and ``torch.accelerator.synchronize()`` otherwise; the names of
TorchNeuron's compile-cache and metrics variables, so no cache figures are
reported yet. Memory figures come from the ``torch.accelerator`` memory functions,
which the Neuron 2.34 release notes say work on Neuron; where they are missing or
raise (an older TorchNeuron), they are read as the eager family does otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from accelport import _packages, platform
from accelport.contract import Probe
from accelport.eager import ACCELERATOR_EQUIVALENTS, EagerBackend
from accelport.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from collections.abc import Callable

    from accelport.contract import Backend

#: Chips TorchNeuron runs on (Neuron 2.33 release notes: public beta, Trn2 and Trn3 only).
NATIVE_CHIPS = frozenset({"Trainium2", "Trainium3"})
INSTALL = (f"pip install 'torch-neuronx>=2.13' --extra-index-url {_packages.NEURON_PACKAGE_INDEX} "
           "(AWS's package index)")
#: The device-module memory reads (see ``EagerBackend.memory_reading``) taken from ``torch.accelerator``
#: first: the Neuron 2.34 release notes say the torch.accelerator memory functions work on Neuron.
ACCELERATOR_MEMORY = frozenset({"memory_allocated", "max_memory_allocated", "reset_peak_memory_stats",
                                "mem_get_info"})


def probe_neuron(root: str | None = None, environ: Mapping[str, str] | None = None) -> Probe:
    """The neuron probe, readable against a fake root (tests) or this machine."""
    env = os.environ if environ is None else environ
    plat = platform.detect(root, env)
    installed = _packages.version("torch-neuronx")
    kind = _packages.torch_neuronx_kind(installed)
    torch_version = _packages.version("torch")
    details: dict[str, str] = {"platform": plat.describe()}
    for key, value in (("torch", torch_version), ("torch-neuronx", installed), ("torch-neuronx kind", kind)):
        if value:
            details[key] = value
    problems: list[str] = []
    if plat.name != "aws-neuron":
        problems.append("no Neuron devices found (no /dev/neuron<N>)")
    elif plat.chip is not None and plat.chip not in NATIVE_CHIPS:
        host = plat.details.get("instance_type", plat.chip)
        problems.append(f"TorchNeuron runs on Trn2 and Trn3 only and this host is {host} ({plat.chip}): "
                        "use torch-neuronx 2.9 or earlier with the neuron-xla backend")
    if installed is None:
        problems.append(f"torch-neuronx is not installed: {INSTALL}")
    elif kind is None:
        problems.append(f"torch-neuronx {installed} has a version accelport cannot read")
    elif kind == "legacy":
        problems.append(f"torch-neuronx {installed} is the legacy XLA-based library (2.9 and earlier), "
                        "which the neuron-xla backend drives; the neuron device needs torch-neuronx 2.13 or later")
    else:
        wanted = _packages.requirement("torch-neuronx", "torch")
        if wanted:
            details["torch range"] = wanted
        if torch_version is None:
            problems.append("torch is not installed")
        elif _packages.satisfies(torch_version, wanted) is False or (
                wanted is None and not _packages.same_minor(torch_version, installed)):
            need = f"torch{wanted}" if wanted else "the torch of the same major.minor"
            problems.append(f"torch-neuronx {installed} needs {need}, but torch {torch_version} is installed")
        if kind == "private-beta":
            details["note"] = (f"torch-neuronx {installed} is a private-beta TorchNeuron build (torch 2.10 to 2.12); "
                               "accelport is checked against the public releases, 2.13 and later")
    if plat.name == "aws-neuron" and plat.chip is None:
        details.setdefault("note", "the instance type could not be read (DMI product_name); TorchNeuron needs "
                                   "Trn2 or Trn3")
    if problems:
        return Probe(False, "; ".join(problems), 0, details)
    chip = f" {plat.chip}" if plat.chip else ""
    cores = f", {plat.cores} NeuronCores" if plat.cores else ""
    return Probe(True, f"{plat.device_count}{chip} Neuron device(s){cores} with torch-neuronx {installed}, "
                       f"torch {torch_version}", plat.device_count, details)


class NeuronBackend(EagerBackend):
    name = "neuron"
    platform = "aws-neuron"
    description = "AWS Trainium through TorchNeuron (torch-neuronx >= 2.13): the native 'neuron' device."
    packages = ("torch", "torch-neuronx")
    device_type = "neuron"
    device_module = "neuron"
    vendor_module = "torch_neuronx"
    dist_backend = "neuron"
    compile_backend = "neuron"
    compile_dynamic = False  # TorchNeuron rejects dynamic=True: each new shape compiles its own graph
    autocast_device_type = "neuron"
    # torch.neuron.X where TorchNeuron has it (synchronize is unconfirmed), else torch.accelerator.X;
    # memory reads the other way round (device_api below).
    sync_api = "module"
    pin_memory = False

    def __init__(self) -> None:
        super().__init__()
        self._accelerator_memory_failed: set[str] = set()

    def _probe(self) -> Probe:
        return probe_neuron()

    def device_api(self, name: str) -> tuple[str, Callable[..., Any]] | None:
        """Memory reads through ``torch.accelerator`` when torch has the function, else as before.

        The Neuron 2.34 release notes say the ``torch.accelerator`` memory functions work on
        Neuron. An older TorchNeuron (Neuron 2.33) may not back them, so a call that raises falls
        back, for the rest of the run, to what the eager family reads otherwise
        (``torch.neuron.X`` where TorchNeuron has it, then ``torch.accelerator``).
        """
        fallback = super().device_api(name)
        if name not in ACCELERATOR_MEMORY or name in self._accelerator_memory_failed:
            return fallback
        equivalent = ACCELERATOR_EQUIVALENTS[name]
        first = getattr(getattr(self._t(), "accelerator", None), equivalent, None)
        if not callable(first):
            return fallback
        dotted = f"torch.accelerator.{equivalent}"
        if fallback is None or fallback[0] == dotted:
            return dotted, first
        failed, then = self._accelerator_memory_failed, fallback[1]

        def read(*args: Any, **kwargs: Any) -> Any:
            try:
                return first(*args, **kwargs)
            except Exception:  # not backed by this TorchNeuron: read it the older way from now on
                failed.add(name)
                return then(*args, **kwargs)

        return dotted, read


@hookimpl
def accelport_register_backends(register: Callable[[type[Backend]], None]) -> None:
    register(NeuronBackend)
