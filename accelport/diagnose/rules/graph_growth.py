"""``graph-growth``: a lazy backend ran a very long graph: work accumulated without a sync.

A problem where the loop never syncs at all (a watched script with no ``torch_xla.sync()``):
its graph grows by a whole step every step, until memory runs out.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from typing import Any

from accelport.contract import StepRecord
from accelport.diagnose import advice
from accelport.diagnose.rule import Rule
from accelport.errors import DiagnosticWarning

__all__ = ["GraphGrowthRule", "GraphGrowthWarning"]


class GraphGrowthWarning(DiagnosticWarning):
    """A lazy backend accumulated a very long graph without a sync."""


class GraphGrowthRule(Rule):
    """Graph sizes against the usual step's, and (watched scripts) optimizer steps with no sync between them."""

    kind = "graph-growth"
    warning = GraphGrowthWarning
    FACTOR = 4.0  # a graph this many times the usual step's graph...
    MIN_EXTRA = 300  # ...and at least this many nodes more
    ABSOLUTE = 100_000  # torch_xla trims graphs past this size itself
    FIRST = 10_000  # a graph this large at ap.sync() with no earlier graph to compare with
    UNSYNCED_STEPS = 5  # optimizer steps in a row with no sync between them (where records count syncs)

    @classmethod
    def severity_of(cls, evidence: Mapping[str, Any]) -> str:
        return "problem" if evidence.get("steps_without_sync") else "warning"

    def unjudged(self, steps: int) -> str | None:
        return None  # judged on every graph that runs (and only on lazy backends)

    def start(self) -> None:
        self._sizes: deque[float] = deque(maxlen=50)
        self._unsynced = 0  # steps in a row whose records say the script did not sync
        self._most_unsynced = 0
        self._step = 0

    def step(self, record: StepRecord) -> None:
        self._step = record.step
        if not record.lazy:
            return
        delta = record.delta
        # Only records from a watched script count its syncs (accelport diagnose): ap.loader
        # and ap.optimizer_step sync every step themselves.
        syncs = delta.get("syncs")
        if syncs is not None and record.counted_steps and not self.reported:
            self._unsynced = 0 if syncs else self._unsynced + record.counted_steps
            self._most_unsynced = max(self._most_unsynced, self._unsynced)
            if self._unsynced >= self.UNSYNCED_STEPS:
                self._never_synced(record)
        size = delta.get("graph_nodes")
        if size:  # (the largest graph run since the last read: a small start-up graph hides behind it)
            self._grown(record, size)

    def totals(self) -> dict[str, Any]:
        return {"largest_graph_nodes": int(max(self._sizes)) if self._sizes else None,
                "steps_in_a_row_without_a_sync": self._most_unsynced or None}

    def graph_ran(self, nodes: int, where: str) -> None:
        """Compared with the usual graph of the steps and syncs before it; with none, flagged past FIRST nodes."""
        usual = statistics.median(self._sizes) if self._sizes else None
        self._sizes.append(nodes)
        if self.reported:
            return
        if usual is None:
            too_big = nodes >= self.FIRST
        else:
            too_big = nodes >= self.ABSOLUTE or (
                nodes >= self.FACTOR * usual and nodes - usual >= self.MIN_EXTRA)
        if not too_big:
            return
        usual_text = f" (a step's graph is usually {int(usual)})" if usual else ""
        self.report(
            f"a graph of {int(nodes)} nodes ran at {where}{usual_text} with no training step since the previous "
            "sync: a loop ran many iterations without a sync (a hand-written accumulation or evaluation loop), "
            "so they compile and run as one huge graph (slow to compile, memory hungry).",
            self._step,
            fix=advice.sync_long_loops(self.run.style),
            graph_nodes=int(nodes),
            usual_graph_nodes=int(usual) if usual else None,
            where=where,
        )

    def _grown(self, record: StepRecord, size: float) -> None:
        # Lazy backends report sizes only on steps that compiled (Backend.compile_facts), so
        # one earlier size is enough to compare with.
        usual = statistics.median(self._sizes) if self._sizes and not self.reported else None
        self._sizes.append(size)
        if self.reported:
            return
        too_big = size >= self.ABSOLUTE or (
            usual is not None and size >= self.FACTOR * usual and size - usual >= self.MIN_EXTRA
        )
        if not too_big:
            return
        usual_text = f" (usually {int(usual)})" if usual else ""
        self.report(
            f"step {record.step} executed a graph of {int(size)} nodes{usual_text}: work accumulated without a "
            "sync, so it compiles and runs as one huge graph (slow to compile, memory hungry).",
            record.step,
            fix=advice.sync_long_loops(self.run.style),
            graph_nodes=int(size),
            usual_graph_nodes=int(usual) if usual else None,
        )

    def _never_synced(self, record: StepRecord) -> None:
        n = self._unsynced
        self.report(
            f"{n} optimizer steps in a row ran without a sync (steps {record.step - n + 1} to {record.step}): "
            "the loop never syncs (no torch_xla.sync() or xm.mark_step() after optimizer.step(), and the batches "
            "do not come through MpDeviceLoader), so on XLA nothing runs and one graph grows by a whole training "
            "step every step: each value read compiles a larger graph, memory grows, and the weights on the "
            "device are not updated until it finally runs.",
            record.step,
            fix=advice.never_synced(self.run.style),
            steps_without_sync=n,
        )
