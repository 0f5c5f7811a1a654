"""``accelport doctor``: what will happen on this machine, and what to fix, before a run.

Safe by construction: it reads package metadata, /sys, /dev, /proc and the
environment (and runs ``neuron-ls`` with a short timeout where Neuron devices exist). It never imports torch, torch_xla, torch_tpu or torch_neuronx,
never touches a device (a training job may hold it) and never uses the network.
Backend-specific checks come from plugins through ``accelport_doctor_checks``.
"""

from __future__ import annotations

import os
import platform as _pyplatform
import re
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import _packages

__all__ = [
    "SEVERITIES",
    "Finding",
    "DoctorContext",
    "PACKAGES",
    "ENVIRONMENT",
    "redact",
    "gather",
    "render_text",
    "render_markdown",
    "exit_status",
]

SEVERITIES = ("ok", "note", "warning", "problem")

#: Distributions whose versions matter, in the order shown.
PACKAGES: tuple[str, ...] = (
    "torch", "torch_xla", "torch-tpu", "libtpu", "torch-neuronx", "libneuronxla", "neuronx-cc", "jax", "jaxlib",
    "accelerate", "lightning",
)

#: Environment variables doctor shows, each with what it does. Only these (and
#: the TPU_*, TORCH_TPU_* and ACCELPORT_* families) are ever printed.
ENVIRONMENT: Mapping[str, str] = {
    "PJRT_DEVICE": "which PJRT device torch_xla uses (CPU, TPU, NEURON); unset: TPU if present, else NEURON, else CPU",
    "CPU_NUM_DEVICES": "how many XLA:CPU devices torch_xla creates (default 1)",
    "XLA_USE_BF16": "deprecated: maps float32 to bf16 on XLA; convert the model or use autocast",
    "XLA_DOWNCAST_BF16": "deprecated: downcasts float32 to bf16 on XLA; convert the model or use autocast",
    "XLA_FLAGS": "flags passed to the XLA compiler",
    "PT_XLA_DEBUG_LEVEL": "1|2: torch_xla prints why it compiles and executes (Compilation/Execution Analysis)",
    "XLA_METRICS_FILE": "torch_xla appends its metrics report to this file at every step",
    "XLA_IR_DEBUG": "1: attach Python frames to torch_xla's IR",
    "XLA_HLO_DEBUG": "1: attach Python frames to the HLO",
    "NEURON_CC_FLAGS": "flags for the Neuron compiler; --cache_dir=... moves the compile cache",
    "NEURON_COMPILE_CACHE_URL": "Neuron compile cache location (local path or s3://); --cache_dir wins",
    "NEURON_RT_VISIBLE_CORES": "which NeuronCores this process may use (index or range)",
    "NEURON_RT_NUM_CORES": "how many NeuronCores this process takes",
    "TORCH_DEVICE_BACKEND_AUTOLOAD": "0: `import torch` does not autoload out-of-tree backends such as torch-tpu",
    "TORCHINDUCTOR_CACHE_DIR": "where torch.compile (inductor) caches compiled kernels",
    "PYTORCH_NVML_BASED_CUDA_CHECK": "1: torch.cuda.is_available() asks NVML instead of initialising CUDA",
    "CUDA_VISIBLE_DEVICES": "which NVIDIA GPUs this process sees",
    "WORLD_SIZE": "replicas in this job (set by the launcher)",
    "RANK": "this process's rank (set by the launcher)",
    "LOCAL_RANK": "this process's rank on this host (set by the launcher)",
}
ENVIRONMENT_PREFIXES: Mapping[str, str] = {
    "ACCELPORT_": "accelport setting",
    "TPU_": "Cloud TPU VM setting",
    "TORCH_TPU_": "TorchTPU setting",
}
_SECRET_NAME = re.compile(r"(?i)(secret|token|password|passwd|credential|api[_-]?key|private)")
_SECRET_VALUE = [
    re.compile(r"(?i)\b(token|secret|password|passwd|apikey|api_key|key|credential)(\s*[=:]\s*)([^\s,;&]+)"),
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),
    re.compile(r"\b(?:gh[pousr]_|xox[abp]-|ya29\.)[A-Za-z0-9_\-.]{10,}"),
    re.compile(r"(?<![A-Za-z0-9/])(?=[A-Za-z0-9+/_\-]*\d)(?=[A-Za-z0-9+/_\-]*[A-Za-z])[A-Za-z0-9+/_\-]{32,}={0,2}"),
]
REDACTED = "<redacted>"


@dataclass(frozen=True)
class Finding:
    """One result of a check: ``severity`` (ok, note, warning, problem), what was seen, and the fix."""

    severity: str
    title: str
    fix: str = ""
    check: str = ""  # which plugin produced it

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {', '.join(SEVERITIES)}, not {self.severity!r}")

    def to_dict(self) -> dict[str, str]:
        return {"severity": self.severity, "title": self.title, "fix": self.fix, "check": self.check}


@dataclass
class DoctorContext:
    """Read-only facts gathered before the checks run (what ``accelport_doctor_checks`` receives)."""

    environ: Mapping[str, str]
    platform: Any
    packages: Mapping[str, str | None]
    probes: Mapping[str, Any]
    backends: Mapping[str, Any]
    selected: str | None
    selection_reason: str
    cpu_count: int
    extra: dict[str, Any] = field(default_factory=dict)


def redact(name: str, value: str) -> str:
    """The value to show for variable ``name``; anything that looks like a credential is redacted."""
    if _SECRET_NAME.search(name):
        return REDACTED
    out = value
    for pattern in _SECRET_VALUE:
        if pattern.groups >= 3:
            out = pattern.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", out)
        else:
            out = pattern.sub(REDACTED, out)
    return out


def _environment(environ: Mapping[str, str]) -> list[dict[str, str]]:
    rows = []
    for name in sorted(environ):
        meaning = ENVIRONMENT.get(name)
        if meaning is None:
            meaning = next((m for p, m in ENVIRONMENT_PREFIXES.items() if name.startswith(p)), None)
        if meaning is None:
            continue
        rows.append({"name": name, "value": redact(name, str(environ[name])), "meaning": meaning})
    return rows


def _dir_size(path: str, budget: float = 0.3, max_files: int = 200_000) -> int | None:
    """Bytes under ``path``; None if it cannot be measured within the budget."""
    total, files, deadline = 0, 0, time.monotonic() + budget
    try:
        for dirpath, _dirs, names in os.walk(path):
            for n in names:
                try:
                    total += os.lstat(os.path.join(dirpath, n)).st_size
                except OSError:
                    continue
                files += 1
                if files > max_files or time.monotonic() > deadline:
                    return None
    except OSError:
        return None
    return total


def _caches(backends: Mapping[str, Any], environ: Mapping[str, str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    candidates: list[tuple[str, str | None]] = [(name, _safe(lambda b=b: b.compile_cache_dir()))
                                                for name, b in backends.items()]
    user = environ.get("USER") or environ.get("LOGNAME") or "root"
    candidates.append(("inductor (torch.compile)",
                       environ.get("TORCHINDUCTOR_CACHE_DIR") or f"/tmp/torchinductor_{user}"))
    for owner, path in candidates:
        if not path or path in seen:
            continue
        seen.add(path)
        row: dict[str, Any] = {"owner": owner, "path": path, "exists": False, "bytes": None, "writable": None}
        if "://" in path:
            row["remote"] = True
        elif os.path.isdir(path):
            row.update(exists=True, bytes=_dir_size(path), writable=os.access(path, os.W_OK))
        else:
            parent = os.path.dirname(os.path.abspath(path))
            while parent and not os.path.isdir(parent) and parent != os.path.dirname(parent):
                parent = os.path.dirname(parent)
            row["writable"] = os.access(parent, os.W_OK) if parent else False
        rows.append(row)
    return rows


def _safe(fn: Any, default: Any = None) -> Any:
    try:
        return fn()
    except Exception:
        return default


def _as_finding(item: Any, check: str) -> Finding:
    if isinstance(item, Finding):
        return item if item.check else Finding(item.severity, item.title, item.fix, check)
    if isinstance(item, Mapping):
        return Finding(str(item.get("severity", "note")), str(item["title"]), str(item.get("fix", "")), check)
    raise TypeError(f"got {type(item).__name__}; expected accelport.doctor.Finding or a dict with a title")


def _no_backend_fix(ctx: DoctorContext, matrix_ok: bool) -> str:
    """The fix for "no backend can be used", from what actually stands in the way."""
    forced = (ctx.environ.get("ACCELPORT_BACKEND") or "").strip()
    if forced:
        return (f"fix what the reason says, or unset ACCELPORT_BACKEND (now {forced!r}) to let accelport "
                "choose")
    if ctx.packages.get("torch") is None:
        return "pip install torch (the build your platform needs: see `accelport matrix`)"
    from .plugins import _disabled_names

    if "cpu" not in ctx.backends and "cpu" in _disabled_names(ctx.environ):
        return "take cpu out of ACCELPORT_DISABLED_PLUGINS: it is the backend every machine can fall back to"
    if not matrix_ok:
        return "fix the compatibility matrix (the problem above): selection reads it"
    return "read each backend's reason in `accelport backends` and fix the one you mean to use"


def _core_findings(ctx: DoctorContext, recommendation: Any) -> list[Finding]:
    from .compat import current_matrix, deprecated_settings, deprecation_messages, target_platform
    from .errors import CompatMatrixError

    findings: list[Finding] = []
    try:
        current_matrix(ctx.environ)
        matrix_ok = True
    except CompatMatrixError as exc:  # a bad ACCELPORT_COMPAT_MATRIX file or plugin rows
        matrix_ok = False
        findings.append(Finding("problem", f"the compatibility matrix cannot be loaded: {exc}",
                                "fix the file and key named above, or unset ACCELPORT_COMPAT_MATRIX", "core"))
    if ctx.packages.get("torch") is None:
        findings.append(Finding("problem", "torch is not installed", "pip install torch (the build your platform "
                                "needs: see `accelport matrix`)", "core"))
    if ctx.selected:
        findings.append(Finding("ok", f"backend {ctx.selected} will be used: {ctx.selection_reason}", "", "core"))
        backend = ctx.backends[ctx.selected]
        platform = target_platform(backend, ctx.environ, ctx.platform.name)
        for message in [] if not matrix_ok else deprecation_messages(ctx.selected, platform, ctx.packages.get("torch"), {},
                                            chip=ctx.platform.chip if platform == ctx.platform.name else None):
            findings.append(Finding("warning", f"the selected path is deprecated or unsupported: {ctx.selected} "
                                    f"on {platform} with torch {ctx.packages.get('torch')}", message, "core"))
    else:
        findings.append(Finding("problem", f"no backend can be used: {ctx.selection_reason}",
                                _no_backend_fix(ctx, matrix_ok), "core"))
    recommended = getattr(recommendation, "recommended", None)
    if recommendation is not None and recommended is None:
        findings.append(Finding(
            "warning", f"no backend is recommended for {ctx.platform.describe()} with torch "
            f"{ctx.packages.get('torch') or '(not installed)'}", getattr(recommendation, "reason", ""), "core"))
    if recommended and recommended != ctx.selected and recommended in ctx.probes:
        probe = ctx.probes[recommended]
        if not probe.available:
            findings.append(Finding(
                "warning", f"{recommended} is recommended for {ctx.platform.name} but unavailable: {probe.reason}",
                f"fix what the reason says to run on {recommended}", "core"))
    for name, message in deprecated_settings(ctx.environ) if matrix_ok else []:
        findings.append(Finding("warning", f"{name} is set: it is deprecated", message, "core"))
    cpus = ctx.cpu_count
    upper = max(1, cpus - 1)
    workers = f"num_workers between 1 and {upper}" if upper > 1 else "num_workers=1"
    findings.append(Finding(
        "note", f"{cpus} CPU core(s) for data loading",
        f"use DataLoader({workers}) per process, and no more workers than {cpus} across all processes on this "
        "host: more workers than cores slows the input pipeline", "core"))
    return findings


def gather(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Collect the whole report as plain data (the ``--json`` output)."""
    from . import __version__
    from .compat import recommend
    from .errors import AccelportError
    from .platform import detect
    from .plugins import create_manager
    from .selection import resolve

    env = dict(os.environ if environ is None else environ)
    host = create_manager(env)  # a private host: doctor never changes the process's selection
    plat = detect(environ=env)
    packages = {name: _packages.version(name) for name in PACKAGES}
    probes = {name: b.probe() for name, b in host.backends.items()}
    try:
        chosen, reason = resolve(host, None, env)
        selected: str | None = chosen.name
    except AccelportError as exc:
        selected, reason = None, str(exc)
    recommendation = _safe(lambda: recommend(plat.name, chip=plat.chip, warn=False))
    cpus = os.cpu_count() or 1
    ctx = DoctorContext(env, plat, packages, probes, dict(host.backends), selected, reason, cpus)

    findings = _core_findings(ctx, recommendation)
    for plugin, result in host.call_each("accelport_doctor_checks", context=ctx):
        for item in result if isinstance(result, (list, tuple)) else [result]:
            try:
                findings.append(_as_finding(item, plugin))
            except (TypeError, ValueError, KeyError) as exc:
                findings.append(Finding("warning", f"plugin {plugin} returned a malformed finding: {exc}",
                                        "report it to the plugin's authors", "core"))
    for failed in host.failed:
        findings.append(Finding("warning", f"plugin {failed.name} was disabled ({failed.stage}): {failed.error}",
                                f"fix or uninstall it, or set ACCELPORT_DISABLED_PLUGINS={failed.name}", "core"))

    order = {s: i for i, s in enumerate(reversed(SEVERITIES))}
    findings.sort(key=lambda f: order[f.severity])
    return {
        "accelport": __version__,
        "system": {
            "python": sys.version.split()[0],
            "os": f"{_pyplatform.system()} {_pyplatform.release()}",
            "machine": _pyplatform.machine(),
            "cpu_count": cpus,
        },
        "platform": {"name": plat.name, "chip": plat.chip, "device_count": plat.device_count,
                     "evidence": list(plat.evidence)},
        "packages": packages,
        "backends": [
            {"name": n, "platform": b.platform, "lazy": b.lazy, "available": probes[n].available,
             "reason": probes[n].reason, "device_count": probes[n].device_count,
             "details": dict(probes[n].details), "plugin": host.backend_plugin.get(n)}
            for n, b in host.backends.items()
        ],
        "selected": {"name": selected, "reason": reason},
        "recommendation": _recommendation_dict(recommendation),
        "environment": _environment(env),
        "caches": _caches(host.backends, env),
        "plugins": [
            {"name": p.name, "module": p.module, "distribution": p.distribution, "version": p.version,
             "builtin": p.builtin, "hooks": list(p.hooks)}
            for p in host.plugins.values()
        ] + [{"name": f.name, "failed": f.stage, "error": f.error} for f in host.failed],
        "findings": [f.to_dict() for f in findings],
    }


def _recommendation_dict(verdict: Any) -> dict[str, Any] | None:
    if verdict is None:
        return None
    to_dict = getattr(verdict, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    return {"platform": verdict.platform, "torch": verdict.torch_version, "recommended": verdict.recommended,
            "ranked": list(verdict.ranked)}


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
    return "<details><summary>accelport doctor</summary>\n\n```\n" + render_text(report) + "\n```\n</details>"
