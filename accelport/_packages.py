"""The one module that asks what is installed, without importing any of it.

Everything here reads package metadata (``importlib.metadata``) or the import
system's finders (``importlib.util.find_spec`` on top-level names only, which
locates a package without executing it). Nothing here imports torch, torch_xla,
torch_tpu or torch_neuronx: on a TPU VM importing torch_xla takes the TPU, and
with torch-tpu installed but libtpu missing, importing torch kills the process.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import importlib.util
import os
import re
import sys

#: AWS's package index: torch-neuronx, libneuronxla and neuronx-cc are published only there.
NEURON_PACKAGE_INDEX = "https://pip.repos.neuron.amazonaws.com"

__all__ = [
    "NEURON_PACKAGE_INDEX",
    "version",
    "requires_python",
    "has_module",
    "release",
    "same_minor",
    "requirement",
    "satisfies",
    "entry_point_names",
    "torch_build",
    "torch_neuronx_kind",
    "cache_clear",
]


@functools.lru_cache(maxsize=None)
def version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (a pip name), or None."""
    try:
        return md.version(distribution)
    except md.PackageNotFoundError:
        return None
    except Exception:  # broken metadata must not break detection
        return None


@functools.lru_cache(maxsize=None)
def requires_python(distribution: str) -> str | None:
    """The ``Requires-Python`` specifier of an installed distribution (e.g. ">=3.10"), or None."""
    try:
        return md.metadata(distribution)["Requires-Python"]  # None when the field is absent
    except Exception:  # not installed, or broken metadata
        return None


@functools.lru_cache(maxsize=None)
def has_module(name: str) -> bool:
    """Whether top-level module ``name`` can be found (it is not imported)."""
    if "." in name:
        raise ValueError("has_module takes a top-level name; finding a submodule imports its parent")
    if name in sys.modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def release(text: str | None) -> tuple[int, ...] | None:
    """The numeric release of a PEP 440 version ("2.9.0+cu128" -> (2, 9, 0)), or None."""
    if not text:
        return None
    from packaging.version import InvalidVersion, Version

    try:
        return Version(text).release
    except InvalidVersion:
        return None


def same_minor(a: str | None, b: str | None) -> bool:
    """True when both versions parse and share major.minor."""
    ra, rb = release(a), release(b)
    return ra is not None and rb is not None and ra[:2] == rb[:2]


@functools.lru_cache(maxsize=None)
def requirement(distribution: str, dependency: str) -> str | None:
    """The version specifier ``distribution`` declares for ``dependency`` (its Requires-Dist).

    ``requirement("torch-tpu", "torch")`` -> ``">=2.11.0,<=2.15.0"``. Requirements
    behind an extra or a marker that does not hold here are skipped. None when
    either is not installed, or the dependency is not declared or unpinned.
    """
    try:
        declared = md.requires(distribution)
    except md.PackageNotFoundError:
        return None
    except Exception:
        return None
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    wanted = canonicalize_name(dependency)
    for line in declared or ():
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if canonicalize_name(req.name) != wanted:
            continue
        try:
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
        except Exception:
            continue
        # Lower bounds first, as people write them: ">=2.11.0,<=2.15.0".
        parts = sorted((str(s) for s in req.specifier), key=lambda s: (s.startswith("<"), s))
        return ",".join(parts) or None
    return None


def satisfies(installed: str | None, specifier: str | None) -> bool | None:
    """Whether version ``installed`` is within ``specifier``; None when either cannot be read.

    Local labels (``+cpu``) are ignored and pre-releases count, as pip does for
    an installed build: ``2.13.0+cpu`` satisfies ``>=2.11.0,<=2.15.0``.
    """
    if not installed or not specifier:
        return None
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return SpecifierSet(specifier).contains(Version(installed), prereleases=True)
    except (InvalidSpecifier, InvalidVersion):
        return None


@functools.lru_cache(maxsize=None)
def entry_point_names(group: str) -> tuple[str, ...]:
    """Names of the entry points in ``group`` (nothing is loaded), e.g. torch's ``torch.backends``."""
    try:
        return tuple(sorted({ep.name for ep in md.entry_points(group=group)}))
    except Exception:
        return ()


@functools.lru_cache(maxsize=None)
def torch_build() -> str | None:
    """Which accelerator the installed torch was built for: "cuda", "rocm", "cpu", or None.

    Read from the local version label (``2.13.0+cpu``, ``+cu128``, ``+rocm6.4``),
    else from the libraries next to the package (``torch/lib/libtorch_cuda.so``),
    found without importing torch. None when torch is not installed.
    """
    installed = version("torch")
    if installed is None:
        return None
    from packaging.version import InvalidVersion, Version

    try:
        local = (Version(installed).local or "").lower()
    except InvalidVersion:
        local = ""
    if local == "cpu":
        return "cpu"
    if re.fullmatch(r"cu\d+", local):
        return "cuda"
    if local.startswith("rocm"):
        return "rocm"
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    for location in locations:
        lib = os.path.join(location, "lib")
        try:
            names = os.listdir(lib)
        except OSError:
            continue
        if any(n.startswith(("libtorch_cuda", "torch_cuda")) for n in names):
            return "cuda"
        if any(n.startswith("libtorch_hip") for n in names):
            return "rocm"
        return "cpu"
    return None


def torch_neuronx_kind(installed: str | None = None) -> str | None:
    """Which library an installed torch-neuronx is: decided by its version, never by its name.

    "native" (TorchNeuron, the ``neuron`` device): 2.13 and later.
    "legacy" (on torch_xla, ``PJRT_DEVICE=NEURON``): 2.9 and earlier.
    "private-beta": 2.10 to 2.12, TorchNeuron builds AWS shared privately.
    None when torch-neuronx is not installed or its version cannot be read.
    """
    found = release(installed if installed is not None else version("torch-neuronx"))
    if found is None or len(found) < 2:
        return None
    if found[:2] >= (2, 13):
        return "native"
    if found[:2] <= (2, 9):
        return "legacy"
    return "private-beta"


def torchrun_takes_shutdown_timeout(torch_dir: str | None = None) -> bool | None:
    """Whether the installed torch's torchrun reads ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (its grace period for the
    workers after a stop signal; a fixed 30 s before it), from its source on disk; None where torch is not found.
    ``torch_dir``: torch's package directory (default: the one this Python finds)."""
    if torch_dir is None:
        try:
            spec = importlib.util.find_spec("torch")
        except (ImportError, ValueError):
            return None
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        if not locations:
            return None
        torch_dir = locations[0]
    try:
        with open(os.path.join(torch_dir, "distributed", "launcher", "api.py"), encoding="utf-8") as f:
            return "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in f.read()
    except (OSError, UnicodeDecodeError):
        return None


def cache_clear() -> None:
    """Forget cached answers (tests install and remove fake distributions)."""
    version.cache_clear()
    requires_python.cache_clear()
    has_module.cache_clear()
    requirement.cache_clear()
    entry_point_names.cache_clear()
    torch_build.cache_clear()
