"""``recompilation``: the graph keeps being recompiled (XLA graphs, or torch.compile'd functions).

Thresholds keep healthy runs silent: a loop that compiles once per bucket shape, plus its
first step and a final short batch, is never flagged; a loop that keeps compiling is
flagged within 30 steps.
"""

from __future__ import annotations

from collections import deque

from accelport.contract import StepRecord
from accelport.diagnose import compiled
from accelport.diagnose.rule import Rule
from accelport.errors import DiagnosticWarning

__all__ = ["RecompilationRule", "RecompilationWarning"]


class RecompilationWarning(DiagnosticWarning):
    """The graph keeps being recompiled."""


class RecompilationRule(Rule):
    """Compiling steps in a rolling window; the cause from dynamo's reasons, or from the batch shapes."""

    kind = "recompilation"
    warning = RecompilationWarning
    WINDOW = 20  # steps the rolling window looks back over
    MIN_STEP = 10  # first step at which recompilation is judged
    STEPS_IN_WINDOW = 8  # compiling steps within WINDOW that mean "keeps compiling"...
    LONG_WINDOW = 60  # ...or, for a loop that recompiles less often, within this window:
    REPEATS_IN_LONG_WINDOW = 6  # this many compiling steps whose batch shape was seen before,
    STEPS_IN_LONG_WINDOW = 10  # or this many in all (new shapes: more than a few buckets)

    def start(self) -> None:
        self._seen = 0  # records since the run started: the windows count records, not step numbers
        # (record, step, compilations, came with a new batch shape), for steps > 1 that compiled
        self._compiling: deque[tuple[int, int, float, bool]] = deque()
        self._last_change: str | None = None  # what changed at the last new batch shape that compiled

    def step(self, record: StepRecord) -> None:
        self._seen += 1
        step = record.step
        compiles = record.delta.get("compilations", 0)
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
        if compiled_cause:
            cause = compiled_cause
        elif change:
            buckets = (f"collate_fn={compiled.describe(suggestion, distinct)}" if suggestion else
                       "collate_fn=ap.data.BucketCollate(buckets=(128, 256, 512))")
            cause = (f"{change}; {distinct} distinct batch shapes so far. "
                     f"Pad to a fixed length, or bucket: {buckets}"
                     " with ap.data.LengthGroupedBatchSampler to keep padding low")
        elif record.signature is None:
            cause = ("the batches did not come through ap.loader, so their shapes are unknown: iterate with "
                     "`for batch in ap.loader(data):` to have the input whose shape changes named. The usual "
                     "causes are batches of varying shape (pad to a fixed length or use ap.data.BucketCollate) "
                     "and data-dependent ops (boolean indexing x[mask], torch.nonzero; use ap.data.masked_sum / "
                     "masked_mean, torch.where)")
        else:
            cause = ("the input shapes did not change, so the graph itself does: look for data-dependent ops "
                     "(boolean indexing x[mask], torch.nonzero, .item() feeding Python control flow) and "
                     "replace them with fixed-shape ops (ap.data.masked_sum / masked_mean, torch.where)")
        self.report(
            f"the graph was recompiled in {len(recent)} of the last {lookback} steps ({total} compilations): "
            f"{cause}.",
            record.step,
            compiling_steps=[c[1] for c in recent],
            distinct_signatures=distinct,
            last_change=change,
            buckets=list(suggestion.buckets) if suggestion else None,
        )

    def _compiled_cause(self, record: StepRecord, suggestion: compiled.Suggestion | None) -> str | None:
        """dynamo's reasons for the recompilations, in the user's terms; "graph-break" when a break explains them."""
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
                                             len(self.run.shapes.distinct))
        return found[0] if found else None
