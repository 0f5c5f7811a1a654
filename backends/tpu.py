"""tpu: Cloud TPU through TorchTPU (PyPI ``torch-tpu``, import ``torch_tpu``), the native ``tpu`` device.

The eager family with TorchTPU's constants. Its runtime is reached only through
``torch.accelerator`` (TorchTPU raises when user code calls ``torch.tpu.synchronize``
and friends), and its compile-cache counters come from ``torch.tpu._get_cache_stats()``,
a private API read defensively.

The probe never imports torch or torch_tpu: torch-tpu registers itself in torch's
device-backend autoload (entry point group ``torch.backends``), so with torch-tpu
installed but libtpu missing, a plain ``import torch`` prints "libtpu not found."
and aborts the process. Everything here comes from package metadata and the
sysfs scan in :mod:`accelport.platform`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from accelport import _packages, platform
from accelport.contract import Probe
from accelport.doctor.finding import DoctorContext, Finding
from accelport.eager import EagerBackend
from accelport.errors import AccelportError
from accelport.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from collections.abc import Callable

    from accelport.contract import Backend

AUTOLOAD_VARIABLE = "TORCH_DEVICE_BACKEND_AUTOLOAD"
SKIP_METADATA_VARIABLE = "TPU_SKIP_MDS_QUERY"
NO_CHIPS = ("no TPU chips found (no Google TPU PCI device under /sys/bus/pci/devices, "
            "no TPU_ACCELERATOR_TYPE with /dev/accel or /dev/vfio nodes)")
AUTOLOAD_NOTE = (
    "torch-tpu {version} registers itself in torch's device-backend autoload (entry point "
    "torch.backends: torch_tpu), so every `import torch` in this environment loads TorchTPU too "
    "(seconds and hundreds of MB more), and on a machine without a TPU the first backward() then waits "
    "minutes for the GCE metadata server unless TPU_SKIP_MDS_QUERY=1; set TORCH_DEVICE_BACKEND_AUTOLOAD=0 "
    "for jobs that do not use the TPU"
)


@dataclass(frozen=True)
class TpuFacts:
    """What the metadata and the sysfs scan say about TorchTPU on this machine."""

    torch_tpu: str | None
    libtpu: str | None
    libtpu_importable: bool
    torch: str | None
    torch_range: str | None
    libtpu_range: str | None
    autoload_entry_point: bool
    autoload_off: bool
    platform: platform.PlatformInfo

    @classmethod
    def gather(cls, root: str | None = None, environ: Mapping[str, str] | None = None) -> TpuFacts:
        env = os.environ if environ is None else environ
        tt = _packages.version("torch-tpu")
        return cls(
            torch_tpu=tt,
            libtpu=_packages.version("libtpu"),
            libtpu_importable=_packages.has_module("libtpu"),
            torch=_packages.version("torch"),
            torch_range=_packages.requirement("torch-tpu", "torch") if tt else None,
            libtpu_range=_packages.requirement("torch-tpu", "libtpu") if tt else None,
            autoload_entry_point="torch_tpu" in _packages.entry_point_names("torch.backends") if tt else False,
            autoload_off=(env.get(AUTOLOAD_VARIABLE) or "").strip() == "0",
            platform=platform.detect(root, env),
        )

    @property
    def libtpu_missing(self) -> bool:
        return self.torch_tpu is not None and (self.libtpu is None or not self.libtpu_importable)

    def problems(self) -> list[str]:
        """Everything that keeps the tpu backend from running here, most basic first."""
        out: list[str] = []
        if self.platform.name != "gcp-tpu":
            out.append(NO_CHIPS)
        if self.torch_tpu is None:
            out.append("torch-tpu is not installed (pip install torch-tpu)")
            return out
        if self.libtpu_missing:
            want = f"libtpu{self.libtpu_range}" if self.libtpu_range else "libtpu"
            out.append(f"torch-tpu {self.torch_tpu} is installed but libtpu is not, so `import torch` aborts "
                       f"the process ('libtpu not found.'): pip install '{want}'")
        elif _packages.satisfies(self.libtpu, self.libtpu_range) is False:
            out.append(f"libtpu {self.libtpu} does not meet torch-tpu {self.torch_tpu}'s requirement "
                       f"libtpu{self.libtpu_range}")
        if self.torch is None:
            out.append("torch is not installed")
        elif _packages.satisfies(self.torch, self.torch_range) is False:
            out.append(f"torch {self.torch} is outside torch-tpu {self.torch_tpu}'s supported range "
                       f"torch{self.torch_range} (from its package metadata)")
        if self.autoload_off:
            out.append(f"{AUTOLOAD_VARIABLE}=0 stops TorchTPU from registering the tpu device; "
                       "unset it in jobs that use the TPU")
        return out

    def details(self) -> dict[str, str]:
        d: dict[str, str] = {}
        for key, value in (("torch", self.torch), ("torch-tpu", self.torch_tpu), ("libtpu", self.libtpu),
                           ("torch range", self.torch_range), ("libtpu range", self.libtpu_range)):
            if value:
                d[key] = value
        d["platform"] = self.platform.describe()
        if self.libtpu_missing:
            d["warning"] = ("torch-tpu without libtpu: `import torch` prints 'libtpu not found.' and the "
                            "process aborts; install libtpu or uninstall torch-tpu")
        elif self.platform.name == "gcp-tpu" and self.platform.details.get("device_nodes") == "0":
            d["warning"] = ("TPU chips are on the PCI bus but none is exposed through /dev/vfio or /dev/accel: "
                            "in a container, pass the devices in (--privileged or --device)")
        if self.autoload_entry_point:
            d["autoload"] = AUTOLOAD_NOTE.format(version=self.torch_tpu)
        return d


def probe_tpu(root: str | None = None, environ: Mapping[str, str] | None = None) -> Probe:
    """The tpu probe, readable against a fake root (tests) or this machine."""
    facts = TpuFacts.gather(root, environ)
    problems = facts.problems()
    details = facts.details()
    if problems:
        return Probe(False, "; ".join(problems), 0, details)
    plat = facts.platform
    chip = f" {plat.chip}" if plat.chip else ""
    return Probe(True, f"{plat.device_count} TPU{chip} chip(s) with torch-tpu {facts.torch_tpu}, "
                       f"libtpu {facts.libtpu}, torch {facts.torch}", plat.device_count, details)


def tpu_findings(root: str | None = None, environ: Mapping[str, str] | None = None) -> list[Finding]:
    """Findings for ``accelport doctor`` (never imports torch or torch_tpu)."""
    try:
        facts = TpuFacts.gather(root, environ)
    except AccelportError:
        # ACCELPORT_SYSROOT names no directory: doctor's core reports that, with its fix;
        # failing here as well would only disable this plugin with a second warning.
        return []
    if facts.torch_tpu is None:
        return []
    found: list[Finding] = []
    if facts.libtpu_missing:
        found.append(Finding(
            "problem", f"torch-tpu {facts.torch_tpu} is installed without libtpu: `import torch` aborts the process",
            f"pip install 'libtpu{facts.libtpu_range or ''}' (or pip uninstall torch-tpu)",
            "tpu: libtpu",
        ))
    if _packages.satisfies(facts.torch, facts.torch_range) is False:
        found.append(Finding(
            "problem", f"torch {facts.torch} is outside torch-tpu {facts.torch_tpu}'s range torch{facts.torch_range}",
            f"pip install 'torch{facts.torch_range}'",
            "tpu: torch version",
        ))
    if facts.autoload_entry_point and not facts.autoload_off and facts.platform.name != "gcp-tpu":
        found.append(Finding(
            "warning", AUTOLOAD_NOTE.format(version=facts.torch_tpu),
            f"export {AUTOLOAD_VARIABLE}=0 on machines without a TPU (accelport sets "
            f"{SKIP_METADATA_VARIABLE}=1 in its own processes there)",
            "tpu: autoload",
        ))
    return found


def keep_tpu_runtime_from_waiting(root: str | None = None, environ: Any = None) -> bool:
    """Where torch-tpu is installed but there is no TPU, make a stray TPU runtime start fail fast.

    With torch-tpu autoloaded, the first ``backward()`` of any model, even on the
    CPU, asks every registered device type for its device count; TorchTPU's answer
    starts libtpu, which on a machine that is not a TPU VM retries the GCE metadata
    server for minutes. ``TPU_SKIP_MDS_QUERY=1`` makes libtpu skip that query and
    report "no TPU" at once (observed with torch-tpu 0.2.0 and libtpu 0.0.52).

    Sets the variable in ``environ`` (default ``os.environ``: this process and its
    children) only when torch-tpu is installed, its autoload is on, the variable is
    unset, and there is no TPU chip, device node or ``TPU_*`` setting. Returns True
    when it set it.
    """
    env = os.environ if environ is None else environ
    if SKIP_METADATA_VARIABLE in env or _packages.version("torch-tpu") is None:
        return False
    if (env.get(AUTOLOAD_VARIABLE) or "").strip() == "0":
        return False
    if any(env.get(k) for k in ("TPU_ACCELERATOR_TYPE", "TPU_NAME", "TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID")):
        return False
    if platform.detect(root, env).name == "gcp-tpu":
        return False
    env[SKIP_METADATA_VARIABLE] = "1"
    return True


class TpuBackend(EagerBackend):
    name = "tpu"
    platform = "gcp-tpu"
    description = "Cloud TPU through TorchTPU (torch-tpu): the native 'tpu' device, eager by default."
    packages = ("torch", "torch-tpu", "libtpu")
    device_type = "tpu"
    device_module = "tpu"
    vendor_module = "torch_tpu"
    dist_backend = "tpu"
    compile_backend = "tpu"
    compile_dynamic = False  # TorchTPU raises NotImplementedError for dynamic=True
    autocast_device_type = "tpu"
    sync_api = "accelerator"  # torch.tpu.synchronize() raises "internal to TorchTPU" for user code
    pin_memory = False
    # Each TorchTPU process sees its own chip as tpu:0 (one process per chip), so the
    # device is not indexed by LOCAL_RANK; the launch environment comes from TorchTPU.
    per_process_device = False
    launch_env_function = "torch.tpu.distributed:set_tpu_launch_env"

    def _probe(self) -> Probe:
        return probe_tpu()

    def device_counters(self) -> dict[str, Any]:
        # Private API (torch.tpu._get_cache_stats: num_compilations, num_cache_hits,
        # num_cache_reqs); absent or changed, the fields stay None.
        stats_fn = getattr(getattr(self._torch, self.module_name, None), "_get_cache_stats", None)
        if not callable(stats_fn):
            return {}
        stats = stats_fn()
        out: dict[str, Any] = {}
        for field, key in (("compilations", "num_compilations"), ("cache_hits", "num_cache_hits")):
            value = stats.get(key) if isinstance(stats, Mapping) else getattr(stats, key, None)
            if isinstance(value, int) and not isinstance(value, bool):
                out[field] = value
        return out

    def compile_cache_dir(self) -> str | None:
        return os.environ.get("TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT") or None


@hookimpl
def accelport_register_backends(register: Callable[[type[Backend]], None]) -> None:
    register(TpuBackend)
    # Registration runs before any backend is used (and so before any backward()):
    # the last moment to keep an autoloaded TorchTPU from stalling a run without a TPU.
    keep_tpu_runtime_from_waiting()


@hookimpl
def accelport_doctor_checks(context: DoctorContext) -> list[Finding] | None:
    return tpu_findings(environ=context.environ) or None
