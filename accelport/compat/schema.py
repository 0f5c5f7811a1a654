"""The compatibility matrix's schema: its row types and the checks every row passes.

The schema is documented in ``docs/compat-matrix.md``. Every check here raises
:class:`~accelport.errors.CompatMatrixError` naming the file (or plugin) and
the key, so a broken row is found in one read. Nothing here imports torch.
"""

from __future__ import annotations

import datetime as _dt
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from accelport.compat.machine import CHIP_PLATFORMS, CHIPS, chip_name
from accelport.errors import CompatMatrixError, InvalidVersionError, did_you_mean
from accelport.platform import PLATFORMS

__all__ = [
    "STATUSES",
    "WORKING",
    "Source",
    "Row",
    "TorchInfo",
    "EnvDeprecation",
    "Release",
    "RELEASE_STATUSES",
    "ShardingFact",
    "ChipFact",
    "PeakFact",
    "PEAK_DTYPES",
    "parse_torch_version",
    "minor_str",
    "OVERRIDE_ENV",
]

#: Every status a row may have, best first. The order ranks backends for selection.
STATUSES: tuple[str, ...] = ("recommended", "supported", "experimental", "deprecated", "unsupported")
#: Statuses under which a backend runs at all (selection may pick them; CI may test them).
WORKING: tuple[str, ...] = STATUSES[:4]
#: The environment variable naming the user's own matrix files (os.pathsep separated).
OVERRIDE_ENV = "ACCELPORT_COMPAT_MATRIX"

Minor = tuple[int, int]

_MINOR_RE = re.compile(r"^(\d{1,3})\.(\d{1,3})$")
#: torch has had 2 majors and about 15 minors; a larger number in a row is a typo, and a range up to
#: it would make every lookup walk millions of minors.
MAX_MINOR = 99
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")
_ENV_RE = re.compile(r"^[A-Z_][A-Z0-9_]*$")
FILE_KEYS = ("schema", "platform", "as_of", "sources", "rows", "torch", "env", "releases", "sharding", "chips",
             "peaks")
ROW_KEYS = ("platform", "backend", "torch", "status", "message", "package", "package_version",
             "python", "chips", "other_chips", "index", "find_links", "replacement", "as_of", "sources",
             "confirmed", "note")
RELEASE_KEYS = ("package", "version", "torch", "status", "message", "python", "pins", "neuron_sdk", "index",
                "find_links", "issue", "as_of", "sources", "confirmed", "note")
#: A patch release's standing within its torch minor, best first.
RELEASE_STATUSES: tuple[str, ...] = ("recommended", "superseded", "bad")
_RELEASE_RE = re.compile(r"^\d+(\.\d+)+(\.\*)?$")
TORCH_KEYS = ("version", "python", "as_of", "sources", "confirmed", "note")
ENV_KEYS = ("name", "message", "replacement", "backends", "as_of", "sources")
SHARDING_KEYS = ("backends", "torch", "available", "engine", "message", "sources")
SOURCE_KEYS = ("title", "url", "note")
CHIP_KEYS = ("chip", "hbm_gib", "devices", "as_of", "sources", "confirmed", "note")
#: No accelerator chip has this much memory (GiB): a larger figure is a typo.
MAX_HBM_GIB = 4096
PEAK_KEYS = ("chip", "title", "match", "tflops", "tile", "tile_unit", "tile_sources", "as_of", "sources",
             "confirmed", "note")
#: The dtypes a peak may be given for (dense matrix work; never the with-sparsity figure), the one a chip is
#: usually quoted by first.
PEAK_DTYPES = ("bf16", "fp16", "fp8", "int8", "tf32", "fp32")
#: No chip does this many TFLOP/s in one dtype (dense): a larger figure is a typo.
MAX_TFLOPS = 100_000


def minor_str(m: Minor) -> str:
    return f"{m[0]}.{m[1]}"


#: Longer is no torch version (2.10.0a0+git1234567 is 18 characters; a full git hash label about 60).
_MAX_VERSION_CHARS = 200


def parse_torch_version(text: str, covered: str = "") -> Minor:
    """(major, minor) of a PEP 440 torch version: ``2.10.0a0+git1234`` -> (2, 10).

    Pre-releases, dev builds and local labels map to the minor they lead up to
    (a 2.15 nightly is judged by the 2.15 row). Raises InvalidVersionError.
    """
    if not isinstance(text, str) or not text.strip():
        raise InvalidVersionError(str(text), covered)
    if len(text) > _MAX_VERSION_CHARS:  # before Version(): int() refuses numbers of more than 4300 digits
        raise InvalidVersionError(f"{text[:20]}... ({len(text)} characters)", covered)
    try:
        release = Version(text.strip()).release
    except (InvalidVersion, ValueError):
        raise InvalidVersionError(text, covered) from None
    return (release[0], release[1] if len(release) > 1 else 0)


@dataclass(frozen=True)
class Source:
    """Where a fact comes from: a title a person can search for and a URL."""

    title: str
    url: str
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"title": self.title, "url": self.url}
        if self.note:
            d["note"] = self.note
        return d


@dataclass(frozen=True)
class Row:
    """One backend's status on one platform over an inclusive range of torch minors."""

    platform: str
    backend: str
    torch_min: Minor
    torch_max: Minor
    status: str
    message: str
    as_of: _dt.date
    sources: tuple[Source, ...]
    package: str | None = None
    package_version: str | None = None
    python: tuple[str, str] | None = None
    chips: tuple[str, ...] = ()
    replacement: str | None = None
    confirmed: bool = True
    note: str | None = None
    origin: str = ""
    key: str = ""
    #: What to do on a chip not in ``chips`` (the alternative path), said instead of ``message`` there.
    other_chips: str | None = None
    #: The package index (``--extra-index-url``) that serves ``package``, when PyPI does not.
    index: str | None = None
    #: A page pip needs with ``-f`` to find ``package``'s pinned dependencies (Google's libtpu releases).
    find_links: str | None = None

    def covers(self, m: Minor) -> bool:
        return self.torch_min <= m <= self.torch_max

    @property
    def torch_range(self) -> str:
        lo, hi = minor_str(self.torch_min), minor_str(self.torch_max)
        return lo if lo == hi else f"{lo}-{hi}"

    def requirement(self, m: Minor) -> str | None:
        """The pip requirement of the paired package for torch minor ``m`` (``torch_xla==2.9.*``)."""
        if not self.package:
            return None
        return self.package + (self.package_version or "").replace("{torch}", minor_str(m))

    @property
    def where(self) -> str:
        return f"{self.origin} {self.key}".strip()

    @property
    def package_name(self) -> str | None:
        """The pip name of ``package`` without extras (``torch_xla[tpu]`` -> ``torch_xla``)."""
        return Requirement(self.package).name if self.package else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "platform": self.platform,
            "backend": self.backend,
            "torch": self.torch_range,
            "status": self.status,
            "message": self.message,
            "package": self.package,
            "package_version": self.package_version,
            "python": list(self.python) if self.python else None,
            "chips": list(self.chips),
            "other_chips": self.other_chips,
            "index": self.index,
            "find_links": self.find_links,
            "replacement": self.replacement,
            "confirmed": self.confirmed,
            "note": self.note,
            "as_of": self.as_of.isoformat(),
            "sources": [s.to_dict() for s in self.sources],
            "origin": self.where,
        }


@dataclass(frozen=True)
class Release:
    """One patch release of a paired package: its standing in its torch minor and what it pairs with.

    ``version`` is exact (``2.8.1``) or a prefix ending in ``.*`` (``2.13.3.0.*``: AWS
    publishes build numbers after it). ``pins`` are the runtime pairings: the version
    of each companion package this release works with (torch_xla's ``tpu`` extra pins
    libtpu; a Neuron SDK release ships torch-neuronx with one neuronx-cc).
    """

    package: str
    version: str
    torch: Minor
    status: str
    message: str
    as_of: _dt.date
    sources: tuple[Source, ...]
    python: tuple[str, str] | None = None
    pins: tuple[tuple[str, str], ...] = ()
    neuron_sdk: tuple[str, ...] = ()
    index: str | None = None
    find_links: str | None = None
    issue: str | None = None
    confirmed: bool = True
    note: str | None = None
    origin: str = ""
    key: str = ""

    @property
    def name(self) -> str:
        """The canonical pip name (``torch_xla`` -> ``torch-xla``), for comparisons."""
        return canonicalize_name(self.package)

    @property
    def pin(self) -> str:
        """The requirement that installs exactly this release (``torch_xla==2.8.1``)."""
        return f"{self.package}=={self.version}"

    def matches(self, installed: str) -> bool:
        """Whether an installed version is this release (local labels such as ``+cpu`` ignored)."""
        try:
            found = Version(installed)
        except InvalidVersion:
            return False
        public = Version(found.public)
        return SpecifierSet(f"=={self.version}").contains(public, prereleases=True)

    def to_dict(self) -> dict[str, Any]:
        return {
            "package": self.package, "version": self.version, "torch": minor_str(self.torch),
            "status": self.status, "message": self.message,
            "python": list(self.python) if self.python else None, "pins": dict(self.pins),
            "neuron_sdk": list(self.neuron_sdk), "index": self.index, "find_links": self.find_links,
            "issue": self.issue, "confirmed": self.confirmed, "note": self.note,
            "as_of": self.as_of.isoformat(), "sources": [s.to_dict() for s in self.sources],
        }


@dataclass(frozen=True)
class TorchInfo:
    """Facts about one torch minor release that do not depend on the platform."""

    version: Minor
    python: tuple[str, str]
    sources: tuple[Source, ...]
    confirmed: bool = True
    note: str | None = None


@dataclass(frozen=True)
class EnvDeprecation:
    """A deprecated environment variable: what to do instead, and why we say so."""

    name: str
    message: str
    replacement: str
    sources: tuple[Source, ...]
    as_of: _dt.date | None = None
    backends: tuple[str, ...] = ()


@dataclass(frozen=True)
class ShardingFact:
    """Whether ``ap.shard``'s engine exists for these backends over a range of torch minors."""

    backends: tuple[str, ...]
    torch_min: Minor
    torch_max: Minor
    available: bool
    engine: str
    message: str
    sources: tuple[Source, ...]

    def covers(self, backend: str, m: Minor) -> bool:
        return backend in self.backends and self.torch_min <= m <= self.torch_max

    def to_dict(self) -> dict[str, Any]:
        return {"backends": list(self.backends), "torch": [minor_str(self.torch_min), minor_str(self.torch_max)],
                "available": self.available, "engine": self.engine, "message": self.message,
                "sources": [s.to_dict() for s in self.sources]}


@dataclass(frozen=True)
class ChipFact:
    """One chip's memory: HBM per chip, and how many devices torch sees on it (each gets an equal share)."""

    name: str
    hbm_bytes: int
    devices: int
    sources: tuple[Source, ...]
    as_of: _dt.date | None = None
    confirmed: bool = True
    note: str | None = None
    origin: str = ""
    key: str = ""

    @property
    def device_bytes(self) -> int:
        """HBM per device (a TorchTPU device on TPU7x is half a chip)."""
        return self.hbm_bytes // self.devices

    @property
    def title(self) -> str:
        return CHIPS[self.name].title

    def to_dict(self) -> dict[str, Any]:
        return {"chip": self.name, "title": self.title, "hbm_bytes": self.hbm_bytes, "devices": self.devices,
                "device_bytes": self.device_bytes, "confirmed": self.confirmed, "note": self.note,
                "as_of": self.as_of.isoformat() if self.as_of else None,
                "sources": [s.to_dict() for s in self.sources]}


@dataclass(frozen=True)
class PeakFact:
    """One chip's peak FLOP/s per dtype (dense), and the tile its matrix unit works in, each with sources.

    ``name`` is the matrix's chip name for TPU and Neuron chips; for GPUs (which the matrix names by
    model) a name of its own, and ``match`` the regular expression that finds it in the device's name
    ("NVIDIA H100 80GB HBM3"). ``tflops`` is empty where no published figure was found ("unknown").
    """

    name: str
    title: str
    tflops: Mapping[str, float]
    sources: tuple[Source, ...]
    tile: int | None = None
    tile_unit: str = "matrix unit"
    tile_sources: tuple[Source, ...] = ()
    match: str | None = None
    as_of: _dt.date | None = None
    confirmed: bool = True
    note: str | None = None
    origin: str = ""
    key: str = ""

    @property
    def headline(self) -> str | None:
        """The dtype the chip is quoted by (its training peak): bf16 where it has one."""
        return next((d for d in PEAK_DTYPES if d in self.tflops), None)

    def matches(self, device: str) -> bool:
        """Whether a device named ``device`` (a matrix chip name, or a GPU's name) is this chip."""
        if self.match is None:
            return chip_name(device) == self.name
        return re.search(self.match, device, re.IGNORECASE) is not None

    def to_dict(self) -> dict[str, Any]:
        return {"chip": self.name, "title": self.title, "tflops": dict(self.tflops) or "unknown",
                "tile": self.tile, "tile_unit": self.tile_unit if self.tile else None, "note": self.note,
                "confirmed": self.confirmed, "sources": [s.to_dict() for s in self.sources],
                "tile_sources": [s.to_dict() for s in self.tile_sources]}


@dataclass
class Parsed:
    """What one file (or one plugin's rows) contributed."""

    origin: str
    rows: list[Row] = field(default_factory=list)
    torch: list[TorchInfo] = field(default_factory=list)
    env: list[EnvDeprecation] = field(default_factory=list)
    sources: dict[str, Source] = field(default_factory=dict)
    releases: list[Release] = field(default_factory=list)
    sharding: list[ShardingFact] = field(default_factory=list)
    chips: list[ChipFact] = field(default_factory=list)
    peaks: list[PeakFact] = field(default_factory=list)


# -- validation helpers ------------------------------------------------------------------


class Checker:
    def __init__(self, origin: str, known_sources: Mapping[str, Source]) -> None:
        self.origin = origin
        self.known_sources = known_sources

    def fail(self, key: str, problem: str) -> CompatMatrixError:
        return CompatMatrixError(self.origin, key, problem)

    def keys(self, table: Any, allowed: Sequence[str], key: str) -> Mapping[str, Any]:
        if not isinstance(table, Mapping):
            raise self.fail(key, f"expected a table, got {type(table).__name__}")
        for k in table:
            if k not in allowed:
                did = did_you_mean(str(k), allowed, aside=True)
                raise self.fail(f"{key}.{k}" if key else str(k),
                                f"unknown key{did}; allowed keys: {', '.join(allowed)}")
        return table

    def string(self, value: Any, key: str, *, required: bool = True) -> str | None:
        if value is None:
            if required:
                raise self.fail(key, "is required")
            return None
        if not isinstance(value, str):
            raise self.fail(key, f"must be a string, got {type(value).__name__} {value!r}")
        if not value.strip():
            raise self.fail(key, "must not be empty")
        return value.strip()

    def name(self, value: Any, key: str) -> str:
        text = self.string(value, key)
        assert text is not None
        if not _NAME_RE.match(text):
            raise self.fail(key, f"{text!r} is not a backend name (lower case letters, digits, '-', '_', '.')")
        return text

    def platform(self, value: Any, key: str) -> str:
        text = self.string(value, key)
        assert text is not None
        if text not in PLATFORMS:
            did = did_you_mean(text, PLATFORMS, aside=True)
            raise self.fail(key, f"unknown platform {text!r}{did}; valid platforms: {', '.join(PLATFORMS)}")
        return text

    def minor(self, value: Any, key: str) -> Minor:
        m = _MINOR_RE.match(value.strip()) if isinstance(value, str) else None
        if m is None:
            raise self.fail(key, f"{str(value)[:40]!r} is not a major.minor version such as \"2.9\"")
        major, minor = int(m.group(1)), int(m.group(2))
        if major > 9 or minor > MAX_MINOR:
            raise self.fail(key, f"{value!r} is not a torch version (major up to 9, minor up to {MAX_MINOR})")
        return (major, minor)

    def minor_range(self, value: Any, key: str) -> tuple[Minor, Minor]:
        if isinstance(value, str):
            m = self.minor(value, key)
            return m, m
        if not isinstance(value, list) or len(value) != 2:
            raise self.fail(key, f"must be \"X.Y\" or a list [\"X.Y\", \"X.Y\"] (inclusive), got {value!r}")
        lo, hi = self.minor(value[0], f"{key}[0]"), self.minor(value[1], f"{key}[1]")
        if lo[0] != hi[0]:
            raise self.fail(key, f"a range must stay within one major version, got {value!r}")
        if lo > hi:
            raise self.fail(key, f"the range {value!r} is empty: the first version is after the second")
        return lo, hi

    def date(self, value: Any, key: str, default: _dt.date | None) -> _dt.date:
        if value is None:
            if default is None:
                raise self.fail(key, "is required (a date such as 2026-12-01, here or at the top of the file)")
            return default
        if isinstance(value, _dt.datetime):
            return value.date()
        if isinstance(value, _dt.date):
            return value
        if isinstance(value, str):
            try:
                return _dt.date.fromisoformat(value)
            except ValueError:
                pass
        raise self.fail(key, f"must be a date such as 2026-12-01, got {value!r}")

    def boolean(self, value: Any, key: str, default: bool) -> bool:
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, got {value!r}")
        return value

    def strings(self, value: Any, key: str) -> tuple[str, ...]:
        if value is None:
            return ()
        if not isinstance(value, list):
            raise self.fail(key, f"must be a list of strings, got {type(value).__name__}")
        return tuple(self.string(v, f"{key}[{i}]") or "" for i, v in enumerate(value))

    def python(self, value: Any, key: str) -> tuple[str, str] | None:
        if value is None:
            return None
        lo, hi = self.minor_range(value, key)
        return minor_str(lo), minor_str(hi)

    def source(self, value: Any, key: str) -> Source:
        if isinstance(value, str):
            if value in self.known_sources:
                return self.known_sources[value]
            did = did_you_mean(value, self.known_sources, aside=True)
            raise self.fail(key, f"unknown source id {value!r}{did}; define it in a [sources] table "
                                 "or give an inline table {title = ..., url = ...}")
        table = self.keys(value, SOURCE_KEYS, key)
        title = self.string(table.get("title"), f"{key}.title")
        url = self.string(table.get("url"), f"{key}.url")
        assert title is not None and url is not None
        if not url.startswith(("https://", "http://")):
            raise self.fail(f"{key}.url", f"{url!r} is not an http(s) URL")
        return Source(title, url, self.string(table.get("note"), f"{key}.note", required=False))

    def url(self, value: Any, key: str) -> str | None:
        text = self.string(value, key, required=False)
        if text is not None and not text.startswith(("https://", "http://")):
            raise self.fail(key, f"{text!r} is not an http(s) URL")
        return text

    def chips(self, value: Any, key: str, platform: str) -> tuple[str, ...]:
        """Chip names; on a platform whose chips the matrix knows, each must be one of them."""
        names = self.strings(value, key)
        if platform not in CHIP_PLATFORMS:
            return names
        valid = [c.name for c in CHIPS.values() if c.platform == platform]
        out = []
        for i, name in enumerate(names):
            found = chip_name(name)
            if found not in valid:
                did = did_you_mean(name, valid, aside=True)
                raise self.fail(f"{key}[{i}]", f"unknown {platform} chip {name!r}{did}; valid chips: "
                                               f"{', '.join(valid)}")
            out.append(found)
        return tuple(out)

    def sources(self, value: Any, key: str) -> tuple[Source, ...]:
        if value is None or value == []:
            raise self.fail(key, "every entry needs at least one source (a [sources] id or {title, url})")
        if not isinstance(value, list):
            raise self.fail(key, f"must be a list, got {type(value).__name__}")
        return tuple(self.source(v, f"{key}[{i}]") for i, v in enumerate(value))


def parse_row(c: Checker, raw: Any, key: str, platform: str | None, as_of: _dt.date | None) -> Row:
    t = c.keys(raw, ROW_KEYS, key)
    plat = c.platform(t.get("platform", platform), f"{key}.platform")
    backend = c.name(t.get("backend"), f"{key}.backend")
    if "torch" not in t:
        raise c.fail(f"{key}.torch", "is required: \"X.Y\" or [\"X.Y\", \"X.Y\"]")
    lo, hi = c.minor_range(t["torch"], f"{key}.torch")
    status = c.string(t.get("status"), f"{key}.status")
    assert status is not None
    if status not in STATUSES:
        did = did_you_mean(status, STATUSES, aside=True)
        raise c.fail(f"{key}.status", f"{status!r} is not a status{did}; expected one of {', '.join(STATUSES)}")
    message = c.string(t.get("message"), f"{key}.message")
    package = c.string(t.get("package"), f"{key}.package", required=False)
    pv = c.string(t.get("package_version"), f"{key}.package_version", required=False)
    if pv is not None and package is None:
        raise c.fail(f"{key}.package_version", "needs 'package' (the pip name it applies to)")
    if package is not None:
        probe = package + (pv or "").replace("{torch}", "2.9")
        if "{" in probe or "}" in probe:
            raise c.fail(f"{key}.package_version", "the only placeholder allowed is {torch}")
        try:
            Requirement(probe)
        except InvalidRequirement as exc:
            raise c.fail(f"{key}.package_version" if pv else f"{key}.package",
                         f"{package + (pv or '')!r} is not a valid pip requirement ({exc})") from None
    replacement = t.get("replacement")
    replacement = c.name(replacement, f"{key}.replacement") if replacement is not None else None
    if status == "deprecated" and replacement is None:
        raise c.fail(f"{key}.replacement", "a deprecated row must name the backend to use instead")
    confirmed = c.boolean(t.get("confirmed"), f"{key}.confirmed", True)
    note = c.string(t.get("note"), f"{key}.note", required=False)
    if not confirmed and note is None:
        raise c.fail(f"{key}.note", "a row with confirmed = false must say in 'note' what is unconfirmed")
    chips = c.chips(t.get("chips"), f"{key}.chips", plat)
    other = c.string(t.get("other_chips"), f"{key}.other_chips", required=False)
    if other is not None and not chips:
        raise c.fail(f"{key}.other_chips", "needs 'chips' (it is what to do on a chip not listed there)")
    for k in ("index", "find_links"):
        if t.get(k) is not None and package is None:
            raise c.fail(f"{key}.{k}", "needs 'package' (the pip name it serves)")
    return Row(
        platform=plat, backend=backend, torch_min=lo, torch_max=hi, status=status,
        message=message or "", as_of=c.date(t.get("as_of"), f"{key}.as_of", as_of),
        sources=c.sources(t.get("sources"), f"{key}.sources"), package=package, package_version=pv,
        python=c.python(t.get("python"), f"{key}.python"), chips=chips,
        replacement=replacement, confirmed=confirmed, note=note, origin=c.origin, key=key,
        other_chips=other, index=c.url(t.get("index"), f"{key}.index"),
        find_links=c.url(t.get("find_links"), f"{key}.find_links"),
    )


def parse_release(c: Checker, raw: Any, key: str, as_of: _dt.date | None) -> Release:
    t = c.keys(raw, RELEASE_KEYS, key)
    package = c.string(t.get("package"), f"{key}.package")
    assert package is not None
    try:
        req = Requirement(package)
    except InvalidRequirement:
        req = None
    if req is None or req.extras or req.specifier or req.marker or req.name != package:
        raise c.fail(f"{key}.package", f"{package!r} is not a bare pip name (no extras, no version)")
    version = c.string(t.get("version"), f"{key}.version")
    assert version is not None
    if not _RELEASE_RE.match(version):
        raise c.fail(f"{key}.version", f"{version!r} is not a release such as \"2.8.1\" or \"2.13.3.0.*\"")
    status = c.string(t.get("status"), f"{key}.status")
    if status not in RELEASE_STATUSES:
        did = did_you_mean(str(status), RELEASE_STATUSES, aside=True)
        raise c.fail(f"{key}.status", f"{status!r} is not a release status{did}; expected one of "
                                      f"{', '.join(RELEASE_STATUSES)}")
    issue = c.url(t.get("issue"), f"{key}.issue")
    if status == "bad" and issue is None:
        raise c.fail(f"{key}.issue", "a bad release must link the issue that shows the problem")
    raw_pins = t.get("pins") or {}
    if not isinstance(raw_pins, Mapping):
        raise c.fail(f"{key}.pins", "must be a table of package = \"specifier\" (libtpu = \"==0.0.17\")")
    pins = []
    for name, spec in raw_pins.items():
        text = c.string(spec, f"{key}.pins.{name}")
        try:
            Requirement(f"{name}{text}")
        except InvalidRequirement as exc:
            raise c.fail(f"{key}.pins.{name}", f"{name}{text} is not a valid pip requirement ({exc})") from None
        pins.append((str(name), text or ""))
    confirmed = c.boolean(t.get("confirmed"), f"{key}.confirmed", True)
    note = c.string(t.get("note"), f"{key}.note", required=False)
    if not confirmed and note is None:
        raise c.fail(f"{key}.note", "an entry with confirmed = false must say in 'note' what is unconfirmed")
    if "torch" not in t:
        raise c.fail(f"{key}.torch", "is required: the torch minor this release pairs with (\"2.8\")")
    return Release(
        package=package, version=version, torch=c.minor(t["torch"], f"{key}.torch"), status=status,
        message=c.string(t.get("message"), f"{key}.message") or "",
        as_of=c.date(t.get("as_of"), f"{key}.as_of", as_of), sources=c.sources(t.get("sources"), f"{key}.sources"),
        python=c.python(t.get("python"), f"{key}.python"), pins=tuple(pins),
        neuron_sdk=c.strings(t.get("neuron_sdk"), f"{key}.neuron_sdk"),
        index=c.url(t.get("index"), f"{key}.index"), find_links=c.url(t.get("find_links"), f"{key}.find_links"),
        issue=issue, confirmed=confirmed, note=note, origin=c.origin, key=key,
    )


def check_releases(releases: Iterable[Release], against: Iterable[Release] = ()) -> None:
    """One entry per package and version, and at most one recommended release per package and torch minor."""
    seen: dict[tuple[str, str], Release] = {(r.name, r.version): r for r in against}
    best: dict[tuple[str, Minor], Release] = {(r.name, r.torch): r for r in against if r.status == "recommended"}
    for r in releases:
        other = seen.get((r.name, r.version))
        if other is not None:
            raise CompatMatrixError(r.origin, f"{r.key}.version",
                                    f"{r.package} {r.version} is already listed at {other.origin} {other.key}")
        seen[(r.name, r.version)] = r
        if r.status == "recommended":
            other = best.get((r.name, r.torch))
            if other is not None:
                raise CompatMatrixError(
                    r.origin, f"{r.key}.status",
                    f"{other.package} {other.version} ({other.origin} {other.key}) is already the recommended "
                    f"release for torch {minor_str(r.torch)}: mark one of them superseded")
            best[(r.name, r.torch)] = r


def _torch_info(c: Checker, raw: Any, key: str) -> TorchInfo:
    t = c.keys(raw, TORCH_KEYS, key)
    version = c.minor(t.get("version"), f"{key}.version")
    python = c.python(t.get("python"), f"{key}.python")
    if python is None:
        raise c.fail(f"{key}.python", "is required: [\"min\", \"max\"] Python minor versions")
    confirmed = c.boolean(t.get("confirmed"), f"{key}.confirmed", True)
    note = c.string(t.get("note"), f"{key}.note", required=False)
    if not confirmed and note is None:
        raise c.fail(f"{key}.note", "an entry with confirmed = false must say in 'note' what is unconfirmed")
    return TorchInfo(version, python, c.sources(t.get("sources"), f"{key}.sources"), confirmed, note)


def _env(c: Checker, raw: Any, key: str, as_of: _dt.date | None) -> EnvDeprecation:
    t = c.keys(raw, ENV_KEYS, key)
    name = c.string(t.get("name"), f"{key}.name")
    assert name is not None
    if not _ENV_RE.match(name):
        raise c.fail(f"{key}.name", f"{name!r} is not an environment variable name")
    return EnvDeprecation(
        name=name, message=c.string(t.get("message"), f"{key}.message") or "",
        replacement=c.string(t.get("replacement"), f"{key}.replacement") or "",
        sources=c.sources(t.get("sources"), f"{key}.sources"),
        as_of=c.date(t.get("as_of"), f"{key}.as_of", as_of) if (t.get("as_of") or as_of) else None,
        backends=tuple(c.name(b, f"{key}.backends[{i}]") for i, b in enumerate(t.get("backends") or [])),
    )


def _sharding(c: Checker, raw: Any, key: str) -> ShardingFact:
    t = c.keys(raw, SHARDING_KEYS, key)
    backends = tuple(c.name(b, f"{key}.backends[{i}]") for i, b in enumerate(t.get("backends") or []))
    if not backends:
        raise c.fail(f"{key}.backends", "is required: the backends this fact is about")
    if "torch" not in t:
        raise c.fail(f"{key}.torch", "is required: \"X.Y\" or [\"X.Y\", \"X.Y\"]")
    lo, hi = c.minor_range(t["torch"], f"{key}.torch")
    return ShardingFact(backends, lo, hi, c.boolean(t.get("available"), f"{key}.available", False),
                        c.string(t.get("engine"), f"{key}.engine") or "", c.string(t.get("message"), f"{key}.message")
                        or "", c.sources(t.get("sources"), f"{key}.sources"))


def _chip(c: Checker, raw: Any, key: str, as_of: _dt.date | None) -> ChipFact:
    t = c.keys(raw, CHIP_KEYS, key)
    text = c.string(t.get("chip"), f"{key}.chip")
    name = chip_name(text)
    if name is None:
        did = did_you_mean(str(text), list(CHIPS), aside=True)
        raise c.fail(f"{key}.chip", f"unknown chip {text!r}{did}; valid chips: {', '.join(CHIPS)}")
    hbm = t.get("hbm_gib")
    if isinstance(hbm, bool) or not isinstance(hbm, (int, float)) or not 0 < hbm <= MAX_HBM_GIB:
        raise c.fail(f"{key}.hbm_gib", f"must be the HBM per chip in GiB, a number above 0 and up to "
                                       f"{MAX_HBM_GIB}, got {hbm!r}")
    devices = t.get("devices", 1)
    if isinstance(devices, bool) or not isinstance(devices, int) or not 1 <= devices <= 64:
        raise c.fail(f"{key}.devices", f"must be how many devices torch sees per chip, 1 to 64, got {devices!r}")
    confirmed = c.boolean(t.get("confirmed"), f"{key}.confirmed", True)
    note = c.string(t.get("note"), f"{key}.note", required=False)
    if not confirmed and note is None:
        raise c.fail(f"{key}.note", "an entry with confirmed = false must say in 'note' what is unconfirmed")
    return ChipFact(name, int(hbm * (1 << 30)), devices, c.sources(t.get("sources"), f"{key}.sources"),
                    c.date(t.get("as_of"), f"{key}.as_of", as_of) if (t.get("as_of") or as_of) else None,
                    confirmed, note, c.origin, key)


def _peak(c: Checker, raw: Any, key: str, as_of: _dt.date | None) -> PeakFact:
    t = c.keys(raw, PEAK_KEYS, key)
    text = c.string(t.get("chip"), f"{key}.chip")
    assert text is not None
    match = c.string(t.get("match"), f"{key}.match", required=False)
    if match is None:  # a TPU or Neuron chip: by its matrix name
        name = chip_name(text)
        if name is None:
            did = did_you_mean(text, list(CHIPS), aside=True)
            raise c.fail(f"{key}.chip", f"unknown chip {text!r}{did}; valid chips: {', '.join(CHIPS)} (a GPU "
                                        "needs 'match', the pattern of its device name)")
        title: str = c.string(t.get("title"), f"{key}.title", required=False) or CHIPS[name].title
    else:
        name = c.name(text, f"{key}.chip")
        try:
            re.compile(match)
        except re.error as exc:
            raise c.fail(f"{key}.match", f"is not a regular expression: {exc}") from None
        given = c.string(t.get("title"), f"{key}.title")
        assert given is not None
        title = given
    confirmed = c.boolean(t.get("confirmed"), f"{key}.confirmed", True)
    note = c.string(t.get("note"), f"{key}.note", required=False)
    raw_tflops = t.get("tflops")
    tflops: dict[str, float] = {}
    if raw_tflops == "unknown":
        if note is None:
            raise c.fail(f"{key}.note", "a peak of \"unknown\" must say in 'note' why (what was looked for)")
    elif isinstance(raw_tflops, Mapping) and raw_tflops:
        for dtype, value in raw_tflops.items():
            if dtype not in PEAK_DTYPES:
                raise c.fail(f"{key}.tflops.{dtype}", f"unknown dtype; valid: {', '.join(PEAK_DTYPES)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TFLOPS:
                raise c.fail(f"{key}.tflops.{dtype}", f"must be the dense peak in TFLOP/s, above 0 and up to "
                                                      f"{MAX_TFLOPS}, got {value!r}")
            tflops[dtype] = float(value)
    else:
        raise c.fail(f"{key}.tflops", "must be a table of dtype = TFLOP/s (dense), or \"unknown\"")
    if not confirmed and note is None:
        raise c.fail(f"{key}.note", "an entry with confirmed = false must say in 'note' what is unconfirmed")
    tile = t.get("tile")
    if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int) or not 1 <= tile <= 4096):
        raise c.fail(f"{key}.tile", f"must be the matrix unit's tile (1 to 4096), got {tile!r}")
    tile_sources = c.sources(t.get("tile_sources"), f"{key}.tile_sources") if tile is not None else ()
    return PeakFact(name, title, tflops, c.sources(t.get("sources"), f"{key}.sources"), tile,
                    c.string(t.get("tile_unit"), f"{key}.tile_unit", required=False) or "matrix unit",
                    tile_sources, match,
                    c.date(t.get("as_of"), f"{key}.as_of", as_of) if (t.get("as_of") or as_of) else None,
                    confirmed, note, c.origin, key)


def check_overlaps(rows: Iterable[Row], against: Iterable[Row] = (), *, adding: bool = False) -> None:
    """Two rows for the same platform and backend may not cover the same torch minor."""
    seen: dict[tuple[str, str], list[Row]] = {}
    for row in against:
        seen.setdefault((row.platform, row.backend), []).append(row)
    for row in rows:
        for other in seen.get((row.platform, row.backend), []):
            if row.torch_min <= other.torch_max and other.torch_min <= row.torch_max:
                tail = (" A plugin may only add rows; override shipped rows with "
                        f"{OVERRIDE_ENV}=/path/file.toml.") if adding else ""
                raise CompatMatrixError(
                    row.origin, f"{row.key}.torch",
                    f"torch {row.torch_range} for {row.backend} on {row.platform} overlaps "
                    f"{other.where} (torch {other.torch_range}).{tail}",
                )
        seen.setdefault((row.platform, row.backend), []).append(row)


def parse_tables(data: Mapping[str, Any], origin: str, known_sources: Mapping[str, Source]) -> Parsed:
    c = Checker(origin, known_sources)
    c.keys(data, FILE_KEYS, "")
    schema = data.get("schema", 1)
    if schema != 1:
        raise c.fail("schema", f"unsupported schema {schema!r}; this accelport reads schema 1")
    out = Parsed(origin)
    raw_sources = data.get("sources", {})
    if not isinstance(raw_sources, Mapping):
        raise c.fail("sources", "must be a table of id = {title = ..., url = ...}")
    for sid, raw in raw_sources.items():
        out.sources[sid] = c.source(raw, f"sources.{sid}")
    c.known_sources = {**known_sources, **out.sources}
    platform = data.get("platform")
    if platform is not None:
        platform = c.platform(platform, "platform")
    as_of = c.date(data["as_of"], "as_of", None) if "as_of" in data else None
    for name, kind in (("rows", list), ("torch", list), ("env", list), ("releases", list), ("sharding", list),
                       ("chips", list), ("peaks", list)):
        if name in data and not isinstance(data[name], kind):
            raise c.fail(name, f"must be an array of tables ([[{name}]])")
    out.rows = [parse_row(c, r, f"rows[{i}]", platform, as_of) for i, r in enumerate(data.get("rows", []))]
    out.torch = [_torch_info(c, t, f"torch[{i}]") for i, t in enumerate(data.get("torch", []))]
    out.env = [_env(c, e, f"env[{i}]", as_of) for i, e in enumerate(data.get("env", []))]
    out.releases = [parse_release(c, r, f"releases[{i}]", as_of) for i, r in enumerate(data.get("releases", []))]
    out.sharding = [_sharding(c, t, f"sharding[{i}]") for i, t in enumerate(data.get("sharding", []))]
    out.chips = [_chip(c, t, f"chips[{i}]", as_of) for i, t in enumerate(data.get("chips", []))]
    named = [fact.name for fact in out.chips]
    for i, name in enumerate(named):
        if name in named[:i]:
            raise c.fail(f"chips[{i}].chip", f"chip {name} is listed twice")
    out.peaks = [_peak(c, t, f"peaks[{i}]", as_of) for i, t in enumerate(data.get("peaks", []))]
    named = [fact.name for fact in out.peaks]
    for i, name in enumerate(named):
        if name in named[:i]:
            raise c.fail(f"peaks[{i}].chip", f"chip {name} is listed twice")
    check_overlaps(out.rows)
    check_releases(out.releases)
    versions = [t.version for t in out.torch]
    for i, v in enumerate(versions):
        if v in versions[:i]:
            raise c.fail(f"torch[{i}].version", f"torch {minor_str(v)} is listed twice")
    return out
