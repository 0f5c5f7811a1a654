"""Step tracking: steps, data wait and batch shapes, one StepRecord per step for the rules and the observers."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from accelport.contract import TIME_PHASES, Backend, StepRecord
from accelport.observe.steptime import MIN_SECONDS, StepClock, add_into, carve_compile, categories, watch_backward

if TYPE_CHECKING:
    from collections.abc import Mapping

    from accelport.diagnose.engine import Diagnostics
    from accelport.diagnose.rule import Diagnosis
    from accelport.observe.flops import FlopWatch
    from accelport.observe.memory import MemoryWatch
    from accelport.observe.nan_search import NanSearch
    from accelport.observe.numerics import NumericsWatch
    from accelport.observe.profile import StepProfile
    from accelport.observe.shapes import ShapeTrace
    from accelport.plugins.host import PluginHost

__all__ = ["StepTracker"]

_ANY = object()  # (no batch signature is this one)


class StepTracker:
    """Counts steps, data wait and batch signatures; hands a StepRecord per step to the rules and the observers.

    Reading the backend's counters costs more than everything else per step (a
    lookup in the runtime's tables, cold in the middle of a training step), so
    they are read after every step only while something may be happening: the
    first :attr:`CLOSE_STEPS` steps of a run and the :attr:`CLOSE_STEPS` steps
    after the counters last moved (a compilation, a host read). In quiet
    stretches they are read once per :attr:`QUIET_EVERY` steps: the steps in
    between are kept as plain tuples and handed over together; the change found
    is counted on the last of them, with ``counted_steps`` saying how many steps
    it covers. Records still reach the rules and the observers one per step and in order.

    It is bound to a run (:meth:`bind`) when the backend is selected: the backend whose
    counters it reads, the plugin host whose ``accelport_step_end`` observers get each
    record, the rules' engine (None: diagnosis off) and the step checks the rules asked
    for (:class:`~accelport.observe.numerics.NumericsWatch`, handed each step's optimizer).
    Each record goes to the engine first and then to the observers, with the findings
    made on it; on lazy backends it also looks at the graph an ``ap.sync()`` ran outside
    the steps (a loop that grew one huge graph).

    Where each step's time goes is measured always, rules or not: :attr:`clock` (a
    :class:`~accelport.observe.steptime.StepClock`) charges the loop's time to its phases as
    it passes, and each step's phases become its ``breakdown`` when its counters are read (the
    compile time is carved out then). :attr:`time_total` sums them over the run; a
    :attr:`profile` (``ap.profile``, ``ACCELPORT_PROFILE``) is started and stopped at step ends.
    """

    QUIET_EVERY = 16
    CLOSE_STEPS = 40

    def __init__(self) -> None:
        self.steps = 0
        self.data_wait = 0.0
        self.step_seconds = 0.0
        #: Distinct batch signatures of the training steps (an evaluation's batches are no step's). Within an
        #: ap.loader loop, a batch with the shapes of the previous one carries the very same signature object
        #: (observers compare by identity).
        self.signatures: set[tuple[Any, ...]] = set()
        self._arrived: set[Any] = set()  # every batch signature that arrived, steps' or not
        self._step_signature: Any = None
        # Steps per batch signature (None: steps without one), but for the run of steps of the current
        # one, counted in _run_steps (a dict update per change of signature, not per step).
        self._signature_steps: dict[Any, int] = {}
        self._run_steps = 0
        self._pending_wait = 0.0
        self._last_signature: tuple[Any, ...] | None = None
        self._last_end: float | None = None
        #: What the loader said about itself: num_workers, batch_size, type (see describe_loader).
        self.loader_info: dict[str, Any] = {}
        # Finished steps whose counters are not read yet: (step, seconds, wait, signature, time, phases).
        self._pending: list[tuple[int, float, float, Any, float, dict[str, float]]] = []
        self._every = 1
        self._close_until = self.CLOSE_STEPS
        self._open: int | None = None  # a step waiting for the loop's sync
        self._backend: Backend | None = None
        self._host: PluginHost | None = None
        self._engine: Diagnostics | None = None
        self._recording = False  # some rule or observer reads the records
        self._unsaid: list[Diagnosis] = []  # findings made outside a record: they go with the next one
        # Wall-clock time of a perf_counter reading, without a second clock call per step.
        self._wall_offset = time.time() - time.perf_counter()
        #: The step checks the rules asked for (None: none did, or no run is bound yet).
        self.numerics: NumericsWatch | None = None
        self._shapes: ShapeTrace | None = None
        self._fresh = False  # a batch of a shape not seen before arrived since the counters were last read
        #: Counts a step's FLOPs once per batch signature (None: not bound to a run).
        self.flops: FlopWatch | None = None
        # The signature whose steps the FLOP watch need not be told of (it said so): most steps of a run.
        self._flops_quiet: Any = _ANY
        #: The search for the op that made the first NaN (``--find-nan``; None: not asked for), shown each batch.
        self.nan_search: NanSearch | None = None
        #: The run's memory (read with the counters, the static part counted at sampled steps).
        self.memory: MemoryWatch | None = None
        self._unbound_batch: Any = None  # the host batch that came before the run was bound (the first step's)
        self._failed = False  # a step raised out of memory: no tensor of it is touched again
        #: Where the loop's time goes, as it passes (see accelport.observe.steptime).
        self.clock = StepClock()
        self._phases: Mapping[str, str] = TIME_PHASES
        #: Seconds per time category over the steps whose breakdown is final, and how many they are.
        self.time_total: dict[str, float] = {}
        self.time_steps = 0
        #: The first step's breakdown (start-up and the first compilation), left out of the verdict.
        self.first_breakdown: dict[str, float] = {}
        #: Seconds inside backward passes by the end of the first step (the clock's ``backward`` counts on).
        self.first_backward = 0.0
        #: A window of steps to profile (ap.profile, ACCELPORT_PROFILE), None if none.
        self.profile: StepProfile | None = None
        # What the counters moved by outside the steps (a graph ap.sync() or an evaluation ran), read there:
        # it goes with the next record, so the records count every compilation and host read once.
        self._carried: dict[str, float] = {}

    def bind(self, backend: Backend, host: PluginHost, engine: Diagnostics | None,
             numerics: NumericsWatch | None, shapes: ShapeTrace | None = None,
             memory: MemoryWatch | None = None) -> None:
        """Record the steps of a run on ``backend`` (the runtime calls this when it selects one)."""
        self._backend, self._host, self._engine, self.numerics = backend, host, engine, numerics
        self._shapes = shapes
        self.memory = memory
        self._flops_quiet = _ANY  # (a FLOP watch of this run's, which was told nothing yet)
        batch, self._unbound_batch = self._unbound_batch, None
        if numerics is not None and batch is not None:  # the checks start with the step whose batch came first
            if not numerics.deferred:
                numerics.batch(batch)
            elif (found := numerics.inspect(batch, None)) is not None:
                numerics.batch(found.info)
        self._recording = engine is not None or host.has_step_observers
        phases = self._phases = backend.time_phases()
        backend.time_with(self.clock)
        # Where the backend tells the body from the tail and a step's start, the end of a backward parts them;
        # everywhere a backward says its batch was a training one (a gradient accumulation's first micro-batches
        # are no work between steps, though no optimizer step followed them).
        self.clock.phased = len({phases.get("pre"), phases.get("body"), phases.get("tail")}) > 1
        watch_backward(self.clock)
        if self.profile is not None:
            self.profile.arm(backend, self.steps)

    def profile_steps(self, profile: StepProfile) -> None:
        """Profile ``profile``'s window of this run's steps (armed now if the run is bound)."""
        self.profile = profile
        if self._backend is not None:
            profile.arm(self._backend, self.steps)

    def inspector(self) -> NumericsWatch | None:
        """What looks at each host batch in ``ap.loader``'s reading thread (its ``inspect``, or ``inspect_many``
        for batches read together; None: nothing)."""
        watch = self.numerics
        # Where the host is the device the batch itself goes with the step (batch_arrived):
        # it is looked at only if the step's gradients turn out non-finite.
        return watch if watch is not None and watch.deferred else None

    def batch_arrived(self, wait: float, sig: Any, batch: Any = None, *, blocked: float | None = None,
                      transfer: float = 0.0) -> None:
        """The loop got a batch after ``wait`` seconds of waiting for data; ``batch`` itself where the host is the
        device. ``blocked``: all the loop waited (default ``wait``), of which ``transfer`` for the backend's copies."""
        search = self.nan_search
        if search is not None:  # (what the loader's thread found in a host batch, else the batch)
            search.batch(sig.info if type(sig) is not tuple else batch)
        watch = self.numerics
        if watch is not None:
            if type(sig) is not tuple:  # what the loader's thread found in the host batch (Inspected)
                watch.batch(sig.info)
                sig = sig.signature
            elif batch is not None and not watch.deferred:
                watch.batch(batch)
        elif self._backend is None:  # the backend (and its checks) is chosen at the end of the first step
            self._unbound_batch = batch
        now = time.perf_counter()
        if blocked is None:
            blocked = wait
        if self.clock.arrived(now, blocked, wait, transfer):
            # The batches that came before this one were no step's (an evaluation's): their wait is not the
            # training loop's wait for data (it is in the step's between_steps).
            self.data_wait -= self._pending_wait
            self._pending_wait = 0.0
        if self._last_end is None:  # the first step starts when the loop first asks for data
            self._last_end = now - blocked
        self.data_wait += wait
        self._pending_wait += wait
        if sig is not self._last_signature:  # ap.loader hands equal signatures as one object
            if sig not in self._arrived:
                self._fresh = True
                self._arrived.add(sig)
            self._last_signature = sig
        # (--find-nan's checked steps run under a dispatch mode of their own: no count beside it, whose mode
        # would be left under the search's on the stack)
        if sig is not self._flops_quiet and self.flops is not None and self.nan_search is None:
            self._flops_quiet = sig if self.flops.batch(sig, batch) else _ANY

    def optimizer_started(self) -> None:
        """The optimizer step starts (its time is the body's, as the forward and backward are)."""
        watch = self.numerics
        if watch is not None:
            watch.started += 1
        self.clock.body()

    def step_end(self, optimizer: Any = None) -> None:
        """An optimizer step ended (``optimizer``: the one stepped, for the step checks)."""
        if self._open is not None:
            self.synced()  # a second step in the same batch (two optimizers): the first one ends here
        self.steps += 1
        watch = self.numerics
        if optimizer is not None and watch is not None:
            watch.step_end(self.steps, optimizer)
        if self._shapes is not None:
            self._shapes.step_end()
        signature = self._last_signature
        if signature is not self._flops_quiet and self.flops is not None and self.nan_search is None:
            self._flops_quiet = signature if self.flops.step_end(signature) else _ANY
        memory = self.memory
        if memory is not None:
            memory.step_end(self.steps, optimizer)
        backend = self._backend
        if backend is not None and backend.step_deferred():
            # Its graph runs when the loop asks for the next batch: finish the record then
            # (synced()), so the step's time and counters hold its own compile and run.
            self._open = self.steps
            return
        self._finish(self.steps)

    def synced(self) -> None:
        """The loop's sync ran: finish the step that waited for it."""
        if self._open is not None:
            step, self._open = self._open, None
            self._finish(step)

    def _finish(self, step: int) -> None:
        now = time.perf_counter()
        parts = self.clock.close(now)
        if step == 1:
            self.first_backward = self.clock.backward
        # (The first step of a loop without batches started at its first backward: the clock knows when.)
        seconds = now - self._last_end if self._last_end is not None else sum(parts.values())
        self.step_seconds += seconds
        self._last_end = now
        wait, self._pending_wait = self._pending_wait, 0.0
        signature = self._last_signature
        if signature is not self._step_signature:
            self._count_run()
            self._step_signature = signature
            if signature is not None:
                self.signatures.add(signature)
        self._run_steps += 1
        pending = self._pending
        pending.append((step, seconds, wait, signature, now + self._wall_offset, parts))
        profile = self.profile
        if profile is not None and step >= profile.next_step:
            state = profile.state
            profile.step_ended(step)
            if profile.state != state:
                if profile.state == "stopped" or len(pending) >= self._every:
                    self._hand_over()  # (the window's last step: its record carries the profile)
                # Starting or stopping the profiler (writing its trace) is accelport's time, not the run's:
                # the next step starts after it.
                self._last_end = time.perf_counter()
                self.clock.skip(self._last_end)
                return
        if len(pending) >= self._every:
            self._hand_over()

    def flush(self, *, pass_ended: bool = True, interrupted: bool = False) -> None:
        """Hand every finished step over, and settle what is still open.

        The end of an ``ap.loader`` loop (``pass_ended``: what runs until its next batch is work between
        the training steps), ``ap.diagnostics()``, a change of backend and the end of the process call it:
        the step checks read what they keep (at a pass's end on a lazy backend, at most once per
        ``PASS_END_READ_SECONDS``: there a read is a sync of its own), a graph run outside the steps is looked at,
        and the rules see what was found since the last step. ``interrupted``: a step may have been left midway (an
        error, a loop left early); then, on a lazy backend whose graphs other processes join, nothing runs the
        device's pending work (the checks' read, a sync there): that graph may hold a collective the others never
        join, a hang in place of the error. The read waits for a later flush.
        """
        self._hand_over()
        if self.flops is not None:
            self.flops.pause()
            self._flops_quiet = _ANY
        if pass_ended:
            self.clock.pass_ended()
        backend = self._backend
        if backend is None or not self._recording:
            return
        if self._shapes is not None:
            self._shapes.pause()
        watch = self.numerics
        if watch is not None and watch.deferred and not self._failed and \
                (not pass_ended or watch.read_at_pass_end()) and not (interrupted and self._lazy_replicas()):
            watch.read()
            for _ in range(3):  # (the reads run at a sync; a bad newest gradient asks for the others: a second read)
                if not (watch.pending and backend.lazy):
                    break
                backend.sync()  # runs the reads (step closures); nothing of the loop's is pending here
        self._outside_steps("a point outside the training steps")
        if self._engine is not None:
            self._unsaid += self._engine.settle()

    def steps_by_signature(self) -> dict[Any, int]:
        """The finished steps per batch signature (equal signatures as one; None: steps without one)."""
        out = dict(self._signature_steps)
        run, signature = self._run_steps, self._step_signature  # (read, not folded in: the loop may be stepping)
        if run:
            out[signature] = out.get(signature, 0) + run
        return out

    def _count_run(self) -> None:
        if self._run_steps:
            steps = self._signature_steps
            steps[self._step_signature] = steps.get(self._step_signature, 0) + self._run_steps
            self._run_steps = 0

    def user_synced(self) -> None:
        """``ap.sync()`` ran: on a lazy backend, look at the graph it executed."""
        backend = self._backend
        if backend is None or not backend.lazy or not self._recording:
            return
        self._hand_over()
        self._outside_steps("ap.sync()")

    def _outside_steps(self, where: str) -> None:
        # Counters are read for the steps first (_hand_over), so what moved since is the
        # work run outside them; a graph that grew is a new graph, so it compiled.
        backend, engine = self._backend, self._engine
        if backend is None or not backend.lazy or engine is None:
            return
        delta = self._carry(backend.step_delta())
        if not delta.get("compilations"):
            return
        facts = backend.compile_facts()
        self._carry(facts)
        nodes = facts.get("graph_nodes")
        if nodes:
            self._unsaid += engine.graph_ran(int(nodes), where)

    def _carry(self, delta: Mapping[str, float]) -> Mapping[str, float]:
        """Keep what the counters moved by outside the steps for the next record (a graph's size: the largest)."""
        carried = self._carried
        for key, value in delta.items():
            if key == "graph_nodes":
                carried[key] = max(carried.get(key, 0), value)
            elif value:
                carried[key] = carried.get(key, 0) + value
        return delta

    def end_run(self, *, failed: bool = False) -> None:
        """The run is over (the process exits, the diagnosed script ended): every step handed over, and a
        profile window still open closed (or said to have been missed). ``failed``: an error ends it; then, on a
        lazy backend with several replicas, nothing runs the device's pending work (its graph may hold a
        collective that the other replicas, gone or elsewhere, never join: a hang in place of the error)."""
        self.flush(pass_ended=False, interrupted=failed)
        self._after_last_step()
        profile = self.profile
        if profile is not None:
            profile.run_ended(self.steps)

    def _lazy_replicas(self) -> bool:
        """Whether the run is on a lazy backend whose graphs other processes join (several replicas, a multi-host
        SPMD slice; True where that cannot be told)."""
        backend = self._backend
        if backend is None or not backend.lazy:
            return False
        try:
            return backend.has_peers()
        except Exception:  # noqa: BLE001 - a backend that cannot say: no device work, to be safe
            return True

    def _after_last_step(self) -> None:
        """What the counters moved by after the last step (a final evaluation that compiled its graphs) goes on a
        record of its own: the last step's number, no time (it is no step's), ``counted_steps`` 0, so the
        records count every compilation that ``ap.metrics()`` counts."""
        backend, host = self._backend, self._host
        if backend is None or host is None or not self.steps or self._failed or self._pending:
            return
        self._carry(backend.step_delta())
        carried, self._carried = self._carried, {}
        if not any(carried.get(key) for key in ("compilations", "device_to_host")):
            return
        if carried.get("compilations") and "compile_seconds" not in carried:
            carried.update(backend.compile_facts())
        if self._recording:
            self._record(host, StepRecord(self.steps, backend.name, backend.lazy, 0.0, 0.0, None, carried,
                                          time.perf_counter() + self._wall_offset, {}, 0))

    def hand_over_finished(self) -> None:
        """Hand over the finished steps (their breakdowns made final), leaving a step that waits for its sync."""
        self._hand_over(finish_open=False)

    def _hand_over(self, finish_open: bool = True) -> None:
        """Read the counters and hand every finished step to the rules and the observers."""
        if finish_open:
            self.synced()  # a loop left early: its last step is finished as it stands
        pending = self._pending
        backend, host = self._backend, self._host
        if not pending or backend is None or host is None:
            return
        self._pending = []
        delta = backend.step_delta()
        carried = self._carried
        if carried:  # (work outside the steps since the last record: its counters are this record's)
            self._carried = {}
            for key, value in carried.items():
                delta[key] = max(delta.get(key, 0), value) if key == "graph_nodes" else delta.get(key, 0) + value
        last = pending[-1][0]
        # A compilation or a host read (other than ap.after_step's) ends a quiet stretch.
        if delta.get("compilations") or delta.get("device_to_host", 0) - delta.get("after_step_reads", 0):
            self._close_until = last + self.CLOSE_STEPS
        if delta.get("compilations"):
            # Only then: these cost more than the counters, and a graph that grew is a
            # new graph, which compiles first.
            for key, value in backend.compile_facts().items():
                delta[key] = max(delta.get(key, 0), value) if key == "graph_nodes" else delta.get(key, 0) + value
            if self._shapes is not None and last > 1 and not self._fresh:
                self._shapes.arm()  # it compiled on batch shapes seen before: which tensor changed?
        self._fresh = False
        self._every = 1 if last < self._close_until else self.QUIET_EVERY
        breakdowns = self._breakdowns(pending, delta.get("compile_seconds", 0.0))
        result = None
        profile = self.profile
        if profile is not None:
            for entry, breakdown in zip(pending, breakdowns, strict=True):
                profile.add(entry[0], breakdown)
            result = profile.settle()
        if not self._recording:
            return
        name, lazy, loader = backend.name, backend.lazy, self.loader_info
        # Steps read together: the change is known only for all of them, so it goes on
        # the last, which says how many steps it covers; the others say theirs was not read.
        for (step, seconds, wait, signature, at, _), breakdown in zip(pending[:-1], breakdowns, strict=False):
            record = StepRecord(step, name, lazy, seconds, wait, signature, {}, at, loader, 0, breakdown=breakdown)
            if result is not None and step == result["steps"][1]:
                record.profile = result
            self._record(host, record)
        step, seconds, wait, signature, at, _ = pending[-1]
        memory = self.memory.read(step) if self.memory is not None else None
        record = StepRecord(step, name, lazy, seconds, wait, signature, delta, at, loader, len(pending),
                            memory=memory, breakdown=breakdowns[-1])
        if result is not None:
            record.profile = result  # (on the window's last step: the one that stopped it, or one before)
        self._record(host, record)

    def _breakdowns(self, pending: list[tuple[Any, ...]], compile_seconds: float) -> list[dict[str, float]]:
        """The final breakdown of each step read together, with the compile time carved out, added to the totals
        (the first step's seconds in ``pending`` grow by a compilation from before its clock started).

        Compilation is known for the steps together: one step's share is carved out of it; steps read
        together that compiled say ``compile`` joined with what it may have been in (the run's totals
        are carved exactly, from the steps' sum).
        """
        phases = self._phases
        out = [categories(entry[5], phases) for entry in pending]
        compile_seconds = float(compile_seconds or 0.0)
        if compile_seconds > 0:
            together: dict[str, float] = {}
            for breakdown in out:
                add_into(together, breakdown)
            left = carve_compile(together, compile_seconds, phases)
            if left > MIN_SECONDS and pending[0][0] == 1 and len(out) == 1:
                # It compiled before the first step's clock started (torch.compile's first forward, in a loop
                # whose first step starts at its first backward; what ran before the first step under accelport
                # diagnose): the start-up is the first step's, and so is its compilation.
                together["compile"] = together.get("compile", 0.0) + left
                step, seconds, *rest = pending[0]
                pending[0] = (step, seconds + left, *rest)
                self.step_seconds += left
            if len(out) == 1:
                out[0] = dict(together)
            else:
                for breakdown in out:
                    carve_compile(breakdown, compile_seconds, phases, split=False)
            add_into(self.time_total, together)
        else:  # (the steps' own breakdowns, added as they are: no dict of their sum per hand-over)
            total = self.time_total
            for breakdown in out:
                add_into(total, breakdown)
        if self.time_steps == 0 and pending[0][0] == 1:
            self.first_breakdown = dict(out[0])
        self.time_steps += len(out)
        return out

    def _record(self, host: PluginHost, record: StepRecord) -> None:
        found = self._engine.step_end(record) if self._engine is not None else ()
        if self._unsaid:
            found, self._unsaid = (*self._unsaid, *found), []
        host.step_end(record, found)

    def failed(self, exc: BaseException) -> None:
        """A step raised ``exc`` (``ap.optimizer_step``, ``ap.sync``, the loader's sync, the script's own code):
        if it ran out of memory, the steps so far are handed over and the failing step gets a record of its
        own (``counted_steps`` 0), so the rules make their finding before ``exc`` goes on, unchanged.

        Nothing of the failed step is read: on XLA, touching a tensor of it after an out-of-memory
        error can end the process (SIGSEGV), so the kept gradients are not read either after it.
        """
        memory, backend, host = self.memory, self._backend, self._host
        if self._failed or memory is None or backend is None or host is None:
            return
        step = self._open if self._open is not None else self.steps + 1
        if memory.raised(exc, step) is None:
            return
        self._failed = True
        if not self._recording:
            return
        self._open = None  # (its record is the failed one, below)
        self._hand_over()
        if self._engine is not None:  # what the rules find now goes with the failed step's record
            self._unsaid += self._engine.settle()
        now = time.perf_counter()
        seconds = now - self._last_end if self._last_end is not None else 0.0
        wait, self._pending_wait = self._pending_wait, 0.0
        self._record(host, StepRecord(step, backend.name, backend.lazy, seconds, wait, self._last_signature, {},
                                      now + self._wall_offset, self.loader_info, 0))
