"""``out-of-memory`` (a problem): a step raised its backend's out-of-memory error; what filled the device, and
what each fix would give.

The error is recognised by the memory sensor (:mod:`accelport.observe.memory`, its list of vendor
exception types and messages) where a step raises it: inside ``ap.optimizer_step``, ``ap.sync`` or the
loader's sync, in the script's own code when it ends the program, and under ``accelport diagnose``.
The finding is made before the error goes on, unchanged. It says the budget of the last good step
(nothing of the failed step is read), what the failing allocation asked for where the message says
it, and the fixes in the order of what they save, each with its number (:func:`accelport.diagnose.memory.fixes`).
"""

from __future__ import annotations

from typing import Any

from accelport.contract import StepRecord
from accelport.diagnose.memory import Budget, blocks_of, fixes, human_bytes
from accelport.diagnose.rule import Rule
from accelport.errors import DiagnosticWarning

__all__ = ["OutOfMemoryRule", "OutOfMemoryWarning"]


class OutOfMemoryWarning(DiagnosticWarning):
    """A step ran out of memory."""


class OutOfMemoryRule(Rule):
    """Says what the sensor caught, with the budget of the last good step and the fixes."""

    kind = "out-of-memory"
    severity = "problem"
    warning = OutOfMemoryWarning
    needs = frozenset({"memory"})
    MIN_SHARE = 0.01  # of the device: a fix that saves less is not listed

    def step(self, record: StepRecord) -> None:
        sensor = self.run.memory
        if sensor is not None and sensor.oom is not None:  # (the failed step's own record)
            self.settle()

    def _batch(self) -> int | None:
        """The batch size: the first dimension of the first input of the last batch (None if unknown)."""
        try:
            shape: Any = self.run.shapes.current[0][0]
            return int(shape[0]) if len(shape) else None
        except (TypeError, ValueError, IndexError):
            return None

    def settle(self) -> None:
        sensor = self.run.memory
        oom = sensor.oom if sensor is not None else None
        if sensor is None or oom is None or self.reported:
            return
        last = sensor.last.values if sensor.last is not None else {}
        budget_values = sensor.budget
        capacity = oom.capacity_bytes or sensor.capacity_bytes
        # Only the message's first sentences (the whole text is in the evidence).
        said = f"{oom.error}, \"{_first_sentences(oom.message)}\"" if oom.message else oom.error
        asked = f" The failing allocation asked for {human_bytes(oom.requested_bytes)}." if oom.requested_bytes else ""
        where = f" at {oom.site}" if oom.site else ""
        head = f"step {oom.step} ran out of memory{where} ({said}).{asked}"
        evidence: dict[str, object] = {"vendor": oom.vendor, "error": oom.error, "error_message": oom.message,
                                       "requested_bytes": oom.requested_bytes, "capacity_bytes": capacity,
                                       "source": oom.source, "sites": [oom.site] if oom.site else []}
        if oom.host and self.run.device_type not in (None, "cpu"):
            self.report(f"{head} That is the host's memory, not the {self.run.device_type} device's, so the data "
                        "pipeline (DataLoader workers, prefetched batches, a dataset read whole) or a copy to the "
                        "host filled it.", oom.step,
                        fix="Fewer DataLoader workers, a smaller prefetch (ap.loader(..., prefetch=1)), a dataset "
                            "read lazily, or a larger host.", **evidence)
            return
        if not budget_values:
            self.report(f"{head} No step finished before it, so there is no budget to show.", oom.step,
                        fix="Estimate the run before it starts with ap.memory_estimate(model, optimizer, batch), "
                            "which says what fits where.", **evidence)
            return
        model = sensor.model()
        blocks, largest = blocks_of(model) if model is not None else (None, 0)
        activation = last.get("activation_bytes") if not sensor.resident else None
        if activation is not None:
            activation = max(int(activation), sensor.activation or 0)
        budget = Budget(budget_values["parameter_bytes"], budget_values["gradient_bytes"],
                        budget_values["optimizer_state_bytes"], activation, capacity, self._batch(),
                        budget_values.get("float32_bytes", 0), blocks, largest, self.run.world_size,
                        sensor.sharded)
        usable = budget.usable_bytes
        oversized = bool(oom.requested_bytes and capacity and oom.requested_bytes > capacity)
        roomy = usable is not None and budget.total_bytes <= usable and activation is not None
        # A fix that would free less than MIN_SHARE of the device is no answer to running out of it.
        found = [] if roomy or oversized else [
            f for f in fixes(budget, self.run.style)
            if not capacity or f.saves_bytes >= self.MIN_SHARE * capacity]
        at = sensor.last.step if sensor.last is not None else sensor.budget_step
        parts = [head, f"At step {at}, the last good one, the device held {budget.describe()}."]
        if activation is None:
            parts.append(f"The activations are not measured on {self.run.backend} (no device peak is known "
                         "there).")
        if oversized:
            parts.append(f"That one allocation is larger than the whole device ({human_bytes(capacity)}), so no "
                         "fix to the budget makes room for it.")
            fix = "Look for the tensor of that size: a shape mistake, a broadcast that grew, a batch far larger " \
                  "than meant."
        elif roomy:
            parts.append("That is well within the device, so the steady budget is not what ran out.")
            fix = ("Look for what this step did differently (one large allocation, a longer sequence, a larger "
                   "batch) or for memory held outside the steps (another process on the device, tensors kept from "
                   "an evaluation or a cache).")
        elif found:
            fix = "Fixes, most saved first: " + "; ".join(f"{i}) {f.text}" for i, f in enumerate(found, 1)) + "."
        elif activation is None and capacity:
            share = budget.static_bytes / capacity
            part = f"{share:.0%}" if share >= 0.01 else "less than 1%"
            parts.append(f"Parameters, gradients and optimizer state take {part} of the device, so the activations "
                         "of the step (or memory held outside the steps) filled it.")
            fix = ("Checkpoint the model's blocks (torch.utils.checkpoint.checkpoint) or take a smaller batch; "
                   "ap.memory_estimate(model, optimizer, batch) measures the activations and says what each "
                   "needs, and the largest batch that fits.")
        else:
            fix = "No fix to the budget was found here: a smaller batch or model is what is left."
        evidence.update(parameter_bytes=budget.parameter_bytes, gradient_bytes=budget.gradient_bytes,
                        optimizer_state_bytes=budget.optimizer_state_bytes, activation_bytes=activation,
                        batch_size=budget.batch_size, budget_step=at, fixes=[f.to_dict() for f in found])
        self.report(" ".join(parts), oom.step, fix=fix, **evidence)


def _first_sentences(text: str, limit: int = 160) -> str:
    """``text`` up to the end of the last sentence that ends within ``limit`` characters (all of it if shorter)."""
    if len(text) <= limit:
        return text
    end = text.rfind(". ", 0, limit)
    return text[:end + 1] if end > 0 else text[:limit] + "..."
