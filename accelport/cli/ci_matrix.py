"""``accelport ci-matrix``: a GitHub Actions ``strategy.matrix`` of the combinations that work.

Prints ``{"include": [{platform, torch, backend, python, runner, status, install, pip_args}, ...]}``::

    - id: m
      run: |
        matrix=$(accelport ci-matrix --platform cpu,gcp-tpu)
        echo "matrix=$matrix" >> "$GITHUB_OUTPUT"
    ...
    if: needs.plan.outputs.matrix != '{"include":[]}'
    strategy:
      matrix: ${{ fromJSON(needs.plan.outputs.matrix) }}
    runs-on: ${{ matrix.runner }}
    steps:
      - run: python -m pip install ${{ matrix.pip_args }} accelport pytest

An empty result is an empty ``include`` list in the default format (a workflow
skips its jobs on it: GitHub rejects an empty ``strategy.matrix``) and an error
with ``--json``; a ``--torch`` version the matrix has no row for on the chosen
platforms is a usage error either way.

``python`` is the newest Python that torch, the paired package and accelport
all support. ``install`` is the requirements alone, separated by spaces (to read
or compare; not safe in a shell, where ``torch-tpu>=0.2.0`` is a redirection).
``pip_args`` is what pip needs: the same requirements quoted for a shell, plus the
package index or find-links page a requirement needs (torch-neuronx comes from
AWS's own index, torch_xla[tpu] up to 2.6 finds libtpu on Google's page), so
``pip install ${{ matrix.pip_args }}`` is safe in a ``run:`` step, and
``shlex.split`` of it gives pip's arguments (what the noxfile's ``hardware``
session does with ``ACCELPORT_CI_PIP_ARGS``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from accelport import _packages

if TYPE_CHECKING:
    from accelport.compat.load import Matrix

#: Default ``runs-on`` per platform; override with ``--runner PLATFORM=LABEL[,LABEL...]``.
DEFAULT_RUNNERS: Mapping[str, str | list[str]] = {
    "cpu": "ubuntu-latest",
    "nvidia-gpu": ["self-hosted", "gpu"],
    "gcp-tpu": ["self-hosted", "tpu"],
    "aws-neuron": ["self-hosted", "trainium"],
}
DEFAULT_STATUSES = ("recommended", "supported", "experimental")
#: Paired packages that are not on PyPI: the index pip needs for them (``pip_args`` adds it).
PACKAGE_INDEXES: Mapping[str, str] = {
    "torch-neuronx": _packages.NEURON_PACKAGE_INDEX,
}
_PY_MINORS = [f"3.{n}" for n in range(8, 21)]


def register(sub: Any) -> None:
    from accelport.compat.schema import STATUSES
    from accelport.platform import PLATFORMS

    p = sub.add_parser(
        "ci-matrix",
        help="a GitHub Actions strategy.matrix (JSON) of the supported combinations",
        description="Print a GitHub Actions strategy.matrix of the platform / torch / backend "
                    "combinations the compatibility matrix says work.",
    )
    p.add_argument("--platform", action="append", metavar="P",
                   help=f"platforms to include (repeat or comma-separate; default all: {', '.join(PLATFORMS)})")
    p.add_argument("--torch", action="append", dest="torch_versions", metavar="V",
                   help="torch minor versions to include (repeat or comma-separate; default all)")
    p.add_argument("--status", action="append", metavar="S",
                   help=f"statuses to include, instead of the default {','.join(DEFAULT_STATUSES)} "
                        f"(repeat or comma-separate; any of {', '.join(STATUSES)})")
    p.add_argument("--runner", action="append", default=[], metavar="PLATFORM=LABEL",
                   help="runs-on label(s) for a platform, e.g. gcp-tpu=self-hosted,tpu-v5e")
    p.add_argument("--format", choices=("github", "json"), default="github",
                   help="github: one compact line for $GITHUB_OUTPUT (default); json: indented")
    p.add_argument("--json", action="store_true", help="same as --format json")
    p.set_defaults(func=run)


def _split(values: Iterable[str] | None, option: str = "") -> list[str]:
    """The comma-separated parts of every value given; an empty part is a usage error naming ``option``.

    In CI an empty value is nearly always a variable that is unset (``--torch "$TORCH"``):
    ignoring it would turn a filter into "everything", or into nothing at all.
    """
    parts = [part.strip() for v in values or () for part in v.split(",")]
    if option and any(not part for part in parts):
        from accelport.errors import UsageError

        given = ", ".join(repr(v) for v in values or ())
        raise UsageError(f"{option} was given an empty value ({given}); in CI this is usually a variable that is "
                         f"not set: set it, or leave {option} out to include every value")
    return [part for part in parts if part]


def _runners(specs: Sequence[str]) -> dict[str, str | list[str]]:
    from accelport.errors import UnknownPlatformError, UsageError
    from accelport.platform import PLATFORMS

    runners = dict(DEFAULT_RUNNERS)
    for spec in specs:
        platform, sep, label = spec.partition("=")
        labels = [x.strip() for x in label.split(",") if x.strip()]
        if not sep or not labels:
            raise UsageError(f"--runner {spec!r}: expected PLATFORM=LABEL[,LABEL...], e.g. gcp-tpu=self-hosted,tpu")
        if platform.strip() not in PLATFORMS:
            raise UsageError(f"--runner {spec!r}: {UnknownPlatformError(platform.strip(), PLATFORMS)}")
        runners[platform.strip()] = labels[0] if len(labels) == 1 else labels
    return runners


def _python(ranges: Iterable[tuple[str, str] | None], requires: str | None) -> str | None:
    """The newest Python minor inside every given range and ``requires`` (a specifier), or None."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import Version

    try:
        spec = SpecifierSet(requires or "")
    except InvalidSpecifier:
        spec = SpecifierSet()
    known = [r for r in ranges if r is not None]
    if not known:
        return None
    fits = [p for p in _PY_MINORS
            if all(Version(lo) <= Version(p) <= Version(hi) for lo, hi in known) and spec.contains(f"{p}.0")]
    return fits[-1] if fits else None


def pip_args(requirements: Sequence[str], package: str | None, index: str | None = None,
             find_links: str | None = None) -> str:
    """``requirements`` quoted for a shell, plus ``--extra-index-url`` where ``package`` needs one.

    ``index`` and ``find_links`` are a row's own (``-f`` Google's libtpu page for torch_xla[tpu] 2.1 to 2.6).
    """
    import shlex

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    args = list(requirements)
    index = index or (PACKAGE_INDEXES.get(canonicalize_name(Requirement(package).name)) if package else None)
    if index:
        args += ["--extra-index-url", index]
    if find_links:
        args += ["-f", find_links]
    return shlex.join(args)


def include(mx: Matrix, platforms: Sequence[str], minors: Sequence[tuple[int, int]] | None,
            statuses: Sequence[str], runners: Mapping[str, Any],
            requires_python: str | None) -> tuple[list[dict[str, Any]], list[str]]:
    """The ``include`` entries and a note for each combination left out for want of a Python."""
    from accelport.compat.schema import minor_str

    entries: list[dict[str, Any]] = []
    skipped: list[str] = []
    for platform in platforms:
        for m in mx.minors(platform):
            if minors is not None and m not in minors:
                continue
            for backend in mx.backends(platform):
                row = mx.lookup(platform, backend, m)
                if row is None or row.status not in statuses:
                    continue
                torch_info = mx.torch.get(m)
                python = _python([torch_info.python if torch_info else None, row.python], requires_python)
                what = f"{platform} torch {minor_str(m)} {backend}"
                if python is None:
                    skipped.append(f"{what}: no Python version fits torch, {row.package or 'the backend'} "
                                   f"and accelport ({requires_python or 'any'})")
                    continue
                paired = row.requirement(m)
                pip = [f"torch=={minor_str(m)}.*"] + ([paired] if paired else [])
                entries.append({"platform": platform, "torch": minor_str(m), "backend": backend,
                                "python": python, "runner": runners[platform], "status": row.status,
                                "install": " ".join(pip),
                                "pip_args": pip_args(pip, row.package, row.index, row.find_links)})
    return entries, skipped


def run(args: argparse.Namespace) -> int:
    # Errors reach the CLI's one error path, which answers in JSON for --json and --format json alike.
    return _run(args, args.json or args.format == "json")


def _run(args: argparse.Namespace, as_json: bool) -> int:
    from accelport.cli import emit_json
    from accelport.compat.schema import STATUSES, parse_torch_version
    from accelport.errors import AccelportError, InvalidVersionError, UnknownPlatformError, UsageError, did_you_mean
    from accelport.platform import PLATFORMS
    from accelport.runtime.state import RUNTIME

    platforms = _split(args.platform, "--platform") or list(PLATFORMS)
    for p in platforms:
        if p not in PLATFORMS:
            raise UsageError(f"--platform: {UnknownPlatformError(p, PLATFORMS)}")
    statuses = _split(args.status, "--status") or list(DEFAULT_STATUSES)
    for s in statuses:
        if s not in STATUSES:
            did = did_you_mean(s, STATUSES)
            raise UsageError(f"--status: unknown status {s!r}.{did} Valid statuses: {', '.join(STATUSES)}.")
    mx = RUNTIME.matrix()
    minors = None
    if args.torch_versions:
        try:
            minors = [parse_torch_version(v, mx.covered()) for v in _split(args.torch_versions, "--torch")]
        except InvalidVersionError as exc:
            raise UsageError(f"--torch: {exc}") from None
        # A version the matrix knows nothing about on these platforms is a mistake (a typo, a
        # stale pin), not an answer: an empty list would quietly drop it from CI.
        known = {m for p in platforms for m in mx.minors(p)}
        unknown = [v for v, m in zip(_split(args.torch_versions), minors, strict=True) if m not in known]
        if unknown:
            covered = {p: mx.covered(p) for p in platforms}
            ranges = (next(iter(covered.values())) if len(set(covered.values())) == 1
                      else "; ".join(f"{r} on {p}" for p, r in covered.items()))
            raise UsageError(
                f"--torch {', '.join(unknown)}: the compatibility matrix has no row for torch "
                f"{', '.join(unknown)} on {', '.join(platforms)} (it covers torch {ranges}); "
                "see `accelport matrix`")
    runners = _runners(args.runner)
    entries, skipped = include(mx, platforms, minors, statuses, runners, _packages.requires_python("accelport"))
    for note in skipped:
        print(f"accelport ci-matrix: left out {note}", file=sys.stderr)
    if not entries and not as_json:
        # In a workflow an empty list is an answer ("no cloud job to run"), not a failure:
        # the workflow skips the jobs on count == 0 (GitHub rejects an empty strategy.matrix).
        print("accelport ci-matrix: no combination matches; printing an empty include list", file=sys.stderr)
    elif not entries:
        raise AccelportError(
            f"no combination matches platforms {', '.join(platforms)}"
            + (f", torch {', '.join(_split(args.torch_versions))}" if args.torch_versions else "")
            + f" and statuses {', '.join(statuses)}: see `accelport matrix` for what works where "
            "(GitHub Actions rejects an empty matrix)"
        )
    matrix = {"include": entries}
    if as_json:
        emit_json(matrix)
    else:
        print(json.dumps(matrix, separators=(",", ":")))
    return 0
