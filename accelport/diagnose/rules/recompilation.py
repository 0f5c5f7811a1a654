"""``recompilation``: the graph keeps being recompiled (XLA graphs, or torch.compile'd functions).

Thresholds keep healthy runs silent: a loop that compiles once per bucket shape, plus its
first step and a final short batch, is never flagged; a loop that keeps compiling is
flagged within 30 steps.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from accelport.contract import StepRecord
from accelport.diagnose import advice, compiled
from accelport.diagnose.rule import Rule
from accelport.errors import DiagnosticWarning

__all__ = ["RecompilationRule", "RecompilationWarning"]


class RecompilationWarning(DiagnosticWarning):
    """The graph keeps being recompiled."""


class RecompilationRule(Rule):
    """Compiling steps in a rolling window; the cause from dynamo's reasons, or from the batch shapes."""

    kind = "recompilation"
    warning = RecompilationWarning
    needs = frozenset({"shapes"})
    WINDOW = 20  # steps the rolling window looks back over
    MIN_STEP = 10  # first step at which recompilation is judged
    STEPS_IN_WINDOW = 8  # compiling steps within WINDOW that mean "keeps compiling"...
    LONG_WINDOW = 60  # ...or, for a loop that recompiles less often, within this window:
    REPEATS_IN_LONG_WINDOW = 6  # this many compiling steps whose batch shape was seen before,
    STEPS_IN_LONG_WINDOW = 10  # or this many in all (new shapes: more than a few buckets)

    judges_from = MIN_STEP

    def start(self) -> None:
        self._seen = 0  # records since the run started: the windows count records, not step numbers
        # (record, step, compilations, came with a new batch shape), for steps > 1 that compiled
        self._compiling: deque[tuple[int, int, float, bool]] = deque()
        self._last_change: str | None = None  # what changed at the last new batch shape that compiled
        self._inside: str | None = None  # "file:line: op changes shape": a tensor made inside the step
        # The whole run: compilations, steps that compiled, seconds spent compiling, step seconds.
        self._all_compilations = 0.0
        self._all_compiling = 0
        self._all_compile_seconds = 0.0
        self._timed = False  # some record said how long it compiled (a replay of an old file may not)
        self._all_seconds = 0.0

    def step(self, record: StepRecord) -> None:
        self._seen += 1
        step = record.step
        compiles = record.delta.get("compilations", 0)
        self._all_seconds += record.seconds
        if compiles:
            self._all_compilations += compiles
            self._all_compiling += 1
            if "compile_seconds" in record.delta:
                self._timed = True
                self._all_compile_seconds += record.delta["compile_seconds"]
        if self.reported:
            return
        if compiles > 0 and step > 1:
            shapes = self.run.shapes
            self._compiling.append((self._seen, step, compiles, shapes.new))  # (pruned by _judge)
            if shapes.new:
                change = shapes.change()
                if change:
                    self._last_change = change
        # The count of compiling steps in the window only rises on a step that compiled.
        if step >= self.MIN_STEP and (compiles > 0 or step == self.MIN_STEP):
            self._judge(record)

    def _judge(self, record: StepRecord) -> None:
        seen = self._seen
        compiling = self._compiling
        while compiling and compiling[0][0] <= seen - self.LONG_WINDOW:
            compiling.popleft()  # (also on a step that did not compile: step 10)
        # Every step or so (8 of the last 20), or steadily but less often: 6 of the last 60
        # on batch shapes seen before (nothing new explains them), or 10 in all. A bucketed
        # loop compiles once per bucket, each on a new shape, plus an eval or a final batch.
        recent = [c for c in compiling if c[0] > seen - self.WINDOW]
        if len(recent) < self.STEPS_IN_WINDOW:
            repeats = sum(1 for c in compiling if not c[3])
            if repeats < self.REPEATS_IN_LONG_WINDOW and len(compiling) < self.STEPS_IN_LONG_WINDOW:
                return
            recent = list(compiling)
            lookback = min(seen, self.LONG_WINDOW)
        else:
            lookback = min(seen, self.WINDOW)
        total = sum(int(c[2]) for c in recent)
        shapes = self.run.shapes
        # Blame the shapes only if most of these compilations came with a new batch shape.
        reshaped = sum(1 for c in recent if c[3])
        change = self._last_change if 2 * reshaped >= len(recent) else None
        suggestion = shapes.suggestion() if change else None
        compiled_cause = None if record.lazy else self._compiled_cause(record, suggestion)
        if compiled_cause == "graph-break":
            return  # the recompilations are the graph break's: the graph-break rule reports them
        distinct = len(shapes.distinct)
        style = self.run.style
        if isinstance(compiled_cause, tuple):
            cause, fix = compiled_cause
        elif change:
            cause = f"{change}; {distinct} distinct batch shapes so far"
            fix = self._shape_fix(change, suggestion)
        elif record.signature is None:
            cause, fix = advice.unseen_shapes(style)
        else:
            trace = self.run.shape_trace
            changed = trace.found if trace is not None else None
            if changed is not None:
                cause = (f"the input shapes did not change, but a tensor made inside the step does: {changed.op} at "
                         f"{changed.where} gave {changed.before} in one step and {changed.after} in the next")
                self._inside = f"{changed.where}: {changed.op} changes shape"
            else:
                cause = ("the input shapes did not change, so the graph itself does: a data-dependent op, or a "
                         "tensor made inside the step whose shape changes")
            fix = advice.data_dependent()
        self._change = change if not compiled_cause else None
        self.report(
            f"the graph was recompiled in {len(recent)} of the last {lookback} steps ({total} compilations): "
            f"{cause}.",
            record.step,
            fix=fix,
            compiling_steps=[c[1] for c in recent],
            sites=[self._inside] if self._inside else [],
            distinct_signatures=distinct,
            last_change=change,
            buckets=list(suggestion.buckets) if suggestion else None,
        )

    def _shape_fix(self, change: str, suggestion: compiled.Suggestion | None) -> str:
        """The fix for a batch shape that changes: a fixed batch size for the batch dimension, buckets else."""
        if " along the batch dimension" in change:
            return advice.varying_batch(self.run.style, _batch_sizes(self.run.shapes.distinct))
        distinct = len(self.run.shapes.distinct)
        return advice.varying_length(self.run.style, compiled.describe(suggestion, distinct) if suggestion else None)

    def current_fix(self) -> str | None:
        """Buckets from every length the run saw, not only those seen when the finding was made."""
        change = getattr(self, "_change", None)
        if change is None or " along the batch dimension" in change:
            return None
        return self._shape_fix(change, self.run.shapes.suggestion())

    def totals(self) -> dict[str, Any]:
        compilations, compile_seconds = self._all_compilations, self._all_compile_seconds
        counters = self.run.counters() if self.run.counters is not None else {}
        # The backend's own counters where the run is live: they count what the records cannot (under accelport
        # diagnose, the script's compilations before its first step).
        if counters.get("compilations") is not None:
            compilations = counters["compilations"]
        timed = self._timed
        if counters.get("compile_seconds") is not None:
            compile_seconds, timed = counters["compile_seconds"], True
        seconds = self._all_seconds
        return {"compilations": int(compilations), "compiling_steps": self._all_compiling,
                "steps": self._seen, "distinct_batch_shapes": len(self.run.shapes.distinct) or None,
                "compile_seconds": round(compile_seconds, 3) if timed else None,
                "compile_share": round(min(compile_seconds / seconds, 1.0), 3) if timed and seconds > 0 else None}

    def _compiled_cause(self, record: StepRecord, suggestion: compiled.Suggestion | None
                        ) -> tuple[str, str] | str | None:
        """dynamo's reasons for the recompilations in the user's terms, with the fix; "graph-break" when a break
        explains them."""
        events = self.run.compile_events
        functions = events.functions() if events is not None else []
        if not functions:
            return None
        if compiled.breaks_explain_recompiles(functions) and events is not None and events.graph_break_count():
            return "graph-break"
        if suggestion is None:
            suggestion = compiled.dynamo_suggestion(functions)
        declared = self.run.compile_dynamic if self.run.backend == record.backend else None
        found = compiled.recompilation_cause(functions, record.backend,
                                             compiled.accepts_dynamic(record.backend, declared), suggestion,
                                             len(self.run.shapes.distinct), self.run.style)
        return (found[0], found[1]) if found else None


def _batch_sizes(signatures: Any) -> int | None:
    """How many sizes the first input's batch dimension took among the batch ``signatures`` (None: not known)."""
    sizes = set()
    for signature in signatures:
        try:
            sizes.add(int(signature[0][0][0]))
        except (TypeError, ValueError, IndexError):
            return None
    return len(sizes) or None
