"""Load the compatibility matrix: shipped TOML, plugin rows, user override files, merged.

The schema and its checks live in :mod:`accelport.compat.schema`; this module
reads the files and layers them. Nothing here imports torch.
"""

from __future__ import annotations

import datetime as _dt
import functools
import os
import sys
import warnings
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from accelport.compat.schema import (
    OVERRIDE_ENV,
    Checker,
    ChipFact,
    EnvDeprecation,
    Minor,
    Parsed,
    PeakFact,
    Release,
    Row,
    ShardingFact,
    Source,
    TorchInfo,
    check_overlaps,
    check_releases,
    minor_str,
    parse_row,
    parse_tables,
)
from accelport.errors import AccelportError, CompatMatrixError, PluginWarning
from accelport.safe_io import read_regular_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = ["Matrix", "RowSource", "load_file", "load_folder", "shipped", "build"]


class RowSource(Protocol):
    """Where plugin rows come from (the plugin host): what this module needs of it, and nothing more."""

    def call_each(self, hook: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Every plugin's answer to ``hook``, as (plugin, result), each plugin isolated."""
        ...

    def note_failure(self, name: str, stage: str, error: str) -> None:
        """Plugin ``name`` gave something unusable at ``stage``."""
        ...


#: A matrix file is a few kilobytes; a cap keeps /dev/zero or a huge file from filling memory.
MAX_FILE_BYTES = 4 << 20
_POINT_AT = (f"point {OVERRIDE_ENV} at a readable matrix TOML file (see docs/compat-matrix.md), or unset it "
             "to use the shipped matrix alone")


def _read_toml(path: str) -> dict[str, Any]:
    try:
        raw = read_regular_file(path, what=OVERRIDE_ENV, limit=MAX_FILE_BYTES)
    except AccelportError as exc:  # a directory, a FIFO, a device, too large, or it would not open
        problem = str(exc).replace(f"{OVERRIDE_ENV} {path!r} ", "", 1)
        if problem.startswith("cannot be read"):
            problem += f": {_POINT_AT}"
        raise CompatMatrixError(path, "", problem) from None
    except OSError as exc:  # it opened but a read failed: /proc/self/mem (EIO), a file on a dead mount
        raise CompatMatrixError(path, "", f"cannot be read ({exc.strerror or exc}): {_POINT_AT}") from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CompatMatrixError(path, "", f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise CompatMatrixError(path, "", f"not valid TOML: {exc}") from None


def load_file(path: str | os.PathLike[str], known_sources: Mapping[str, Source] | None = None) -> Parsed:
    """Read and validate one matrix file (shipped ids in ``known_sources`` may be cited)."""
    p = os.fspath(path)
    if known_sources is None:
        known_sources = shipped().sources
    return parse_tables(_read_toml(p), p, known_sources)


@functools.lru_cache(maxsize=1)
def shipped() -> Parsed:
    """The data shipped in ``accelport.compat_matrix`` (read once per process)."""
    from importlib.resources import files

    return load_folder(files("accelport.compat_matrix"), "accelport.compat_matrix")


def load_folder(folder: Any, origin: str | None = None) -> Parsed:
    """Every ``*.toml`` in ``folder`` (a path or a resource directory) read as one data set, like the shipped one."""
    if isinstance(folder, (str, os.PathLike)):
        import pathlib

        folder = pathlib.Path(folder)
    entries = sorted((e for e in folder.iterdir() if e.name.endswith(".toml")), key=lambda e: e.name)
    raw = []
    for entry in entries:
        name = str(entry)
        try:
            raw.append((name, tomllib.loads(entry.read_text(encoding="utf-8"))))
        except tomllib.TOMLDecodeError as exc:
            raise CompatMatrixError(name, "", f"not valid TOML: {exc}") from None
    # Source ids are shared by every shipped file: collect them all before any row cites one.
    pooled: dict[str, Source] = {}
    for origin, data in raw:
        srcs = data.get("sources", {})
        if isinstance(srcs, Mapping):
            checker = Checker(origin, {})
            for sid, s in srcs.items():
                if sid in pooled:
                    raise CompatMatrixError(origin, f"sources.{sid}", "source id already defined in another file")
                pooled[sid] = checker.source(s, f"sources.{sid}")
    total = Parsed(origin or str(folder), sources=pooled)
    for origin, data in raw:
        part = parse_tables(data, origin, pooled)
        check_overlaps(part.rows, total.rows)
        check_releases(part.releases, total.releases)
        total.rows += part.rows
        total.torch += part.torch
        total.env += part.env
        total.releases += part.releases
        total.sharding += part.sharding
        total.chips += part.chips
        total.peaks += part.peaks
    return total


def _plugin_rows(host: RowSource) -> list[Row]:
    """Rows from ``accelport_compat_rows``; an invalid plugin's rows are dropped with a PluginWarning."""
    cache = _PLUGIN_CACHE.get(host)
    if cache is not None:
        return cache
    base = shipped()
    accepted: list[Row] = list(base.rows)
    mine: list[Row] = []
    # The host calls each plugin isolated; what a plugin returned is checked here, against the schema.
    for plugin, result in host.call_each("accelport_compat_rows"):
        origin = f"plugin {plugin!r}"
        try:
            if isinstance(result, (str, bytes, Mapping)) or not isinstance(result, Sequence):
                raise CompatMatrixError(origin, "", "accelport_compat_rows must return a list of row tables")
            c = Checker(origin, base.sources)
            rows = [parse_row(c, r, f"rows[{i}]", None, None) for i, r in enumerate(result)]
            check_overlaps(rows)
            check_overlaps(rows, accepted, adding=True)
        except CompatMatrixError as exc:
            host.note_failure(plugin, "hook accelport_compat_rows", f"{type(exc).__name__}: {exc}")
            warnings.warn(f"accelport plugin {plugin!r}: its compatibility rows were ignored: {exc}",
                          PluginWarning, stacklevel=2)
            continue
        accepted += rows
        mine += rows
    _PLUGIN_CACHE[host] = mine
    return mine


_PLUGIN_CACHE: weakref.WeakKeyDictionary[RowSource, list[Row]] = weakref.WeakKeyDictionary()


class Matrix:
    """The merged matrix: shipped rows and plugin rows, under the user's override files.

    Lookups take the first matching layer: later override files win over
    earlier ones, and any override file wins over the shipped and plugin rows.
    """

    def __init__(self, base: Sequence[Row], overrides: Sequence[Sequence[Row]] = (),
                 torch: Iterable[TorchInfo] = (), env: Iterable[EnvDeprecation] = (),
                 origins: Sequence[str] = (), releases: Iterable[Release] = (),
                 sharding: Iterable[ShardingFact] = (), chips: Iterable[ChipFact] = (),
                 peaks: Iterable[PeakFact] = ()) -> None:
        self.layers: list[list[Row]] = [list(layer) for layer in reversed(overrides)] + [list(base)]
        # Patch releases, shipped first: a later entry for the same package and version replaces it.
        merged: dict[tuple[str, str], Release] = {}
        for r in releases:
            merged.pop((r.name, r.version), None)
            merged[(r.name, r.version)] = r
        self.releases: list[Release] = list(merged.values())
        self.torch: dict[Minor, TorchInfo] = {}
        for info in torch:
            self.torch[info.version] = info  # later entries (overrides) replace earlier ones
        self.env: dict[str, EnvDeprecation] = {}
        for e in env:
            self.env[e.name] = e
        self.origins = list(origins)
        #: Later entries (override files) first: they win in :meth:`sharding_for`.
        self.sharding: list[ShardingFact] = list(reversed(list(sharding)))
        #: Each chip's memory, by matrix chip name; a later entry (an override file) replaces an earlier one.
        self.chips: dict[str, ChipFact] = {}
        for fact in chips:
            self.chips[fact.name] = fact
        #: Each chip's peak FLOP/s, by name; a later entry (an override file) replaces an earlier one.
        self.peaks: dict[str, PeakFact] = {}
        for peak in peaks:
            self.peaks[peak.name] = peak

    def peak_for(self, device: str | None) -> PeakFact | None:
        """The peak FLOP/s of a device: a matrix chip name ("v5e", "Trainium2") or a GPU's name
        ("NVIDIA H100 80GB HBM3"); the first entry that matches, None if none does."""
        if not device or not isinstance(device, str):
            return None
        return next((p for p in self.peaks.values() if p.matches(device)), None)

    @property
    def rows(self) -> list[Row]:
        return [row for layer in self.layers for row in layer]

    def backends(self, platform: str) -> list[str]:
        """Backends with rows on ``platform``, in the order the data lists them."""
        seen: dict[str, None] = {}
        for layer in reversed(self.layers):
            for row in layer:
                if row.platform == platform:
                    seen.setdefault(row.backend, None)
        return list(seen)

    def minors(self, platform: str | None = None) -> list[Minor]:
        """Every torch minor some row covers (on ``platform``), ascending."""
        found: set[Minor] = set()
        for row in self.rows:
            if platform is None or row.platform == platform:
                found.update((row.torch_min[0], n) for n in range(row.torch_min[1], row.torch_max[1] + 1))
        return sorted(found)

    def lookup(self, platform: str, backend: str, m: Minor) -> Row | None:
        for layer in self.layers:
            for row in layer:
                if row.platform == platform and row.backend == backend and row.covers(m):
                    return row
        return None

    def sharding_for(self, backend: str, m: Minor) -> ShardingFact | None:
        """Whether ``ap.shard``'s engine exists for ``backend`` with torch minor ``m`` (None: unknown)."""
        return next((f for f in self.sharding if f.covers(backend, m)), None)

    @property
    def as_of(self) -> _dt.date | None:
        dates = [row.as_of for row in self.rows]
        return max(dates) if dates else None

    def covered(self, platform: str | None = None) -> str:
        ms = self.minors(platform)
        return f"{minor_str(ms[0])} to {minor_str(ms[-1])}" if ms else "nothing"

    def pythons(self) -> list[str]:
        """Every Python minor some torch entry or row names, ascending ("3.8" ... "3.15")."""
        from accelport.compat.machine import python_key, python_range

        found: set[str] = set()
        for bounds in [t.python for t in self.torch.values()] + [r.python for r in self.rows]:
            if bounds is not None:
                found.update(python_range(*bounds))
        return sorted(found, key=python_key)

    def releases_of(self, package: str, m: Minor | None = None) -> list[Release]:
        """The patch releases of ``package`` (any spelling; extras ignored), for torch minor ``m`` if given."""
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name

        name = canonicalize_name(Requirement(package).name)
        return [r for r in self.releases if r.name == name and (m is None or r.torch == m)]

    def recommended_release(self, package: str, m: Minor) -> Release | None:
        """The release to install of ``package`` for torch minor ``m`` (an override file's wins)."""
        found = [r for r in self.releases_of(package, m) if r.status == "recommended"]
        return found[-1] if found else None

    def release(self, package: str, installed: str) -> Release | None:
        """The entry an installed version of ``package`` is, or None (exact versions before prefixes)."""
        hits = [r for r in self.releases_of(package) if r.matches(installed)]
        hits.sort(key=lambda r: r.version.endswith(".*"))
        return hits[0] if hits else None


def build(host: RowSource | None = None, environ: Mapping[str, str] | None = None) -> Matrix:
    """The matrix in effect: shipped data, ``host``'s plugin rows, then ``ACCELPORT_COMPAT_MATRIX`` files."""
    env = os.environ if environ is None else environ
    base = shipped()
    rows = list(base.rows)
    origins = [base.origin]
    if host is not None:
        extra = _plugin_rows(host)
        rows += extra
        origins += sorted({r.origin for r in extra})
    overrides: list[list[Row]] = []
    torch = list(base.torch)
    envs = list(base.env)
    releases = list(base.releases)
    sharding = list(base.sharding)
    chips = list(base.chips)
    peaks = list(base.peaks)
    for path in (p for p in env.get(OVERRIDE_ENV, "").split(os.pathsep) if p.strip()):
        part = load_file(path.strip(), base.sources)
        overrides.append(part.rows)
        torch += part.torch
        envs += part.env
        releases += part.releases
        sharding += part.sharding
        chips += part.chips
        peaks += part.peaks
        origins.append(part.origin)
    return Matrix(rows, overrides, torch, envs, origins, releases, sharding, chips, peaks)
