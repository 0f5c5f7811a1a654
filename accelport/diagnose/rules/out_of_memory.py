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

    def start(self) -> None:
        self._batch: int | None = None
        self._signature: object = None

    def step(self, record: StepRecord) -> None:
        signature = record.signature
        if signature is not self._signature:  # (ap.loader hands equal shapes as one object)
            self._signature = signature
            try:  # the first dimension of the first input: the batch size
                shape: Any = signature[0][0] if signature else ()
                self._batch = int(shape[0]) if len(shape) else self._batch
            except (TypeError, ValueError, IndexError):
                pass
        if not self._batch and record.loader.get("batch_size"):
            self._batch = int(record.loader["batch_size"])
        sensor = self.run.memory
        if sensor is not None and sensor.oom is not None:
            self.settle()

    def settle(self) -> None:
        sensor = self.run.memory
        oom = sensor.oom if sensor is not None else None
        if sensor is None or oom is None or self.reported:
            return
        last = sensor.last.values if sensor.last is not None else {}
        budget_values = sensor.budget
        capacity = oom.capacity_bytes or sensor.capacity_bytes
        # What was seen comes before the finding's first colon (the fix after it): the quote keeps none.
        said = f"{oom.error}, \"{oom.message.replace(': ', ' - ')}\"" if oom.message else oom.error
        asked = f" The failing allocation asked for {human_bytes(oom.requested_bytes)}." if oom.requested_bytes else ""
        head = f"step {oom.step} ran out of memory ({said}).{asked}"
        evidence: dict[str, object] = {"vendor": oom.vendor, "error": oom.error, "error_message": oom.message,
                                       "requested_bytes": oom.requested_bytes, "capacity_bytes": capacity,
                                       "source": oom.source}
        if oom.host and self.run.device_type not in (None, "cpu"):
            self.report(f"{head} That is the host's memory, not the {self.run.device_type} device's, so the data "
                        "pipeline (DataLoader workers, prefetched batches, a dataset read whole) or a copy to the "
                        "host filled it: fewer DataLoader workers, a smaller prefetch (ap.loader(..., prefetch=1)), "
                        "a dataset read lazily, or a larger host.", oom.step, **evidence)
            return
        if not budget_values:
            self.report(f"{head} No step finished before it, so there is no budget to show: estimate the run "
                        "before it starts with ap.memory_estimate(model, optimizer, batch), which says what fits "
                        "where.", oom.step, **evidence)
            return
        model = sensor.model()
        blocks, largest = blocks_of(model) if model is not None else (None, 0)
        activation = last.get("activation_bytes") if not sensor.resident else None
        if activation is not None:
            activation = max(int(activation), sensor.activation or 0)
        budget = Budget(budget_values["parameter_bytes"], budget_values["gradient_bytes"],
                        budget_values["optimizer_state_bytes"], activation, capacity, self._batch,
                        budget_values.get("float32_bytes", 0), blocks, largest, self.run.world_size,
                        sensor.sharded)
        usable = budget.usable_bytes
        oversized = bool(oom.requested_bytes and capacity and oom.requested_bytes > capacity)
        roomy = usable is not None and budget.total_bytes <= usable and activation is not None
        found = [] if roomy or oversized else fixes(budget)
        at = sensor.last.step if sensor.last is not None else sensor.budget_step
        parts = [head, f"At step {at}, the last good one, the device held {budget.describe()}."]
        if activation is None:
            parts.append(f"The activations are not measured on {self.run.backend} (no device peak is known "
                         "there); ap.memory_estimate(model, optimizer, batch) measures them.")
        seen = " ".join(parts).rstrip(".")
        if oversized:
            message = (f"{seen}: that one allocation is larger than the whole device ({human_bytes(capacity)}), so "
                       "no fix to the budget makes room for it. Look for the tensor of that size: a shape mistake, "
                       "a broadcast that grew, a batch far larger than meant.")
        elif roomy:
            message = (f"{seen}: that is well within the device, so the steady budget is not what ran out. Look for "
                       "what this step did differently (one large allocation, a longer sequence, a larger batch) or "
                       "for memory held outside the steps (another process on the device, tensors kept from an "
                       "evaluation or a cache).")
        elif found:
            message = f"{seen}: fixes, most saved first: " + "; ".join(
                f"{i}) {fix.text}" for i, fix in enumerate(found, 1)) + "."
        else:
            message = f"{seen}: no fix to the budget was found here; a smaller batch or model is what is left."
        evidence.update(parameter_bytes=budget.parameter_bytes, gradient_bytes=budget.gradient_bytes,
                        optimizer_state_bytes=budget.optimizer_state_bytes, activation_bytes=activation,
                        batch_size=self._batch, budget_step=at, fixes=[fix.to_dict() for fix in found])
        self.report(message, oom.step, **evidence)
