"""Where a run's step time goes, said in words: the one line and the verdict with its fix.

    time per step 41.2 ms: data 17.0 (41%), device 20.1 (49%), host_sync 2.9 (7%), other 1.2 (3%)
    input-bound: 41% of the step time after the first step waits for the next batch (99 step(s))
    Set num_workers to 3 in the DataLoader ... (as input-bound says).

The verdict is xprof's kind of answer (input-bound, host-bound, compile-bound, device-bound,
sync-bound), judged on the steps after the first (which holds the start-up and the first
compilations) from the time breakdown the step tracker measured. It is a summary of every run,
healthy ones included (a device-bound run is where one wants to be), not a finding: findings are
the rules' (:mod:`accelport.diagnose.rules`), each made once, when something is wrong. Where the
verdict points at a kind, it names that kind's fix, in that kind's words.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from accelport.diagnose import advice
from accelport.observe.steptime import breakdown_line

__all__ = ["explain", "verdict", "VERDICTS", "with_efficiency"]

#: Each time category and the verdict it leads to when it takes the largest share.
VERDICTS: Mapping[str, str] = {
    "data": "input-bound", "transfer": "input-bound", "compile": "compile-bound", "device": "device-bound",
    "host_sync": "sync-bound", "collective": "sync-bound", "other": "host-bound",
}


def _verdict_of(category: str) -> str:
    kinds: list[str] = []
    for part in category.split("+"):
        kind = VERDICTS.get(part, "host-bound")
        if kind not in kinds:
            kinds.append(kind)
    return " or ".join(kinds)


def verdict(breakdown: Mapping[str, float]) -> tuple[str, float, dict[str, float]]:
    """(the verdict, the share that makes it, the shares by verdict) for a breakdown in seconds."""
    total = sum(v for v in breakdown.values() if v > 0)
    if total <= 0:
        return "", 0.0, {}
    shares: dict[str, float] = {}
    for category, seconds in breakdown.items():
        if seconds > 0:
            kind = _verdict_of(category)
            shares[kind] = shares.get(kind, 0.0) + seconds / total
    kind = max(shares, key=lambda k: shares[k])
    return kind, shares[kind], shares


def _said_by(fix: str, kind: str) -> str:
    """``fix`` (a sentence or a few, ending with a period) with the kind whose fix it is."""
    return f"{fix.rstrip().rstrip('.')} (as {kind} says)."


def _finding(findings: Sequence[Any], kind: str) -> Any:
    return next((f for f in findings if getattr(f, "kind", None) == kind), None)


def _fix(kind: str, after: Mapping[str, float], *, lazy: bool, loader: Mapping[str, Any],
         findings: Sequence[Any], style: str, shapes: int | None = None) -> str:
    """The one fix that matters most for ``kind``: that of the diagnosis kind it points at, in the script's terms."""
    if kind == "input-bound":
        if after.get("transfer", 0.0) > after.get("data", 0.0):
            return ("The copies of each batch to the device hold the loop up: load further ahead "
                    "(ap.loader(..., prefetch=N)) so they overlap the step, or send less (uint8 images, token ids) "
                    "and convert on the device.")
        return _said_by(advice.data_workers(style, loader.get("num_workers"), os.cpu_count() or 1), "input-bound")
    if kind == "sync-bound":
        if after.get("collective", 0.0) > after.get("host_sync", 0.0):
            return ("The replicas wait for each other in the gradient all-reduce: the slowest one sets the pace "
                    "(uneven batches, work done on one rank only such as logging or evaluation); give every rank "
                    "the same work, and do rank-0-only work every N steps.")
        return _said_by(advice.host_reads(style), "host-sync")
    if kind == "compile-bound":
        found = _finding(findings, "recompilation") or _finding(findings, "compile-limit")
        if found is not None and getattr(found, "fix", None):
            return _said_by(found.fix, found.kind)
        if shapes == 1:  # (no input changed shape: the graph itself does)
            return ("It compiles after the first step on one batch shape: the graph itself changes (a Python "
                    "value baked into it, a tensor made inside the step whose shape changes); accelport diagnose "
                    "names the op once it repeats.")
        if lazy:
            return ("Graphs compile after the first step: see which input changes shape (accelport diagnose names "
                    "it once it repeats); for compilations that are the same every run, a persistent cache "
                    "(ap.compile_cache(DIR) before the first step, or XLA_PERSISTENT_CACHE_PATH) pays them once.")
        return ("Functions compile after the first step: a new input shape or a changed Python value recompiles; "
                "pad or bucket inputs to a few shapes (ap.data.BucketCollate).")
    if kind == "host-bound":
        if lazy:
            return ("The host takes longer to trace each step's graph (and to run the script's own Python) than "
                    "the device takes to run it: give the device more work per step (a larger batch), trace less "
                    "Python per step (no Python loops over tensors), and log through ap.after_step; "
                    "`accelport diagnose --profile A:B` shows where the host's time goes.")
        return ("The script's own code between the steps' work (after the backward pass and after the optimizer "
                "step: logging, metrics, checkpoints, data handling in the loop) takes the largest share: do it every "
                "N steps or move it into the DataLoader's workers; `accelport diagnose --profile A:B` shows which.")
    if kind == "device-bound":
        return advice.device_bound(style, lazy)
    parts = [p for p in kind.split(" or ")]
    return (f"This backend cannot tell {' from '.join(parts)} apart in every step; a profile of a few steps "
            "(`accelport diagnose --profile A:B`, ACCELPORT_PROFILE=A:B) shows the device's own time.")


def explain(total: Mapping[str, float], steps: int, *, first: Mapping[str, float] | None = None,
            loader: Mapping[str, Any] | None = None, findings: Sequence[Any] = (), lazy: bool = False,
            style: str = "accelport", shapes: int | None = None) -> list[str]:
    """[the line, the verdict, its fix] for a run whose ``steps`` steps took ``total`` (seconds by category), of
    which the first step took ``first`` (left out of the verdict when there are more); the fix spelled for a
    script that trains as ``style`` says (``RunView.style``), for a run of ``shapes`` batch shapes (None: not
    known). Work between the steps (``between_steps``) is on the line, not in the verdict, which judges the
    training steps. Only the line where no verdict can be made."""
    if steps <= 0 or not total:
        return []
    seconds = sum(total.values())
    lines = [breakdown_line(total, seconds / steps, steps)]
    after = dict(total)
    judged = steps
    if first and steps > 1:
        for key, value in first.items():
            after[key] = max(after.get(key, 0.0) - value, 0.0)
        judged = steps - 1
    after.pop("between_steps", None)
    kind, share, _ = verdict(after)
    if not kind:
        return lines
    which = "after the first step" if judged < steps else "of the run"
    goes = {"input-bound": "waits for the next batch", "compile-bound": "compiles",
            "device-bound": "is the device's own work", "sync-bound": "waits for device values or other replicas",
            "host-bound": "runs the host's own code"}.get(kind, "goes there")
    lines.append(f"{kind}: {share:.0%} of the step time {which} {goes} ({judged} step(s))")
    lines.append(_fix(kind, after, lazy=lazy, loader=loader or {}, findings=findings, style=style, shapes=shapes))
    return lines


def with_efficiency(lines: list[str], efficiency: Mapping[str, Any] | None) -> list[str]:
    """[the line, the verdict, its fix] of :func:`explain` with, when the run is device-bound, how much of the
    chip the step uses on the verdict (MFU against the chip's peak, or the achieved FLOP/s where the matrix
    has no peak for it) and the causes the step shows first in the fix, each with its number and its fix.
    A device-bound run without any of the causes keeps its fix."""
    if len(lines) < 3 or not lines[1].startswith("device-bound") or not efficiency:
        return lines
    from accelport.observe.flops import verdict_text

    said = verdict_text(efficiency)
    out = list(lines)
    if said:
        out[1] = f"{lines[1]}, {said}"
    causes = [c for c in efficiency.get("causes") or () if c.get("text") and c.get("fix")]
    if causes:
        out[2] = " ".join(f"{c['text'][0].upper()}{c['text'][1:]}: {c['fix']}." for c in causes)
    return out
