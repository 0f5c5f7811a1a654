"""Where the training loop's wall time goes, attributed as it passes: the step clock.

A :class:`StepClock` charges every moment of the loop's thread to the phase it is in
(``accelport.contract.TIME_PHASES``), telling them apart by the boundaries it is told of:

- a batch's arrival (``ap.loader``, or the DataLoader under ``accelport diagnose``): the
  wait is split into ``data`` (what the source itself took to give the batch), ``transfer``
  (the backend's copies of it to the device, as far as the loop waited for them) and the
  rest of the wait (a loader thread not yet scheduled: ``other``); after it comes the body;
- the start and the end of every ``torch.autograd.backward`` (``loss.backward()``) of the
  loop's thread (:func:`watch_backward`), and the start of the optimizer step: after a
  backward, and after the optimizer step, the script runs its own code (the tail). A
  backward inside the optimizer step (the closure of ``opt.step(closure)``: LBFGS) is the
  step's own work: after it the optimizer runs on, still the body. Where the backend makes
  the body, the tail and a step's start one category (lazy backends: :attr:`StepClock.phased`
  is False) neither is a boundary; the loop thread's backward passes are only counted there,
  to tell a training batch from an evaluation's;
- what a backend marks itself (:meth:`accelport.contract.Backend.time_with`): its syncs,
  its waits for the other replicas, host reads of its tensors (the tracer times those);
- the end of a loader's pass (:meth:`StepClock.pass_ended`).

Work between two training steps (an evaluation loop, a checkpoint save, an epoch's logging) is
no step's own: it is told by a batch that no training work followed (no backward, no optimizer
step) before the next batch came, and by the end of a pass. What the step had run until such a
batch arrived is charged to ``between`` (category ``between_steps``), on every backend alike.

The time between two boundaries goes to the phase on top of the clock's stack. A step's
phases add up to its wall time exactly (each moment is charged once); the backend maps them
to categories (``Backend.time_phases``). Compile time is not a boundary: the compiler runs
inside a phase (the forward pass, a sync) and its seconds, read from the backend's counters,
are carved out of that phase's category afterwards (:func:`carve_compile`).

Nothing here imports torch until a backward is to be watched, and the clock's hot path is a
clock read and a dict update per boundary.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from accelport.contract import TIME_CATEGORIES

__all__ = ["StepClock", "watch_backward", "categories", "carve_compile", "joined", "add_into", "ordered",
           "breakdown_line", "MIN_SECONDS"]

_clock = time.perf_counter
_get_ident = threading.get_ident
#: Below this a category holds nothing worth telling apart (the tolerance of a step's sum).
MIN_SECONDS = 50e-6
#: Phases whose category does not depend on the backend.
_DIRECT = {"data": "data", "transfer": "transfer", "sched": "other", "between": "between_steps"}
_ORDER = {name: i for i, name in enumerate(TIME_CATEGORIES)}


class StepClock:
    """Charges the loop thread's time to the phase it is in; :meth:`close` hands over a step's phases."""

    __slots__ = ("_stack", "_mark", "parts", "thread", "_stepping", "_idle", "_passed", "_closed", "_loose",
                 "backward", "_backward_from", "_backward_depth", "phased", "_backwards", "__weakref__")

    def __init__(self) -> None:
        self._stack = ["pre"]
        self._mark: float | None = None  # the last boundary; None before the first step starts
        #: Seconds per phase of the step so far.
        self.parts: dict[str, float] = {}
        #: The loop's thread (events from other threads are not the loop's and are ignored).
        self.thread: int | None = None
        # The optimizer step runs (from its start to the step's end): a backward in it (a closure's) ends in the
        # body, not in the script's own code.
        self._stepping = False
        # A batch arrived and no training work (a backward, an optimizer step) followed it yet; a loader's
        # pass ended: the next batch's arrival makes what ran since the step's start work between steps.
        self._idle = False
        self._passed = False
        # The step ended and no backward or optimizer step started since: a backward that ends after the
        # step did (a loop that updates its weights by hand ends its steps inside the backward) leaves the
        # next step's start as it is.
        self._closed = False
        # The clock was started by a backward, and no step has ended yet (a loop without batches): the first
        # step starts at its last backward, not at the first of the passes that were no step.
        self._loose = False
        #: Seconds the loop's thread spent inside backward passes over the run (a job's ranks wait for each other
        #: there: DDP's gradient all-reduce runs inside the backward), whatever phase they were charged to; not
        #: measured (0) on a clock that is not phased.
        self.backward = 0.0
        self._backward_from: float | None = None
        self._backward_depth = 0  # backward passes nested in the loop's thread (reentrant checkpointing)
        #: Whether the backend tells the body from the tail and a step's start (else they are one category): a
        #: backward's end parts them; else a backward only says its batch was a training one, read from the count
        #: of backward passes at each batch's arrival (see watch_backward), and the optimizer's start is no boundary.
        self.phased = True
        self._backwards = 0  # the loop thread's backward passes at the last batch's arrival (a clock not phased)

    @property
    def in_backward(self) -> bool:
        """Whether the loop's thread is inside a backward pass now (where a data-parallel rank waits for the others)."""
        return self._backward_from is not None

    @property
    def started(self) -> bool:
        return self._mark is not None

    def _charge(self, now: float) -> None:
        mark = self._mark
        if mark is not None:
            top = self._stack[-1]
            parts = self.parts
            parts[top] = parts.get(top, 0.0) + (now - mark)
            self._mark = now

    def arrived(self, now: float, blocked: float, data: float, transfer: float) -> bool:
        """A batch reached the loop at ``now`` after ``blocked`` seconds, of which ``data`` the source took and
        ``transfer`` the backend's copies; the loop's body starts. Returns whether what ran since the step
        started, the batches that arrived before this one included, was work between training steps."""
        start = now - blocked
        mark = self._mark
        if mark is None or self._loose:
            self._mark, self.parts, self._loose = start, {}, False
            self.thread = threading.get_ident()
            mark = None
        elif start > mark:
            self._charge(start)
        if not self.phased:
            # A backward of the loop's thread since the last batch was training work: the batch before was a
            # training one, though no optimizer step followed it yet (the micro-batches of a gradient
            # accumulation are their step's, not work between steps).
            count = _backward_counts.get(self.thread, 0)
            if count != self._backwards:
                self._backwards, self._idle = count, False
        between = mark is not None and (self._idle or self._passed)
        if between:
            self._between()
        self._idle, self._passed = True, False
        if mark is not None and start < mark:
            # The wait began before this step did (the step before was finished during it, as a loader that
            # syncs first finishes it): that part is the step before's. Only what is left is this step's,
            # data first.
            blocked = max(now - mark, 0.0)
            data = min(data, blocked)
            transfer = min(transfer, blocked - data)
        parts = self.parts
        parts["data"] = parts.get("data", 0.0) + data
        if transfer:
            parts["transfer"] = parts.get("transfer", 0.0) + transfer
        rest = blocked - data - transfer
        if rest > 0:
            parts["sched"] = parts.get("sched", 0.0) + rest
        self._mark = now
        stack = self._stack
        if stack[0] == "pre":
            # What ran before the loop asked for the batch was the script's own code (the forward
            # pass comes after the batch): the tail of the step before, not the body.
            pre = parts.pop("pre", 0.0)
            if pre:
                parts["tail"] = parts.get("tail", 0.0) + pre
        stack[0] = "body"
        return between

    def _between(self) -> None:
        """What the step ran so far was work between two training steps (an evaluation's batches)."""
        parts = self.parts
        moved = sum(v for k, v in parts.items() if k != "between")
        if moved:
            self.parts = {"between": parts.get("between", 0.0) + moved}

    def pass_ended(self) -> None:
        """A loader's pass ended: until the next batch, the loop runs work between training steps."""
        if self._mark is not None and (self.thread is None or _get_ident() == self.thread):
            self._passed = True

    def body(self) -> None:
        """The optimizer step starts: it is the body until the step ends, closures' forwards and backwards too.
        On a clock that is not :attr:`phased` the body is one category with what comes before and after it:
        once the clock runs there is nothing to part, only its batch to be said a training one."""
        if not self.phased and self._mark is not None:
            self._idle = False  # (training work: a step that ends only after the next batch came says so here)
            return
        thread = self.thread
        if thread is not None and _get_ident() != thread:
            return
        self._stepping = True
        self._move("body")  # (a step's start before any batch stays "pre": the forward is in it)

    def tail(self) -> None:
        """A backward ended: the script's own code runs until the next body; inside the optimizer step (a
        closure's backward) the optimizer's own work goes on. A step that ended inside the backward (a loop
        that updates its weights by hand) leaves the next step's start as it is: the forward is in it."""
        if self._closed:
            return
        self._base("body" if self._stepping else "tail")

    def _base(self, phase: str) -> None:
        # On every backward and optimizer step: kept to a clock read and a dict update.
        thread = self.thread
        if thread is not None and _get_ident() != thread:
            return
        self._move(phase)

    def _move(self, phase: str) -> None:
        """The loop's thread moves to ``phase``: what ran since the last boundary goes to the phase it was in."""
        stack = self._stack
        mark = self._mark
        self._idle = self._closed = False  # training work: the batch before it was a training batch
        if mark is None or (self._loose and not self._stepping):
            # The first step of a loop without batches starts at its backward (the last one before it ends:
            # the passes before, of a loop that updates its weights by hand, were no step).
            self._mark, self.parts, self._loose = _clock(), {}, True
            self.thread = _get_ident()
        else:
            now = _clock()
            top = stack[-1]
            parts = self.parts
            parts[top] = parts.get(top, 0.0) + (now - mark)
            self._mark = now
        stack[0] = phase

    def enter(self, phase: str) -> None:
        """A phase that nests (a sync, a host read, a collective) starts in the loop's thread."""
        thread = self.thread
        if thread is not None and _get_ident() != thread:
            return
        self._charge(_clock())
        self._stack.append(phase)

    def leave(self, phase: str) -> None:
        """The phase :meth:`enter` started ends (said by name: a leave without its enter changes nothing)."""
        thread = self.thread
        if thread is not None and _get_ident() != thread:
            return
        stack = self._stack
        if len(stack) > 1 and stack[-1] == phase:
            self._charge(_clock())
            stack.pop()

    def span(self, phase: str, since: float) -> None:
        """The loop spent the time from ``since`` until now in ``phase`` (known only once it ended: a copy
        that turned out to be a host read). Inside a sync it stays the sync's: what a sync runs after the
        step (torch_xla's step closures, ``ap.after_step``) reads values the step already made."""
        if self.thread is not None and threading.get_ident() != self.thread:
            return
        mark = self._mark
        if mark is None or self._stack[-1] in ("sync", "sync_collective"):
            return
        now = time.perf_counter()
        if since > mark:
            self._charge(since)
        else:
            since = mark
        parts = self.parts
        parts[phase] = parts.get(phase, 0.0) + (now - since)
        self._mark = now

    def skip(self, now: float) -> None:
        """The time until ``now`` is no step's (accelport's own work between two steps)."""
        if self._mark is not None:
            self._mark = now

    def close(self, now: float) -> dict[str, float]:
        """A step ended at ``now``: its phases (adding up to its wall time), and the next step starts."""
        self._stepping = self._idle = self._passed = self._loose = False
        self._closed = True
        if self._mark is None:  # the first step, of a loop without batches nor backward: it starts here
            self._mark = now
            self.thread = threading.get_ident()
            return {}
        self._charge(now)
        out, self.parts = self.parts, {}
        self._stack[0] = "pre"
        return out


def categories(parts: Mapping[str, float], phases: Mapping[str, str]) -> dict[str, float]:
    """A step's phases as time categories, on a backend whose phases map as ``phases`` says."""
    out: dict[str, float] = {}
    get = out.get
    for phase, seconds in parts.items():
        category = _DIRECT.get(phase) or phases.get(phase, "other")
        out[category] = get(category, 0.0) + seconds
    return out


def joined(names: Iterable[str]) -> str:
    """Categories that cannot be told apart, as one: their parts in TIME_CATEGORIES order, joined by '+'."""
    parts = {part for name in names for part in name.split("+")}
    return "+".join(sorted(parts, key=lambda p: (_ORDER.get(p, len(_ORDER)), p)))


def carve_compile(breakdown: dict[str, float], seconds: float, phases: Mapping[str, str],
                  split: bool = True) -> float:
    """Move ``seconds`` of compilation out of the categories of the phases compilers run in, into ``compile``.

    A compiler runs inside a sync or a host read (XLA graphs) or the forward pass (torch.compile):
    their categories are carved first, then the body's, then the script's own code. Where the
    compilation may have been in either of two categories that both hold time, what is left is said
    as one category (``device+host_sync``): which one held it is not known. ``split=False`` (one
    figure for several steps, each of which may or may not have compiled) carves nothing and joins
    ``compile`` with those categories instead.

    Work between the steps (``between_steps``: an evaluation's first graphs) compiles first: what it
    held of the compilation stays its own, and only the rest is carved out of the step's categories.
    Returns the seconds that no category held (a compilation before the step's clock started).
    """
    if seconds <= 0:
        return 0.0
    if split:
        seconds -= min(seconds, breakdown.get("between_steps", 0.0))
        if seconds <= 0:
            return 0.0
    groups: list[list[str]] = []
    used: set[str] = set()
    for names in (("sync", "read"), ("body",), ("pre",), ("tail",)):
        group = []
        for phase in names:
            category = phases.get(phase, "other")
            if category not in used:
                used.add(category)
                group.append(category)
        if group:
            groups.append(group)
    for group in groups:
        present = [c for c in group if breakdown.get(c, 0.0) > MIN_SECONDS]
        if not present:
            continue
        held = sum(breakdown.pop(c) for c in present)
        if not split:
            label = joined(["compile", *present])
            breakdown[label] = breakdown.get(label, 0.0) + held
            return 0.0
        taken = min(seconds, held)
        label = present[0] if len(present) == 1 else joined(present)
        if held - taken > 0:
            breakdown[label] = breakdown.get(label, 0.0) + held - taken
        breakdown["compile"] = breakdown.get("compile", 0.0) + taken
        seconds -= taken
        if seconds <= 0:
            return 0.0
    return seconds if split else 0.0


def add_into(total: dict[str, float], breakdown: Mapping[str, float]) -> None:
    for key, value in breakdown.items():
        total[key] = total.get(key, 0.0) + value


def _rank(name: str) -> tuple[int, str]:
    return _ORDER.get(name.split("+")[0], len(_ORDER)), name


def ordered(breakdown: Mapping[str, float]) -> list[tuple[str, float]]:
    """The categories of ``breakdown`` in TIME_CATEGORIES order (a joined one at the place of its first part)."""
    return sorted(breakdown.items(), key=lambda item: _rank(item[0]))


def breakdown_line(breakdown: Mapping[str, float], per_step: float, steps: int) -> str:
    """``time per step 41.2 ms: data 17.0 (41%), device 20.1 (49%), host_sync 2.9 (7%), other 1.2 (3%)``:
    milliseconds per step and share of ``breakdown`` (seconds over ``steps`` steps); empty categories left out."""
    total = sum(breakdown.values()) or 1e-12
    shown = ", ".join(f"{k} {v / steps * 1e3:.1f} ({v / total:.0%})" for k, v in ordered(breakdown)
                      if v / total >= 0.005)
    return f"time per step {per_step * 1e3:.1f} ms: {shown or 'nothing measured'}"


# -- loss.backward(): where the forward pass ends ---------------------------------------------------

_clocks: list[weakref.ReferenceType[StepClock]] = []  # the phased clocks
_installed: list[Any] = []  # [the original torch.autograd.backward] once wrapped
_backward_counts: dict[int | None, int] = {}  # thread -> backward passes it began, since the wrapper was installed


def watch_backward(clock: StepClock) -> None:
    """Tell ``clock`` when each backward pass starts and ends (wraps ``torch.autograd.backward`` once per
    process; ``Tensor.backward`` calls it). torch must be imported already. A clock that is not
    :attr:`~StepClock.phased` is told nothing: it reads how many backward passes its thread began (a count per
    thread, the wrapper's only work where no clock is phased, as on XLA) when a batch arrives."""
    if clock.phased and not any(ref() is clock for ref in _clocks):
        _clocks[:] = [ref for ref in _clocks if ref() is not None]
        _clocks.append(weakref.ref(clock))
    elif not clock.phased and not clock._backward_depth:  # (one inside a backward is let go at its end)
        _clocks[:] = [ref for ref in _clocks if ref() is not None and ref() is not clock]
    if _installed:
        return
    autograd = sys.modules.get("torch.autograd")
    original = getattr(autograd, "backward", None)
    if original is None:
        return
    compiler = getattr(sys.modules.get("torch"), "compiler", None)
    is_compiling = getattr(compiler, "is_compiling", None) or (lambda: False)
    clocks, counts = _clocks, _backward_counts

    def backward(*args: Any, **kwargs: Any) -> Any:
        # (Counted first: dynamo does not trace this frame, skip_code below, so the count runs as Python does;
        # the compile check, about 2 us a backward inside a training loop, is paid only where a clock is told.)
        thread = _get_ident()
        counts[thread] = counts.get(thread, 0) + 1
        # Under torch.compile's tracing the plain call: a clock read would break the graph.
        if not clocks or is_compiling():
            return original(*args, **kwargs)
        for ref in clocks:  # (on every backward: no list built)
            clock = ref()
            if clock is not None and clock.phased:
                clock._base("body")
                if clock.thread is None or _get_ident() == clock.thread:  # (the loop's backward, outermost)
                    clock._backward_depth += 1
                    if clock._backward_depth == 1:
                        clock._backward_from = clock._mark if clock._mark is not None else _clock()
        try:
            return original(*args, **kwargs)
        finally:
            for ref in clocks:
                clock = ref()
                if clock is not None:
                    if clock.phased:  # (a clock bound to a lazy backend during the backward: no tail to start)
                        clock.tail()
                    if clock._backward_depth and (clock.thread is None or _get_ident() == clock.thread):
                        clock._backward_depth -= 1
                        if clock._backward_depth == 0:
                            since, clock._backward_from = clock._backward_from, None
                            if since is not None:
                                clock.backward += _clock() - since

    backward.__wrapped__ = original  # type: ignore[attr-defined]
    backward.__doc__ = original.__doc__
    backward._accelport_clock = True  # type: ignore[attr-defined]
    autograd.backward = backward  # type: ignore[union-attr]
    _installed.append(original)
    # A frame dynamo compiles would break at the clock read: have it run this one as it is.
    skip = getattr(sys.modules.get("torch._dynamo.eval_frame"), "skip_code", None)
    if skip is not None:
        try:
            skip(backward.__code__)
        except Exception:  # noqa: BLE001 - an older dynamo: is_compiling() covers its tracing
            pass
