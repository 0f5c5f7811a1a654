"""``compile-limit`` (a problem): a compiled function reached dynamo's recompile limit, and from then on runs
eagerly, uncompiled and silently slower, for every new shape."""

from __future__ import annotations

from typing import Any

from accelport.contract import StepRecord
from accelport.diagnose import advice, compiled
from accelport.diagnose.rule import Rule
from accelport.errors import DiagnosticWarning

__all__ = ["CompileLimitRule", "CompileLimitWarning"]


class CompileLimitWarning(DiagnosticWarning):
    """A compiled function reached dynamo's recompile limit and now runs eagerly for new shapes."""


class CompileLimitRule(Rule):
    """dynamo's own record of the limit (live), or the records' ``compile_limit_hits`` (a replay)."""

    kind = "compile-limit"
    severity = "problem"
    warning = CompileLimitWarning

    def start(self) -> None:
        self._hits = 0  # from the records (replay); live runs read dynamo too
        self._last: StepRecord | None = None

    def step(self, record: StepRecord) -> None:
        self._last = record
        delta = record.delta
        # On the records whose counters were read (a quiet block's last): at most 15 steps late.
        if not delta:
            return
        if self.run.compile_events is not None:
            # Live: dynamo's record since this run's start. (The records' count is process-wide, and under an
            # in-process diagnose its first step holds every hit since the process started.)
            if not self.reported and self._live_hits():
                self._judge(record)
            return
        self._hits += int(delta.get("compile_limit_hits", 0))
        if not self.reported and self._hits:
            self._judge(record)

    def settle(self) -> None:
        if self._last is not None and not self.reported and self._live_hits():
            self._judge(self._last)

    def _live_hits(self) -> int:
        events = self.run.compile_events
        return events.limit_hit_count() if events is not None else 0

    def _judge(self, record: StepRecord) -> None:
        events = self.run.compile_events
        hits = events.limit_hits() if events is not None else []
        functions = events.functions() if events is not None and hits else []
        shapes = self.run.shapes
        distinct = len(shapes.distinct)
        suggestion = shapes.suggestion() or compiled.dynamo_suggestion(functions)
        style = self.run.style
        if hits:
            hit = hits[0]
            declared = self.run.compile_dynamic if self.run.backend == record.backend else None
            dynamic = compiled.accepts_dynamic(record.backend, declared)

            def fix_for(suggestion: Any, distinct: int) -> str:
                return compiled.compile_limit_message(hit, functions, record.backend, dynamic, suggestion, distinct,
                                                      style)[1]

            message, _ = compiled.compile_limit_message(hit, functions, record.backend, dynamic, suggestion,
                                                        distinct, style)
            evidence: dict[str, Any] = {"function": f"{hit.function} ({hit.where})", "limit": hit.limit,
                                        "limit_type": hit.limit_type}
        else:  # replayed from a metrics file: the count, not dynamo's record

            def fix_for(suggestion: Any, distinct: int) -> str:
                return advice.varying_length(style, compiled.describe(suggestion, distinct) if suggestion else None)

            message = ("a compiled function reached torch._dynamo's recompile limit: from now on every new shape "
                       "runs it eagerly, uncompiled and silently slower, for the rest of the run "
                       f"({distinct} distinct batch shapes so far).")
            evidence = {}
        evidence["distinct_signatures"] = distinct
        evidence["buckets"] = list(suggestion.buckets) if suggestion else None
        self._fix_for = fix_for
        self.report(message, record.step, fix=fix_for(suggestion, distinct), **evidence)

    def current_fix(self) -> str | None:
        """The fix with buckets from every length the run saw (the finding is made early, before the longest came)."""
        fix_for = getattr(self, "_fix_for", None)
        suggestion = self.run.shapes.suggestion()
        if fix_for is None or suggestion is None:
            return None
        return str(fix_for(suggestion, len(self.run.shapes.distinct)))

    def totals(self) -> dict[str, Any]:
        events = self.run.compile_events
        counters = self.run.counters() if self.run.counters is not None else {}
        return {"compilations": counters.get("compilations"),
                "distinct_batch_shapes": len(self.run.shapes.distinct) or None,
                "functions_at_the_limit": len({(h.function, h.where) for h in events.limit_hits()})
                if events is not None else None,
                "compile_seconds": round(events.compile_seconds(), 3) if events is not None else None}
