"""``memory-growth``: the device's memory keeps growing step after step after warm-up, until it runs out.

Read from the memory figures the step records carry (the device allocator's, or the process's
resident memory where the host is the device). A plateau, a one-time allocation and the first steps'
warm-up are not growth. Found live, the rule asks the memory sensor to look at the training loop's
variables at the next two step ends for what keeps autograd graphs alive from step to step (the loss
kept in a list, a running sum of losses): that is the cause it names, with the fix.
"""

from __future__ import annotations

import statistics
from collections import deque

from accelport.contract import StepRecord
from accelport.diagnose.memory import human_bytes
from accelport.diagnose.rule import Rule
from accelport.errors import DiagnosticWarning

__all__ = ["MemoryGrowthRule", "MemoryGrowthWarning"]


class MemoryGrowthWarning(DiagnosticWarning):
    """The device's memory grows every step: the run will run out of it."""


_KEPT_FIX = ("keep a number, not the tensor: losses.append(loss.item()) or total += loss.item() (a host read "
             "each step), or loss.detach() to keep it on the device; better, log through ap.after_step(fn, loss), "
             "which hands fn the host value once the step has run, without a read inside the step")


class MemoryGrowthRule(Rule):
    """Memory readings after warm-up: growth in most intervals of the last window, by at least MIN_GROWTH per step."""

    kind = "memory-growth"
    warning = MemoryGrowthWarning
    needs = frozenset({"memory"})
    WARMUP = 5  # readings of the first steps are not judged: allocators and caches fill up
    WINDOW = 15  # intervals between readings judged together (each covers one or more steps)
    SHARE = 0.8  # of the window's intervals, at least this share must grow...
    #: ...and the median interval by at least this many bytes per step: a device allocator's figures are
    #: exact; the process's resident memory also moves with Python's and the libraries' own allocations.
    MIN_GROWTH = 256 * 1024
    MIN_GROWTH_RESIDENT = 1024 * 1024
    WAIT = 8  # readings to wait for the cause search before saying the growth without it
    HISTORY = 512  # intervals kept to find where the growth began

    def start(self) -> None:
        # (first step, last step, bytes per step, bytes at the end) of each interval between two readings
        # whose steps compiled nothing: new compiled code is memory too, and recompilation has its own kind.
        self._intervals: deque[tuple[int, int, float, int]] = deque(maxlen=self.HISTORY)
        self._last: tuple[int, int] | None = None
        self._resident = False
        # start, last step, bytes per step, bytes at the window's first and last step, its first step
        self._growth: tuple[int, int, float, int, int, int] | None = None
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
        self._intervals.append((last[0], record.step, (int(value) - last[1]) / (record.step - last[0]), int(value)))
        if self._growth is None:
            self._growth = self._grows()
            if self._growth is None:
                return
            sensor = self.run.memory
            if sensor is not None:
                sensor.look_for_kept_graphs()
        self._waited += 1
        self.settle()

    def _grows(self) -> tuple[int, int, float, int, int, int] | None:
        intervals = list(self._intervals)
        if len(intervals) < self.WINDOW:
            return None
        window = intervals[-self.WINDOW:]
        rates = [rate for _, _, rate, _ in window]
        least = self.MIN_GROWTH_RESIDENT if self._resident else self.MIN_GROWTH
        if sum(r > 0 for r in rates) < self.SHARE * len(rates) or statistics.median(rates) < least:
            return None
        if window[-1][3] < max(end for _, _, _, end in window):
            return None  # it fell back: not growing now
        # Where the growth began: going back from the newest interval, the earliest that grew by at least half
        # the usual amount while no more than the window's share of the intervals since did not.
        usual = statistics.median(rates)
        start, seen, flat = window[-1][0], 0, 0
        for first, _, rate, _ in reversed(intervals):
            seen += 1
            flat += rate < usual / 2
            if flat > (1 - self.SHARE) * seen:
                break
            if rate >= usual / 2:
                start = first
        steps = sum(s1 - s0 for s0, s1, _, _ in window)
        grown = sum((s1 - s0) * rate for s0, s1, rate, _ in window)
        last_step, last = window[-1][1], window[-1][3]
        return start, last_step, grown / steps, int(last - grown), last, window[0][0]

    def settle(self) -> None:
        growth = self._growth
        if growth is None or self.reported:
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
            message = (f"{seen}: the script keeps tensors with their autograd graph from earlier steps: {names}. "
                       f"Each kept loss keeps its whole graph (and what it saved for backward) alive. Fix: "
                       f"{_KEPT_FIX}.")
        else:
            searched = ("no variable of the training loop kept more tensors with an autograd graph from one step "
                        "to the next, so it is something else: ") if kept is not None else ""
            message = (f"{seen}: something keeps memory from every step: {searched}a list or dict that collects "
                       "tensors (outputs, losses, predictions; detach them or keep .item() values), a cache that "
                       f"never evicts, or on XLA a graph that grows without a sync. If it is losses: {_KEPT_FIX}.")
        self.report(message, step, growth_bytes_per_step=int(per_step), started_at_step=start,
                    memory_bytes=last, kept=[{"name": k.name, "where": k.where, "kind": k.kind, "before": k.before,
                                              "after": k.after} for k in kept or ()])
