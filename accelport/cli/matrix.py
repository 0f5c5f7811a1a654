"""``accelport matrix``: the compatibility verdict for a platform, chip, torch and Python, or the whole table.

With any of ``--platform``, ``--chip``, ``--torch`` and ``--python`` it prints the
verdict (what is missing defaults to this machine's; a chip implies its platform);
with none, every platform's table. Text output fits 80 columns (a source URL stays
whole on its own line).
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accelport.compat.load import Matrix
    from accelport.compat.verdict import Verdict

WIDTH = 80
#: No platform, chip, torch or Python version is near this long; a longer value is refused before it
#: is parsed (``int()`` of a 5000-digit minor raises) and is quoted cut, not whole.
MAX_VALUE = 100
QUOTED = 40  # characters of a refused value that its error quotes
_SHORT = {"unsupported": "-"}
# Tables read from the everyday platform to the specialised ones.
_DISPLAY_ORDER = ("cpu", "nvidia-gpu", "gcp-tpu", "aws-neuron")


def register(sub: Any) -> None:
    from accelport.compat.machine import CHIPS
    from accelport.platform import PLATFORMS

    p = sub.add_parser(
        "matrix",
        help="the compatibility verdict for a platform, chip, torch and Python (no filter: the whole table)",
        description="What the compatibility matrix says. With --platform, --chip, --torch or --python: the "
                    "verdict (the others default to this machine's; a chip implies its platform); with none: "
                    "the whole table.",
    )
    p.add_argument("--platform", metavar="P", help=f"one of {', '.join(PLATFORMS)}")
    p.add_argument("--chip", metavar="NAME", help=f"one of {', '.join(CHIPS)}")
    p.add_argument("--torch", dest="torch_version", metavar="V",
                   help="a torch version: 2.9, 2.9.0+cu128, 2.10.0a0+git1234 ...")
    p.add_argument("--python", metavar="X.Y", help="a Python version such as 3.12 (default: this one)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="machine-readable output")
    fmt.add_argument("--markdown", action="store_true",
                     help="the whole matrix as Markdown tables (docs/matrix.md is generated this way)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from accelport.cli import emit_json
    from accelport.compat.machine import parse_chip, parse_python
    from accelport.compat.verdict import recommend
    from accelport.errors import (
        InvalidPythonVersionError,
        InvalidVersionError,
        UnknownChipError,
        UnknownPlatformError,
        UsageError,
    )
    from accelport.runtime.state import RUNTIME

    _refuse_long_values(args)
    mx = RUNTIME.matrix()
    filters = (args.platform, args.chip, args.torch_version, args.python)
    if args.markdown:
        if any(f is not None for f in filters):
            raise UsageError("--markdown prints the whole matrix: drop --platform and --torch "
                             "(and any --chip or --python)")
        print(render_markdown(mx))
        return 0
    if all(f is None for f in filters):
        if args.json:
            emit_json(matrix_dict(mx))
        else:
            print(render_table(mx, recommend(matrix=mx, warn=False)))
        return 0
    try:
        # A typed chip must be one the data knows (recommend() also takes what detection reports).
        chip = parse_chip(args.chip) if args.chip is not None else None
        python = parse_python(args.python, mx.pythons()) if args.python is not None else None
        verdict = recommend(args.platform, args.torch_version, chip=chip, python=python, matrix=mx, warn=False)
    except UnknownChipError as exc:
        raise UsageError(f"--chip: {exc}") from None
    except InvalidPythonVersionError as exc:
        raise UsageError(f"--python: {exc}") from None
    except (UnknownPlatformError, InvalidVersionError) as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        emit_json(verdict.to_dict())
    else:
        print(render_verdict(verdict))
    return 0


def _refuse_long_values(args: argparse.Namespace) -> None:
    """A UsageError for a filter longer than MAX_VALUE, quoting it redacted and cut."""
    import os

    from accelport.compat.machine import CHIPS
    from accelport.errors import UsageError
    from accelport.platform import PLATFORMS
    from accelport.redact import Redactor

    expected = {
        "--platform": f"one of {', '.join(PLATFORMS)}",
        "--chip": f"one of {', '.join(CHIPS)}",
        "--torch": "a torch version such as 2.9 or 2.9.0+cu128",
        "--python": "a Python major.minor such as 3.12",
    }
    for flag, value in (("--platform", args.platform), ("--chip", args.chip), ("--torch", args.torch_version),
                        ("--python", args.python)):
        if value is not None and len(value) > MAX_VALUE:
            # Redacted before the cut: a secret the cut would halve is still hidden whole.
            quoted = Redactor(os.environ, limit=QUOTED).text(value)
            raise UsageError(f"{flag}: '{quoted}' is too long to be a value here: give {expected[flag]}")


def matrix_dict(mx: Matrix) -> dict[str, Any]:
    from accelport.compat.schema import minor_str

    return {
        "as_of": mx.as_of.isoformat() if mx.as_of else None,
        "origins": mx.origins,
        "rows": [r.to_dict() for r in mx.rows],
        "releases": [r.to_dict() for r in mx.releases],
        "torch": [{"version": minor_str(t.version), "python": list(t.python), "confirmed": t.confirmed,
                   "note": t.note, "sources": [s.to_dict() for s in t.sources]} for t in mx.torch.values()],
        "env": [{"name": e.name, "message": e.message, "replacement": e.replacement,
                 "backends": list(e.backends), "sources": [s.to_dict() for s in e.sources]}
                for e in mx.env.values()],
    }


def _wrap(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent,
                         break_on_hyphens=False) or [indent.rstrip()]


def _cell(status: str, confirmed: bool) -> str:
    return _SHORT.get(status, status) + ("" if confirmed else "*")


def _chunks(names: Sequence[str], first: int, col: int) -> list[list[str]]:
    per = max(1, (WIDTH - first) // col)
    return [list(names[i:i + per]) for i in range(0, len(names), per)] or [[]]


def render_table(mx: Matrix, here: Verdict | None = None) -> str:
    """Every platform's statuses by torch range; consecutive torch minors that agree share a line."""
    from accelport.compat.schema import minor_str
    from accelport.platform import PLATFORMS

    as_of = mx.as_of.isoformat() if mx.as_of else "unknown"
    lines = _wrap(f"Compatibility matrix as of {as_of}. For messages, packages, patch releases and "
                  "sources: accelport matrix --platform P --torch V (--chip, --python narrow it).", "")
    unconfirmed = False
    for platform in sorted(PLATFORMS, key=_DISPLAY_ORDER.index):
        backends = mx.backends(platform)
        if not backends:
            continue
        lines += ["", platform]
        col = max([len("recommended*")] + [len(b) for b in backends]) + 2
        for names in _chunks(backends, 14, col):
            groups: list[tuple[list[str], tuple[str, ...]]] = []
            for m in mx.minors(platform):
                cells = []
                for b in names:
                    row = mx.lookup(platform, b, m)
                    cells.append(_cell(row.status, row.confirmed) if row else "")
                    unconfirmed |= bool(row and not row.confirmed)
                if groups and groups[-1][1] == tuple(cells):
                    groups[-1][0].append(minor_str(m))
                else:
                    groups.append(([minor_str(m)], tuple(cells)))  # (minors, cells)
            lines.append(("  " + "torch".ljust(12) + "".join(n.ljust(col) for n in names)).rstrip())
            for ms, group_cells in groups:
                span = ms[0] if len(ms) == 1 else f"{ms[0]}-{ms[-1]}"
                lines.append(("  " + span.ljust(12) + "".join(c.ljust(col) for c in group_cells)).rstrip())
    lines += [""]
    legend = "-: unsupported (or not applicable)."
    if unconfirmed:
        legend += " *: not confirmed against a primary source."
    lines += _wrap(legend, "")
    if here is not None:
        lines += [""] + _wrap(f"This machine: {here.reason}", "")
    return "\n".join(lines)


def render_markdown(mx: Matrix) -> str:
    """The whole matrix as Markdown: per platform, torch versions by backends, then the sources."""
    from accelport.compat.schema import minor_str
    from accelport.platform import PLATFORMS

    as_of = mx.as_of.isoformat() if mx.as_of else "unknown"
    out = [
        "# Compatibility matrix",
        "",
        "<!-- Generated by `accelport matrix --markdown > docs/matrix.md` from compat_matrix/*.toml;",
        "     tests/test_docs.py fails when this file and the data disagree. -->",
        "",
        f"As of {as_of}. Each cell: the backend's status for that torch version, and the package it "
        "pairs with. `*` marks a fact not confirmed against a primary source. For the messages and "
        "sources of one combination: `accelport matrix --platform P --torch V`.",
    ]
    sources: list[Any] = []
    for platform in sorted(PLATFORMS, key=_DISPLAY_ORDER.index):
        backends = mx.backends(platform)
        if not backends:
            continue
        out += ["", f"## {platform}", "", "| torch | " + " | ".join(f"`{b}`" for b in backends) + " |",
                "|---|" + "---|" * len(backends)]
        for m in mx.minors(platform):
            cells = []
            for b in backends:
                row = mx.lookup(platform, b, m)
                if row is None:
                    cells.append("")
                    continue
                for s in row.sources:
                    if s not in sources:
                        sources.append(s)
                req = row.requirement(m) if row.status != "unsupported" else None
                refs = ",".join(str(sources.index(s) + 1) for s in row.sources)
                cells.append(f"{row.status}{'' if row.confirmed else '*'}" + (f" `{req}`" if req else "")
                             + f" [{refs}]")
            out.append(f"| {minor_str(m)} | " + " | ".join(cells) + " |")
    if mx.releases:
        out += ["", "## Patch releases", "",
                "Which patch of a paired package to install for each torch minor, the ones with a known problem, "
                "and the runtime each pairs with (`accelport doctor` compares the installed versions with these).",
                "", "| package | release | torch | status | Python | pairs with | |", "|---|---|---|---|---|---|---|"]
        for r in mx.releases:
            for s in r.sources:
                if s not in sources:
                    sources.append(s)
            refs = ",".join(str(sources.index(s) + 1) for s in r.sources)
            pairs = ", ".join(f"`{name}{spec}`" for name, spec in r.pins)
            if r.neuron_sdk:
                pairs = (pairs + "; " if pairs else "") + "Neuron " + ", ".join(r.neuron_sdk)
            python = f"{r.python[0]}-{r.python[1]}" if r.python else ""
            status = f"{r.status}{'' if r.confirmed else '*'}"
            issue = f" <{r.issue}>" if r.issue else ""
            out.append(f"| `{r.package}` | {r.version} | {minor_str(r.torch)} | {status} | {python} | {pairs} "
                       f"| {r.message}{issue} [{refs}] |")
    out += ["", "## Sources", ""]
    out += [f"{i}. {s.title}: <{s.url}>" for i, s in enumerate(sources, 1)]
    return "\n".join(out)


def render_verdict(v: Any) -> str:
    """A verdict as text: the answer first, then every backend, the alternatives and the sources."""
    chip = f" ({v.chip})" if v.chip else ""
    head = f"{v.platform}{chip}, torch {v.torch_version or 'not installed'}"
    if v.python:
        head += f", Python {v.python}"
    if v.row_torch and v.row_torch != _minor_of(v.torch_version):
        head += f": judged by the torch {v.row_torch} rows"
    lines = _wrap(head, "")
    facts = [f"as of {v.as_of.isoformat()}"] if v.as_of else []
    if v.python and not v.python_given:
        facts.append("this machine's Python; --python asks about another")
    if facts:
        lines += _wrap(f"({'; '.join(facts)})", "")
    if v.unverified:
        lines += _wrap(f"Unverified: torch {v.torch_version} is newer than every row for {v.platform}; "
                       f"the torch {v.row_torch} rows are used.", "")
    lines.append("")
    rec = v.recommended
    if rec:
        st = v.backends[rec]
        pip = " ".join((f"torch=={v.row_torch}.*", st.install or "", *st.pip_options)).replace("  ", " ")
        lines += _wrap(f"recommended: {rec}" + (f" (pip: {pip})" if st.requires else ""), "")
    else:
        lines += _wrap("recommended: none", "")
        if v.ranked:
            lines += _wrap(f"usable: {', '.join(f'{b} ({v.statuses[b]})' for b in v.ranked)}", "  ")
    sources: list[Any] = []
    if v.backends:
        lines.append("")
    from accelport.compat.schema import STATUSES

    order = list(v.backends)
    for name in sorted(order, key=lambda b: (STATUSES.index(v.backends[b].status), order.index(b))):
        st = v.backends[name]
        lines.append(f"{name:<12} {st.status:<12} torch {st.torch}")
        lines += _wrap(st.message, "    ")
        if st.requires:
            lines += _wrap(f"package: {st.requires}", "    ")
        if st.release is not None and st.status != "unsupported":
            lines += _wrap(f"release: {_describe_release(st.release)}", "    ")
        for bad in st.known_bad if st.status != "unsupported" else ():
            lines += _wrap(f"avoid: {bad.package} {bad.version}: {bad.message} {bad.issue or ''}".rstrip(), "    ")
        if st.pip_options and st.status != "unsupported":
            lines += _wrap(f"pip: {' '.join(st.pip_options)}", "    ")
        if st.python:
            lines += _wrap(f"python: {st.python[0]} to {st.python[1]}", "    ")
        if st.chips:
            lines += _wrap(f"chips: {', '.join(st.chips)}", "    ")
        if st.replacement and st.status in ("deprecated", "unsupported"):
            lines += _wrap(f"instead: the {st.replacement} backend", "    ")
        if st.note:
            lines += _wrap(("note: " if st.confirmed else "unconfirmed: ") + st.note, "    ")
        refs = []
        for s in st.sources:
            if s not in sources:
                sources.append(s)
            refs.append(f"[{sources.index(s) + 1}]")
        lines += _wrap("sources: " + " ".join(refs), "    ")
    if v.alternatives:
        lines += ["", "nearest working combinations:"]
        for alt in v.alternatives:
            lines += _wrap(alt.describe(), "  ")
    if not v.backends:
        lines += [""] + _wrap(v.reason, "")
    if sources:
        lines += ["", "sources:"]
        for i, s in enumerate(sources, 1):
            lines += textwrap.wrap(f"[{i}] {s.title}", WIDTH, initial_indent="  ",
                                   subsequent_indent="      ", break_on_hyphens=False)
            lines.append(f"      {s.url}")
    return "\n".join(lines)


def _describe_release(r: Any) -> str:
    """``torch_xla 2.8.1 (pairs with libtpu==0.0.17)``; ``torch-neuronx 2.9.0.2.15.32035 (Neuron 2.31.0, ...)``."""
    pairs = [f"{name}{spec}" for name, spec in r.pins]
    if r.neuron_sdk:
        pairs.append("Neuron " + ", ".join(r.neuron_sdk))
    return f"{r.package} {r.version}" + (f" (pairs with {'; '.join(pairs)})" if pairs else "")


def _minor_of(text: str | None) -> str | None:
    from accelport.compat.schema import minor_str, parse_torch_version

    try:
        return minor_str(parse_torch_version(text)) if text else None
    except Exception:
        return None
