"""``accelport doctor``: what will happen on this machine, and what to fix, before a run.

Safe by construction: it reads package metadata, /sys, /dev, /proc and the
environment (and runs ``neuron-ls`` with a short timeout where Neuron devices exist).
It never imports torch, torch_xla, torch_tpu or torch_neuronx,
never touches a device (a training job may hold it) and never uses the network.
Backend-specific checks come from plugins through ``accelport_doctor_checks``.
"""

from __future__ import annotations

import math
import os
import platform as _pyplatform
import sys
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from accelport import _packages
from accelport.doctor.finding import SEVERITIES, DoctorContext, Finding, as_finding
from accelport.platform import one_scan
from accelport.redact import Redactor, redact
from accelport.settings import plugin_timeout

if TYPE_CHECKING:
    from accelport.compat.load import Matrix
    from accelport.compat.verdict import Verdict

__all__ = ["PACKAGES", "ENVIRONMENT", "SHOWN_CHARACTERS", "gather"]

#: The most characters doctor shows of one string (a reason, a value): a 128 KB PJRT_DEVICE is
#: quoted in a dozen reasons, and the report stays readable and quick to redact.
SHOWN_CHARACTERS = 4000

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


#: The PJRT device types torch_xla knows by name; a backend's ``pjrt_devices`` add to them.
KNOWN_PJRT_DEVICES: tuple[str, ...] = ("TPU", "CPU", "CUDA", "GPU", "ROCM", "NEURON")


def _redaction_environ(environ: Mapping[str, str], backends: Mapping[str, Any]) -> dict[str, str]:
    """``environ`` as the report's redaction reads it: plus, for a ``PJRT_DEVICE`` that names no known device
    and looks like a credential, every form in which the report quotes it, named as secrets.

    The backends' reasons quote the device type as torch_xla reads it (the part before ``_``,
    uppercased: :func:`accelport.settings.explicit_pjrt_device`), which the pattern that caught the value
    no longer matches (an AWS secret key uppercased has no lower-case letter). A known device
    (``PJRT_DEVICE=TPU``) stays visible.
    """
    from accelport.settings import explicit_pjrt_device

    out = dict(environ)
    raw = (environ.get("PJRT_DEVICE") or "").strip()
    device = explicit_pjrt_device(environ)
    known = set(KNOWN_PJRT_DEVICES)
    for backend in backends.values():
        known.update(str(d).upper() for d in getattr(backend, "pjrt_devices", ()) or ())
    if not raw or device in known or redact("PJRT_DEVICE", raw) == raw:
        return out
    forms = {raw, raw.upper(), raw.lower(), device or "", (device or "").lower()}
    for i, form in enumerate(sorted(f for f in forms if f and f not in known)):
        out[f"PJRT_DEVICE (as quoted, {i}) SECRET"] = form
    return out


def _dir_size(path: str, budget: float = 0.3, max_files: int = 200_000) -> int | None:
    """Bytes under ``path``; None if it cannot be measured within the budget.

    Directories count against ``max_files`` and the clock as files do: a tree of
    empty directories costs a walk all the same.
    """
    total, files, deadline = 0, 0, time.monotonic() + budget
    try:
        for dirpath, _dirs, names in os.walk(path):
            files += 1
            if files > max_files or time.monotonic() > deadline:
                return None
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


def _checkpoints(environ: Mapping[str, str], now: float | None = None) -> dict[str, Any] | None:
    """What ``ACCELPORT_CHECKPOINT_DIR`` holds (ap.Checkpointer's default directory); None when it is unset."""
    from accelport.resume import CHECKPOINT_DIR_ENV, find_checkpoints, newest_complete

    directory = (environ.get(CHECKPOINT_DIR_ENV) or "").strip()
    if not directory:
        return None
    now = time.time() if now is None else now
    path = os.path.abspath(directory)
    row: dict[str, Any] = {"directory": path, "exists": os.path.isdir(path), "is_file": os.path.lexists(path)
                           and not os.path.isdir(path), "writable": None, "complete": [], "torn": [], "newest": None,
                           "goodput": None}
    if row["exists"]:
        row["writable"] = os.access(path, os.W_OK)
        found = find_checkpoints(path)
        row["complete"] = [{"step": f.step, "path": f.path, "world_size": f.world_size,
                            **_when(f.time, now)} for f in found if f.complete]
        row["torn"] = [{"step": f.step, "path": f.path, "problem": f.problem} for f in found if not f.complete]
        newest = newest_complete(found)
        row["newest"] = next((c for c in row["complete"] if newest is not None and c["step"] == newest.step), None)
        from accelport.goodput import account_of_directory

        row["goodput"] = account_of_directory(path)  # the last job's account, kept by ap.Checkpointer's rank 0
    return row


def _when(written: float | None, now: float) -> dict[str, Any]:
    """``age_s`` (None unless known) and ``time_problem`` of a checkpoint written at ``written`` (its
    checkpoint.json's time): "not valid" (not a finite time since the epoch), "in the future" (later than
    ``now``: another host's clock, or a file not written by a save), or None."""
    if written is None:
        return {"age_s": None, "time_problem": None}
    if not math.isfinite(written) or written < 0:
        return {"age_s": None, "time_problem": "not valid"}
    if written > now:
        return {"age_s": None, "time_problem": "in the future"}
    return {"age_s": now - written, "time_problem": None}


def _age(seconds: float | None, problem: str | None = None) -> str:
    if problem == "in the future":
        return "at a time in the future (its checkpoint.json's time is later than this host's clock)"
    if problem is not None:
        return "at a time not valid (its checkpoint.json's time is not a time since 1970)"
    if seconds is None:
        return "at a time not recorded"
    minutes = int(seconds // 60)
    if minutes < 1:
        return f"{seconds:.0f} s ago"
    if minutes < 120:
        return f"{minutes} min ago"
    hours = minutes // 60
    return f"{hours} h {minutes % 60} min ago" if hours < 48 else f"{hours // 24} days ago"


def _checkpoint_findings(row: Mapping[str, Any] | None) -> list[Finding]:
    """Where a resumed run would start from, for ``ACCELPORT_CHECKPOINT_DIR``."""
    if row is None:
        return []
    where = f"ACCELPORT_CHECKPOINT_DIR={row['directory']}"
    if row["is_file"]:
        return [Finding("problem", f"{where} is a file, not a directory: ap.Checkpointer() refuses it",
                        "point ACCELPORT_CHECKPOINT_DIR at a directory (created if missing)", "core")]
    if not row["exists"]:
        return [Finding("note", f"{where} does not exist yet: a run starts at step 0 and ap.Checkpointer() creates it",
                        "", "core")]
    found: list[Finding] = []
    if row["writable"] is False:
        found.append(Finding("problem", f"{where} is not writable by this user: ap.Checkpointer() cannot save there",
                             "give the directory to the user that trains, or point the variable elsewhere", "core"))
    newest = row["newest"]
    if newest is None:
        found.append(Finding("note", f"{where} holds no complete checkpoint: a run starts at step 0", "", "core"))
    else:
        world = f", written by {newest['world_size']} rank(s)" if newest.get("world_size") else ""
        written = _age(newest["age_s"], newest.get("time_problem"))
        found.append(Finding("note", f"checkpoints in {row['directory']}: {len(row['complete'])} complete, the newest "
                             f"at step {newest['step']} ({newest['path']}{world}) written {written}; "
                             "a run with ap.Checkpointer() resumes from it", "", "core"))
    if row.get("goodput") is not None:
        from accelport.goodput import render

        lines = render(row["goodput"])
        found.append(Finding("note", f"the last job in {row['directory']}: " + "; ".join(lines), "", "core"))
    later = [t for t in row["torn"] if newest is None or t["step"] > newest["step"]]
    for torn in later:
        found.append(Finding("warning", f"checkpoint {torn['path']} is incomplete: {torn['problem']}",
                             "nothing to do: a resumed run skips it (with a warning) and the next save of that step "
                             "replaces it; to free its space, delete it once no run of this job is running (a "
                             "background save is completed at a later step, and looks incomplete until then)", "core"))
    return found


def _safe(fn: Any, default: Any = None) -> Any:
    try:
        return fn()
    except Exception:
        return default


def _no_backend_fix(ctx: DoctorContext, matrix_ok: bool) -> str:
    """The fix for "no backend can be used", from what actually stands in the way."""
    forced = (ctx.environ.get("ACCELPORT_BACKEND") or "").strip()
    if forced:
        return (f"fix what the reason says, or unset ACCELPORT_BACKEND (now {forced!r}) to let accelport "
                "choose")
    if ctx.packages.get("torch") is None:
        return "pip install torch (the build your platform needs: see `accelport matrix`)"
    from accelport.plugins.host import disabled_names

    if "cpu" not in ctx.backends and "cpu" in disabled_names(ctx.environ):
        return "take cpu out of ACCELPORT_DISABLED_PLUGINS: it is the backend every machine can fall back to"
    if not matrix_ok:
        return "fix the compatibility matrix (the problem above): selection reads it"
    return "read each backend's reason in `accelport backends` and fix the one you mean to use"


def _core_findings(ctx: DoctorContext, recommendation: Verdict | None, matrix: Matrix | None,
                   matrix_error: str | None) -> list[Finding]:
    from accelport.compat.deprecations import deprecated_settings, deprecation_messages, target_platform

    findings: list[Finding] = []
    matrix_ok = matrix is not None
    if matrix_error is not None:  # a bad ACCELPORT_COMPAT_MATRIX file or plugin rows
        findings.append(Finding("problem", f"the compatibility matrix cannot be loaded: {matrix_error}",
                                "fix the file and key named above, or unset ACCELPORT_COMPAT_MATRIX", "core"))
    if ctx.packages.get("torch") is None:
        findings.append(Finding("problem", "torch is not installed", "pip install torch (the build your platform "
                                "needs: see `accelport matrix`)", "core"))
    if ctx.selected:
        from accelport.runtime.selection import pjrt_unmet

        unmet = pjrt_unmet(ctx.backends, ctx.environ, ctx.backends[ctx.selected])
        if unmet and not (ctx.environ.get("ACCELPORT_BACKEND") or "").strip():
            findings.append(Finding("warning", unmet.split(". Fix that", 1)[0],
                                    "install the XLA backend's packages (see `accelport matrix` and the reasons "
                                    "above), or unset PJRT_DEVICE", "core"))
        findings.append(Finding("ok", f"backend {ctx.selected} will be used: {ctx.selection_reason}", "", "core"))
        backend = ctx.backends[ctx.selected]
        platform = target_platform(backend, ctx.environ, ctx.platform.name)
        chip = ctx.platform.chip if platform == ctx.platform.name else None
        # {}: the deprecated variables are findings of their own, below.
        for message in [] if matrix is None else deprecation_messages(
                ctx.selected, platform, ctx.packages.get("torch"), {}, chip=chip, matrix=matrix):
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
    for name, message in [] if matrix is None else deprecated_settings(ctx.environ, matrix=matrix):
        findings.append(Finding("warning", f"{name} is set: it is deprecated", message, "core"))
    findings += _sharding_findings(ctx, matrix)
    cpus = ctx.cpu_count
    upper = max(1, cpus - 1)
    workers = f"num_workers between 1 and {upper}" if upper > 1 else "num_workers=1"
    findings.append(Finding(
        "note", f"{cpus} CPU core(s) for data loading",
        f"use DataLoader({workers}) per process, and no more workers than {cpus} across all processes on this "
        "host: more workers than cores slows the input pipeline", "core"))
    return findings


def _sharding_findings(ctx: DoctorContext, matrix: Matrix | None) -> list[Finding]:
    """What ``ap.shard`` would use on the selected backend with this torch, from the matrix, and whether
    sharded checkpoints lack numpy (``ctx.extra``: ``numpy``, ``torch_distributed``, as :func:`gather` finds them)."""
    from accelport.compat.schema import parse_torch_version
    from accelport.errors import InvalidVersionError

    torch_version = ctx.packages.get("torch")
    if matrix is None or not ctx.selected or not torch_version:
        return []
    try:
        minor = parse_torch_version(torch_version)
    except InvalidVersionError:
        return []
    fact = matrix.sharding_for(ctx.selected, minor)
    if fact is None:
        return []
    if fact.available:
        found = [Finding("note", f"ap.shard on {ctx.selected} with torch {torch_version}: {fact.engine}. "
                         f"{fact.message}", "", "core")]
        # Sharded checkpoints (ap.save / ap.load through torch.distributed.checkpoint) import numpy;
        # torch does not depend on it, so a bare `pip install torch` leaves it out.
        if ctx.extra.get("torch_distributed") and ctx.extra.get("numpy") is False:
            found.append(Finding("warning", f"numpy is not installed: ap.shard runs on {ctx.selected}, but saving "
                                 "or loading a sharded model (ap.save / ap.load, through "
                                 "torch.distributed.checkpoint) fails without it", "pip install numpy", "core"))
        return found
    return [Finding("warning", f"ap.shard cannot shard on {ctx.selected} with torch {torch_version}: a script "
                    "that calls it with several replicas fails there (alone it runs unsharded)", fact.message,
                    "core")]


def _memory(plat: Any, matrix: Matrix | None) -> tuple[dict[str, Any], Finding]:
    """What the machine's devices can hold, without touching one: the HBM of the detected chip from the
    matrix's chip facts (TPU, Trainium), the host's memory where the host is the device; a GPU's is read at
    run time (``ap.metrics().capacity_bytes``)."""
    from accelport.diagnose.memory import human_bytes
    from accelport.observe.memory import host_capacity
    from accelport.platform import sysroot

    fact = None
    if matrix is not None and plat.chip:
        from accelport.compat.machine import chip_name

        fact = matrix.chips.get(chip_name(plat.chip) or "")
    if fact is not None:
        count = f"{plat.device_count} x " if plat.device_count else ""
        split = (f", {fact.devices} devices of {human_bytes(fact.device_bytes)} each" if fact.devices > 1 else "")
        sources = "; ".join(src.url for src in fact.sources)
        info = {"device": fact.name, "per": "chip", "capacity_bytes": fact.hbm_bytes, "devices_per_chip": fact.devices,
                "device_bytes": fact.device_bytes, "chips": plat.device_count or None,
                "sources": [src.to_dict() for src in fact.sources]}
        return info, Finding("note", f"device memory: {count}{fact.title}, {human_bytes(fact.hbm_bytes)} of HBM per "
                             f"chip{split} (the compatibility matrix: {sources})",
                             "ap.memory_estimate(model, optimizer, batch) says what a step needs and on how many "
                             "devices it fits", "core")
    if plat.name in ("gcp-tpu", "aws-neuron", "nvidia-gpu"):
        what = "this chip's" if plat.name != "nvidia-gpu" else "a GPU's"
        return ({"device": plat.chip or plat.name, "per": None, "capacity_bytes": None},
                Finding("note", f"device memory: {what} is not known before a run (doctor never touches the device)",
                        "it is read at run time: ap.metrics().capacity_bytes", "core"))
    try:
        capacity = host_capacity(sysroot())
    except Exception:  # noqa: BLE001 - a bad ACCELPORT_SYSROOT is a finding of its own
        capacity = None
    info = {"device": "host", "per": "host", "capacity_bytes": capacity}
    return info, Finding("note", f"host memory: {human_bytes(capacity)} (MemTotal, or a lower cgroup limit); "
                         "on cpu it is the device's", "ap.memory_estimate(model, optimizer, batch) says what a "
                         "step needs", "core")


def _torch_distributed_ships() -> bool:
    """Whether the installed torch has torch.distributed.checkpoint, found on disk, never imported.

    ``find_spec("torch.distributed")`` would import torch (a submodule's parent runs first),
    so the package's directory is located and looked in instead.
    """
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return False
    for location in (spec.submodule_search_locations or ()) if spec is not None else ():
        if os.path.isfile(os.path.join(location, "distributed", "checkpoint", "__init__.py")):
            return True
    return False


@one_scan()  # the probes, the selection and the recommendation each detect the platform: read /sys once
def gather(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Collect the whole report as plain data (the ``--json`` output)."""
    from accelport import __version__
    from accelport.compat.load import build
    from accelport.compat.verdict import recommend
    from accelport.errors import AccelportError, CompatMatrixError
    from accelport.platform import PlatformInfo, detect
    from accelport.plugins.host import create_manager
    from accelport.runtime.selection import resolve

    env = dict(os.environ if environ is None else environ)
    # Its own host and matrix, from ``env`` alone: doctor never changes the process's selection,
    # and every answer below (selection, recommendation, deprecations) reads the same ones.
    host = create_manager(env, timeout=plugin_timeout(env))
    try:
        plat, root_problem = detect(environ=env), None
    except AccelportError as exc:  # ACCELPORT_SYSROOT names no directory: a problem to report, not a crash
        plat, root_problem = PlatformInfo("cpu", evidence=(str(exc),)), str(exc)
    matrix: Matrix | None
    matrix_error: str | None = None
    try:
        matrix = build(host, env)
    except CompatMatrixError as exc:
        matrix, matrix_error = None, str(exc)
    packages = {name: _packages.version(name) for name in PACKAGES}
    probes = {name: host.probe(name) for name in list(host.backends)}
    probes = {name: probe for name, probe in probes.items() if name in host.backends}  # minus the disabled
    try:
        chosen, reason = resolve(host, None, env, matrix=matrix, found=plat)
        selected: str | None = chosen.name
    except AccelportError as exc:
        selected, reason = None, str(exc)
    recommendation = None if matrix is None else _safe(
        lambda: recommend(plat.name, chip=plat.chip, matrix=matrix, environ=env, warn=False))
    cpus = os.cpu_count() or 1
    # Found, not imported: numpy for sharded checkpoints, and whether torch ships torch.distributed.
    extra = {"numpy": _packages.has_module("numpy"), "torch_distributed": _torch_distributed_ships()}
    ctx = DoctorContext(env, plat, packages, probes, dict(host.backends), selected, reason, cpus, extra)

    findings = _core_findings(ctx, recommendation, matrix, matrix_error)
    checkpoints = _checkpoints(env)
    findings += _checkpoint_findings(checkpoints)
    memory, memory_finding = _memory(plat, matrix)
    findings.append(memory_finding)
    if matrix is not None:  # installed patch releases against the matrix's: known-bad, superseded, mispaired
        from accelport.compat.releases import installed_findings

        findings += [Finding(f.severity, f.title, f.fix, "core") for f in installed_findings(matrix)]
    if root_problem:
        findings.append(Finding("problem", root_problem, "fix or unset ACCELPORT_SYSROOT", "core"))
    for plugin, result in host.call_each("accelport_doctor_checks", context=ctx):
        for item in result if isinstance(result, (list, tuple)) else [result]:
            try:
                findings.append(as_finding(item, plugin))
            except (TypeError, ValueError, KeyError) as exc:
                findings.append(Finding("warning", f"plugin {plugin} returned a malformed finding: {exc}",
                                        "report it to the plugin's authors", "core"))
    # The rules, set up as a run sets them up: a rule class that cannot run is one of the failures below.
    from accelport.diagnose.engine import rules_from
    from accelport.errors import PluginWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginWarning)  # said below, as a finding
        rules_from(host)
    for failed in host.failed:
        findings.append(Finding("warning", f"plugin {failed.name} was disabled ({failed.stage}): {failed.error}",
                                f"fix or uninstall it, or set ACCELPORT_DISABLED_PLUGINS={failed.name}", "core"))

    order = {s: i for i, s in enumerate(reversed(SEVERITIES))}
    findings.sort(key=lambda f: order[f.severity])
    report = {
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
        "memory": memory,
        "environment": _environment(env),
        "caches": _caches(host.backends, env),
        "checkpoints": checkpoints,
        "plugins": [
            {"name": p.name, "module": p.module, "distribution": p.distribution, "version": p.version,
             "builtin": p.builtin, "hooks": list(p.hooks)}
            for p in host.plugins.values()
        ] + [{"name": f.name, "failed": f.stage, "error": f.error} for f in host.failed],
        "findings": [f.to_dict() for f in findings],
    }
    # The one pass over the finished report: a secret is hidden whichever section quotes it,
    # and no string is longer than SHOWN_CHARACTERS.
    return Redactor(_redaction_environ(env, host.backends), limit=SHOWN_CHARACTERS).tree(report)


def _recommendation_dict(verdict: Verdict | None) -> dict[str, Any] | None:
    if verdict is None:
        return None
    to_dict = getattr(verdict, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    return {"platform": verdict.platform, "torch": verdict.torch_version, "recommended": verdict.recommended,
            "ranked": list(verdict.ranked)}


