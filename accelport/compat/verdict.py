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
import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from accelport import _packages
from accelport.compat.load import Matrix, build
from accelport.compat.machine import CHIPS, chip_name, in_range, parse_python, python_key, this_python
from accelport.compat.schema import (
    OVERRIDE_ENV,
    STATUSES,
    WORKING,
    Minor,
    Release,
    Row,
    Source,
    minor_str,
    parse_torch_version,
)
from accelport.errors import (
    CompatibilityWarning,
    InvalidVersionError,
    UnknownChipError,
    UnknownPlatformError,
    warn_user,
)
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
    """One backend's standing in a verdict: its matrix row, narrowed to this torch, chip and Python.

    ``status`` and ``message`` may differ from the row's (a chip the row does not
    cover, or a Python the paired package has no wheel for, makes it unsupported);
    the row's other facts are read through as they are.
    """

    row: Row
    status: str
    message: str
    #: The paired package pinned for this torch minor (e.g. ``torch_xla==2.9.*``), if any.
    requires: str | None
    #: The patch release to install for this torch minor, when the data names one.
    release: Release | None = None
    #: Patch releases of this torch minor with a known problem (each links its issue).
    known_bad: tuple[Release, ...] = ()

    @property
    def install(self) -> str | None:
        """The requirement to install: ``requires`` narrowed to the recommended patch (``torch_xla[tpu]==2.8.1``)."""
        if self.release is None or self.row.package is None:
            return self.requires
        return f"{self.row.package}=={self.release.version}"

    @property
    def pip_options(self) -> tuple[str, ...]:
        """What pip needs besides the requirements: AWS's index, Google's libtpu page."""
        out: list[str] = []
        index = self.row.index or (self.release.index if self.release else None)
        links = self.row.find_links or (self.release.find_links if self.release else None)
        if index:
            out += ["--extra-index-url", index]
        if links:
            out += ["-f", links]
        return tuple(out)

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
        out.update(status=self.status, message=self.message, requires=self.requires, install=self.install,
                   pip_options=list(self.pip_options),
                   release=self.release.to_dict() if self.release else None,
                   known_bad=[r.to_dict() for r in self.known_bad])
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
    #: The Python major.minor judged ("3.12"), and whether it was given (else: this machine's).
    python: str | None = None
    python_given: bool = False

    @property
    def subject(self) -> str:
        """What was asked, in words: ``aws-neuron (trn1) with torch 2.14 on Python 3.12``."""
        chip = f" ({self.chip})" if self.chip else ""
        torch = f" with torch {self.torch_version}" if self.torch_version else ""
        py = f" on Python {self.python}" if self.python else ""
        return f"{self.platform}{chip}{torch}{py}"

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
            "python": self.python,
            "python_from": "given" if self.python_given else "this machine",
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


@dataclass(frozen=True)
class _Query:
    """What the rows are narrowed to: a chip, a Python, and whether torch's own wheels must fit it."""

    chip: str | None
    python: str
    #: Check that torch's wheels exist for ``python`` (not when torch is installed on this very Python).
    torch_python: bool
    #: Installed versions by pip name when ``python`` is this machine's: an installed package has a wheel here.
    installed: Callable[[str], str | None] | None


def _same_chip(a: str, b: str) -> bool:
    return (chip_name(a) or a.strip().lower()) == (chip_name(b) or b.strip().lower())


def _nearest_python(python: str, bounds: tuple[str, str]) -> str:
    return bounds[1] if python_key(python) > python_key(bounds[1]) else bounds[0]


def _effective(row: Row, m: Minor, q: _Query, mx: Matrix) -> tuple[str, str]:
    """The row's status and message, narrowed to the chip and Python of ``q``.

    Only a working status is narrowed: an unsupported row's own message says more.
    """
    if row.status not in WORKING:
        return row.status, row.message
    if row.chips and q.chip and not any(_same_chip(q.chip, c) for c in row.chips):
        return "unsupported", (f"{row.backend} does not run on {q.chip} (only on {', '.join(row.chips)}). "
                               + (row.other_chips or row.message))
    py = q.python
    info = mx.torch.get(m)
    if q.torch_python and info is not None and not in_range(py, info.python):
        lo, hi = info.python
        return "unsupported", (f"torch {minor_str(m)} has no wheels for Python {py} (only {lo} to {hi}): "
                               f"use Python {_nearest_python(py, info.python)}, or a torch release with "
                               f"Python {py} wheels.")
    if row.python is not None and not in_range(py, row.python):
        name = row.package_name or row.backend
        spec = (row.package_version or "").replace("{torch}", minor_str(m)) or ">=0"
        have = q.installed(name) if q.installed is not None and row.package else None
        if not (have and _packages.satisfies(have, spec)):
            lo, hi = row.python
            return "unsupported", (f"{name} for torch {minor_str(m)} has no wheel for Python {py} (only {lo} to "
                                   f"{hi}), so pip cannot install it: use Python {_nearest_python(py, row.python)}, "
                                   f"where {row.backend} is {row.status}.")
    return row.status, row.message


def _status(row: Row, m: Minor, q: _Query, mx: Matrix) -> BackendStatus:
    status, message = _effective(row, m, q, mx)
    release = mx.recommended_release(row.package, m) if row.package else None
    bad = tuple(r for r in mx.releases_of(row.package, m) if r.status == "bad") if row.package else ()
    return BackendStatus(row, status, message, row.requirement(m), release, bad)


def _alternatives(mx: Matrix, platform: str, target: Minor, q: _Query) -> tuple[Combination, ...]:
    """Per backend, its best-status nearest working torch minor other than ``target``; best first."""
    # Another torch minor is not installed: its wheels must exist for this Python.
    q = replace(q, torch_python=True)
    best: dict[str, tuple[tuple[int, int, int], Combination]] = {}
    for m in mx.minors(platform):
        if m == target:
            continue
        for backend in mx.backends(platform):
            row = mx.lookup(platform, backend, m)
            if row is None:
                continue
            st = _status(row, m, q, mx)
            if st.status not in WORKING:
                continue
            distance = abs(m[1] - target[1]) if m[0] == target[0] else 1000 + abs(m[0] - target[0])
            key = (STATUSES.index(st.status), distance, -m[1])
            if backend not in best or key < best[backend][0]:
                best[backend] = (key, Combination(minor_str(m), backend, st.status, st.install))
    return tuple(c for _, c in sorted(best.values(), key=lambda kc: kc[0]))[:_ALTERNATIVES]


def recommend(
    platform: str | None = None,
    torch_version: str | None = None,
    *,
    chip: str | None = None,
    python: str | None = None,
    matrix: Matrix | None = None,
    environ: Mapping[str, str] | None = None,
    warn: bool = True,
) -> Verdict:
    """The verdict for ``platform``, ``torch_version``, ``chip`` and ``python``.

    Defaults: the detected platform (and its chip), the installed torch (read
    from metadata, never imported) and the running Python. A known ``chip``
    (``trn1``, ``v6e``; see :data:`accelport.compat.machine.CHIPS`, aliases such as
    "Trainium2" accepted) implies its platform; a chip the data does not name is
    kept as given (a detected GPU model). A row that lists its chips makes the
    backend ``unsupported`` on another chip; a row whose package has no wheel for
    ``python`` does too (unless that package is installed on this very Python).
    Raises UnknownPlatformError, UnknownChipError (a chip of another platform),
    InvalidVersionError and InvalidPythonVersionError. A torch newer than every
    row is judged by the newest row, marked ``unverified``, with a CompatibilityWarning.
    ``matrix`` defaults to :func:`default_matrix` of ``environ`` (default: the process's).
    """
    known_chip = chip_name(chip) if chip else None
    if known_chip is not None:
        chip = known_chip
        home = CHIPS[known_chip].platform
        if platform is None:
            platform = home
        elif platform in PLATFORMS and platform != home:
            raise UnknownChipError(known_chip, [c.name for c in CHIPS.values() if c.platform == platform],
                                   platform=platform)
    if platform is None:
        from accelport.platform import detect

        found = detect(environ=environ)
        platform, chip = found.name, chip or chip_name(found.chip) or found.chip
    elif platform not in PLATFORMS:
        raise UnknownPlatformError(str(platform), PLATFORMS)
    mx = matrix if matrix is not None else default_matrix(environ)
    python_given = python is not None
    py = parse_python(str(python), mx.pythons()) if python_given else this_python()
    explicit = torch_version is not None
    tv = torch_version if explicit else _packages.version("torch")
    covered = mx.covered(platform)
    make = functools.partial(Verdict, chip=chip, as_of=mx.as_of, python=py, python_given=python_given)
    if tv is None:
        return make(platform, None, (),
                    reason=f"torch is not installed (pip install torch; the matrix covers torch {covered})")
    try:
        wanted = parse_torch_version(tv, covered)
    except InvalidVersionError:
        if explicit:
            raise
        return make(platform, tv, (),
                    reason=f"the installed torch version {tv!r} is not a PEP 440 version; no verdict")
    minors = mx.minors(platform)
    if not minors:
        return make(platform, tv, (), reason=f"the compatibility matrix has no rows for {platform}")
    # An installed torch on the running Python proves its wheel exists; any other combination must be checked.
    installed_torch = not python_given and (not explicit or tv == _packages.version("torch"))
    q = _Query(chip, py, torch_python=not installed_torch,
               installed=None if python_given else _packages.version)
    on = make(platform, tv, ()).subject
    if wanted < minors[0]:
        older = _alternatives(mx, platform, wanted, q)
        return make(platform, tv, (), row_torch=None, alternatives=older,
                    reason=(f"torch {tv} is older than the matrix covers for {platform} ({covered}): "
                            f"upgrade torch; nearest working: {_join(older)}"))
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
            backends[backend] = _status(row, row_minor, q, mx)
    order = list(backends)
    ranked = tuple(sorted((b for b in order if backends[b].status in WORKING),
                          key=lambda b: (STATUSES.index(backends[b].status), order.index(b))))
    statuses = {b: st.status for b, st in backends.items()}
    alts: tuple[Combination, ...] = ()
    caveat = (f" (judged by the torch {minor_str(row_minor)} row: torch {tv} is newer than the matrix, "
              "so this is unverified)") if unverified else ""
    rec = next((b for b in ranked if statuses[b] == "recommended"), None)
    if rec is not None:
        reason = f"{rec} is recommended for {on}{caveat}: {backends[rec].message}"
    else:
        alts = _alternatives(mx, platform, row_minor, q)
        best = f"; {ranked[0]} is {statuses[ranked[0]]}: {backends[ranked[0]].message.rstrip('.')}" if ranked else ""
        # Why the backends that would otherwise be recommended are not, when a chip or Python decided it.
        narrowed = [f"{b}: {st.message.rstrip('.')}" for b, st in backends.items()
                    if st.status == "unsupported" and st.row.status == "recommended"]
        why = f"; {'; '.join(narrowed)}" if narrowed else ""
        near = f"; nearest working: {_join(alts)}" if alts else ""
        reason = f"no backend is recommended for {on}{caveat}{why}{best}{near}"
    return make(platform, tv, ranked, statuses, backends, minor_str(row_minor), unverified, alts, reason=reason)


def _join(combos: tuple[Combination, ...]) -> str:
    return ", ".join(c.describe() for c in combos) or "none"
