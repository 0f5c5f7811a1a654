"""Diagnose a slow or wrong run while it trains, in plain words, with the fix.

A built-in plugin on the ``accelport_step_end`` hook (name ``diagnostics``):
disable it like any plugin, or with ``ACCELPORT_DIAGNOSTICS=0``. Third parties
add rules by implementing the same hook. Each kind of finding is reported once
as a warning (a subclass of :class:`accelport.DiagnosticWarning`) and kept for
``ap.diagnostics()``.

The rules are fed by step records (what the backend's counters say) and, where a
process is being watched live, by objects that need no ``ap.*`` call to work:
dynamo's own records (:mod:`.dynamo`: recompilation reasons, the recompile limit,
graph breaks) and the step's numbers (:mod:`.numerics`: non-finite gradients,
updates that round away). Replaying a metrics file (``accelport report``) runs
the same rules on the records alone.

The thresholds are chosen so that healthy runs stay silent: a loop that
compiles once per bucket shape, plus its first step and a final short batch,
is never flagged; a loop that keeps compiling is flagged within 30 steps.
"""

from __future__ import annotations

import os
import statistics
import warnings
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from accelport.contract import StepRecord
from accelport.diagnose import compiled
from accelport.diagnose.buckets import suggest
from accelport.diagnose.dynamo import observer
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
    "CompileLimitWarning",
    "GraphBreakWarning",
    "NonFiniteWarning",
    "PrecisionWarning",
    "PROBLEMS",
    "severity",
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


class CompileLimitWarning(DiagnosticWarning):
    """A compiled function reached dynamo's recompile limit and now runs eagerly for new shapes."""


class GraphBreakWarning(DiagnosticWarning):
    """A compiled function breaks its graph on every call."""


class NonFiniteWarning(DiagnosticWarning):
    """The loss or the gradients became NaN or Inf."""


class PrecisionWarning(DiagnosticWarning):
    """Low-precision parameters whose updates round away: training stalls."""


KINDS: Mapping[str, type[DiagnosticWarning]] = {
    "recompilation": RecompilationWarning,
    "host-sync": HostSyncWarning,
    "input-bound": InputBoundWarning,
    "graph-growth": GraphGrowthWarning,
    "cpu-fallback": CpuFallbackWarning,
    "deprecated-config": DeprecatedConfigWarning,
    "compile-limit": CompileLimitWarning,
    "graph-break": GraphBreakWarning,
    "non-finite": NonFiniteWarning,
    "precision": PrecisionWarning,
}
#: Kinds that mean the run is wrong or silently crippled, not merely slower: they say so first.
#: Kinds where the run is wrong or crippled, not only slower: a function silently run eagerly
#: for the rest of the run, NaN weights, weights that stopped moving. A loop that never syncs
#: (graph-growth with ``steps_without_sync``) is one too: its graph grows until memory runs out.
PROBLEMS = frozenset({"compile-limit", "non-finite", "precision"})

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
GRAPH_GROWTH_FIRST = 10_000  # a graph this large at ap.sync() with no earlier graph to compare with
GRAPH_BREAK_MIN_STEP = 3  # graph breaks are judged from this step (they are recorded at compile time)


@dataclass(frozen=True)
class Diagnosis:
    """One finding: what was seen (``evidence``), and the cause and fix (``message``)."""

    kind: str
    message: str
    step: int
    evidence: Mapping[str, Any] = field(default_factory=dict)
    #: "problem" for the kinds in PROBLEMS and a loop that never syncs, else "warning".
    severity: str = "warning"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "step": self.step, "evidence": dict(self.evidence),
                "severity": self.severity}


def severity(kind: str, evidence: Mapping[str, Any]) -> str:
    """"problem" for the kinds in PROBLEMS and a loop that never syncs, else "warning"."""
    return "problem" if kind in PROBLEMS or evidence.get("steps_without_sync") else "warning"


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
        #: dynamo's records, from here on (they are process-wide).
        self._observer = observer()
        self._mark = self._observer.mark()
        self._restart()

    def _restart(self) -> None:
        """Forget the rolling windows: a new run (its steps count from 1 again)."""
        self._step = 0
        self._last_record: StepRecord | None = None
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
        self._signature_counts: Counter[Any] = Counter()  # steps per batch signature, but for...
        self._signature_run = 0  # ...the steps of the current run of equal signatures
        self._graph_breaks = 0  # from the records (replay); live runs read dynamo too
        self._limit_hits = 0

    # -- reporting ------------------------------------------------------------------------
    def report(self, kind: str, message: str, step: int, **evidence: Any) -> None:
        """Record a finding; warn the first time each kind is seen."""
        if kind in self._reported:
            return
        self._reported.add(kind)
        problem = severity(kind, evidence) == "problem"
        diagnosis = Diagnosis(kind, message, step, evidence, "problem" if problem else "warning")
        self.findings.append(diagnosis)
        text = f"[{kind}] PROBLEM: {message}" if problem else f"[{kind}] {message}"
        warnings.warn(text, KINDS.get(kind, DiagnosticWarning), stacklevel=user_stacklevel())

    # -- the hook --------------------------------------------------------------------------
    @hookimpl
    def accelport_step_end(self, record: StepRecord) -> None:
        step = record.step
        if step <= self._step:
            self._restart()
        self._step = step
        self._last_record = record
        self._seen += 1
        seen = self._seen
        delta = record.delta
        reported = self._reported

        # Batch shapes: the loader hands the same signature object while shapes repeat.
        signature = record.signature
        if signature is self._prev_signature:
            self._signature_run += 1  # counted into _signature_counts when the shape changes
        else:
            self._count_signatures()
            self._signature_run = 1
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

        # torch.compile's records, and what the step's numbers say (live runs): looked at on
        # the records whose counters were read (a quiet block's last), so at most 15 steps late.
        if delta:
            self._limit_hits += int(delta.get("compile_limit_hits", 0))
            if "compile-limit" not in reported and (self._limit_hits or self._observer.limit_hit_count(self._mark)):
                self._compile_limit(record)
            self._graph_breaks += int(delta.get("graph_breaks", 0))
            runtime = self._runtime
            watch = runtime.tracker.numerics if runtime is not None else None
            if watch is not None and (watch.nonfinite is not None or watch.stalled is not None):
                self._numerics(watch, step)
        if "graph-break" not in reported and step >= GRAPH_BREAK_MIN_STEP and \
                (compiles > 0 or step == GRAPH_BREAK_MIN_STEP or self._graph_breaks):
            self._graph_break(record)

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
        suggestion = self._suggestion() if change else None
        compiled_cause = None if record.lazy else self._compiled_cause(record, suggestion)
        if compiled_cause == "graph-break":
            return  # the recompilations are the graph break's: reported as that
        if compiled_cause:
            cause = compiled_cause
        elif change:
            buckets = (f"collate_fn={compiled.describe(suggestion, len(self._signatures))}" if suggestion else
                       "collate_fn=ap.data.BucketCollate(buckets=(128, 256, 512))")
            cause = (f"{change}; {len(self._signatures)} distinct batch shapes so far. "
                     f"Pad to a fixed length, or bucket: {buckets}"
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
            buckets=list(suggestion.buckets) if suggestion else None,
        )

    def _count_signatures(self) -> None:
        if self._signature_run and self._prev_signature is not None:
            self._signature_counts[self._prev_signature] += self._signature_run
        self._signature_run = 0

    def _suggestion(self) -> Any:
        """Buckets for the length that varies across the batches seen (None if none varies)."""
        self._count_signatures()
        _, lengths = compiled.signature_lengths(self._signature_counts)
        return suggest(lengths) if len(lengths) > 1 else None

    def _dynamic(self, record: StepRecord) -> bool | None:
        runtime = self._runtime
        return compiled.accepts_dynamic(record.backend, runtime.selected if runtime is not None else None)

    def _compiled_cause(self, record: StepRecord, suggestion: Any) -> str | None:
        """dynamo's reasons for the recompilations, in the user's terms; "graph-break" when a break explains them."""
        functions = self._observer.functions(self._mark)
        if not functions:
            return None
        if compiled.breaks_explain_recompiles(functions) and self._observer.graph_break_count(self._mark):
            self._graph_break(record)
            return "graph-break"
        if suggestion is None:
            suggestion = self._dynamo_suggestion(functions)
        found = compiled.recompilation_cause(functions, record.backend, self._dynamic(record), suggestion,
                                             len(self._signatures))
        return found[0] if found else None

    @staticmethod
    def _dynamo_suggestion(functions: Sequence[Any]) -> Any:
        """Buckets from the sizes dynamo saw (each once), where the batches' shapes are unknown."""
        for f in functions:
            if f.size_changes:
                return suggest({size: 1 for size in f.size_changes[0].sizes})
        return None

    def _compile_limit(self, record: StepRecord) -> None:
        hits = self._observer.limit_hits(self._mark)
        functions = self._observer.functions(self._mark) if hits else []
        suggestion = self._suggestion() or self._dynamo_suggestion(functions)
        if hits:
            hit = hits[0]
            message = compiled.compile_limit_message(hit, functions, record.backend, self._dynamic(record),
                                                     suggestion, len(self._signatures))
            evidence: dict[str, Any] = {"function": f"{hit.function} ({hit.where})", "limit": hit.limit,
                                        "limit_type": hit.limit_type}
        else:  # replayed from a metrics file: the count, not dynamo's record
            fix = f" Pad to a few lengths: collate_fn={compiled.describe(suggestion, len(self._signatures))}." \
                if suggestion else " Pad or bucket the inputs (ap.data.BucketCollate) so it sees only a few shapes."
            message = ("a compiled function reached torch._dynamo's recompile limit: from now on every new shape "
                       "runs it eagerly, uncompiled and silently slower, for the rest of the run "
                       f"({len(self._signatures)} distinct batch shapes so far).{fix}")
            evidence = {}
        evidence["distinct_signatures"] = len(self._signatures)
        evidence["buckets"] = list(suggestion.buckets) if suggestion else None
        self.report("compile-limit", message, record.step, **evidence)

    def _graph_break(self, record: StepRecord) -> None:
        live = self._observer.graph_break_count(self._mark)
        if not live and not self._graph_breaks:
            return
        breaks = self._observer.graph_breaks(self._mark) if live else []
        total = live or self._graph_breaks
        message = compiled.graph_break_message(breaks, total)
        self.report("graph-break", message, record.step, graph_breaks=total,
                    sites=[f"{b.where}: {b.reason}" for b in breaks])

    def _numerics(self, watch: Any, step: int) -> None:
        from accelport.diagnose.numerics import CHECK_EVERY_LAZY, PRECISION_EVERY, PRECISION_STALLED

        found = watch.nonfinite
        if found is not None and "non-finite" not in self._reported:
            fixes = {
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
            }
            overflow = ("a learning rate too high (lower it or warm it up), gradient clipping with "
                        "torch.nn.utils.clip_grad_norm_ (without a Python branch on the norm, which "
                        "recompiles on XLA), the loss computed in fp32.")
            fixes["gradients"] = f"The inputs were finite, so the loss or a gradient overflowed: {overflow}"
            # The inputs were not looked at (neither ap.loader nor a DataLoader brought them):
            # they come first, as likely as the loss and far cheaper to rule out.
            fixes["unknown"] = ("Check the inputs first: torch.isfinite(x).all() on each batch (or iterate them "
                                f"with ap.loader, which checks them); if they are finite, {overflow}")
            fixes["update"] = ("The update overflowed the weight's dtype: lower the learning rate, keep the weights "
                               "in fp32 (ap.autocast for the forward pass), and clip gradients with "
                               "torch.nn.utils.clip_grad_norm_.")
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
                "non-finite",
                f"the {found.found_in} became NaN or Inf {when}: {source} ({found.detail}). Every step "
                f"after it trains on NaN. {fixes[found.source]}",
                found.step, first_step=found.step if found.finite_at is None else None, source=found.source,
                names=list(found.names), finite_at_step=found.finite_at, found_by_step=found.step,
            )
        stalled = watch.stalled
        if stalled is not None and "precision" not in self._reported:
            listed = ", ".join(f"{share:.0%} of {name} ({dtype})" for name, dtype, share in stalled.params[:5])
            more = f" and {len(stalled.params) - 5} more" if len(stalled.params) > 5 else ""
            self.report(
                "precision",
                f"updates of low-precision parameters round away: of the elements whose gradient was non-zero, "
                f"{listed}{more} did not change over a step, in two samples {PRECISION_EVERY} steps apart "
                f"({PRECISION_STALLED:.0%} or more counts), so training stalls: each update is smaller than "
                "half the gap between neighbouring values (in bf16, 4096 + 1 = 4096). Keep the weights in fp32 and "
                "run the forward "
                "pass under ap.autocast(torch.bfloat16); or use stochastic rounding "
                "(NEURON_RT_STOCHASTIC_ROUNDING_EN=1 on Neuron), or an optimizer that compensates the rounding "
                "(Kahan summation).",
                stalled.step, params=[name for name, _, _ in stalled.params],
                unchanged_share={name: round(share, 3) for name, _, share in stalled.params},
            )

    # -- outside the steps ---------------------------------------------------------------------------
    def graph_ran(self, nodes: int, where: str = "ap.sync()") -> None:
        """A lazy backend ran a graph outside a training step (at ``ap.sync()``, or found at the end of the run).

        Compared with the usual graph of the steps and syncs before it; with none to
        compare with, flagged past GRAPH_GROWTH_FIRST nodes.
        """
        usual = statistics.median(self._graph_sizes) if self._graph_sizes else None
        self._graph_sizes.append(nodes)
        if "graph-growth" in self._reported:
            return
        if usual is None:
            too_big = nodes >= GRAPH_GROWTH_FIRST
        else:
            too_big = nodes >= GRAPH_GROWTH_ABSOLUTE or (
                nodes >= GRAPH_GROWTH_FACTOR * usual and nodes - usual >= GRAPH_GROWTH_MIN_EXTRA)
        if not too_big:
            return
        usual_text = f" (a step's graph is usually {int(usual)})" if usual else ""
        self.report(
            "graph-growth",
            f"a graph of {int(nodes)} nodes ran at {where}{usual_text} with no training step since the previous "
            "sync: a loop ran many iterations without a sync (a hand-written accumulation or evaluation loop), "
            "so they compile and run as one huge graph (slow to compile, memory hungry). Call ap.sync() once per "
            "iteration of that loop, or iterate it with ap.loader, which syncs once per batch.",
            self._step,
            graph_nodes=int(nodes),
            usual_graph_nodes=int(usual) if usual else None,
            where=where,
        )

    def settle(self) -> None:
        """The checks that need no new step: what the live objects found after the last record."""
        if self._last_record is None:
            return
        runtime = self._runtime
        watch = runtime.tracker.numerics if runtime is not None else None
        if watch is not None:
            self._numerics(watch, self._step)
        if "compile-limit" not in self._reported and self._observer.limit_hit_count(self._mark):
            self._compile_limit(self._last_record)

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
        stall = "stops the device and cuts the graph" if record.lazy else \
            "makes the host wait there until the device has run everything queued before it"
        self.report(
            "host-sync",
            f"{per_step:.1f} device-to-host transfers per step in {syncing} of the last {covered} "
            "steps: something reads device values inside the step (.item(), print(tensor), .tolist(), "
            f"if tensor:), which {stall}. Log with "
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
