"""The torch.compile family: recompilation with its cause, the recompile-limit cliff, graph breaks.

The rules themselves (:mod:`accelport.diagnose.rules`) decide when to judge, on each
step record; this module says what dynamo's records mean in the user's terms (see
:mod:`accelport.observe.dynamo`) and what to do about it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from accelport.diagnose import advice
from accelport.diagnose.buckets import Suggestion, describe, suggest
from accelport.observe.dynamo import FunctionCompiles, GraphBreak, LimitHit

__all__ = ["accepts_dynamic", "shape_cause", "recompilation_cause", "compile_limit_message", "graph_break_message",
           "break_fix", "breaks_explain_recompiles", "dynamo_suggestion"]

#: torch.compile backends (by accelport backend name) whose compiler rejects dynamic shapes.
STATIC_ONLY = frozenset({"tpu", "neuron"})


def accepts_dynamic(backend_name: str, declared: bool | None = None) -> bool | None:
    """Whether the backend's compiler takes dynamic shapes (None: not known); ``declared`` is what the
    backend in use says of itself (``compile_dynamic``), which wins."""
    if declared is not None:
        return declared
    if backend_name in STATIC_ONLY:
        return False
    if backend_name in ("cpu", "cuda"):
        return True
    return None


def _sizes(sizes: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(s) for s in sizes[:limit])
    return shown + (f", ... ({len(sizes)} sizes)" if len(sizes) > limit else "")


def shape_cause(f: FunctionCompiles) -> str | None:
    """'its input x changed size along dim 1 (16, 17, 18, ... (9 sizes))', from dynamo's reasons."""
    if f.size_changes:
        c = f.size_changes[0]
        return f"its input {c.arg!r} changed size along dim {c.dim} ({_sizes(c.sizes)})"
    if f.dtype_changes:
        return f"its input {f.dtype_changes[0]!r} changed dtype"
    if f.other_reasons:
        return f"a guard failed: {f.other_reasons[0]}"
    return None


def _fix(backend_name: str, dynamic: bool | None, suggestion: Suggestion | None, now: int | None,
         f: FunctionCompiles | None, style: str = "accelport") -> str:
    """What to change for a compiled function that sees new sizes: by the dimension that changes."""
    change = f.size_changes[0] if f is not None and f.size_changes else None
    if change is not None and change.dim == 0:
        # The batch dimension: a last short batch (or a sampler without drop_last), not lengths.
        fixed = advice.varying_batch(style, len(change.sizes))
        if dynamic is False:
            return fixed
        return (f"{fixed[:-1]}; or mark it dynamic: torch._dynamo.mark_dynamic({change.arg}, 0) before the call.")
    if suggestion is not None and suggestion.compilations < (now or suggestion.shapes_seen):
        bucket = advice.varying_length(style, describe(suggestion, now))
    else:
        bucket = advice.varying_length(style, None)
    if dynamic is False:
        return f"Bucketing is the fix: the {backend_name} compiler rejects dynamic shapes. {bucket}"
    mark = (f"torch._dynamo.mark_dynamic({change.arg}, {change.dim}) before the call"
            if change is not None else "torch._dynamo.mark_dynamic(tensor, dim) on the input that changes")
    where = f"{backend_name}'s compiler (inductor) accepts dynamic shapes" if dynamic else \
        "where the compiler accepts dynamic shapes (inductor on cpu and cuda)"
    return (f"{bucket[:-1]}; or, since {where}, mark that dimension dynamic: {mark}, or compile with "
            "dynamic=None (the default), which does so after the second shape.")


def recompilation_cause(functions: Sequence[FunctionCompiles], backend_name: str, dynamic: bool | None,
                        suggestion: Suggestion | None, distinct: int, style: str = "accelport"
                        ) -> tuple[str, str, FunctionCompiles] | None:
    """The cause of eager recompilations in the user's terms, from dynamo's own reasons: (cause, fix, function)."""
    candidates = [f for f in functions if f.compilations > 1 or f.guard_failures]
    if not candidates:
        return None
    f = candidates[0]
    cause = shape_cause(f)
    if cause is None:
        return None
    now = max(f.compilations, distinct)
    text = (f"the compiled function {f.label} was compiled {f.compilations} times: {cause}, and "
            "torch.compile builds a graph for each")
    return text, _fix(backend_name, dynamic, suggestion if f.size_changes else None, now, f, style), f


def compile_limit_message(hit: LimitHit, functions: Sequence[FunctionCompiles], backend_name: str,
                          dynamic: bool | None, suggestion: Suggestion | None, distinct: int,
                          style: str = "accelport") -> tuple[str, str]:
    """The recompile-limit cliff: which function, the limit, what it saw; and the fix."""
    f = next((f for f in functions if f.where == hit.where or f.where.endswith(hit.where)), None)
    label = f.label if f is not None else f"{hit.function} ({hit.where})"
    cause = shape_cause(f) if f is not None else None
    shapes = ""
    if (f is None or not f.size_changes) and distinct > 1:
        shapes = f"; the loader saw {distinct} distinct batch shapes so far"
    last = hit.last_reason.split(": ", 1)[-1] if hit.last_reason else ""
    because = f" because {cause}" if cause else (f" (last reason: {last})" if last else "")
    now = max(distinct, len(f.size_changes[0].sizes) if f is not None and f.size_changes else 0)
    return (f"the compiled function {label} reached torch._dynamo.config.{hit.limit_type} ({hit.limit}) "
            f"after {hit.limit} compilations{because}{shapes}: from now on every new shape runs it eagerly, "
            "uncompiled and silently slower, for the rest of the run. Raising the limit only moves the cliff.",
            _fix(backend_name, dynamic, suggestion, now or None, f, style))


_ON_DEVICE = ("keep the value on the device, torch.where(cond, a, b) instead of a Python branch on .item() or "
              ".tolist(); for boolean indexing, ap.data.masked_sum / masked_mean")
_MOVE = ("move that call out of the compiled region (compile the parts before and after it), or replace it with a "
         "torch op")


def break_fix(reason: str, source: str, style: str = "accelport") -> str:
    """The fix for one graph break in the user's code, by its cause."""
    text = f"{reason} {source}".lower()
    if "print(" in source.replace(" ", "") or "logging" in text or "logger." in text:
        if style == "accelport":
            return "log outside the compiled region: ap.after_step(print, tensor) reads it once the step has run"
        return "log outside the compiled region: print what the compiled call returns, after it returns"
    if any(k in text for k in (".item()", "item()", "tolist", "generic_jump", "data-dependent", "data dependent",
                               "dynamic shape operator", "nonzero", "local_scalar_dense", "jump", "__bool__")):
        return _ON_DEVICE
    return _MOVE


def _library_fix(b: GraphBreak) -> str:
    """A break in a library's own code: not the user's to move; what they can change instead."""
    called = f" from {b.caller}" if b.caller else ""
    return (f"it is {b.library}'s own code (called{called}), not a line of yours to change: a newer {b.library} may "
            "not break there; meanwhile compile a region that does not run it (the model's forward rather than "
            "the whole step), or leave it, since it costs one more graph per call")


def graph_break_message(breaks: Sequence[GraphBreak], total: int, style: str = "accelport") -> tuple[str, str]:
    """The top graph breaks, each with dynamo's reason and its line (the library's, when it is one's), and the fix."""
    cost = ("each call runs the graph before the break, then Python (on an accelerator, after a device-to-host "
            "read), then the graph after it, instead of one graph")
    if not breaks:
        many = "" if total <= 1 else f" ({total} compilations broke a graph)"
        return (f"a compiled function breaks its graph on every call{many}: {cost}. Where and why is read from "
                "dynamo in the live process (ap.diagnostics() there); TORCH_LOGS=graph_breaks prints it too.", "")

    def one(b: GraphBreak) -> str:
        source = f" (`{b.source}`)" if b.source else ""
        owner = f" (inside {b.library}{', called from ' + b.caller if b.caller else ''})" if b.library else ""
        return f"at {b.where} in {b.function}{source}{owner}: {b.reason}"

    def fix(b: GraphBreak) -> str:
        return _library_fix(b) if b.library else break_fix(b.reason, b.source, style)

    if len(breaks) == 1:
        text = fix(breaks[0])
        return (f"a compiled function breaks its graph on every call, {one(breaks[0])}. That costs: {cost}.",
                f"{text[0].upper()}{text[1:]}.")
    listed = " ".join(f"{i + 1}) {one(b)}." for i, b in enumerate(breaks[:3]))
    fixes = " ".join(f"{i + 1}) {fix(b)}." for i, b in enumerate(breaks[:3]))
    return (f"compiled functions break their graphs on every call ({cost}); the top {len(breaks[:3])}: {listed}",
            fixes)


def breaks_explain_recompiles(functions: Sequence[FunctionCompiles]) -> bool:
    """True when the recompilations are of the code after a graph break, on the value read there."""
    values = sum(f.after_break_values for f in functions)
    sized = sum(len(f.size_changes) + len(f.dtype_changes) for f in functions)
    return values > 0 and values >= sized


def dynamo_suggestion(functions: Sequence[FunctionCompiles]) -> Suggestion | None:
    """Buckets from the sizes dynamo saw (each once), where the batches' shapes are unknown."""
    for f in functions:
        if f.size_changes:
            return suggest({size: 1 for size in f.size_changes[0].sizes})
    return None


def signature_lengths(counts: Mapping[Any, int]) -> tuple[tuple[int, int] | None, dict[int, int]]:
    """(input, dim) that varies across batch signatures, and how often each of its sizes was seen."""
    from accelport.diagnose.buckets import lengths_from_signatures, varying_dim

    where = varying_dim(counts)
    return where, (dict(lengths_from_signatures(counts, where)) if where is not None else {})
