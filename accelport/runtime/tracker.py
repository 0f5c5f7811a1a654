"""Step tracking: steps, data wait and batch shapes, handed to the observers as one StepRecord per step."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from accelport.contract import Backend, StepRecord

if TYPE_CHECKING:
    from accelport.plugins.host import PluginHost

__all__ = ["StepTracker"]


class StepTracker:
    """Counts steps, data wait and batch signatures; hands a StepRecord per step to the observers.

    Reading the backend's counters costs more than everything else per step (a
    lookup in the runtime's tables, cold in the middle of a training step), so
    they are read after every step only while something may be happening: the
    first :attr:`CLOSE_STEPS` steps of a run and the :attr:`CLOSE_STEPS` steps
    after the counters last moved (a compilation, a host read). In quiet
    stretches they are read once per :attr:`QUIET_EVERY` steps: the steps in
    between are kept as plain tuples and handed over together; the change found
    is counted on the last of them, with ``counted_steps`` saying how many steps
    it covers. Records still reach observers one per step and in order.
    """

    QUIET_EVERY = 16
    CLOSE_STEPS = 40

    def __init__(self) -> None:
        self.steps = 0
        self.data_wait = 0.0
        self.step_seconds = 0.0
        #: Distinct batch signatures. Within an ap.loader loop, a batch with the shapes of the
        #: previous one carries the very same signature object (observers compare by identity).
        self.signatures: set[tuple[Any, ...]] = set()
        self._pending_wait = 0.0
        self._last_signature: tuple[Any, ...] | None = None
        self._last_end: float | None = None
        self.loader_info: dict[str, Any] = {}
        # Finished steps whose counters are not read yet: (step, seconds, wait, signature, time).
        self._pending: list[tuple[int, float, float, Any, float]] = []
        self._every = 1
        self._close_until = self.CLOSE_STEPS
        self._open: tuple[int, Backend, PluginHost | None] | None = None  # a step waiting for the loop's sync
        self._backend: Backend | None = None
        self._host: PluginHost | None = None
        # Wall-clock time of a perf_counter reading, without a second clock call per step.
        self._wall_offset = time.time() - time.perf_counter()

    def batch_arrived(self, wait: float, sig: tuple[Any, ...]) -> None:
        if self._last_end is None:  # the first step starts when the loop first asks for data
            self._last_end = time.perf_counter() - wait
        self.data_wait += wait
        self._pending_wait += wait
        if sig is not self._last_signature:  # ap.loader hands equal signatures as one object
            self.signatures.add(sig)
            self._last_signature = sig

    def step_end(self, backend: Backend, host: PluginHost | None) -> None:
        self.synced()  # a second step in the same batch (two optimizers): the first one ends here
        self.steps += 1
        if backend.step_deferred():
            # Its graph runs when the loop asks for the next batch: finish the record then
            # (synced()), so the step's time and counters hold its own compile and run.
            self._open = (self.steps, backend, host)
            return
        self._finish(self.steps, backend, host)

    def synced(self) -> None:
        """The loop's sync ran: finish the step that waited for it."""
        if self._open is not None:
            step, backend, host = self._open
            self._open = None
            self._finish(step, backend, host)

    def _finish(self, step: int, backend: Backend, host: PluginHost | None) -> None:
        now = time.perf_counter()
        seconds = now - self._last_end if self._last_end is not None else 0.0
        self.step_seconds += seconds
        self._last_end = now
        wait, self._pending_wait = self._pending_wait, 0.0
        if host is None or not host.has_step_observers:
            return
        pending = self._pending
        pending.append((step, seconds, wait, self._last_signature, now + self._wall_offset))
        self._backend, self._host = backend, host
        if len(pending) >= self._every:
            self.flush()

    def flush(self) -> None:
        """Read the counters and hand every finished step to the observers."""
        self.synced()  # a loop left early: its last step is finished as it stands
        pending = self._pending
        backend, host = self._backend, self._host
        if not pending or backend is None or host is None:
            return
        self._pending = []
        delta = backend.step_delta()
        last = pending[-1][0]
        # A compilation or a host read (other than ap.after_step's) ends a quiet stretch.
        if delta.get("compilations") or delta.get("device_to_host", 0) - delta.get("after_step_reads", 0):
            self._close_until = last + self.CLOSE_STEPS
        if delta.get("compilations"):
            # Only then: these cost more than the counters, and a graph that grew is a
            # new graph, which compiles first.
            delta.update(backend.compile_facts())
        self._every = 1 if last < self._close_until else self.QUIET_EVERY
        name, lazy, loader = backend.name, backend.lazy, self.loader_info
        # Steps read together: the change is known only for all of them, so it goes on
        # the last, which says how many steps it covers; the others say theirs was not read.
        for step, seconds, wait, signature, at in pending[:-1]:
            host.step_end(StepRecord(step, name, lazy, seconds, wait, signature, {}, at, loader, 0))
        step, seconds, wait, signature, at = pending[-1]
        host.step_end(StepRecord(step, name, lazy, seconds, wait, signature, delta, at, loader, len(pending)))
