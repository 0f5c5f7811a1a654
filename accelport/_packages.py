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
import sys

__all__ = ["version", "requires_python", "has_module", "release", "same_minor", "cache_clear"]


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
        return md.metadata(distribution).get("Requires-Python")
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


def cache_clear() -> None:
    """Forget cached answers (tests install and remove fake distributions)."""
    version.cache_clear()
    requires_python.cache_clear()
    has_module.cache_clear()
