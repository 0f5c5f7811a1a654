"""``precision`` (a problem): updates of bf16 or fp16 parameters round away, so training stalls.

What was found comes from the step checks (:mod:`accelport.observe.numerics`): a slice of
each low-precision parameter sampled after a step and after the next.
"""

from __future__ import annotations

from accelport.contract import StepRecord
from accelport.diagnose.rule import Rule
from accelport.errors import DiagnosticWarning

__all__ = ["PrecisionRule", "PrecisionWarning"]


class PrecisionWarning(DiagnosticWarning):
    """Low-precision parameters whose updates round away: training stalls."""


class PrecisionRule(Rule):
    """Says which parameters stalled, on the records whose counters were read and when the run settles."""

    kind = "precision"
    severity = "problem"
    warning = PrecisionWarning
    needs = frozenset({"numerics"})

    def step(self, record: StepRecord) -> None:
        if record.delta:
            self.settle()

    def settle(self) -> None:
        watch = self.run.numerics
        stalled = watch.stalled if watch is not None else None
        if stalled is None or self.reported:
            return
        from accelport.observe.numerics import PRECISION_EVERY, PRECISION_STALLED

        listed = ", ".join(f"{share:.0%} of {name} ({dtype})" for name, dtype, share in stalled.params[:5])
        more = f" and {len(stalled.params) - 5} more" if len(stalled.params) > 5 else ""
        self.report(
            f"updates of low-precision parameters round away: of the elements whose gradient was non-zero, "
            f"{listed}{more} did not change over a step, in two samples {PRECISION_EVERY} steps apart "
            f"({PRECISION_STALLED:.0%} or more counts), so training stalls: each update is smaller than "
            "half the gap between neighbouring values (in bf16, 4096 + 1 = 4096). Keep the weights in fp32 and "
            "run the forward "
            "pass under ap.autocast(torch.bfloat16); or use stochastic rounding "
            "(NEURON_RT_STOCHASTIC_ROUNDING_EN=1 on Neuron), or an optimizer that compensates the rounding "
            "(Kahan summation).",
            stalled.step, params=[name for name, _, _ in stalled.params],
            unchanged_share={name: round(share, 3) for name, _, share in stalled.params},
        )
