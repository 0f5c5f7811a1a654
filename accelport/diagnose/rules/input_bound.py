"""``input-bound``: the training loop waits for the data loader while the device is idle."""

from __future__ import annotations

import os
from collections import deque

from accelport.contract import StepRecord
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

    def start(self) -> None:
        self._timing: deque[tuple[float, float]] = deque(maxlen=self.WINDOW)  # (seconds, wait), step > 1
        self._seconds_sum = 0.0
        self._wait_sum = 0.0

    def step(self, record: StepRecord) -> None:
        if record.step <= 1 or self.reported:
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
        if workers is None:
            advice = ("wrap a torch DataLoader with num_workers > 0 (at most the number of CPU cores), "
                      "and move decoding and augmentation out of the training loop")
            worker_text = "a plain iterable"
        elif workers == 0:
            n = f"{max(1, cpus - 1)}" if cpus <= 3 else f"between 2 and {cpus - 1}"
            advice = f"set num_workers to {n} so batches are prepared in parallel while the device computes"
            worker_text = "num_workers=0"
        elif workers >= cpus:
            advice = (f"num_workers={workers} already uses every CPU core ({cpus}): make each sample "
                      "cheaper (pre-tokenise, cache decoded data) or use a machine with more cores")
            worker_text = f"num_workers={workers}"
        else:
            advice = (f"raise num_workers towards {cpus} (the CPU cores), raise prefetch in "
                      "ap.loader(..., prefetch=N), or make each sample cheaper")
            worker_text = f"num_workers={workers}"
        share = wait / total
        self.report(
            f"the training loop waited for data {share:.0%} of the time over the last {len(recent)} steps "
            f"({worker_text}, {cpus} CPU cores): the device is idle while the loader works. "
            f"{advice[0].upper()}{advice[1:]}.",
            record.step,
            data_wait_share=round(share, 3),
            num_workers=workers,
            cpu_count=cpus,
        )
