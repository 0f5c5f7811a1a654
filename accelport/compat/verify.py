"""Check the shipped compatibility matrix against the package registry: ``python -m accelport.compat.verify``.

A maintainer's tool (it needs the network), not a test. For every torch minor
(``torch.toml``), every row that names a package and a Python range, and every
patch release (``releases.toml``), it asks pip, per CPython version, which
versions have a binary wheel for Linux x86_64 (``pip index versions PACKAGE
--python-version X.Y --only-binary=:all:``), and prints every disagreement:

- ``claimed-missing``: the data claims a Python the registry serves no wheel for;
- ``unclaimed-present``: the registry serves a wheel for a Python the data leaves out;
- ``pin-missing``: a release's pinned runtime (torch_xla's libtpu) has no wheel for a claimed Python;
- ``unlisted-release``: the registry has a release of a package ``releases.toml`` does not list;
- ``registry``: pip could not answer (network, usage).

Packages served only by another index (torch-neuronx on AWS's) cannot be checked
from here; the tool says so and skips them. Exit status: 0 no disagreement,
1 disagreements, 2 the registry cannot be used. Only pip's command line is used.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from accelport import _packages
from accelport.compat.machine import python_key, python_range
from accelport.compat.schema import Minor, Parsed, Release, Row, minor_str

__all__ = ["IndexResult", "Disagreement", "Registry", "parse_index_versions", "index_versions_args", "check",
           "main"]

DEFAULT_INDEX = "https://pypi.org/simple"
# pip does not widen a --platform tag to older manylinux tags, so every tag in use is listed:
# torch <= 2.6 ships manylinux1, torch >= 2.7 and torch_xla manylinux_2_28, libtpu <= 0.0.10
# manylinux_2_27, libtpu >= 0.0.11 and torch-tpu manylinux_2_31.
DEFAULT_PLATFORMS = ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                     "manylinux2014_x86_64", "manylinux1_x86_64")

OK, NO_MATCH, NOT_FOUND, NETWORK, USAGE, UNKNOWN = "ok", "no_match", "not_found", "network", "usage", "unknown"


@dataclass
class IndexResult:
    """What one ``pip index versions`` call said."""

    status: str
    name: str | None = None
    latest: str | None = None
    versions: list[str] = field(default_factory=list)
    installed: str | None = None
    message: str = ""

    @property
    def usable(self) -> bool:
        """True when the answer is about the registry (versions, none compatible, no such project)."""
        return self.status in (OK, NO_MATCH, NOT_FOUND)


_HEAD = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*) \((?P<latest>[^)]+)\)\s*$")
_AVAILABLE = re.compile(r"^Available versions:\s*(?P<list>.*)$")
_INSTALLED = re.compile(r"^\s*INSTALLED:\s*(?P<v>\S+)")
_NO_MATCH = re.compile(r"^ERROR: No matching distribution found for (?P<name>\S+)")
# In -vv logs (pip writes them to stdout) these tell an unreachable index or a missing
# project from "no compatible wheel": without -vv all three print the same ERROR line.
_CONNECTION = re.compile(r"Could not fetch URL \S+: connection error|Max retries exceeded|NewConnectionError|"
                         r"Failed to establish a new connection|Temporary failure in name resolution|SSLError|"
                         r"Read timed out", re.I)
_HTTP_404 = re.compile(r'"GET \S+ HTTP/[\d.]+" 404|404 Client Error: Not Found', re.I)


def parse_index_versions(stdout: str, stderr: str = "", rc: int | None = None) -> IndexResult:
    """Parse the output of ``pip index versions NAME [...]``.

    Reads pip 23 to 26 text output, pip 26's ``--json``, the "No matching
    distribution" error, usage errors (exit status 2) and ``-vv`` logs.
    """
    out, err = stdout or "", stderr or ""
    both = f"{out}\n{err}"
    text = out.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text.splitlines()[0]) if "\n" in text else json.loads(text)
        except json.JSONDecodeError:
            data = None
        if isinstance(data, dict) and isinstance(data.get("versions"), list):
            return IndexResult(OK, data.get("name"), data.get("latest"), [str(v) for v in data["versions"]],
                               data.get("installed_version"))
    res = IndexResult(UNKNOWN)
    for line in out.splitlines():
        m = _HEAD.match(line)
        if m and res.name is None:
            res.name, res.latest = m.group("name"), m.group("latest")
            continue
        m = _AVAILABLE.match(line)
        if m:
            res.versions = [v.strip() for v in m.group("list").split(",") if v.strip()]
            continue
        m = _INSTALLED.match(line)
        if m:
            res.installed = m.group("v")
    if res.versions:
        res.status = OK
        return res
    for line in both.splitlines():
        m = _NO_MATCH.match(line.strip())
        if m:
            res.name, res.message = m.group("name"), line.strip()
            res.status = NETWORK if _CONNECTION.search(both) else NOT_FOUND if _HTTP_404.search(both) else NO_MATCH
            return res
    if rc == 2 or "error:" in err.lower() or "no such option" in err.lower():
        res.status = USAGE
        res.message = " ".join(x.strip() for x in err.splitlines() if x.strip() and "experimental" not in x)
        return res
    res.message = err.strip()[-500:]
    return res


Runner = Callable[[Sequence[str]], "tuple[int, str, str]"]


def run_pip(args: Sequence[str], timeout: float = 300) -> tuple[int, str, str]:
    """``python -m pip ARGS`` with this interpreter: (exit status, stdout, stderr)."""
    try:
        done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        return 124, "", f"pip did not answer within {timeout:g} s"
    return done.returncode, done.stdout, done.stderr


def index_versions_args(package: str, python: str | None, *, index_url: str = DEFAULT_INDEX,
                        platforms: Iterable[str] = DEFAULT_PLATFORMS) -> list[str]:
    """The pip arguments that list ``package``'s versions with a binary wheel for CPython ``python``."""
    args = ["--isolated", "--disable-pip-version-check", "index", "versions", "--index-url", index_url, "-vv"]
    if python:
        args += ["--python-version", python, "--only-binary=:all:"]
        for tag in platforms:
            args += ["--platform", tag]
    return [*args, package]


class Registry:
    """``pip index versions`` answers, asked once per (package, Python)."""

    def __init__(self, runner: Runner | None = None, *, index_url: str = DEFAULT_INDEX,
                 platforms: Iterable[str] = DEFAULT_PLATFORMS) -> None:
        self.runner: Runner = runner or run_pip
        self.index_url = index_url
        self.platforms = tuple(platforms)
        self.cache: dict[tuple[str, str | None], IndexResult] = {}

    def versions(self, package: str, python: str | None) -> IndexResult:
        key = (canonicalize_name(package), python)
        if key not in self.cache:
            rc, out, err = self.runner(index_versions_args(package, python, index_url=self.index_url,
                                                           platforms=self.platforms))
            self.cache[key] = parse_index_versions(out, err, rc)
        return self.cache[key]


@dataclass(frozen=True)
class Disagreement:
    """One place where the data and the registry disagree (or the registry could not say)."""

    where: str
    kind: str
    text: str

    def __str__(self) -> str:
        return f"{self.where}: [{self.kind}] {self.text}"


def _matching(versions: Iterable[str], spec: str) -> list[str]:
    wanted = SpecifierSet(spec)
    out = []
    for v in versions:
        try:
            if wanted.contains(Version(v), prereleases=True):
                out.append(v)
        except InvalidVersion:
            continue
    return out


def _minors(row: Row) -> list[Minor]:
    return [(row.torch_min[0], n) for n in range(row.torch_min[1], row.torch_max[1] + 1)]


@dataclass
class Report:
    """What a check found: the disagreements, and what it could not check (and why)."""

    disagreements: list[Disagreement] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


#: Packages only AWS publishes (PyPI holds a placeholder torch-neuronx 1.0): skipped even without ``index``.
ELSEWHERE: dict[str, str] = {name: _packages.NEURON_PACKAGE_INDEX
                             for name in ("torch-neuronx", "libneuronxla", "neuronx-cc")}


def _elsewhere(package: str, index: str | None, find_links: str | None) -> str | None:
    index = index or ELSEWHERE.get(canonicalize_name(package))
    if index:
        return f"{package} is served by {index}, not by the registry checked here"
    if find_links:
        return f"{package} needs {find_links} (pip -f), which the registry checked here does not serve"
    return None


def check(data: Parsed, registry: Registry, pythons: Sequence[str], only: str | None = None) -> Report:
    """Every disagreement between ``data`` and the registry, for CPython versions ``pythons``.

    ``only``: ``torch`` (torch.toml), ``releases`` (releases.toml) or a backend name.
    """
    rep = Report()
    add = rep.disagreements.append

    def torch_has(m: Minor, py: str) -> bool | None:
        res = registry.versions("torch", py)
        if not res.usable:
            return None
        return bool(_matching(res.versions, f"=={minor_str(m)}.*"))

    if only in (None, "torch"):
        for info in data.torch:
            claimed = set(python_range(*info.python))
            where = f"torch.toml torch {minor_str(info.version)}"
            for py in pythons:
                wheel = torch_has(info.version, py)
                if wheel is None:
                    res = registry.versions("torch", py)
                    add(Disagreement(where, "registry", f"Python {py}: {res.status} {res.message}".strip()))
                elif py in claimed and not wheel:
                    add(Disagreement(where, "claimed-missing",
                                     f"claims Python {py}; the registry has no torch {minor_str(info.version)}.* "
                                     "wheel for it"))
                elif py not in claimed and wheel:
                    add(Disagreement(where, "unclaimed-present",
                                     f"leaves out Python {py}; the registry has torch {minor_str(info.version)}.* "
                                     "wheels for it"))

    releases = {(r.name, r.torch): r for r in data.releases if r.status == "recommended"}
    for row in data.rows:
        if row.package is None or row.python is None or only not in (None, row.backend):
            continue
        req = Requirement(row.package)
        why = _elsewhere(req.name, row.index, None)
        if why:
            rep.skipped.setdefault(canonicalize_name(req.name), why)
            continue
        claimed = set(python_range(*row.python))
        for m in _minors(row):
            spec = (row.package_version or "").replace("{torch}", minor_str(m))
            where = (f"{row.origin.rsplit('/', 1)[-1]} {row.key} {row.backend} torch {minor_str(m)} "
                     f"({row.package}{spec})")
            pinned = releases.get((canonicalize_name(req.name), m)) if req.extras else None
            for py in pythons:
                res = registry.versions(req.name, py)
                if not res.usable:
                    add(Disagreement(where, "registry", f"Python {py}: {res.status} {res.message}".strip()))
                    continue
                have = _matching(res.versions, spec) if spec else list(res.versions)
                torch_ok = torch_has(m, py)
                missing = [] if have else [f"no {req.name}{spec} wheel"]
                if torch_ok is False:
                    missing.append(f"no torch {minor_str(m)}.* wheel")
                pins_missing = _pins_missing(pinned, py, registry, rep) if pinned and have else []
                if py in claimed and (missing or pins_missing):
                    kind = "claimed-missing" if missing else "pin-missing"
                    add(Disagreement(where, kind, f"claims Python {py}, but " + "; ".join(missing + pins_missing)))
                elif py not in claimed and not missing and not pins_missing and torch_ok:
                    add(Disagreement(where, "unclaimed-present",
                                     f"leaves out Python {py}, yet the registry has {req.name} {', '.join(have)} "
                                     f"and torch {minor_str(m)}.* for it"))

    if only in (None, "releases"):
        _check_releases(data.releases, registry, pythons, rep)
    return rep


def _pins_missing(release: Release, py: str, registry: Registry, rep: Report) -> list[str]:
    if release.index or release.find_links:
        pins = ", ".join(f"{name}{spec}" for name, spec in release.pins)
        rep.skipped.setdefault(release.pin, f"its pins ({pins}) need {release.index or release.find_links}, "
                                            "which the registry checked here does not serve")
        return []
    out = []
    for name, spec in release.pins:
        res = registry.versions(name, py)
        if res.usable and not _matching(res.versions, spec):
            out.append(f"{release.pin} pins {name}{spec}, which has no wheel for Python {py}")
    return out


def _check_releases(releases: Sequence[Release], registry: Registry, pythons: Sequence[str], rep: Report) -> None:
    add = rep.disagreements.append
    by_package: dict[str, list[Release]] = {}
    for r in releases:
        by_package.setdefault(r.name, []).append(r)
    for name, entries in by_package.items():
        why = _elsewhere(entries[0].package, entries[0].index, None)
        if why:
            rep.skipped.setdefault(name, why)
            continue
        for r in entries:
            where = f"releases.toml {r.key} {r.package} {r.version}"
            claimed = set(python_range(*r.python)) if r.python else set()
            for py in pythons:
                res = registry.versions(r.package, py)
                if not res.usable:
                    add(Disagreement(where, "registry", f"Python {py}: {res.status} {res.message}".strip()))
                    continue
                has = bool(_matching(res.versions, f"=={r.version}"))
                if r.python and py in claimed and not has:
                    add(Disagreement(where, "claimed-missing", f"claims Python {py}; the registry has no wheel "
                                                               f"of {r.version} for it"))
                elif r.python and py not in claimed and has:
                    add(Disagreement(where, "unclaimed-present", f"leaves out Python {py}; the registry has a "
                                                                 f"wheel of {r.version} for it"))
        # A release the data does not list, within the torch minors it covers (a new patch to judge).
        res = registry.versions(entries[0].package, None)
        if not res.usable:
            continue
        first = min(r.torch for r in entries)
        for v in res.versions:
            try:
                parsed = Version(v)
            except InvalidVersion:
                continue
            if parsed.is_prerelease or parsed.release[:2] < first:
                continue
            if not any(r.matches(v) for r in entries):
                add(Disagreement(f"releases.toml {entries[0].package}", "unlisted-release",
                                 f"the registry has {entries[0].package} {v}, which releases.toml does not list"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m accelport.compat.verify",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--python", action="append", metavar="X.Y",
                        help="CPython version to check (repeat; default: every one the matrix names, and one more)")
    parser.add_argument("--only", metavar="WHAT", help="torch, releases, or a backend name")
    parser.add_argument("--matrix", metavar="DIR", help="a folder of matrix files (default: the shipped data)")
    parser.add_argument("--index-url", default=DEFAULT_INDEX, help=f"the registry (default {DEFAULT_INDEX})")
    parser.add_argument("--platform", action="append", metavar="TAG",
                        help="wheel platform tag (repeat; default: the x86_64 manylinux tags in use)")
    args = parser.parse_args(argv)

    from accelport.compat.load import Matrix, load_folder, shipped

    data = load_folder(args.matrix) if args.matrix else shipped()
    pythons = args.python or _default_pythons(Matrix(data.rows, torch=data.torch).pythons())
    for py in pythons:
        if not re.fullmatch(r"\d+\.\d+", py):
            parser.error(f"--python {py!r}: expected major.minor such as 3.12")
    registry = Registry(index_url=args.index_url, platforms=args.platform or DEFAULT_PLATFORMS)
    probe = registry.versions("torch", "3.12")
    if probe.status != OK:  # a dead index answers "no match" for everything: do not report that as facts
        print(f"the registry cannot be used: asking for torch gave {probe.status} {probe.message}".strip(),
              file=sys.stderr)
        return 2
    report = check(data, registry, pythons, args.only)
    for d in report.disagreements:
        print(d)
    for name, why in sorted(report.skipped.items()):
        print(f"skipped {name}: {why}")
    print(f"{len(report.disagreements)} disagreement(s); checked Python {', '.join(pythons)} against "
          f"{args.index_url}; {len(report.skipped)} skipped (not served by this registry)")
    return 1 if report.disagreements else 0


def _default_pythons(known: Sequence[str]) -> list[str]:
    """Every Python the matrix names plus the next one (a new CPython with wheels is news too)."""
    if not known:
        return []
    major, minor = python_key(known[-1])
    return [*known, f"{major}.{minor + 1}"]


if __name__ == "__main__":
    sys.exit(main())
