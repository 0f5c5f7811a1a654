"""The installed paired packages against the patch-release facts: what to install instead, and why.

``accelport doctor`` turns each answer into a finding. Versions are read from
package metadata (:mod:`accelport._packages`); nothing is imported.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass

from accelport import _packages
from accelport.compat.load import Matrix
from accelport.compat.schema import Release, minor_str

__all__ = ["ReleaseFinding", "installed_findings"]


@dataclass(frozen=True)
class ReleaseFinding:
    """One thing wrong with an installed release: severity (note, warning), what was seen, what to install."""

    severity: str
    title: str
    fix: str


def _pip(requirements: list[str], release: Release | None) -> str:
    args = ["pip", "install", *requirements]
    if release is not None and release.index:
        args += ["--extra-index-url", release.index]
    if release is not None and release.find_links:
        args += ["-f", release.find_links]
    return shlex.join(args)


def installed_findings(matrix: Matrix,
                       version: Callable[[str], str | None] = _packages.version) -> list[ReleaseFinding]:
    """For each installed package the data has releases of: a known-bad or superseded patch, and pins it misses.

    ``version`` reads an installed version by pip name (default: package metadata).
    """
    out: list[ReleaseFinding] = []
    packages = dict.fromkeys(r.package for r in matrix.releases)
    for package in packages:
        installed = version(package)
        if installed is None:
            continue
        found = matrix.release(package, installed)
        numbers = _packages.release(installed)
        best = (matrix.recommended_release(package, (numbers[0], numbers[1]))
                if numbers is not None and len(numbers) >= 2 else None)
        if found is not None and found.status in ("bad", "superseded") and best is not None:
            if found.status == "bad":
                out.append(ReleaseFinding(
                    "warning", f"{package} {installed} has a known problem: {found.message} ({found.issue})",
                    _pip([best.pin], best)))
            else:
                out.append(ReleaseFinding(
                    "note", f"{package} {installed} is not the recommended torch {minor_str(best.torch)} release "
                    f"({best.version}): {found.message}", _pip([best.pin], best)))
        for name, spec in (found.pins if found is not None else ()):
            have = version(name)
            if have is None or _packages.satisfies(have, spec) is not False:
                continue  # not installed (a CPU-only torch_xla needs no libtpu), or it matches
            sdk = f" (Neuron {', '.join(found.neuron_sdk)})" if found and found.neuron_sdk else ""
            out.append(ReleaseFinding(
                "warning", f"{name} {have} does not match {package} {installed}{sdk}, which pairs with {name}{spec}",
                _pip([f"{name}{spec}"], found)))
    return out
