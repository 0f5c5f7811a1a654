"""What a diagnosis rule is, and what it sees: the API a rule's author writes against.

A rule is a class: its kind, its thresholds, its fix text and its severity together, in
one small module. A plugin registers it through ``accelport_register_rules`` (the
built-in kinds are registered exactly so, see :mod:`accelport.diagnose.rules`), and the
engine (:class:`accelport.diagnose.engine.Diagnostics`) runs one instance of it per run:

    import accelport as ap

    class SlowStepRule(ap.Rule):
        kind = "slow-step"
        LIMIT = 2.0  # seconds

        def step(self, record):
            if record.step > 1 and record.seconds > self.LIMIT:
                self.report(f"step {record.step} took {record.seconds:.1f} s: ... Fix: ...",
                            record.step, seconds=round(record.seconds, 3))

    @ap.hookimpl
    def accelport_register_rules(register):
        register(SlowStepRule)

A rule meets the run only through what it is handed: the step records
(:class:`accelport.contract.StepRecord`) and a read-only :class:`RunView` (the backend,
its family, the world size, the environment, what the run's sensors found). It never
imports the runtime, and never looks at another plugin.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from accelport.errors import DiagnosticWarning

if TYPE_CHECKING:
    from accelport.contract import StepRecord
    from accelport.diagnose.buckets import Suggestion
    from accelport.observe.dynamo import CompileEvents
    from accelport.observe.memory import MemoryWatch
    from accelport.observe.nan_search import NanSearch
    from accelport.observe.numerics import NumericsWatch
    from accelport.observe.shapes import ShapeTrace

__all__ = ["Diagnosis", "Rule", "RunView", "RankRun", "JobView", "JobRule", "BatchShapes", "SEVERITIES",
           "KIND_PATTERN", "describe_shape_change"]

#: "warning": the run is slower than it needs to be. "problem": it is wrong or crippled
#: (NaN weights, weights that stopped moving, a function silently run uncompiled).
SEVERITIES = ("warning", "problem")
#: How a kind is spelled: lower-case words joined by '-' (``graph-break``), as the docs,
#: the JSON and ``ACCELPORT_DISABLED_PLUGINS`` spell them.
KIND_PATTERN = re.compile(r"^[a-z][a-z0-9]*(?:-[a-z0-9]+)*$")


@dataclass(frozen=True)
class Diagnosis:
    """One finding: what was seen and why (``message``), what to change (``fix``), and the numbers.

    ``step`` and ``evidence`` are the moment the finding was made; ``totals`` are its kind's
    numbers over the whole run so far (compilations, time spent compiling and its share, host
    reads per step ...), as of when the finding was read.
    """

    kind: str
    message: str
    step: int
    evidence: Mapping[str, Any] = field(default_factory=dict)
    #: "problem" (the run is wrong or crippled) or "warning" (slower than it needs to be).
    severity: str = "warning"
    #: What to change, in the script's own terms (empty where the message says it).
    fix: str = ""
    totals: Mapping[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        """The message and the fix, as a warning says them."""
        return f"{self.message} {self.fix}" if self.fix else self.message

    @property
    def totals_text(self) -> str:
        """The run totals in one line: 'compilations 26, compile seconds 147.1, compile share 86%'."""
        parts = []
        for key, value in dict(self.totals).items():
            if value is None or value == {} or value == []:
                continue
            name = key.replace("_", " ")
            if key.endswith("_share") and isinstance(value, (int, float)):
                parts.append(f"{name} {value:.0%}")
            elif isinstance(value, dict):
                parts.append(f"{name} " + ", ".join(f"{k} {v}" for k, v in value.items()))
            else:
                parts.append(f"{name} {value}")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "fix": self.fix, "step": self.step,
                "evidence": dict(self.evidence), "totals": dict(self.totals), "severity": self.severity}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Diagnosis:
        """A finding as :meth:`to_dict` wrote it (a rank's, a job's ``--output``); a field of the wrong type reads
        as empty. ``data["kind"]`` must be there."""
        evidence, totals, step = data.get("evidence"), data.get("totals"), data.get("step")
        return cls(kind=str(data["kind"]), message=str(data.get("message") or ""),
                   step=step if isinstance(step, int) and not isinstance(step, bool) else 0,
                   evidence=evidence if isinstance(evidence, Mapping) else {},
                   severity=str(data.get("severity") or "warning"), fix=str(data.get("fix") or ""),
                   totals=totals if isinstance(totals, Mapping) else {})


def describe_shape_change(before: Sequence[Any] | None, after: Sequence[Any] | None) -> str | None:
    """'input 0 changed from (8, 128) to (8, 131) along dim 1 (a sequence or image dimension)' for the first
    input whose shape differs; the batch dimension (dim 0) is named as such."""
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
            return f"input {i} changed from {tuple(sa)} to {tuple(sb)}{_dimension(tuple(sa), tuple(sb))}"
        return f"input {i} changed dtype from {da} to {db}"
    if len(before) != len(after):
        return f"the batch changed from {len(before)} to {len(after)} tensors"
    return None


def _dimension(before: tuple[Any, ...], after: tuple[Any, ...]) -> str:
    """Which dimension changed: ' along the batch dimension (dim 0)', ' along dim 1 (...)', or ''."""
    if len(before) != len(after):
        return f" (from {len(before)} to {len(after)} dimensions)"
    changed = [d for d, (x, y) in enumerate(zip(before, after, strict=True)) if x != y]
    if changed == [0]:
        return " along the batch dimension (dim 0)"
    if changed and 0 not in changed:
        dims = ", ".join(map(str, changed))
        return f" along dim {dims} (a sequence or image dimension)" if len(changed) == 1 else \
            f" along dims {dims}"
    return f" along dims {', '.join(map(str, changed))}" if changed else ""


class BatchShapes:
    """The batch shapes of a run so far, kept once for every rule (updated before the rules see a record).

    ``ap.loader`` hands equal signatures as one object while shapes repeat, so a step with
    the shapes of the step before costs one identity test here.
    """

    def __init__(self) -> None:
        #: Every distinct batch signature seen.
        self.distinct: set[Any] = set()
        #: The signature of the record being judged, and of the one before it.
        self.current: Any = None
        self.previous: Any = None
        #: Whether the record being judged brought a signature not seen before.
        self.new = False
        self._counts: Counter[Any] = Counter()  # steps per signature, but for...
        self._run = 0  # ...the steps of the current run of equal signatures

    def update(self, signature: Any) -> None:
        if signature is self.current:
            self._run += 1  # counted into _counts when the shape changes
            self.previous = signature
            self.new = False
            return
        self._count()
        self._run = 1
        self.previous, self.current = self.current, signature
        self.new = signature is not None and signature not in self.distinct
        if self.new:
            self.distinct.add(signature)

    def _count(self) -> None:
        if self._run and self.current is not None:
            self._counts[self.current] += self._run
        self._run = 0

    def change(self) -> str | None:
        """What changed from the previous record's batch to this one's ('input 0 changed from ... to ...')."""
        return describe_shape_change(self.previous, self.current)

    def counts(self) -> Mapping[Any, int]:
        """Steps per distinct signature so far."""
        self._count()
        return self._counts

    def suggestion(self) -> Suggestion | None:
        """Buckets for the length that varies across the batches seen (None if none varies)."""
        from accelport.diagnose.buckets import suggest
        from accelport.diagnose.compiled import signature_lengths

        _, lengths = signature_lengths(self.counts())
        return suggest(lengths) if len(lengths) > 1 else None


def _never(kind: str) -> bool:
    return False


@dataclass(frozen=True)
class RankRun:
    """One rank's run of a job, as the job's rules see it (what each rank hands rank 0 at its end).

    ``per_step`` is the seconds per step by time category after the first step (which holds the start-up
    and the first compilations), as that rank measured it; ``findings`` its own findings, as dicts.
    """

    rank: int
    host: str
    pid: int
    steps: int
    exit_status: int
    per_step: Mapping[str, float] = field(default_factory=dict)
    #: Seconds per step (after the first) inside backward passes, whichever category holds them: where a
    #: data-parallel rank waits for the others (DDP's gradient all-reduce, FSDP's reduce-scatters).
    backward: float = 0.0
    findings: Sequence[Mapping[str, Any]] = ()
    compilations: int = 0
    peak_memory_bytes: int | None = None
    backend: str | None = None
    #: How the script trains (``RunView.style``): the job's fixes are said in its terms.
    style: str = "torch"
    #: The kinds its rules could not judge, and why ("needs 30 steps"): a job is "ok" only where none is left.
    not_judged: Mapping[str, str] = field(default_factory=dict)
    #: Its backend runs each step as a compiled graph (torch_xla): the step's collectives run inside it.
    lazy: bool = False

    @property
    def step_seconds(self) -> float:
        return sum(v for v in self.per_step.values() if v > 0)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankRun:
        """A rank's summary as it travelled (JSON); ValueError where it is not one."""
        try:
            return cls(rank=int(data["rank"]), host=str(data["host"]), pid=int(data["pid"]),
                       steps=int(data["steps"]), exit_status=int(data["exit_status"]),
                       per_step={str(k): float(v) for k, v in dict(data.get("per_step") or {}).items()},
                       backward=float(data.get("backward") or 0.0),
                       findings=[dict(f) for f in data.get("findings") or ()],
                       compilations=int(data.get("compilations") or 0),
                       peak_memory_bytes=(int(data["peak_memory_bytes"]) if data.get("peak_memory_bytes") is not None
                                          else None),
                       backend=data.get("backend"), style=str(data.get("style") or "torch"),
                       not_judged={str(k): str(v) for k, v in dict(data.get("not_judged") or {}).items()},
                       lazy=bool(data.get("lazy")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a rank's summary: {exc}") from None


@dataclass(frozen=True)
class JobView:
    """What a job rule sees: every rank's run that reached rank 0, and the ranks that did not."""

    world_size: int
    runs: Sequence[RankRun]
    missing: Sequence[int] = ()
    #: What the ranks whose summaries never came last said of their progress (``steps``, ``in_backward``):
    #: where a rank that hangs stands.
    progress: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)

    @property
    def meeting(self) -> str:
        """Where the ranks meet each step: ``collective`` where the ranks' collectives were timed (a ported
        loop, accelport's own, the script's torch.distributed calls), ``device`` on a lazy backend (the
        collectives run inside the step's compiled graph: a rank waits for the others where its host waits
        for its device, in the sync or a host read), else ``backward`` (DDP's gradient all-reduce runs inside
        the backward pass, which one process alone cannot tell from its own compute)."""
        for run in self.runs:
            total = run.step_seconds
            if total > 0 and run.per_step.get("collective", 0.0) > 0.05 * total:
                return "collective"
        return "device" if any(run.lazy for run in self.runs) else "backward"

    def waits(self) -> dict[int, float]:
        """rank -> seconds per step it waits for the others: its time where the ranks meet beyond that of the rank
        that spends least there (the last to arrive waits for no one; the ranks run the same program)."""
        where = self.meeting

        def met(run: RankRun) -> float:
            if where == "device":
                return sum(v for c, v in run.per_step.items() if _WAITS_FOR_DEVICE & set(c.split("+")))
            return run.per_step.get("collective", 0.0) if where == "collective" else run.backward

        # Only ranks with timed steps: one that took none (failed at once) waited nowhere, and would make all
        # of the others' backward look like waiting.
        timed = [run for run in self.runs if run.steps > 1 and run.step_seconds > 0]
        if len(timed) < 2:
            return {run.rank: 0.0 for run in self.runs}
        least = min(met(run) for run in timed)
        return {run.rank: max(met(run) - least, 0.0) if run in timed else 0.0 for run in self.runs}

    def breakdown(self) -> dict[int, dict[str, float]]:
        """rank -> its seconds per step by category, with the time it waited for the others charged to
        ``collective`` instead of the category its backward pass was charged to."""
        if len(self.runs) < 2:
            return {run.rank: dict(run.per_step) for run in self.runs}
        waited = self.waits()
        out: dict[int, dict[str, float]] = {}
        where = self.meeting
        for run in self.runs:
            parts = dict(run.per_step)
            wait = waited[run.rank]
            holder = _holder(parts, wait) if where == "backward" and wait > 0 else None
            if holder is not None:
                parts[holder] -= wait
                parts["collective"] = parts.get("collective", 0.0) + wait
            elif where == "device" and wait > 0:
                # Out of the categories where the host waits for the device, the largest first.
                left = wait
                for c in sorted((c for c in parts if _WAITS_FOR_DEVICE & set(c.split("+"))), key=lambda c: -parts[c]):
                    taken = min(parts[c], left)
                    parts[c] -= taken
                    left -= taken
                parts["collective"] = parts.get("collective", 0.0) + wait - left
            out[run.rank] = {k: v for k, v in parts.items() if v > 0}
        return out


#: Where a lazy backend's host waits for its device: the sync that runs the step's graph, and host reads.
_WAITS_FOR_DEVICE = frozenset({"device", "host_sync"})


def _holder(parts: Mapping[str, float], seconds: float) -> str | None:
    """The category a backward pass's time was charged to on a rank: the largest with the device in it."""
    held = [c for c, v in parts.items() if "device" in c.split("+") and v >= seconds * 0.999]
    if not held:
        held = [c for c, v in parts.items() if v >= seconds * 0.999]
    return max(held, key=lambda c: parts[c]) if held else None


class JobRule:
    """A rule over a whole job's ranks (a straggler, ranks doing different work): one judgement at the job's end.

    ``judge`` returns the finding, with ``evidence["rank"]`` the rank it is about, or None.
    """

    kind: ClassVar[str] = ""

    def judge(self, job: JobView) -> Diagnosis | None:
        raise NotImplementedError


@dataclass(frozen=True)
class RunView:
    """What a rule may read of the run besides its step records. Read-only; one per run.

    The runtime (``ap.*``) and ``accelport diagnose`` fill in what they know; a replay of a
    metrics file (``accelport report``) knows only the records, so every live sensor is None.
    """

    #: The backend whose counters the records carry ("?" where unknown, e.g. a replay).
    backend: str = "?"
    #: True for the lazy (XLA graph) family, False for eager devices.
    lazy: bool = False
    #: The environment the run reads (ACCELPORT_* settings; never printed whole).
    environ: Mapping[str, str] = field(default_factory=dict)
    #: The torch.device type of the run ("cpu", "cuda", "xla", ...), None where unknown.
    device_type: str | None = None
    world_size: int = 1
    #: Whether the backend's compiler accepts ``dynamic=True`` (None: not known).
    compile_dynamic: bool | None = None
    #: How the script trains, so a fix is spelled in its own terms (see accelport.diagnose.advice):
    #: "accelport" (a ported loop), "torch", "torch_xla", "transformers" or "lightning".
    style: str = "accelport"
    #: The step checks (non-finite gradients and their source, low-precision updates that round
    #: away): read ``numerics.nonfinite`` and ``numerics.stalled``. Present where a registered rule
    #: ``needs`` "numerics" and the run is live.
    numerics: NumericsWatch | None = None
    #: Where a tensor made inside the step changes shape (``shape_trace.found``), on lazy backends for a rule
    #: whose ``needs`` has "shapes": recorded for a few steps once a step compiled on a batch shape seen before.
    shape_trace: ShapeTrace | None = None
    #: torch.compile's records since the run started (live runs on a process with dynamo).
    compile_events: CompileEvents | None = None
    #: Every counter of the backend since the run started (``ap.metrics()``'s fields), live runs only.
    counters: Callable[[], Mapping[str, Any]] | None = None
    #: The batch shapes so far (kept by the engine, updated before each record is judged).
    shapes: BatchShapes = field(default_factory=BatchShapes)
    #: Whether a finding of a kind was already made in this run.
    found: Callable[[str], bool] = _never
    #: The search for the operation that made the first NaN or Inf (``accelport diagnose --find-nan``,
    #: ``ACCELPORT_FIND_NAN``): read ``nan_search.found``. Present where a registered rule ``needs``
    #: "nan-search" and the run asked for the search.
    nan_search: NanSearch | None = None
    #: How ``accelport diagnose`` ran the script: the arguments after ``accelport diagnose`` (``("--",
    #: "train.py", "--epochs", "1")``, ``("-m", "pkg.train")``); None for a ported script.
    command: tuple[str, ...] | None = None
    #: The run's memory (:class:`~accelport.observe.memory.MemoryWatch`): the static part as last counted
    #: (``budget``), the last reading, the out-of-memory error a step raised (``oom``), and what keeps
    #: autograd graphs (``look_for_kept_graphs()``, then ``kept``). Present in live runs (``ap.metrics()``
    #: reads it too); the script's own out-of-memory errors are watched where a rule ``needs`` "memory".
    memory: MemoryWatch | None = None


class Rule:
    """One kind of finding. Subclass it, set :attr:`kind`, override the signals it reads.

    One instance judges one run (a new instance when the step numbers start again). The
    engine reports each kind once: the first :meth:`report` makes the finding (a warning of
    :attr:`warning`'s category, an entry of ``ap.diagnostics()``, the metrics file, the JSON
    and the report page); later calls are ignored, so a rule may keep counting after it.
    A rule that raises (``sys.exit`` and any other BaseException too) or does not return within
    ``ACCELPORT_PLUGIN_TIMEOUT`` seconds is disabled for the rest of the run with a PluginWarning
    naming its plugin. What it reports is redacted, escaped and cut to a readable length as it is made.
    """

    #: The kind's name: lower-case words joined by '-' (see KIND_PATTERN), unique among the rules.
    kind: ClassVar[str]
    #: "warning" or "problem" (see SEVERITIES); override :meth:`severity_of` where evidence decides.
    severity: ClassVar[str] = "warning"
    #: The warning category a finding is given as (a subclass of DiagnosticWarning).
    warning: ClassVar[type[DiagnosticWarning]] = DiagnosticWarning
    #: The live sensors the rule reads through the view: "numerics" (the step checks), "nan-search" (the
    #: op that made the first NaN, built only where the run asks for it), "memory" (the run's memory).
    needs: ClassVar[frozenset[str]] = frozenset()
    #: The first step at which the rule can have judged anything (a verdict of "no finding"
    #: before it would be a guess; see :meth:`unjudged`).
    judges_from: ClassVar[int] = 1

    def __init__(self, run: RunView, report: Callable[[Rule, str, int, str, dict[str, Any]], None]) -> None:
        self.run = run
        self._report = report
        self.start()

    @classmethod
    def severity_of(cls, evidence: Mapping[str, Any]) -> str:
        """This kind's severity for a finding with ``evidence`` (default: :attr:`severity`)."""
        return cls.severity

    @property
    def reported(self) -> bool:
        """Whether this kind was already found in this run."""
        return self.run.found(self.kind)

    def report(self, message: str, step: int, *, fix: str = "", **evidence: Any) -> None:
        """Make the finding: ``message`` says what was seen and its cause, ``fix`` what to change (in the
        script's own terms: see ``run.style``), ``evidence`` the numbers of this moment."""
        self._report(self, message, step, fix, evidence)

    def unjudged(self, steps: int) -> str | None:
        """Why this rule has not judged a run of ``steps`` steps ("needs 10 steps"), or None when it has (or
        when it does not apply to this run: host reads on cpu, XLA graphs on an eager device)."""
        return None if steps >= self.judges_from else f"needs {self.judges_from} steps"

    def totals(self) -> Mapping[str, Any]:
        """This kind's numbers over the whole run so far, shown beside the finding (read when it is shown).

        A rule keeps counting after its finding for this; nothing by default.
        """
        return {}

    def current_fix(self) -> str | None:
        """The fix as the whole run so far would have it (buckets from every length seen), or None to keep
        the one given when the finding was made."""
        return None

    # -- the signals; override the ones the rule reads ---------------------------------------
    def start(self) -> None:
        """The run starts (before its first record): set up the rule's state here."""

    def step(self, record: StepRecord) -> None:
        """Judge one step record. Called for every step, in order: keep it cheap."""

    def graph_ran(self, nodes: int, where: str) -> None:
        """A lazy backend ran a graph of ``nodes`` nodes outside a training step (at ``where``)."""

    def settle(self) -> None:
        """Every step so far was handed over (the end of a loop, ``ap.diagnostics()``, the end of the run):
        judge what a live sensor found since the last record."""
