"""``non-finite`` (a problem): the loss or the gradients became NaN or Inf, with where it came from.

What was found, and where, comes from the step checks (:mod:`accelport.observe.numerics`);
this rule says it, with the fix for its source.
"""

from __future__ import annotations

from accelport.contract import StepRecord
from accelport.diagnose.rule import Rule
from accelport.errors import DiagnosticWarning

__all__ = ["NonFiniteRule", "NonFiniteWarning"]


class NonFiniteWarning(DiagnosticWarning):
    """The loss or the gradients became NaN or Inf."""


_OVERFLOW = ("a learning rate too high (lower it or warm it up), gradient clipping with "
             "torch.nn.utils.clip_grad_norm_ (without a Python branch on the norm, which "
             "recompiles on XLA), the loss computed in fp32.")

#: The fix for each source the step checks can name.
FIXES = {
    "input": ("Bad data: check the dataset for NaN/Inf (torch.isfinite(x).all() per sample) and "
              "drop or repair those samples."),
    "loss": ("A learning rate too high (lower it, or warm it up), or a loss that overflows: clip "
             "gradients with torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) before "
             "ap.optimizer_step (without a Python branch on the returned norm, which recompiles on "
             "XLA), and compute the loss in fp32 (loss_fn(logits.float(), y)) under autocast."),
    "gradient": ("An op whose backward is not finite at these values (sqrt, log or a division at 0: "
                 "add an eps), or a learning rate too high: clip gradients with "
                 "torch.nn.utils.clip_grad_norm_ (without a Python branch on the norm, which "
                 "recompiles on XLA), and compute the loss in fp32."),
    "gradients": f"The inputs were finite, so the loss or a gradient overflowed: {_OVERFLOW}",
    # The inputs were not looked at (neither ap.loader nor a DataLoader brought them):
    # they come first, as likely as the loss and far cheaper to rule out.
    "unknown": ("Check the inputs first: torch.isfinite(x).all() on each batch (or iterate them "
                f"with ap.loader, which checks them); if they are finite, {_OVERFLOW}"),
    "update": ("The update overflowed the weight's dtype: lower the learning rate, keep the weights "
               "in fp32 (ap.autocast for the forward pass), and clip gradients with "
               "torch.nn.utils.clip_grad_norm_."),
}


class NonFiniteRule(Rule):
    """Says what the step checks found, on the records whose counters were read and when the run settles."""

    kind = "non-finite"
    severity = "problem"
    warning = NonFiniteWarning
    needs = frozenset({"numerics"})

    def step(self, record: StepRecord) -> None:
        if record.delta:
            self.settle()

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
            f"after it trains on NaN. {FIXES[found.source]}",
            found.step, first_step=found.step if found.finite_at is None else None, source=found.source,
            names=list(found.names), finite_at_step=found.finite_at, found_by_step=found.step,
        )
