"""The compatibility verdict: which backend to use on a platform with a torch version, and why.

The facts live in ``compat_matrix/*.toml`` (schema: ``docs/compat-matrix.md``),
loaded and validated by :mod:`accelport.compat.schema`, extended by plugins through
``accelport_compat_rows`` and by the user through ``ACCELPORT_COMPAT_MATRIX``.
This module turns them into a :class:`Verdict` and into the deprecation
warnings emitted when a backend is selected. It never imports torch: the
installed torch version is read from package metadata.
"""

from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from accelport import _packages
from accelport.compat.load import Matrix, build
from accelport.compat.schema import (
    OVERRIDE_ENV,
    STATUSES,
    WORKING,
    Minor,
    Row,
    Source,
    minor_str,
    parse_torch_version,
)
from accelport.errors import CompatibilityWarning, InvalidVersionError, UnknownPlatformError, warn_user
from accelport.platform import PLATFORMS

__all__ = [
    "Verdict",
    "BackendStatus",
    "Combination",
    "recommend",
    "default_matrix",
    "parse_torch_version",
    "STATUSES",
]

_ALTERNATIVES = 3


@dataclass(frozen=True)
class BackendStatus:
    """One backend's standing in a verdict: its matrix row, narrowed to this torch and chip.

    ``status`` and ``message`` may differ from the row's (a chip the row does not
    cover makes it unsupported); the row's other facts are read through as they are.
    """

    row: Row
    status: str
    message: str
    #: The paired package pinned for this torch minor (e.g. ``torch_xla==2.9.*``), if any.
    requires: str | None

    @property
    def backend(self) -> str:
        return self.row.backend

    @property
    def torch(self) -> str:
        return self.row.torch_range

    @property
    def sources(self) -> tuple[Source, ...]:
        return self.row.sources

    @property
    def as_of(self) -> _dt.date:
        return self.row.as_of

    @property
    def python(self) -> tuple[str, str] | None:
        return self.row.python

    @property
    def chips(self) -> tuple[str, ...]:
        return self.row.chips

    @property
    def replacement(self) -> str | None:
        return self.row.replacement

    @property
    def confirmed(self) -> bool:
        return self.row.confirmed

    @property
    def note(self) -> str | None:
        return self.row.note

    @property
    def origin(self) -> str:
        return self.row.where

    def to_dict(self) -> dict[str, Any]:
        out = self.row.to_dict()
        for key in ("platform", "package", "package_version"):  # the verdict says these once
            del out[key]
        out.update(status=self.status, message=self.message, requires=self.requires)
        return out


@dataclass(frozen=True)
class Combination:
    """A combination that works on the platform: torch minor, backend, status, paired package."""

    torch: str
    backend: str
    status: str
    requires: str | None = None

    def describe(self) -> str:
        extra = f"; {self.requires}" if self.requires else ""
        return f"torch {self.torch} with {self.backend} ({self.status}{extra})"

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Verdict:
    """What the matrix says for one platform and torch version.

    ``ranked`` lists the backends that run, best status first (recommended,
    supported, experimental, deprecated); the default selection policy takes
    the first available one. ``backends`` holds every backend's status,
    message and sources. ``unverified`` is True when the torch version is
    newer than every row and the newest row was used instead.
    """

    platform: str
    torch_version: str | None
    ranked: tuple[str, ...]
    statuses: Mapping[str, str] = field(default_factory=dict)
    backends: Mapping[str, BackendStatus] = field(default_factory=dict)
    row_torch: str | None = None
    unverified: bool = False
    alternatives: tuple[Combination, ...] = ()
    chip: str | None = None
    reason: str = ""
    as_of: _dt.date | None = None

    @property
    def recommended(self) -> str | None:
        """The backend whose status is ``recommended``, or None."""
        for name in self.ranked:
            if self.statuses.get(name) == "recommended":
                return name
        return None

    def status(self, backend: str) -> str:
        """``backend``'s status; a backend without a row here is ``unsupported``."""
        return self.statuses.get(backend, "unsupported")

    @property
    def sources(self) -> tuple[Source, ...]:
        seen: dict[Source, None] = {}
        for st in self.backends.values():
            for s in st.sources:
                seen.setdefault(s, None)
        return tuple(seen)

    def to_dict(self) -> dict[str, Any]:
        return {
            "platform": self.platform,
            "chip": self.chip,
            "torch_version": self.torch_version,
            "row_torch": self.row_torch,
            "unverified": self.unverified,
            "recommended": self.recommended,
            "ranked": list(self.ranked),
            "reason": self.reason,
            "backends": [b.to_dict() for b in self.backends.values()],
            "alternatives": [a.to_dict() for a in self.alternatives],
            "sources": [s.to_dict() for s in self.sources],
            "as_of": self.as_of.isoformat() if self.as_of else None,
        }


# -- building a verdict --------------------------------------------------------------------


def default_matrix(environ: Mapping[str, str] | None = None) -> Matrix:
    """The matrix without a plugin host: shipped rows under ``environ``'s ``ACCELPORT_COMPAT_MATRIX`` files.

    Callers that have a plugin host (the runtime, doctor, the CLI) build theirs with
    :func:`accelport.compat.load.build` and pass it as ``matrix=``.
    """
    return build(None, os.environ if environ is None else environ)


def _effective(row: Row, chip: str | None) -> tuple[str, str]:
    """The row's status and message, narrowed to ``chip`` when the row lists the chips it supports."""
    if row.chips and chip and chip.lower() not in {c.lower() for c in row.chips}:
        return "unsupported", (f"{row.backend} runs only on {', '.join(row.chips)}; this machine has {chip}. "
                               + row.message)
    return row.status, row.message


def _status(row: Row, m: Minor, chip: str | None) -> BackendStatus:
    status, message = _effective(row, chip)
    return BackendStatus(row, status, message, row.requirement(m))


def _alternatives(mx: Matrix, platform: str, target: Minor, chip: str | None) -> tuple[Combination, ...]:
    """Per backend, its best-status nearest working torch minor other than ``target``; best first."""
    best: dict[str, tuple[tuple[int, int, int], Combination]] = {}
    for m in mx.minors(platform):
        if m == target:
            continue
        for backend in mx.backends(platform):
            row = mx.lookup(platform, backend, m)
            if row is None:
                continue
            status, _ = _effective(row, chip)
            if status not in WORKING:
                continue
            distance = abs(m[1] - target[1]) if m[0] == target[0] else 1000 + abs(m[0] - target[0])
            key = (STATUSES.index(status), distance, -m[1])
            if backend not in best or key < best[backend][0]:
                best[backend] = (key, Combination(minor_str(m), backend, status, row.requirement(m)))
    return tuple(c for _, c in sorted(best.values(), key=lambda kc: kc[0]))[:_ALTERNATIVES]


def recommend(
    platform: str | None = None,
    torch_version: str | None = None,
    *,
    chip: str | None = None,
    matrix: Matrix | None = None,
    environ: Mapping[str, str] | None = None,
    warn: bool = True,
) -> Verdict:
    """The verdict for ``platform`` and ``torch_version``.

    Defaults: the detected platform (and its chip) and the installed torch
    (read from metadata, never imported). Raises UnknownPlatformError for an
    unknown platform and InvalidVersionError for a ``torch_version`` that is
    not PEP 440. A torch newer than every row is judged by the newest row, the
    verdict is marked ``unverified`` and a CompatibilityWarning says so.
    ``matrix`` defaults to :func:`default_matrix` of ``environ`` (default: the process's).
    """
    if platform is None:
        from accelport.platform import detect

        found = detect(environ=environ)
        platform, chip = found.name, chip or found.chip
    elif platform not in PLATFORMS:
        raise UnknownPlatformError(str(platform), PLATFORMS)
    mx = matrix if matrix is not None else default_matrix(environ)
    explicit = torch_version is not None
    tv = torch_version if explicit else _packages.version("torch")
    covered = mx.covered(platform)
    if tv is None:
        return Verdict(platform, None, (), chip=chip, as_of=mx.as_of,
                       reason=f"torch is not installed (pip install torch; the matrix covers torch {covered})")
    try:
        wanted = parse_torch_version(tv, covered)
    except InvalidVersionError:
        if explicit:
            raise
        return Verdict(platform, tv, (), chip=chip, as_of=mx.as_of,
                       reason=f"the installed torch version {tv!r} is not a PEP 440 version; no verdict")
    minors = mx.minors(platform)
    if not minors:
        return Verdict(platform, tv, (), chip=chip, as_of=mx.as_of,
                       reason=f"the compatibility matrix has no rows for {platform}")
    on = f"{platform} with torch {tv}"
    if wanted < minors[0]:
        newer = _alternatives(mx, platform, wanted, chip)
        return Verdict(platform, tv, (), row_torch=None, chip=chip, alternatives=newer, as_of=mx.as_of,
                       reason=(f"torch {tv} is older than the matrix covers for {platform} ({covered}): "
                               f"upgrade torch; nearest working: {_join(newer)}"))
    row_minor, unverified = wanted, False
    if wanted > minors[-1]:
        row_minor, unverified = minors[-1], True
        if warn:
            warn_user(f"torch {tv} is newer than every row of the compatibility matrix for {platform} "
                      f"(newest: {minor_str(minors[-1])}); accelport uses the {minor_str(minors[-1])} row, "
                      "which is unverified for this torch. Check the vendors' release notes, or add rows with "
                      f"{OVERRIDE_ENV}=/path/file.toml.", CompatibilityWarning)
    backends: dict[str, BackendStatus] = {}
    for backend in mx.backends(platform):
        row = mx.lookup(platform, backend, row_minor)
        if row is not None:
            backends[backend] = _status(row, row_minor, chip)
    order = list(backends)
    ranked = tuple(sorted((b for b in order if backends[b].status in WORKING),
                          key=lambda b: (STATUSES.index(backends[b].status), order.index(b))))
    statuses = {b: s.status for b, s in backends.items()}
    alts: tuple[Combination, ...] = ()
    caveat = (f" (judged by the torch {minor_str(row_minor)} row: torch {tv} is newer than the matrix, "
              "so this is unverified)") if unverified else ""
    rec = next((b for b in ranked if statuses[b] == "recommended"), None)
    if rec is not None:
        reason = f"{rec} is recommended for {on}{caveat}: {backends[rec].message}"
    else:
        alts = _alternatives(mx, platform, row_minor, chip)
        best = f"; {ranked[0]} is {statuses[ranked[0]]}: {backends[ranked[0]].message}" if ranked else ""
        near = f"; nearest working: {_join(alts)}" if alts else ""
        reason = f"no backend is recommended for {on}{caveat}{best}{near}"
    return Verdict(platform, tv, ranked, statuses, backends, minor_str(row_minor), unverified, alts, chip,
                   reason, mx.as_of)


def _join(combos: tuple[Combination, ...]) -> str:
    return ", ".join(c.describe() for c in combos) or "none"
