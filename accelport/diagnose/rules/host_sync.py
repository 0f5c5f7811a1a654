"""``host-sync``: the step reads device values on the host (``.item()``, ``print(tensor)``), which stalls the device.

Silent on ``cpu``, where the host is the device: no backend there counts such reads.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from accelport.contract import StepRecord
from accelport.diagnose import advice
from accelport.diagnose.rule import Rule
from accelport.errors import DiagnosticWarning
from accelport.observe.tracer import HostSyncSites

__all__ = ["HostSyncRule", "HostSyncWarning"]


class HostSyncWarning(DiagnosticWarning):
    """The step reads device values on the host (``.item()``, ``print(tensor)``)."""


class HostSyncRule(Rule):
    """Most of the last steps read device values on the host, beside ``ap.after_step``'s reads."""

    kind = "host-sync"
    warning = HostSyncWarning
    MIN_STEP = 6
    WINDOW = 10  # steps looked back over
    STEPS = 8  # of the last WINDOW steps, this many read device values on the host

    judges_from = 1 + WINDOW  # the first step holds the set-up; then a whole window

    def unjudged(self, steps: int) -> str | None:
        if not self._counted:
            return None  # no backend counts host reads here (cpu: the host is the device)
        return super().unjudged(steps)

    def start(self) -> None:
        # Host reads of the records whose counters were read, after the first step:
        # (reads, steps they cover), most recent last.
        self._reads: deque[tuple[float, int]] = deque()
        self._read_steps = 0
        #: ACCELPORT_DIAGNOSTICS=trace: the file and line of each read.
        self._trace = (self.run.environ.get("ACCELPORT_DIAGNOSTICS") or "").strip().lower() == "trace"
        self._sites = HostSyncSites()
        self._listen = self._trace  # from the first record on, as the reads it ranks
        # The whole run's (after the first step, which holds the set-up): reads, steps, steps that read.
        self._counted = False  # the records carry host reads (not on cpu)
        self._all_reads = 0.0
        self._all_steps = 0
        self._all_reading = 0


    def step(self, record: StepRecord) -> None:
        # Only on a step that read device values on the host. Records whose counters were not
        # read (counted_steps == 0) are covered by a later one. The first step also holds the
        # set-up before it (loading a checkpoint, a first eval).
        if self._listen:
            self._listen = False
            self._sites.listen()
        delta = record.delta
        if "device_to_host" not in delta:
            return
        self._counted = True
        if record.step <= 1:
            return
        reads = delta["device_to_host"] - delta.get("after_step_reads", 0)
        span = max(record.counted_steps, 1)
        self._all_reads += reads
        self._all_steps += span
        self._all_reading += reads > 0
        if self.reported:
            return
        self._reads.append((reads, span))
        self._read_steps += span
        while self._read_steps - self._reads[0][1] >= self.WINDOW:
            self._read_steps -= self._reads.popleft()[1]
        if reads > 0 and record.step >= self.MIN_STEP:
            self._judge(record)

    def _judge(self, record: StepRecord) -> None:
        covered = self._read_steps
        if covered < self.WINDOW:
            return
        # A record covering several steps (read together) counts as one step that read: its
        # reads may all come from one step (a checkpoint, an eval). Any read ends the quiet
        # stretch, so a loop that keeps reading is then judged step by step.
        syncing = sum(1 for n, _ in self._reads if n > 0)
        if syncing < self.STEPS * covered / self.WINDOW:
            return
        per_step = sum(n for n, _ in self._reads) / covered
        sites = self._sites.most_common(3)
        if sites:
            where = f" It happens at {', '.join(sites)}."
        elif self._trace:
            where = (" The trace caught none of them (it watches .item(), .tolist(), print, bool/int/float, "
                     ".numpy(), .cpu() and .to('cpu') on device tensors): they come from inside ops, often "
                     "ops that fall back to the CPU.")
        else:
            where = " Set ACCELPORT_DIAGNOSTICS=trace to see the file and line."
        if self.run.found("cpu-fallback"):
            where += (" Some or all of them are the cpu-fallback ops reported above: each copies its "
                      "inputs to the host, so replacing those ops removes these reads too.")
        stall = "stops the device and cuts the graph" if record.lazy else \
            "makes the host wait there until the device has run everything queued before it"
        self.report(
            f"{per_step:.1f} device-to-host transfers per step in {syncing} of the last {covered} "
            "steps: something reads device values inside the step (.item(), print(tensor), .tolist(), "
            f"if tensor:), which {stall}.{where}",
            record.step,
            fix=advice.host_reads(self.run.style),
            transfers_per_step=round(per_step, 2),
            sites=sites,
        )

    def totals(self) -> dict[str, Any]:
        steps = self._all_steps
        return {"host_reads": int(self._all_reads), "steps": steps, "steps_that_read": self._all_reading,
                "reads_per_step": round(self._all_reads / steps, 2) if steps else None}
