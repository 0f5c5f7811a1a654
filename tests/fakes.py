"""Fake machines and fake installed packages, for what cannot exist on the test machines.

Fake hosts are directory trees laid out like the real /sys, /dev and /proc of a
Cloud TPU VM, a Trainium instance or an NVIDIA host; ``accelport.platform.detect``
reads them exactly as it reads the real ones. Fake distributions are
``*.dist-info`` directories on sys.path, found by importlib.metadata exactly as
pip-installed ones are; they carry no code that is ever imported.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from accelport import _packages
from accelport.platform import GOOGLE_PCI_VENDOR, TPU_DEVICE_IDS

TPU_ID_BY_GENERATION = {gen: dev for dev, gen in TPU_DEVICE_IDS.items()}


def write(root: Path, path: str, text: str | bytes = "") -> Path:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        target.write_bytes(text)
    else:
        target.write_text(text)
    return target


def pci_device(root: Path, bdf: str, vendor: str, device: str, iommu_group: int | None = None) -> Path:
    """A PCI function as sysfs shows it: a device directory, linked from /sys/bus/pci/devices."""
    real = root / "sys/devices/pci0000:00" / bdf
    write(root, f"/sys/devices/pci0000:00/{bdf}/vendor", vendor + "\n")
    write(root, f"/sys/devices/pci0000:00/{bdf}/device", device + "\n")
    if iommu_group is not None:
        groups = root / "sys/kernel/iommu_groups" / str(iommu_group)
        groups.mkdir(parents=True, exist_ok=True)
        os.symlink(f"../../../kernel/iommu_groups/{iommu_group}", real / "iommu_group")
    link = root / "sys/bus/pci/devices" / bdf
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink():
        os.symlink(f"../../../devices/pci0000:00/{bdf}", link)
    return real


def host_basics(root: Path) -> None:
    """What every Linux VM has: an Intel host bridge, a virtio NIC, /dev/null."""
    pci_device(root, "0000:00:00.0", "0x8086", "0x1237")
    pci_device(root, "0000:00:03.0", "0x1af4", "0x1000")
    write(root, "/dev/null")
    write(root, "/proc/cpuinfo", "processor\t: 0\n")


def tpu_vm(root: Path, generation: str = "v5e", chips: int = 4, *, vfio: bool = True,
           accel_nodes: bool = False) -> Path:
    """A single-host Cloud TPU VM: TPU PCI functions, their VFIO groups, Google's gVNIC."""
    host_basics(root)
    pci_device(root, "0000:00:05.0", GOOGLE_PCI_VENDOR, "0x0042")  # gVNIC: Google's NIC, not a TPU
    for i in range(chips):
        pci_device(root, f"0000:00:{i + 6:02x}.0", GOOGLE_PCI_VENDOR, TPU_ID_BY_GENERATION[generation],
                   iommu_group=i)
        if vfio:
            write(root, f"/dev/vfio/{i}")
        if accel_nodes:
            write(root, f"/dev/accel{i}")
    if vfio:
        write(root, "/dev/vfio/vfio")
    return root


def neuron_host(root: Path, devices: int = 16, instance: str | None = "trn1.32xlarge") -> Path:
    """An EC2 Neuron instance: /dev/neuron<N> and the instance type in DMI."""
    host_basics(root)
    for i in range(devices):
        write(root, f"/dev/neuron{i}")
    if instance is not None:
        write(root, "/sys/devices/virtual/dmi/id/product_name", instance + "\n")
        write(root, "/sys/devices/virtual/dmi/id/sys_vendor", "Amazon EC2\n")
    return root


def neuron_ls(root: Path, script: str) -> Path:
    """A stand-in /opt/aws/neuron/bin/neuron-ls: a shell script (the SDK cannot be installed here)."""
    path = write(root, "/opt/aws/neuron/bin/neuron-ls", "#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def nvidia_host(root: Path, gpus: int = 8, model: str = "NVIDIA H100 80GB HBM3") -> Path:
    """An NVIDIA host: the driver's /proc entries and /dev nodes."""
    host_basics(root)
    for i in range(gpus):
        bdf = f"0000:{i + 0x18:02x}:00.0"
        pci_device(root, bdf, "0x10de", "0x2330")
        write(root, f"/proc/driver/nvidia/gpus/{bdf}/information",
              f"Model: \t\t {model}\nIRQ:   \t\t 55\nGPU UUID: \t GPU-{i:08x}\nBus Location: \t {bdf}\n")
        write(root, f"/dev/nvidia{i}")
    write(root, "/dev/nvidiactl")
    write(root, "/dev/nvidia-uvm")
    write(root, "/proc/driver/nvidia/version", "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15\n")
    return root


def bare_cpu_host(root: Path) -> Path:
    host_basics(root)
    return root


def install_dist(monkeypatch: Any, site: Path, name: str, version: str, *,
                 requires: Iterable[str] = (), entry_points: str | None = None,
                 module: str | None = None) -> None:
    """Put a fake installed distribution on sys.path (first, so it shadows a real one).

    ``module`` also creates an empty top-level package of that name, so
    ``importlib.util.find_spec`` finds it; nothing ever imports it.
    """
    site.mkdir(parents=True, exist_ok=True)
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    if entry_points is not None:
        (info / "entry_points.txt").write_text(entry_points)
    if module is not None:
        (site / module).mkdir()
        (site / module / "__init__.py").write_text("raise ImportError('a stand-in distribution: never imported')\n")
    if str(site) not in sys.path:
        monkeypatch.syspath_prepend(str(site))
    _packages.cache_clear()
