"""Which machine is this? Read from /sys, /dev, /proc and the environment only.

Detection never imports a vendor library, never starts a runtime, never
contacts a metadata server and never raises (but for an ``ACCELPORT_SYSROOT`` that
names no directory). Every function takes ``root`` so
tests can point it at a fake filesystem tree; ``ACCELPORT_SYSROOT`` does the
same for a whole process (a captured tree, a subprocess test).

The one program it may run is ``neuron-ls`` on a host that already shows
``/dev/neuron*`` devices: it reads the driver's device table without opening a
NeuronCore (it is routinely run next to training jobs), with a short timeout.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import os
import re
import signal
import stat
import subprocess
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from accelport.errors import AccelportError

__all__ = [
    "PLATFORMS",
    "PlatformInfo",
    "detect",
    "one_scan",
    "sysroot",
    "TPU_DEVICE_IDS",
    "NEURON_FAMILIES",
    "tpu_generation",
]

#: Every platform name accelport knows, most specific first.
PLATFORMS: tuple[str, ...] = ("gcp-tpu", "aws-neuron", "nvidia-gpu", "cpu")

GOOGLE_PCI_VENDOR = "0x1ae0"
#: PCI device id -> TPU generation (torch_xla ``_internal/tpu.py``, torch_tpu ``utils/hardware.py``).
#: Google's other PCI devices (gVNIC is 0x0042) are not TPUs.
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
    "trn2n": "Trainium2",
    "trn2u": "Trainium2",
    "trn3": "Trainium3",
}
#: Where the Neuron SDK installs its tools (aws-neuron-sdk setup guides, Ray's detector).
NEURON_LS = "/opt/aws/neuron/bin/neuron-ls"
#: Seconds neuron-ls may take before detection gives up on it and counts /dev nodes.
NEURON_LS_TIMEOUT = 3.0
# Largest file detection reads: sysfs attributes are one line, /proc entries a few.
_MAX_READ = 4096


@dataclass(frozen=True)
class PlatformInfo:
    """The detected platform.

    ``name`` is one of PLATFORMS; ``chip`` the generation where it can be read;
    ``device_count`` the accelerator chips (TPU chips, Neuron devices, GPUs);
    ``cores`` the NeuronCores where neuron-ls reported them; ``evidence`` says
    what was seen, in words; ``details`` carries the same facts as key/value
    strings for machine-readable reports.
    """

    name: str
    chip: str | None = None
    device_count: int = 0
    evidence: tuple[str, ...] = field(default_factory=tuple)
    cores: int | None = None
    details: Mapping[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        parts = [self.name]
        if self.chip:
            parts.append(self.chip)
        if self.device_count:
            parts.append(f"{self.device_count} device{'s' if self.device_count != 1 else ''}")
        return ", ".join(parts)


# -- safe file access ----------------------------------------------------------------------


def sysroot(root: str | None = None) -> str:
    """The filesystem root detection reads: ``root``, else ``ACCELPORT_SYSROOT``, else ``/``.

    Raises AccelportError when ``ACCELPORT_SYSROOT`` names no directory: detection would
    find nothing there and quietly report a CPU host.
    """
    if root is not None:
        return root
    variable = os.environ.get("ACCELPORT_SYSROOT") or ""
    if not variable:
        return "/"
    try:
        present = os.path.isdir(variable)
    except ValueError:  # a NUL byte
        present = False
    if not present:
        raise AccelportError(f"ACCELPORT_SYSROOT={variable!r} is not a directory, so detection would find no "
                             "device there and report a CPU host: point it at a tree with sys/, dev/ and proc/ "
                             "(a copy of a host's), or unset it to read this machine's /")
    return variable


def _join(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


#: PCI scans shared by every detection inside :func:`one_scan` (root -> what _pci_tpus found); None outside.
_scans: dict[str, tuple[list[str], int]] | None = None
_scan_depth = 0
_scan_lock = threading.Lock()


@contextlib.contextmanager
def one_scan() -> Iterator[None]:
    """Within this block (or a function it decorates), each root's PCI devices are read once.

    A doctor run asks for the platform about ten times (its own question, each backend's
    probe, the recommendation); on a host with thousands of PCI devices each scan costs
    most of a second. Outside such a block every :func:`detect` reads ``/sys`` afresh, so
    a long-lived process never sees a stale answer.
    """
    global _scans, _scan_depth
    with _scan_lock:
        if _scan_depth == 0:
            _scans = {}
        _scan_depth += 1
    try:
        yield
    finally:
        with _scan_lock:
            _scan_depth -= 1
            if _scan_depth == 0:
                _scans = None


def _read(path: str) -> str | None:
    """A small text file's stripped contents, or None. Never blocks on a FIFO or device node."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        with open(path, "rb") as f:
            data = f.read(_MAX_READ)
    except (OSError, ValueError):
        return None
    return data.decode("utf-8", errors="replace").replace("\x00", "").strip()


def _glob(root: str, pattern: str) -> list[str]:
    try:
        # The root is a path, not a pattern: a directory named "[tree]" or "run*" is read as it is.
        return sorted(glob.glob(_join(glob.escape(root), pattern)))
    except (OSError, ValueError, RecursionError):
        return []


def _numbered(paths: list[str], prefix: str) -> list[str]:
    """Paths whose last component is ``prefix`` followed by digits (nvidia0, not nvidiactl)."""
    pattern = re.compile(rf"{re.escape(prefix)}\d+")
    return [p for p in paths if pattern.fullmatch(os.path.basename(p))]


def _env(env: Mapping[str, Any], key: str) -> str:
    try:
        value = env.get(key, "")
    except Exception:
        return ""
    return value.strip() if isinstance(value, str) else ""


# -- Cloud TPU -----------------------------------------------------------------------------


def tpu_generation(accelerator_type: str) -> str | None:
    """The TPU generation in a Cloud TPU accelerator type ("v5litepod-8" -> "v5e", "tpu7x-8" -> "v7")."""
    m = re.match(r"^(?:tpu-?)?v?(\d+)([a-z]*)", accelerator_type.strip().lower())
    if not m:
        return None
    number, suffix = int(m.group(1)), m.group(2)
    if number in (2, 3):
        return "v2/v3"
    if number == 5:
        return {"p": "v5p", "e": "v5e", "lite": "v5e", "litepod": "v5e"}.get(suffix)
    if number == 6:
        return "v6e" if suffix in ("e", "lite", "litepod") else None
    if number == 7:
        return "v7"
    if number == 4:
        return "v4"
    return None


def _pci_tpus(root: str) -> tuple[list[str], int]:
    """(generation of each TPU chip on the PCI bus, how many are exposed under /dev/vfio), read once per
    :func:`one_scan`."""
    scans = _scans
    if scans is not None and root in scans:
        chips, exposed = scans[root]
        return list(chips), exposed
    found = _scan_pci_tpus(root)
    if scans is not None:
        scans[root] = found
    return list(found[0]), found[1]


def _scan_pci_tpus(root: str) -> tuple[list[str], int]:
    chips: list[str] = []
    exposed = 0
    for vendor_file in _glob(root, "/sys/bus/pci/devices/*/vendor"):
        if (_read(vendor_file) or "").lower() != GOOGLE_PCI_VENDOR:
            continue
        device_dir = os.path.dirname(vendor_file)
        device_id = (_read(os.path.join(device_dir, "device")) or "").lower()
        if device_id not in TPU_DEVICE_IDS:
            continue
        chips.append(TPU_DEVICE_IDS[device_id])
        # TorchTPU counts a chip only when its IOMMU group is exposed under /dev/vfio.
        try:
            group = os.path.basename(os.readlink(os.path.join(device_dir, "iommu_group")))
            if os.path.exists(_join(root, f"/dev/vfio/{group}")):
                exposed += 1
        except (OSError, ValueError):
            pass
    return chips, exposed


def _tpu(root: str, env: Mapping[str, Any]) -> tuple[PlatformInfo | None, list[str]]:
    chips, exposed = _pci_tpus(root)
    accel_nodes = _numbered(_glob(root, "/dev/accel*"), "accel")
    vfio_nodes = _numbered(_glob(root, "/dev/vfio/*"), "")
    accel_type = _env(env, "TPU_ACCELERATOR_TYPE")
    details: dict[str, str] = {}
    evidence: list[str] = []
    for key in ("TPU_ACCELERATOR_TYPE", "TPU_NAME", "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "TPU_VISIBLE_CHIPS"):
        value = _env(env, key)
        if value:
            details[key] = value
    hosts = [h for h in details.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if chips:
        evidence.append(f"{len(chips)} Google TPU PCI device(s) ({GOOGLE_PCI_VENDOR}) in /sys/bus/pci/devices")
        nodes = max(exposed, len(accel_nodes))
        details["device_nodes"] = str(nodes)
        if nodes:
            evidence.append(f"{nodes} exposed through /dev/vfio or /dev/accel")
        else:
            evidence.append("none exposed through /dev/vfio or /dev/accel (a container without the devices passed in?)")
        chip = chips[0]
    elif accel_type and (accel_nodes or vfio_nodes):
        # Some images hide the PCI ids; the accelerator type plus device nodes still say TPU.
        n = len(accel_nodes) or len(vfio_nodes)
        evidence.append(f"{n} /dev/{'accel' if accel_nodes else 'vfio/'}<N> device node(s)")
        chips = [""] * n
        chip = tpu_generation(accel_type) or ""
    else:
        note = (f"TPU_ACCELERATOR_TYPE={accel_type} is set but no TPU device is present"
                if accel_type else "")
        return None, [note] if note else []
    if accel_type:
        evidence.append(f"TPU_ACCELERATOR_TYPE={accel_type}")
    if len(hosts) > 1:
        evidence.append(f"host {details.get('TPU_WORKER_ID', '?')} of {len(hosts)} (TPU_WORKER_HOSTNAMES)")
    return PlatformInfo("gcp-tpu", chip or None, len(chips), tuple(evidence), None, details), []


# -- AWS Neuron ----------------------------------------------------------------------------


def _visible_cores(spec: str) -> int | None:
    """How many cores NEURON_RT_VISIBLE_CORES names ("0-3" -> 4, "1,3" -> 2), or None if unreadable."""
    count = 0
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            return None
        low, high = int(m.group(1)), int(m.group(2) or m.group(1))
        if high < low:
            return None
        count += high - low + 1
    return count


def _neuron_devices_from_json(data: Any) -> list[Mapping[str, Any]]:
    """The device records in neuron-ls JSON: a top-level list (``--json-output``) or a list inside."""
    if isinstance(data, list):
        return [d for d in data if isinstance(d, Mapping)]
    if isinstance(data, Mapping):
        for value in data.values():
            if isinstance(value, list) and value and all(isinstance(d, Mapping) for d in value) \
                    and any("nc_count" in d or "neuron_device" in d for d in value):
                return list(value)
    return []


@functools.lru_cache(maxsize=8)
def _neuron_ls(executable: str, mtime: float) -> tuple[int, int] | str:
    """(devices, NeuronCores) from neuron-ls, or a sentence saying why not. Cached per binary."""
    del mtime  # part of the cache key: a reinstalled tool is asked again
    # --json-output until Neuron 2.33; Neuron 2.34 replaces it with --output-format json.
    problem = "neuron-ls gave no device list"
    for flags in (["--json-output"], ["--output-format", "json"]):
        try:
            out = _run_bounded([executable, *flags], NEURON_LS_TIMEOUT)
        except subprocess.TimeoutExpired:
            return f"neuron-ls did not answer within {NEURON_LS_TIMEOUT:g} s"
        except (OSError, ValueError) as exc:
            return f"neuron-ls could not run ({type(exc).__name__})"
        if out.returncode != 0:
            problem = f"neuron-ls {' '.join(flags)} exited with status {out.returncode}"
            continue
        try:
            devices = _neuron_devices_from_json(json.loads(out.stdout.decode("utf-8", errors="replace")))
        except ValueError:
            problem = f"neuron-ls {' '.join(flags)} printed something that is not JSON"
            continue
        except RecursionError:  # json.loads of "[[[[..." thousands deep
            problem = f"neuron-ls {' '.join(flags)} printed JSON nested too deeply to read"
            continue
        if devices:
            cores = 0
            for d in devices:
                n = d.get("nc_count", 0)
                cores += n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0
            return len(devices), cores
    return problem


def _run_bounded(command: list[str], timeout: float) -> subprocess.CompletedProcess[bytes]:
    """``subprocess.run`` in a session of its own: after the timeout the whole process group is killed.

    subprocess.run kills only the program it started; a tool that forks (a shell script,
    a helper it spawns) would leave its children running, holding the output pipe open.
    """
    with subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)  # its group id is its pid (a new session)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=1)  # a child that left the group may hold the pipe: stop reading
            raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def _neuron_ls_path(root: str) -> str | None:
    path = _join(root, NEURON_LS)
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(st.st_mode) and os.access(path, os.X_OK):
        return path
    return None


def _neuron(root: str, env: Mapping[str, Any]) -> PlatformInfo | None:
    devices = _numbered(_glob(root, "/dev/neuron*"), "neuron")
    if not devices:
        return None
    product = _read(_join(root, "/sys/devices/virtual/dmi/id/product_name")) or ""
    product = product.splitlines()[0].strip() if product else ""
    family = product.split(".")[0].lower()
    chip = NEURON_FAMILIES.get(family)
    count = len(devices)
    evidence = [f"{count} /dev/neuron<N> device(s)"]
    details: dict[str, str] = {}
    if product:
        evidence.append(f"instance type {product}")
        details["instance_type"] = product
    cores: int | None = None
    tool = _neuron_ls_path(root)
    if tool is not None:
        try:
            mtime = os.stat(tool).st_mtime
        except OSError:
            mtime = 0.0
        try:
            found = _neuron_ls(tool, mtime)
        except Exception as exc:  # noqa: BLE001 - a bad answer must not hide the /dev nodes found above
            found = f"neuron-ls gave an answer that could not be read ({type(exc).__name__})"
        if isinstance(found, tuple):
            ls_devices, ls_cores = found
            count = ls_devices
            cores = ls_cores or None
            evidence.append(f"neuron-ls: {ls_devices} device(s), {ls_cores} NeuronCore(s)")
            details["neuron_cores"] = str(ls_cores)
        else:
            evidence.append(f"{found}; counted /dev nodes instead")
    visible = _env(env, "NEURON_RT_VISIBLE_CORES")
    if visible:
        details["NEURON_RT_VISIBLE_CORES"] = visible
        n = _visible_cores(visible)
        evidence.append(f"NEURON_RT_VISIBLE_CORES={visible}" + (f" ({n} core(s) for this process)" if n else
                                                                   " (not a core list or range)"))
    return PlatformInfo("aws-neuron", chip, count, tuple(evidence), cores, details)


# -- NVIDIA --------------------------------------------------------------------------------


def _nvidia(root: str) -> PlatformInfo | None:
    gpus = [p for p in _glob(root, "/proc/driver/nvidia/gpus/*") if os.path.isdir(p)]
    if gpus:
        info = _read(os.path.join(gpus[0], "information")) or ""
        m = re.search(r"^Model:\s*(.+)$", info, re.MULTILINE)
        return PlatformInfo(
            "nvidia-gpu", m.group(1).strip() if m else None, len(gpus),
            (f"{len(gpus)} GPU(s) in /proc/driver/nvidia/gpus",),
        )
    nodes = _numbered(_glob(root, "/dev/nvidia*"), "nvidia")
    if nodes:
        return PlatformInfo("nvidia-gpu", None, len(nodes), (f"{len(nodes)} /dev/nvidia<N> node(s)",))
    return None


# -- the entry point -----------------------------------------------------------------------


def detect(root: str | None = None, environ: Mapping[str, Any] | None = None) -> PlatformInfo:
    """Detect the platform. Cheap (a few file reads), safe, and never raises, except for an
    ``ACCELPORT_SYSROOT`` that names no directory (AccelportError: a setting to fix).

    The most specific platform wins: a TPU VM or a Trainium host is never
    reported as a CPU host because it also has a CPU.
    """
    env: Mapping[str, Any] = os.environ if environ is None else environ
    notes: list[str] = []
    try:
        base = sysroot(root)
        if not isinstance(base, str):
            raise TypeError(f"root must be a path string, not {type(base).__name__}")
    except AccelportError:
        raise  # ACCELPORT_SYSROOT names no directory: a setting to fix, not a CPU host
    except Exception as exc:
        return PlatformInfo("cpu", None, 0, (f"detection failed ({type(exc).__name__}: {exc}); assuming cpu",))

    def tpu() -> PlatformInfo | None:
        found, extra = _tpu(base, env)
        notes.extend(extra)
        return found

    for name, finder in (("TPU", tpu), ("Neuron", lambda: _neuron(base, env)),
                         ("NVIDIA", lambda: _nvidia(base))):
        try:
            found = finder()
        except Exception as exc:  # detection must never take the caller down
            notes.append(f"{name} detection failed ({type(exc).__name__}: {exc})")
            continue
        if found is not None:
            return found
    return PlatformInfo("cpu", None, 0, ("no TPU, Neuron or NVIDIA device found", *notes))
