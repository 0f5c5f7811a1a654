"""``non-finite`` (a problem): the loss or the gradients became NaN or Inf, with where it came from.

What was found, and where, comes from the step checks (:mod:`accelport.observe.numerics`);
this rule says it, with the fix for its source.
"""

from __future__ import annotations

from typing import Any

from accelport.contract import StepRecord
from accelport.diagnose import advice
from accelport.diagnose.rule import Rule
from accelport.errors import DiagnosticWarning

__all__ = ["NonFiniteRule", "NonFiniteWarning", "fix"]


class NonFiniteWarning(DiagnosticWarning):
    """The loss or the gradients became NaN or Inf."""


def fix(source: str, style: str) -> str:
    """The fix for a non-finite value from ``source`` (see NonFinite.source), in the script's terms."""
    overflow = advice.overflow(style)
    return {
        "input": ("Bad data: check the dataset for NaN/Inf (torch.isfinite(x).all() per sample) and "
                  "drop or repair those samples."),
        "loss": f"A learning rate too high, or a loss that overflows. {overflow}",
        "gradient": ("An op whose backward is not finite at these values (sqrt, log or a division at 0: add an "
                     f"eps), or a learning rate too high. {overflow}"),
        "gradients": f"The inputs were finite, so the loss or a gradient overflowed. {overflow}",
        # The inputs were not looked at (no loader accelport sees brought them): they come first,
        # as likely as the loss and far cheaper to rule out.
        "unknown": ("Check the inputs first: torch.isfinite(x).all() on each batch (or load them through a "
                    f"DataLoader, or ap.loader, which accelport checks); if they are finite: {overflow}"),
        "update": ("The update overflowed the weight's dtype: lower the learning rate, keep the weights in fp32 "
                   "(autocast for the forward pass), and clip gradients."),
    }[source]


class NonFiniteRule(Rule):
    """Says what the step checks found, on the records whose counters were read and when the run settles."""

    kind = "non-finite"
    severity = "problem"
    warning = NonFiniteWarning
    needs = frozenset({"numerics"})

    def start(self) -> None:
        self._last_step = 0

    def unjudged(self, steps: int) -> str | None:
        watch = self.run.numerics
        if watch is not None and steps and watch.low_precision_params is None:
            return "no optimizer step: the gradients were not checked"
        return None

    def step(self, record: StepRecord) -> None:
        self._last_step = record.step
        if record.delta:
            self.settle()

    def totals(self) -> dict[str, Any]:
        watch = self.run.numerics
        found = watch.nonfinite if watch is not None else None
        if found is None:
            return {}
        return {"steps": self._last_step, "steps_after_it": max(self._last_step - found.step, 0)}

    def settle(self) -> None:
        watch = self.run.numerics
        found = watch.nonfinite if watch is not None else None
        if found is None or watch is None or self.reported:
            return
        from accelport.observe.numerics import CHECK_EVERY_LAZY

        source = {"input": "it came from the input batch", "loss": "it came from the loss",
                  "gradient": "it came from a parameter's gradient",
                  "gradients": f"it showed in the {found.found_in}",
                  "update": "it came from the optimizer's update",
                  "unknown": f"it showed in the {found.found_in}, from an unknown source"}[found.source]
        if found.finite_at is None:
            when = f"at step {found.step}"
        else:  # accelerators and lazy backends read them apart, to keep the reads out of the steps
            every = "every few hundred steps" if watch.every >= CHECK_EVERY_LAZY else f"every {watch.every} steps"
            when = (f"after step {found.finite_at} and by step {found.step} (on {watch.backend_name} they "
                    f"are read {every} and at the end of each loop)")
        self.report(
            f"the {found.found_in} became NaN or Inf {when}: {source} ({found.detail}). Every step "
            "after it trains on NaN.",
            found.step, fix=fix(found.source, self.run.style),
            first_step=found.step if found.finite_at is None else None, source=found.source,
            names=list(found.names), finite_at_step=found.finite_at, found_by_step=found.step,
        )
