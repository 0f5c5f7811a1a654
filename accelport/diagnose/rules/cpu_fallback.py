"""``cpu-fallback``: ops with no lowering for the device ran on the host CPU (XLA backends count them)."""

from __future__ import annotations

from typing import Any

from accelport.contract import StepRecord
from accelport.diagnose.rule import Rule
from accelport.errors import DiagnosticWarning

__all__ = ["CpuFallbackRule", "CpuFallbackWarning"]


class CpuFallbackWarning(DiagnosticWarning):
    """Ops without a device lowering run on the host."""


class CpuFallbackRule(Rule):
    """The backend's fallback counters since the run started, read on a few steps (they cost a lookup each)."""

    kind = "cpu-fallback"
    warning = CpuFallbackWarning
    CHECK_STEPS = frozenset({1, 2, 5, 10, 20, 50, 100, 200, 500})  # then every CHECK_EVERY-th step
    CHECK_EVERY = 1000

    def step(self, record: StepRecord) -> None:
        if record.lazy and not self.reported and (
                record.step in self.CHECK_STEPS or record.step % self.CHECK_EVERY == 0):
            self._judge(record)

    def totals(self) -> dict[str, Any]:
        counters = self.run.counters
        ops = (counters().get("cpu_fallback") or {}) if counters is not None else {}
        return {"ops": {op: n for op, n in ops.items() if op != "aten::_local_scalar_dense"}}

    def _judge(self, record: StepRecord) -> None:
        counters = self.run.counters
        if counters is None or self.run.backend != record.backend:
            return
        # Since the run started: torch_xla's counters are process-wide.
        ops = counters().get("cpu_fallback") or {}
        ops = {op: n for op, n in ops.items() if op != "aten::_local_scalar_dense"}  # that is .item()
        if not ops:
            return
        listed = ", ".join(f"{op} ({n}x)" for op, n in sorted(ops.items(), key=lambda kv: -kv[1])[:5])
        self.report(
            f"ops with no {record.backend} lowering ran on the host CPU: {listed}. Each one copies data to "
            "the host and back and cuts the graph.",
            record.step,
            fix=("Replace them with fixed-shape equivalents (torch.nonzero -> a mask with torch.where; boolean "
                 "indexing -> ap.data.masked_sum) or move them out of the step."),
            ops=dict(ops),
        )
