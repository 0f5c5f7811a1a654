"""Diagnose a slow or wrong run while it trains, in plain words, with the fix.

A built-in plugin on the ``accelport_step_end`` hook (name ``diagnostics``):
disable it like any plugin, or with ``ACCELPORT_DIAGNOSTICS=0``. Third parties
add rules by implementing the same hook. Each kind of finding is reported once
as a warning (a subclass of :class:`accelport.DiagnosticWarning`) and kept for
``ap.diagnostics()``.

The thresholds are chosen so that healthy runs stay silent: a loop that
compiles once per bucket shape, plus its first step and a final short batch,
is never flagged; a loop that keeps compiling is flagged within 30 steps.
"""

from __future__ import annotations

import os
import statistics
import warnings
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from accelport.contract import StepRecord
from accelport.diagnose.tracer import HostSyncSites
from accelport.errors import DiagnosticWarning, user_stacklevel
from accelport.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from accelport.runtime.state import Runtime

__all__ = [
    "Diagnosis",
    "Diagnostics",
    "KINDS",
    "RecompilationWarning",
    "HostSyncWarning",
    "InputBoundWarning",
    "GraphGrowthWarning",
    "CpuFallbackWarning",
    "DeprecatedConfigWarning",
]


class RecompilationWarning(DiagnosticWarning):
    """The graph keeps being recompiled."""


class HostSyncWarning(DiagnosticWarning):
    """The step reads device values on the host (``.item()``, ``print(tensor)``)."""


class InputBoundWarning(DiagnosticWarning):
    """The device waits for the data loader."""


class GraphGrowthWarning(DiagnosticWarning):
    """A lazy backend accumulated a very long graph without a sync."""


class CpuFallbackWarning(DiagnosticWarning):
    """Ops without a device lowering run on the host."""


class DeprecatedConfigWarning(DiagnosticWarning):
    """A deprecated setting is in effect."""


KINDS: Mapping[str, type[DiagnosticWarning]] = {
    "recompilation": RecompilationWarning,
    "host-sync": HostSyncWarning,
    "input-bound": InputBoundWarning,
    "graph-growth": GraphGrowthWarning,
    "cpu-fallback": CpuFallbackWarning,
    "deprecated-config": DeprecatedConfigWarning,
}

# Thresholds (see the module docstring for what they must keep silent).
WINDOW = 20  # steps the rolling rules look back over
RECOMPILE_MIN_STEP = 10  # first step at which recompilation is judged
RECOMPILE_STEPS_IN_WINDOW = 8  # compiling steps within WINDOW that mean "keeps compiling"...
RECOMPILE_LONG_WINDOW = 60  # ...or, for a loop that recompiles less often, within this window:
RECOMPILE_REPEATS_IN_LONG_WINDOW = 6  # this many compiling steps whose batch shape was seen before,
RECOMPILE_STEPS_IN_LONG_WINDOW = 10  # or this many in all (new shapes: more than a few buckets)
HOST_SYNC_MIN_STEP = 6
HOST_SYNC_WINDOW = 10  # steps host-sync looks back over
HOST_SYNC_STEPS = 8  # of the last HOST_SYNC_WINDOW steps, this many read device values on the host
INPUT_BOUND_MIN_STEP = 10
INPUT_BOUND_SHARE = 0.3  # share of step time spent waiting for data...
INPUT_BOUND_MIN_WAIT = 0.005  # ...and at least this many seconds per step (below it, nothing to win)
GRAPH_GROWTH_FACTOR = 4.0  # a graph this many times the usual step's graph...
GRAPH_GROWTH_MIN_EXTRA = 300  # ...and at least this many nodes more
GRAPH_GROWTH_ABSOLUTE = 100_000  # torch_xla trims graphs past this size itself
UNSYNCED_STEPS = 5  # optimizer steps in a row with no sync between them (where records count syncs)
FALLBACK_CHECK_STEPS = frozenset({1, 2, 5, 10, 20, 50, 100, 200, 500})  # then every 1000th step
FALLBACK_CHECK_EVERY = 1000


@dataclass(frozen=True)
class Diagnosis:
    """One finding: what was seen (``evidence``), and the cause and fix (``message``)."""

    kind: str
    message: str
    step: int
    evidence: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "step": self.step, "evidence": dict(self.evidence)}


def describe_shape_change(before: Sequence[Any] | None, after: Sequence[Any] | None) -> str | None:
    """'input 0 changed from (8, 128) to (8, 131)' for the first input whose shape differs."""
    if before is None or after is None:
        return None
    for i, (a, b) in enumerate(zip(before, after, strict=False)):
        if a == b:
            continue
        try:
            (sa, da), (sb, db) = a, b
        except (TypeError, ValueError):  # a signature from a third-party loader
            return f"input {i} changed from {a!r} to {b!r}"
        if sa != sb:
            return f"input {i} changed from {tuple(sa)} to {tuple(sb)}"
        return f"input {i} changed dtype from {da} to {db}"
    if len(before) != len(after):
        return f"the batch changed from {len(before)} to {len(after)} tensors"
    return None


class Diagnostics:
    """The rules. One instance per plugin host; state covers the current run.

    It sees every step, so the per-step work is a few integer and float updates
    of rolling windows; a rule is evaluated only on a step that can change its
    verdict (a step that compiled, one that read device values, one whose
    data-wait share crossed the threshold, one with a graph size), which gives
    the same findings, at the same steps, as evaluating every rule every step.
    """

    def __init__(self, environ: Mapping[str, str] | None = None, runtime: Runtime | None = None) -> None:
        self.findings: list[Diagnosis] = []
        #: The run being watched; None when records are replayed (``accelport report``).
        self._runtime = runtime
        self._reported: set[str] = set()
        self._env = os.environ if environ is None else environ
        self._trace = (self._env.get("ACCELPORT_DIAGNOSTICS") or "").strip().lower() == "trace"
        self._sites = HostSyncSites()
        self._restart()

    def _restart(self) -> None:
        """Forget the rolling windows: a new run (its steps count from 1 again)."""
        self._step = 0
        self._seen = 0  # records since the (re)start: windows count records, not step numbers
        self._prev_signature: Any = None
        self._signatures: set[Any] = set()
        self._last_change: str | None = None  # what changed at the last new batch shape that compiled
        # (record, step, compilations, came with a new batch shape), for steps > 1 that compiled
        self._compiling: deque[tuple[int, int, float, bool]] = deque()
        # Host reads of the records whose counters were read, after the first step:
        # (reads, steps they cover), most recent last.
        self._reads: deque[tuple[float, int]] = deque()
        self._read_steps = 0
        self._timing: deque[tuple[float, float]] = deque(maxlen=WINDOW)  # (seconds, wait), step > 1
        self._seconds_sum = 0.0
        self._wait_sum = 0.0
        self._graph_sizes: deque[float] = deque(maxlen=50)
        self._unsynced = 0  # steps in a row whose records say the script did not sync

    # -- reporting ------------------------------------------------------------------------
    def report(self, kind: str, message: str, step: int, **evidence: Any) -> None:
        """Record a finding; warn the first time each kind is seen."""
        if kind in self._reported:
            return
        self._reported.add(kind)
        diagnosis = Diagnosis(kind, message, step, evidence)
        self.findings.append(diagnosis)
        warnings.warn(f"[{kind}] {message}", KINDS.get(kind, DiagnosticWarning), stacklevel=user_stacklevel())

    # -- the hook --------------------------------------------------------------------------
    @hookimpl
    def accelport_step_end(self, record: StepRecord) -> None:
        step = record.step
        if step <= self._step:
            self._restart()
        self._step = step
        self._seen += 1
        seen = self._seen
        delta = record.delta
        reported = self._reported

        # Batch shapes: the loader hands the same signature object while shapes repeat.
        signature = record.signature
        new_signature = False
        if signature is not self._prev_signature and signature is not None \
                and signature not in self._signatures:
            self._signatures.add(signature)
            new_signature = True
        compiles = delta.get("compilations", 0)
        if compiles > 0 and step > 1 and "recompilation" not in reported:
            self._compiling.append((seen, step, compiles, new_signature))  # (pruned by the rule)
            if new_signature:
                change = describe_shape_change(self._prev_signature, signature)
                if change:
                    self._last_change = change
        self._prev_signature = signature
        if seen == 1:
            self._deprecated_config(record)
            if self._trace:
                self._sites.listen()

        # recompilation: the count of compiling steps in the window only rises on a step that compiled.
        if step >= RECOMPILE_MIN_STEP and "recompilation" not in reported and \
                (compiles > 0 or step == RECOMPILE_MIN_STEP):
            self._recompilation(record)

        # host-sync: likewise, only on a step that read device values on the host. Records
        # whose counters were not read (counted_steps == 0) are covered by a later one.
        # The first step also holds the set-up before it (loading a checkpoint, a first eval).
        if step > 1 and "device_to_host" in delta and "host-sync" not in reported:
            reads = delta["device_to_host"] - delta.get("after_step_reads", 0)
            span = max(record.counted_steps, 1)
            self._reads.append((reads, span))
            self._read_steps += span
            while self._read_steps - self._reads[0][1] >= HOST_SYNC_WINDOW:
                self._read_steps -= self._reads.popleft()[1]
            if reads > 0 and step >= HOST_SYNC_MIN_STEP:
                self._host_sync(record)

        # input-bound: running sums over the window (the first step includes start-up).
        if step > 1 and "input-bound" not in reported:
            timing = self._timing
            if len(timing) == WINDOW:
                old_seconds, old_wait = timing[0]
                self._seconds_sum -= old_seconds
                self._wait_sum -= old_wait
            timing.append((record.seconds, record.data_wait_seconds))
            self._seconds_sum += record.seconds
            self._wait_sum += record.data_wait_seconds
            # The running sums only pick the steps worth an exact look (with some slack for rounding).
            if step >= INPUT_BOUND_MIN_STEP and \
                    self._wait_sum >= 0.999 * INPUT_BOUND_SHARE * self._seconds_sum and \
                    self._wait_sum >= 0.999 * INPUT_BOUND_MIN_WAIT * len(timing):
                self._input_bound(record)

        if record.lazy:
            # Only records from a watched script count its syncs (accelport diagnose): ap.loader
            # and ap.optimizer_step sync every step themselves.
            syncs = delta.get("syncs")
            if syncs is not None and record.counted_steps and "graph-growth" not in reported:
                self._unsynced = 0 if syncs else self._unsynced + record.counted_steps
                if self._unsynced >= UNSYNCED_STEPS:
                    self._never_synced(record)
            size = delta.get("graph_nodes")
            if size:  # (the largest graph run since the last read: a small start-up graph hides behind it)
                self._graph_growth(record, size)
            if "cpu-fallback" not in reported and (step in FALLBACK_CHECK_STEPS or step % FALLBACK_CHECK_EVERY == 0):
                self._cpu_fallback(record)

    # -- rules --------------------------------------------------------------------------------
    def _recompilation(self, record: StepRecord) -> None:
        seen = self._seen
        compiling = self._compiling
        while compiling and compiling[0][0] <= seen - RECOMPILE_LONG_WINDOW:
            compiling.popleft()  # (also on a step that did not compile: step 10)
        # Every step or so (8 of the last 20), or steadily but less often: 6 of the last 60
        # on batch shapes seen before (nothing new explains them), or 10 in all. A bucketed
        # loop compiles once per bucket, each on a new shape, plus an eval or a final batch.
        recent = [c for c in compiling if c[0] > seen - WINDOW]
        if len(recent) < RECOMPILE_STEPS_IN_WINDOW:
            repeats = sum(1 for c in compiling if not c[3])
            if repeats < RECOMPILE_REPEATS_IN_LONG_WINDOW and len(compiling) < RECOMPILE_STEPS_IN_LONG_WINDOW:
                return
            recent = list(compiling)
            lookback = min(seen, RECOMPILE_LONG_WINDOW)
        else:
            lookback = min(seen, WINDOW)
        total = sum(int(c[2]) for c in recent)
        # Blame the shapes only if most of these compilations came with a new batch shape.
        reshaped = sum(1 for c in recent if c[3])
        change = self._last_change if 2 * reshaped >= len(recent) else None
        if change:
            cause = (f"{change}; {len(self._signatures)} distinct batch shapes so far. "
                     "Pad to a fixed length, or bucket: collate_fn=ap.data.BucketCollate(buckets=(128, 256, 512))"
                     " with ap.data.LengthGroupedBatchSampler to keep padding low")
        elif record.signature is None:
            cause = ("the batches did not come through ap.loader, so their shapes are unknown: iterate with "
                     "`for batch in ap.loader(data):` to have the input whose shape changes named. The usual "
                     "causes are batches of varying shape (pad to a fixed length or use ap.data.BucketCollate) "
                     "and data-dependent ops (boolean indexing x[mask], torch.nonzero; use ap.data.masked_sum / "
                     "masked_mean, torch.where)")
        else:
            cause = ("the input shapes did not change, so the graph itself does: look for data-dependent ops "
                     "(boolean indexing x[mask], torch.nonzero, .item() feeding Python control flow) and "
                     "replace them with fixed-shape ops (ap.data.masked_sum / masked_mean, torch.where)")
        self.report(
            "recompilation",
            f"the graph was recompiled in {len(recent)} of the last {lookback} steps ({total} compilations): "
            f"{cause}.",
            record.step,
            compiling_steps=[c[1] for c in recent],
            distinct_signatures=len(self._signatures),
            last_change=change,
        )

    def _host_sync(self, record: StepRecord) -> None:
        covered = self._read_steps
        if covered < HOST_SYNC_WINDOW:
            return
        # A record covering several steps (read together) counts as one step that read: its
        # reads may all come from one step (a checkpoint, an eval). Any read ends the quiet
        # stretch, so a loop that keeps reading is then judged step by step.
        syncing = sum(1 for n, _ in self._reads if n > 0)
        if syncing < HOST_SYNC_STEPS * covered / HOST_SYNC_WINDOW:
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
        if "cpu-fallback" in self._reported:
            where += (" Some or all of them are the cpu-fallback ops reported above: each copies its "
                      "inputs to the host, so replacing those ops removes these reads too.")
        self.report(
            "host-sync",
            f"{per_step:.1f} device-to-host transfers per step in {syncing} of the last {covered} "
            "steps: something reads device values inside the step (.item(), print(tensor), .tolist(), "
            "if tensor:), which stops the device and cuts the graph. Log with "
            "ap.after_step(fn, loss) instead: it runs fn with host values once the step has run, "
            f"without an extra round trip.{where}",
            record.step,
            transfers_per_step=round(per_step, 2),
            sites=sites,
        )

    def _input_bound(self, record: StepRecord) -> None:
        recent = self._timing
        total = sum(seconds for seconds, _ in recent)
        wait = sum(w for _, w in recent)
        self._seconds_sum, self._wait_sum = total, wait  # exact again
        if total <= 0 or wait / total < INPUT_BOUND_SHARE or wait / len(recent) < INPUT_BOUND_MIN_WAIT:
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
            "input-bound",
            f"the training loop waited for data {share:.0%} of the time over the last {len(recent)} steps "
            f"({worker_text}, {cpus} CPU cores): the device is idle while the loader works. "
            f"{advice[0].upper()}{advice[1:]}.",
            record.step,
            data_wait_share=round(share, 3),
            num_workers=workers,
            cpu_count=cpus,
        )

    def _graph_growth(self, record: StepRecord, size: float) -> None:
        if "graph-growth" in self._reported:
            self._graph_sizes.append(size)
            return
        # Lazy backends report sizes only on steps that compiled (Backend.compile_facts), so
        # one earlier size is enough to compare with.
        usual = statistics.median(self._graph_sizes) if self._graph_sizes else None
        self._graph_sizes.append(size)
        too_big = size >= GRAPH_GROWTH_ABSOLUTE or (
            usual is not None and size >= GRAPH_GROWTH_FACTOR * usual and size - usual >= GRAPH_GROWTH_MIN_EXTRA
        )
        if not too_big:
            return
        usual_text = f" (usually {int(usual)})" if usual else ""
        self.report(
            "graph-growth",
            f"step {record.step} executed a graph of {int(size)} nodes{usual_text}: work accumulated without a "
            "sync, so it compiles and runs as one huge graph (slow to compile, memory hungry). Call ap.sync() "
            "inside long loops that are not training steps (evaluation, generation, metric accumulation), "
            "e.g. once per iteration.",
            record.step,
            graph_nodes=int(size),
            usual_graph_nodes=int(usual) if usual else None,
        )

    def _never_synced(self, record: StepRecord) -> None:
        n = self._unsynced
        self.report(
            "graph-growth",
            f"{n} optimizer steps in a row ran without a sync (steps {record.step - n + 1} to {record.step}): "
            "the loop never syncs (no torch_xla.sync() or xm.mark_step() after optimizer.step(), and the batches "
            "do not come through MpDeviceLoader), so on XLA nothing runs and one graph grows by a whole training "
            "step every step: each value read compiles a larger graph, memory grows, and the weights on the "
            "device are not updated until it finally runs. Add torch_xla.sync() (xm.mark_step() on older "
            "torch_xla) right after optimizer.step(), or iterate the batches through "
            "torch_xla.distributed.parallel_loader.MpDeviceLoader, which syncs once per batch; a ported loop "
            "(ap.loader, ap.optimizer_step) syncs by itself.",
            record.step,
            steps_without_sync=n,
        )

    def _cpu_fallback(self, record: StepRecord) -> None:
        runtime = self._runtime
        backend = runtime.selected if runtime is not None else None
        if runtime is None or backend is None or backend.name != record.backend:
            return
        # Since the backend was selected: torch_xla's counters are process-wide.
        ops = runtime.since_selected().get("cpu_fallback") or {}
        ops = {op: n for op, n in ops.items() if op != "aten::_local_scalar_dense"}  # that is .item()
        if not ops:
            return
        listed = ", ".join(f"{op} ({n}x)" for op, n in sorted(ops.items(), key=lambda kv: -kv[1])[:5])
        self.report(
            "cpu-fallback",
            f"ops with no {record.backend} lowering ran on the host CPU: {listed}. Each one copies data to "
            "the host and back and cuts the graph. Replace them with fixed-shape equivalents (torch.nonzero -> "
            "a mask with torch.where; boolean indexing -> ap.data.masked_sum) or move them out of the step.",
            record.step,
            ops=dict(ops),
        )

    def _deprecated_config(self, record: StepRecord) -> None:
        from accelport.compat.deprecations import deprecated_settings

        found = deprecated_settings(self._env, backend=record.backend, in_effect_only=True)
        if found:
            self.report("deprecated-config", " ".join(message for _, message in found), record.step,
                        settings=[name for name, _ in found])


def create_plugin(environ: Mapping[str, str], runtime: Runtime | None) -> Diagnostics:
    """The plugin object the plugin host registers (a fresh one per host, so per run)."""
    return Diagnostics(environ, runtime)
