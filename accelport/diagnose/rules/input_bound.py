"""``input-bound``: the training loop waits for the data loader while the device is idle."""

from __future__ import annotations

import os
from collections import deque
from typing import Any

from accelport.contract import StepRecord
from accelport.diagnose import advice
from accelport.diagnose.rule import Rule
from accelport.errors import DiagnosticWarning

__all__ = ["InputBoundRule", "InputBoundWarning"]


class InputBoundWarning(DiagnosticWarning):
    """The device waits for the data loader."""


class InputBoundRule(Rule):
    """The share of step time spent waiting for data, over a rolling window (the first step holds start-up)."""

    kind = "input-bound"
    warning = InputBoundWarning
    WINDOW = 20  # steps looked back over
    MIN_STEP = 10
    SHARE = 0.3  # share of step time spent waiting for data...
    MIN_WAIT = 0.005  # ...and at least this many seconds per step (below it, nothing to win)

    judges_from = MIN_STEP

    def start(self) -> None:
        self._timing: deque[tuple[float, float]] = deque(maxlen=self.WINDOW)  # (seconds, wait), step > 1
        self._seconds_sum = 0.0
        self._wait_sum = 0.0
        self._all_wait = 0.0  # over the whole run, after the first step (which holds start-up)
        self._all_seconds = 0.0

    def step(self, record: StepRecord) -> None:
        if record.step <= 1:
            return
        self._all_wait += record.data_wait_seconds
        self._all_seconds += record.seconds
        if self.reported:
            return
        # Running sums over the window; they only pick the steps worth an exact look (with
        # some slack for rounding), so the exact sums run rarely.
        timing = self._timing
        if len(timing) == self.WINDOW:
            old_seconds, old_wait = timing[0]
            self._seconds_sum -= old_seconds
            self._wait_sum -= old_wait
        timing.append((record.seconds, record.data_wait_seconds))
        self._seconds_sum += record.seconds
        self._wait_sum += record.data_wait_seconds
        if record.step >= self.MIN_STEP and self._wait_sum >= 0.999 * self.SHARE * self._seconds_sum and \
                self._wait_sum >= 0.999 * self.MIN_WAIT * len(timing):
            self._judge(record)

    def _judge(self, record: StepRecord) -> None:
        recent = self._timing
        total = sum(seconds for seconds, _ in recent)
        wait = sum(w for _, w in recent)
        self._seconds_sum, self._wait_sum = total, wait  # exact again
        if total <= 0 or wait / total < self.SHARE or wait / len(recent) < self.MIN_WAIT:
            return
        workers = (record.loader or {}).get("num_workers")
        cpus = os.cpu_count() or 1
        worker_text = "a plain iterable" if workers is None else f"num_workers={workers}"
        share = wait / total
        self.report(
            f"the training loop waited for data {share:.0%} of the time over the last {len(recent)} steps "
            f"({worker_text}, {cpus} CPU cores): the device is idle while the loader works.",
            record.step,
            fix=advice.data_workers(self.run.style, workers, cpus, self.run.device_type),
            data_wait_share=round(share, 3),
            num_workers=workers,
            cpu_count=cpus,
        )

    def totals(self) -> dict[str, Any]:
        return {"data_wait_seconds": round(self._all_wait, 3), "step_seconds": round(self._all_seconds, 3),
                "data_wait_share": round(self._all_wait / self._all_seconds, 3) if self._all_seconds > 0 else None}
