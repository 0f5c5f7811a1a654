"""``accelport doctor``'s report as text and as markdown for a bug report."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["render_text", "render_markdown", "exit_status"]


def exit_status(report: Mapping[str, Any]) -> int:
    """0: no problem; 1: at least one finding of severity problem."""
    return 1 if any(f["severity"] == "problem" for f in report["findings"]) else 0


_ICON = {"ok": "ok  ", "note": "note", "warning": "WARN", "problem": "FAIL"}


def _size(n: int | None) -> str:
    if n is None:
        return "size unknown"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return ""


def render_text(report: Mapping[str, Any]) -> str:
    """The human report (about 40 lines)."""
    s, p = report["system"], report["platform"]
    lines = [
        f"accelport {report['accelport']}  Python {s['python']}  {s['os']} {s['machine']}  {s['cpu_count']} CPUs",
        f"platform: {p['name']}" + (f" ({p['chip']})" if p["chip"] else "")
        + (f", {p['device_count']} device(s)" if p["device_count"] else "")
        + (f"  [{'; '.join(p['evidence'])}]" if p["evidence"] else ""),
        "",
        "packages:",
    ]
    lines += [f"  {name:<14} {ver or '-'}" for name, ver in report["packages"].items() if ver] or ["  (none)"]
    missing = [name for name, ver in report["packages"].items() if not ver]
    if missing:
        lines.append(f"  not installed: {', '.join(missing)}")
    lines += ["", "backends:"]
    sel = report["selected"]["name"]
    for b in report["backends"]:
        mark = "*" if b["name"] == sel else " "
        lines.append(f" {mark}{b['name']:<11} {'available' if b['available'] else 'unavailable':<11} {b['reason']}")
    lines.append(f"  selected: {sel or 'none'}: {report['selected']['reason']}")
    rec = report.get("recommendation") or {}
    if rec:
        lines.append(f"  recommended for {rec.get('platform')} with torch {rec.get('torch_version')}: "
                     f"{rec.get('recommended') or 'none'}")
    if report["environment"]:
        lines += ["", "environment:"]
        lines += [f"  {e['name']}={e['value']}  ({e['meaning']})" for e in report["environment"]]
    if report["caches"]:
        lines += ["", "compile caches:"]
        for c in report["caches"]:
            where = "remote" if c.get("remote") else (_size(c["bytes"]) if c["exists"] else "not created yet")
            lines.append(f"  {c['owner']}: {c['path']} ({where})")
    ckpt = report.get("checkpoints")
    if ckpt:
        newest = ckpt.get("newest")
        lines += ["", "checkpoints (ACCELPORT_CHECKPOINT_DIR):",
                  f"  {ckpt['directory']}: " + ("a file, not a directory" if ckpt.get("is_file") else
                                                "not created yet" if not ckpt.get("exists") else
                                                f"{len(ckpt['complete'])} complete, {len(ckpt['torn'])} incomplete"
                                                + (f"; newest step {newest['step']}" if newest else ""))]
    lines += ["", "plugins: " + ", ".join(
        f"{p['name']}" + (f" {p['version']}" if p.get("version") else "") + (" (FAILED)" if p.get("failed") else "")
        for p in report["plugins"])]
    lines += ["", "findings:"]
    for f in report["findings"]:
        lines.append(f"  [{_ICON[f['severity']]}] {f['title']}")
        if f["fix"] and f["severity"] != "ok":
            lines.append(f"         fix: {f['fix']}")
    problems = sum(f["severity"] == "problem" for f in report["findings"])
    warns = sum(f["severity"] == "warning" for f in report["findings"])
    lines += ["", f"{problems} problem(s), {warns} warning(s)"]
    return "\n".join(lines)


def render_markdown(report: Mapping[str, Any]) -> str:
    """A block to paste into a bug report."""
    body = render_text(report)
    # A fence longer than any run of backticks in the text: nothing in it can close the block.
    longest = max((len(run) for run in re.findall(r"`+", body)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"<details><summary>accelport doctor</summary>\n\n{fence}\n{body}\n{fence}\n</details>"
