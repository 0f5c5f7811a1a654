"""Which machine is this? Read from /sys, /dev, /proc and the environment only.

Detection never imports a vendor library, never starts a runtime, never
contacts a metadata server and never raises. Every function takes ``root`` so
tests can point it at a fake filesystem tree.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["PLATFORMS", "PlatformInfo", "detect", "TPU_DEVICE_IDS"]

#: Every platform name accelport knows, most specific first.
PLATFORMS: tuple[str, ...] = ("gcp-tpu", "aws-neuron", "nvidia-gpu", "cpu")

GOOGLE_PCI_VENDOR = "0x1ae0"
#: PCI device id -> TPU generation (torch_xla ``_internal/tpu.py``, torch_tpu ``utils/hardware.py``).
TPU_DEVICE_IDS: Mapping[str, str] = {
    "0x0027": "v2/v3",
    "0x005e": "v4",
    "0x0062": "v5p",
    "0x0063": "v5e",
    "0x006f": "v6e",
    "0x0076": "v7",
}
# EC2 instance families with Neuron devices -> chip name.
NEURON_FAMILIES: Mapping[str, str] = {
    "inf1": "Inferentia",
    "inf2": "Inferentia2",
    "trn1": "Trainium",
    "trn1n": "Trainium",
    "trn2": "Trainium2",
    "trn2u": "Trainium2",
    "trn3": "Trainium3",
}


@dataclass(frozen=True)
class PlatformInfo:
    """The detected platform: ``name`` is one of PLATFORMS; ``evidence`` says what was seen."""

    name: str
    chip: str | None = None
    device_count: int = 0
    evidence: tuple[str, ...] = field(default_factory=tuple)

    def describe(self) -> str:
        parts = [self.name]
        if self.chip:
            parts.append(self.chip)
        if self.device_count:
            parts.append(f"{self.device_count} device{'s' if self.device_count != 1 else ''}")
        return ", ".join(parts)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(4096).strip()
    except (OSError, ValueError):
        return None


def _join(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def _glob(root: str, pattern: str) -> list[str]:
    try:
        return sorted(glob.glob(_join(root, pattern)))
    except (OSError, ValueError):
        return []


def _tpu(root: str, env: Mapping[str, str]) -> PlatformInfo | None:
    chips: list[str] = []
    for vendor_file in _glob(root, "/sys/bus/pci/devices/*/vendor"):
        if (_read(vendor_file) or "").lower() != GOOGLE_PCI_VENDOR:
            continue
        device_id = (_read(os.path.join(os.path.dirname(vendor_file), "device")) or "").lower()
        if device_id in TPU_DEVICE_IDS:
            chips.append(TPU_DEVICE_IDS[device_id])
    accel_type = env.get("TPU_ACCELERATOR_TYPE", "")
    if chips:
        evidence = [f"{len(chips)} Google TPU PCI device(s) ({GOOGLE_PCI_VENDOR}) in /sys/bus/pci"]
        if accel_type:
            evidence.append(f"TPU_ACCELERATOR_TYPE={accel_type}")
        return PlatformInfo("gcp-tpu", chips[0], len(chips), tuple(evidence))
    if accel_type and _glob(root, "/dev/accel*"):
        # Older TPU VMs expose /dev/accel* but not always readable PCI ids.
        m = re.match(r"(v\d+[a-z]*)", accel_type)
        n = len(_glob(root, "/dev/accel*"))
        return PlatformInfo(
            "gcp-tpu", m.group(1) if m else None, n,
            (f"TPU_ACCELERATOR_TYPE={accel_type}", f"{n} /dev/accel* device(s)"),
        )
    return None


def _neuron(root: str) -> PlatformInfo | None:
    devices = [p for p in _glob(root, "/dev/neuron*") if re.search(r"neuron\d+$", p)]
    if not devices:
        return None
    product = _read(_join(root, "/sys/devices/virtual/dmi/id/product_name")) or ""
    family = product.split(".")[0].lower()
    chip = NEURON_FAMILIES.get(family)
    evidence = [f"{len(devices)} /dev/neuron* device(s)"]
    if product:
        evidence.append(f"instance type {product}")
    return PlatformInfo("aws-neuron", chip, len(devices), tuple(evidence))


def _nvidia(root: str) -> PlatformInfo | None:
    gpus = _glob(root, "/proc/driver/nvidia/gpus/*")
    if gpus:
        info = _read(os.path.join(gpus[0], "information")) or ""
        m = re.search(r"^Model:\s*(.+)$", info, re.MULTILINE)
        return PlatformInfo(
            "nvidia-gpu", m.group(1).strip() if m else None, len(gpus),
            (f"{len(gpus)} GPU(s) in /proc/driver/nvidia/gpus",),
        )
    nodes = [p for p in _glob(root, "/dev/nvidia*") if re.search(r"nvidia\d+$", p)]
    if nodes:
        return PlatformInfo("nvidia-gpu", None, len(nodes), (f"{len(nodes)} /dev/nvidia<N> node(s)",))
    return None


def detect(root: str = "/", environ: Mapping[str, str] | None = None) -> PlatformInfo:
    """Detect the platform. Cheap (a few file reads), safe, and never raises."""
    env = os.environ if environ is None else environ
    try:
        for finder in (lambda: _tpu(root, env), lambda: _neuron(root), lambda: _nvidia(root)):
            found = finder()
            if found is not None:
                return found
    except Exception as exc:  # detection must never take the caller down
        return PlatformInfo("cpu", None, 0, (f"detection failed ({type(exc).__name__}: {exc}); assuming cpu",))
    return PlatformInfo("cpu", None, 0, ("no TPU, Neuron or NVIDIA device found",))
