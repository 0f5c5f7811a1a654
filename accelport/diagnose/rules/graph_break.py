"""``graph-break``: a compiled function breaks its graph on every call (Python, and on an accelerator a host
read, between two graphs)."""

from __future__ import annotations

from typing import Any

from accelport.contract import StepRecord
from accelport.diagnose import compiled
from accelport.diagnose.rule import Rule
from accelport.errors import DiagnosticWarning

__all__ = ["GraphBreakRule", "GraphBreakWarning"]


class GraphBreakWarning(DiagnosticWarning):
    """A compiled function breaks its graph on every call."""


class GraphBreakRule(Rule):
    """dynamo's records of graph breaks (live), or the records' ``graph_breaks`` counts (a replay)."""

    kind = "graph-break"
    warning = GraphBreakWarning
    MIN_STEP = 3  # graph breaks are judged from this step (they are recorded at compile time)

    judges_from = MIN_STEP

    def start(self) -> None:
        self._counted = 0  # from the records (replay); live runs read dynamo

    def step(self, record: StepRecord) -> None:
        delta = record.delta
        if delta:
            self._counted += int(delta.get("graph_breaks", 0))
        if not self.reported and record.step >= self.MIN_STEP and \
                (delta.get("compilations", 0) > 0 or record.step == self.MIN_STEP or self._counted):
            self._judge(record)

    def _judge(self, record: StepRecord) -> None:
        events = self.run.compile_events
        live = events.graph_break_count() if events is not None else 0
        if not live and not self._counted:
            return
        breaks = events.graph_breaks() if events is not None and live else []
        total = live or self._counted
        message, fix = compiled.graph_break_message(breaks, total, self.run.style)
        # The user's lines only: a break in a library's own code is shown where the user called into it.
        sites = [f"{b.caller or b.where}: {b.reason}" if b.library else f"{b.where}: {b.reason}" for b in breaks]
        self.report(message, record.step, fix=fix, graph_breaks=total, sites=sites,
                    libraries=sorted({b.library for b in breaks if b.library}))

    def totals(self) -> dict[str, Any]:
        events = self.run.compile_events
        live = events.graph_break_count() if events is not None else 0
        return {"graph_breaks": live or self._counted}
