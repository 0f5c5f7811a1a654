"""neuron-xla: AWS Trainium/Inferentia through the XLA-based torch-neuronx (2.9 and older).

torch-neuronx 2.13 and newer is TorchNeuron, the native ``neuron`` device: the
pip name is the same, so the installed version decides, never the name.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from typing import TYPE_CHECKING

from accelport import _packages
from accelport.errors import AccelportError
from accelport.lazy import LazyBackend, Requirement, doctor_findings
from accelport.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from collections.abc import Callable

    from accelport.contract import Backend
    from accelport.doctor.finding import DoctorContext, Finding

#: Neuron's compile cache when neither NEURON_CC_FLAGS --cache_dir nor NEURON_COMPILE_CACHE_URL moves it.
DEFAULT_NEURON_CACHE = "/var/tmp/neuron-compile-cache"


def _cc_flags(environ: Mapping[str, str]) -> list[str]:
    raw = environ.get("NEURON_CC_FLAGS", "")
    try:
        return shlex.split(raw)
    except ValueError:  # an unbalanced quote: read it the way a plain split would
        return raw.split()


def _flag_cache_dir(flags: list[str]) -> str | None:
    found = None
    for i, flag in enumerate(flags):
        if flag.startswith("--cache_dir="):
            found = flag.split("=", 1)[1]
        elif flag == "--cache_dir" and i + 1 < len(flags):
            found = flags[i + 1]
    return found or None


def neuron_cache_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """Where Neuron's compiler wrapper caches compiled graphs (a path or s3:// URL), or None when off.

    ``NEURON_CC_FLAGS --cache_dir=...`` wins over ``NEURON_COMPILE_CACHE_URL``;
    the default is /var/tmp/neuron-compile-cache; ``--no_cache`` turns it off
    (aws-neuron-sdk, "Neuron Persistent Cache").
    """
    env = os.environ if environ is None else environ
    flags = _cc_flags(env)
    if "--no_cache" in flags:
        return None
    return _flag_cache_dir(flags) or env.get("NEURON_COMPILE_CACHE_URL", "").strip() or DEFAULT_NEURON_CACHE


class NeuronXlaBackend(LazyBackend):
    name = "neuron-xla"
    platform = "aws-neuron"
    description = ("AWS Trainium/Inferentia through torch-neuronx on XLA (2.9 and older; "
                   "Neuron 2.31 is its last SDK, TorchNeuron 'neuron' replaces it).")
    packages = ("torch", "torch_xla", "torch-neuronx", "libneuronxla")
    pjrt_devices = ("NEURON",)
    runtime_module = "libneuronxla"
    runtime_hint = "pip install libneuronxla from the Neuron package index (it comes with torch-neuronx)"
    hardware = "Neuron devices (/dev/neuron*)"
    requires = (
        Requirement("torch_xla", same_minor_as_torch=True),
        Requirement(
            "torch-neuronx",
            specifier="<2.13",
            same_minor_as_torch=True,
            missing="pip install 'torch-neuronx<2.13' from the Neuron package index "
                    f"({_packages.NEURON_PACKAGE_INDEX.split('://')[-1]}); 2.9 is its last XLA-based release",
            outside="torch-neuronx {version} is TorchNeuron, the native backend (2.13 and newer): "
                    "use the 'neuron' backend",
        ),
    )

    def compile_cache_dir(self) -> str | None:
        return neuron_cache_dir()

    def enable_compile_cache(self, path: str | os.PathLike[str]) -> str:
        # Neuron's compiler wrapper (neuron_cc_wrapper) reads these variables at every
        # compile; torch_xla's own cache (xr.initialize_cache) is not the one Neuron uses.
        target = os.fspath(path)
        if not target.startswith("s3://"):
            target = os.path.abspath(target)
        flags = _cc_flags(os.environ)
        if "--no_cache" in flags:
            raise AccelportError("NEURON_CC_FLAGS contains --no_cache, which turns Neuron's compile cache "
                                 "off; remove it to use ap.compile_cache()")
        by_flag = _flag_cache_dir(flags)
        if by_flag is not None and by_flag != target:
            raise AccelportError(f"NEURON_CC_FLAGS sets --cache_dir={by_flag}, which wins over "
                                 f"ap.compile_cache({os.fspath(path)!r}); change or remove the flag")
        if self.compile_cache_dir() == target:
            return target
        if self._computation_started():
            raise AccelportError(
                f"ap.compile_cache({os.fspath(path)!r}) came after the first computation on {self.name}; "
                "call it before the model or data touch the device, or set NEURON_COMPILE_CACHE_URL "
                "before starting Python"
            )
        if not target.startswith("s3://"):
            os.makedirs(target, exist_ok=True)
        os.environ["NEURON_COMPILE_CACHE_URL"] = target
        return target


@hookimpl
def accelport_register_backends(register: Callable[[type[Backend]], None]) -> None:
    register(NeuronXlaBackend)


def cache_findings(context: DoctorContext) -> list[Finding]:
    """The Neuron compile cache must be writable, or every run compiles from scratch."""
    from accelport.doctor.finding import Finding

    env = context.environ
    relevant = (context.platform.name == "aws-neuron" or context.packages.get("torch-neuronx")
                or any(env.get(v) for v in ("NEURON_CC_FLAGS", "NEURON_COMPILE_CACHE_URL")))
    path = neuron_cache_dir(env)
    if not relevant or path is None or "://" in path:
        return []
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)  # the nearest existing directory the compiler would create it in
    if os.path.isdir(probe) and os.access(probe, os.W_OK | os.X_OK):
        return []
    return [Finding(
        "problem", f"the Neuron compile cache {path} is not writable ({probe} is not): every run compiles "
        "every graph again, and a failed compile cannot be cached either",
        "point it at a writable directory: export NEURON_COMPILE_CACHE_URL=/path/you/own (or "
        "NEURON_CC_FLAGS=--cache_dir=...), or fix the directory's permissions", "neuron-xla")]


@hookimpl
def accelport_doctor_checks(context: DoctorContext) -> list[Finding] | None:
    return doctor_findings(NeuronXlaBackend, context) + cache_findings(context) or None
