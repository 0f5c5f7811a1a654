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


_FIX = {
    "accelport": ("Keep the weights in fp32 and run the forward pass under ap.autocast(torch.bfloat16); or use "
                  "stochastic rounding (NEURON_RT_STOCHASTIC_ROUNDING_EN=1 on Neuron), or an optimizer that "
                  "compensates the rounding (Kahan summation)."),
    "torch": ("Keep the weights in fp32 (do not call model.to(torch.bfloat16)) and run the forward pass under "
              "torch.autocast(device_type, dtype=torch.bfloat16); or use an optimizer that compensates the rounding "
              "(Kahan summation), or stochastic rounding (NEURON_RT_STOCHASTIC_ROUNDING_EN=1 on Neuron)."),
    "transformers": ("Load the model in fp32 (no torch_dtype=torch.bfloat16) and train with "
                     "TrainingArguments(bf16=True), which keeps fp32 master weights under autocast."),
    "lightning": ("Keep the weights in fp32 and use Trainer(precision=\"bf16-mixed\") rather than "
                  "\"bf16-true\": mixed precision keeps fp32 master weights."),
}
_FIX["torch_xla"] = _FIX["torch"]


class PrecisionRule(Rule):
    """Says which parameters stalled, on the records whose counters were read and when the run settles."""

    kind = "precision"
    severity = "problem"
    warning = PrecisionWarning
    needs = frozenset({"numerics"})

    def unjudged(self, steps: int) -> str | None:
        from accelport.observe.numerics import PRECISION_EVERY, PRECISION_FIRST

        watch = self.run.numerics
        low = watch.low_precision_params if watch is not None else 0
        if low is None and steps:
            return "no optimizer step: the updates were not sampled"
        if not low:
            return None  # no bf16/fp16 parameter (or no step checks: a replay)
        needs = PRECISION_FIRST + PRECISION_EVERY + 1  # two samples, each over a step
        return None if steps >= needs else f"needs {needs} steps to sample the bf16/fp16 updates twice"

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
            "half the gap between neighbouring values (in bf16, 4096 + 1 = 4096).",
            stalled.step,
            fix=_FIX.get(self.run.style, _FIX["torch"]), params=[name for name, _, _ in stalled.params],
            unchanged_share={name: round(share, 3) for name, _, share in stalled.params},
        )
