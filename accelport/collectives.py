"""What a backend knows about its own world collectives while they run: no torch, no process group.

A :class:`Collectives` belongs to one backend object (``backend.collectives`` on both
families) and says two things:

- **which collective each thread waits in.** A backend marks exactly the code that
  waits for the other ranks (``with self.collectives.waiting("ap.barrier"): ...``),
  and ``accelport launch``'s probe asks :meth:`Collectives.waiting_in` for the
  script's thread: a rank inside the optimizer's own step or a step hook is not
  waiting for anyone, even though ``ap.optimizer_step`` is on its stack.
- **when ``ap.all_reduce`` checks that every rank passed the same tensor.** The
  check is a collective of its own, so it must run on the same calls on every rank:
  the schedule counts this process's calls (:meth:`Collectives.check_due`), which
  every rank of a correct program makes in the same order.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from accelport.settings import is_true

__all__ = ["Collectives", "CHECK_FIRST", "CHECK_EVERY", "CHECK_SETTING"]

#: ``ap.all_reduce`` checks its first this many calls (a loop's call sites all run in its first
#: steps, where a mismatch is nearly always made) ...
CHECK_FIRST = 8
#: ... and then every this many-th call, so that one that starts later is still found.
CHECK_EVERY = 100
#: Set (``1``, ``true``) on every rank, ``ap.all_reduce`` checks every call: for debugging.
CHECK_SETTING = "ACCELPORT_CHECK_COLLECTIVES"


class Collectives:
    """One backend's bookkeeping of its world collectives (see the module's docstring)."""

    def __init__(self) -> None:
        self._waiting: dict[int, str] = {}  # thread ident -> the ap.* collective it waits in
        self._all_reduce_calls = 0
        #: The run's step clock (``accelport.observe.steptime.StepClock``, bound by the backend's
        #: ``time_with``): the waits go to its ``collective`` phase. None: not timed.
        self.timer: Any = None

    @contextlib.contextmanager
    def waiting(self, name: str) -> Iterator[None]:
        """Mark the calling thread as waiting for every other rank in ``name`` (``"ap.barrier"``) meanwhile.

        Nested marks keep the outer name. A dict entry per thread, set and removed by that thread
        only: the probe's thread reads it without a lock.
        """
        thread = threading.get_ident()
        if thread in self._waiting:
            yield
            return
        self._waiting[thread] = name
        timer = self.timer
        if timer is not None:
            timer.enter("collective")
        try:
            yield
        finally:
            del self._waiting[thread]
            if timer is not None:
                timer.leave("collective")

    def waiting_in(self, thread: int) -> str | None:
        """The collective thread ``thread`` waits in now (as marked by :meth:`waiting`), else None."""
        return self._waiting.get(thread)

    def check_due(self, environ: Mapping[str, str]) -> bool:
        """Whether this call of ``ap.all_reduce`` checks that every rank passed the same tensor; counts it.

        The first :data:`CHECK_FIRST` calls and every :data:`CHECK_EVERY`-th after, or every call
        where ``environ`` sets :data:`CHECK_SETTING` (it must then be set on every rank, as
        ``accelport launch`` passes the environment to all of them).
        """
        self._all_reduce_calls += 1
        calls = self._all_reduce_calls
        return calls <= CHECK_FIRST or calls % CHECK_EVERY == 0 or is_true(environ.get(CHECK_SETTING))
