"""``memory-growth``: the device's memory keeps growing step after step after warm-up, until it runs out.

Read from the memory figures the step records carry (the device allocator's, or the process's
resident memory where the host is the device). A plateau, a one-time allocation and the first steps'
warm-up are not growth. Found live, the rule asks the memory sensor to look at the training loop's
variables at the next two step ends for what keeps autograd graphs alive from step to step (the loss
kept in a list, a running sum of losses): that is the cause it names, with the fix.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque

from accelport.contract import StepRecord
from accelport.diagnose import advice
from accelport.diagnose.memory import human_bytes
from accelport.diagnose.rule import Rule
from accelport.errors import DiagnosticWarning

__all__ = ["MemoryGrowthRule", "MemoryGrowthWarning"]


class MemoryGrowthWarning(DiagnosticWarning):
    """The device's memory grows every step: the run will run out of it."""


class MemoryGrowthRule(Rule):
    """Memory readings after warm-up: growth over most spans of SPAN intervals in the last window, by at least
    MIN_GROWTH per step (spans, not single intervals: an allocator that grows by large chunks grows every few
    steps, not every step)."""

    kind = "memory-growth"
    warning = MemoryGrowthWarning
    needs = frozenset({"memory"})
    WARMUP = 5  # readings of the first steps are not judged: allocators and caches fill up
    WINDOW = 20  # intervals between readings judged together (each covers one or more steps)
    SPAN = 4  # consecutive intervals judged as one
    SHARE = 0.8  # of the window's spans, at least this share must grow...
    #: ...and the median span by at least this many bytes per step: a device allocator's figures are exact;
    #: the process's resident memory also moves with Python's and the libraries' own allocations.
    MIN_GROWTH = 256 * 1024
    MIN_GROWTH_RESIDENT = 1024 * 1024
    #: Intervals after the window that must go on growing (by half the window's rate) before it is said: a
    #: climb that stops (a cache filling, the allocator settling after warm-up) is no growth.
    CONFIRM = 4
    #: Readings come after every step for a run's first 40 steps: warm-up, a window and its confirmation.
    judges_from = 1 + WARMUP + WINDOW + CONFIRM
    WAIT = 8  # readings to wait for the cause search before saying the growth without it
    HISTORY = 512  # intervals kept to find where the growth began

    def start(self) -> None:
        # (first step, last step, bytes grown, bytes at the end) of each interval between two readings whose
        # steps compiled nothing: new compiled code is memory too, and recompilation has its own kind.
        self._intervals: deque[tuple[int, int, int, int]] = deque(maxlen=self.HISTORY)
        self._last: tuple[int, int] | None = None
        self._recorded = 0
        self._resident = False
        # start, last step, bytes per step, bytes at the window's first and last step, its first step
        self._growth: tuple[int, int, float, int, int, int] | None = None
        self._seen_at = 0  # intervals recorded when the growth was seen (it is confirmed CONFIRM after)
        self._confirmed = False
        self._waited = 0

    def step(self, record: StepRecord) -> None:
        memory = record.memory
        if not memory or record.step <= self.WARMUP or self.reported:
            return
        value = memory.get("memory_bytes")
        if value is None:
            return
        self._resident = bool(memory.get("resident"))
        last, self._last = self._last, (record.step, int(value))
        if last is None or record.step <= last[0] or record.delta.get("compilations"):
            return
        self._intervals.append((last[0], record.step, int(value) - last[1], int(value)))
        self._recorded += 1
        if self._growth is None:
            self._growth = self._grows()
            if self._growth is None:
                return
            self._seen_at, self._confirmed = self._recorded, False
            sensor = self.run.memory
            if sensor is not None:  # (looked for while the growth is confirmed)
                sensor.look_for_kept_graphs()
            return
        if not self._confirmed:
            since = self._recorded - self._seen_at
            if since < self.CONFIRM:
                return
            after = list(self._intervals)[-since:]
            steps = sum(s1 - s0 for s0, s1, _, _ in after)
            start, _, per_step, first, _, first_step = self._growth
            if sum(g for _, _, g, _ in after) / steps < per_step / 2:
                self._growth = None  # it stopped: a climb, not growth
                return
            self._growth = (start, record.step, per_step, first, int(value), first_step)
            self._confirmed = True
        self._waited += 1
        self.settle()

    def _spans(self, intervals: list[tuple[int, int, int, int]]) -> list[tuple[int, float]]:
        """(first step, bytes per step) of each run of SPAN consecutive intervals."""
        out = []
        for i in range(len(intervals) - self.SPAN + 1):
            run = intervals[i:i + self.SPAN]
            steps = sum(s1 - s0 for s0, s1, _, _ in run)
            out.append((run[0][0], sum(grown for _, _, grown, _ in run) / steps))
        return out

    def _grows(self) -> tuple[int, int, float, int, int, int] | None:
        kept = self._intervals
        if len(kept) < self.WINDOW:
            return None
        # (Judged at every reading: the window is copied, the whole history only once it grows.)
        window = list(itertools.islice(kept, len(kept) - self.WINDOW, None))
        least = self.MIN_GROWTH_RESIDENT if self._resident else self.MIN_GROWTH
        steps = sum(s1 - s0 for s0, s1, _, _ in window)
        grown = sum(g for _, _, g, _ in window)
        # (Judged at every record while nothing grows: the window's total says "no" before its spans are made.
        # The last test below asks for more than this.)
        if grown / steps < least:
            return None
        rates = [rate for _, rate in self._spans(window)]
        if sum(r > 0 for r in rates) < self.SHARE * len(rates) or statistics.median(rates) < least:
            return None
        if window[-1][3] < max(end for _, _, _, end in window):
            return None  # it fell back: not growing now
        if (grown - max(g for _, _, g, _ in window)) / steps < least:
            return None  # one allocation made most of it: a one-time allocation, not growth
        # Where the growth began: going back from the newest interval, block by block of SPAN intervals, the
        # first step of the earliest block of a run that grew by at least half the usual amount.
        usual = statistics.median(rates)
        intervals = list(kept)
        start = window[-1][0]
        for i in range(len(intervals) - self.SPAN, -1, -self.SPAN):
            first, rate = self._spans(intervals[i:i + self.SPAN])[0]
            if rate < usual / 2:
                break
            start = first
        last_step, last = window[-1][1], window[-1][3]
        return start, last_step, grown / steps, last - grown, last, window[0][0]

    def settle(self) -> None:
        growth = self._growth
        if growth is None or not self._confirmed or self.reported:
            return
        sensor = self.run.memory
        kept = sensor.kept if sensor is not None else None
        if kept is None and sensor is not None and self._waited < self.WAIT:
            return  # the search looks at the next step ends: its answer comes with a later record
        start, step, per_step, first, last, first_step = growth
        what = "resident memory" if self._resident else "device memory"
        seen = (f"{what} grew by {human_bytes(per_step)} per step from step {start} on, to {human_bytes(last)} at "
                f"step {step} ({human_bytes(last - first)} since step {first_step})")
        capacity = sensor.capacity_bytes if sensor is not None else None
        if capacity and per_step > 0 and capacity > last:
            seen += f", so the {human_bytes(capacity)} would run out in about {int((capacity - last) / per_step)} steps"
        if kept:
            names = "; ".join(k.describe() for k in kept[:3])
            message = (f"{seen}: the script keeps tensors with their autograd graph from earlier steps ({names}); "
                       "each kept loss keeps its whole graph, and what it saved for backward, alive.")
            fix = advice.kept_graphs(self.run.style)
        else:
            searched = ("no variable of the training loop kept more tensors with an autograd graph from one step "
                        "to the next, so it is something else: ") if kept is not None else ""
            message = (f"{seen}: something keeps memory from every step: {searched}a list or dict that collects "
                       "tensors (outputs, losses, predictions), a cache that never evicts, or on XLA a graph that "
                       "grows without a sync.")
            fix = ("Detach what a list or dict collects (or keep .item() values) and bound any cache. If it is "
                   "losses: " + advice.kept_graphs(self.run.style))
            if self._resident:
                # Measured: glibc's heap grows by megabytes a step when small tensors are kept between large
                # buffers it serves from the heap (its mmap threshold rises after a large free), and is flat
                # with a fixed threshold.
                fix += (" On the host the C allocator can grow too: small tensors kept between large buffers stop "
                        "glibc from giving its heap back; MALLOC_MMAP_THRESHOLD_=1048576 in the environment "
                        "serves buffers of 1 MiB and more by mmap, returned when freed.")
        self.report(message, step, fix=fix, growth_bytes_per_step=int(per_step), started_at_step=start,
                    memory_bytes=last, kept=[{"name": k.name, "where": k.where, "kind": k.kind, "before": k.before,
                                              "after": k.after} for k in kept or ()])
