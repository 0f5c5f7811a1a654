"""``graph-break``: a compiled function breaks its graph on every call (Python, and on an accelerator a host
read, between two graphs)."""

from __future__ import annotations

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
        self.report(compiled.graph_break_message(breaks, total), record.step, graph_breaks=total,
                    sites=[f"{b.where}: {b.reason}" for b in breaks])
