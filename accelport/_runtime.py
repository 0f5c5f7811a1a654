"""Process-wide state behind the public API: the plugin host, the selected backend, step tracking."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from .contract import COUNTER_FIELDS, LEVEL_FIELDS, Backend, Metrics, StepRecord

__all__ = ["Runtime", "StepTracker", "RUNTIME"]


class StepTracker:
    """Counts steps, data wait and batch signatures; emits a StepRecord per step."""

    def __init__(self) -> None:
        self.steps = 0
        self.data_wait = 0.0
        self.step_seconds = 0.0
        self.signatures: set[tuple[Any, ...]] = set()
        self._pending_wait = 0.0
        self._last_signature: tuple[Any, ...] | None = None
        self._last_end: float | None = None
        self._last_counters: dict[str, float] = {}
        self.loader_info: dict[str, Any] = {}

    def batch_arrived(self, wait: float, sig: tuple[Any, ...]) -> None:
        if self._last_end is None:  # the first step starts when the loop first asks for data
            self._last_end = time.perf_counter() - wait
        self.data_wait += wait
        self._pending_wait += wait
        self._last_signature = sig
        self.signatures.add(sig)

    def step_end(self, backend: Backend, host: Any) -> None:
        now = time.perf_counter()
        self.steps += 1
        seconds = now - self._last_end if self._last_end is not None else 0.0
        self.step_seconds += seconds
        self._last_end = now
        wait, self._pending_wait = self._pending_wait, 0.0
        if host is None or not host.has_step_observers:
            return
        current = backend.step_counters()
        delta = {k: v - self._last_counters.get(k, 0) for k, v in current.items()}
        self._last_counters = current
        host.step_end(
            StepRecord(
                step=self.steps,
                backend=backend.name,
                lazy=backend.lazy,
                seconds=seconds,
                data_wait_seconds=wait,
                signature=self._last_signature,
                delta=delta,
                time=time.time(),
                loader=self.loader_info,
            )
        )


class Runtime:
    """Holds the plugin host and the selected backend. One per process (``RUNTIME``)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._host: Any = None
        self._backend: Backend | None = None
        self.reason = ""
        self.explicit: str | None = None
        self.tracker = StepTracker()
        self._baseline: dict[str, Any] = {}
        #: Keys of the warnings already given in this process (each is given once).
        self.warned: set[str] = set()

    def host(self) -> Any:
        if self._host is None:
            with self._lock:
                if self._host is None:
                    from .plugins import create_manager

                    self._host = create_manager()
        return self._host

    def backend(self) -> Backend:
        if self._backend is None:
            with self._lock:
                if self._backend is None:
                    from .compat import warn_deprecations
                    from .selection import resolve

                    backend, reason = resolve(self.host(), self.explicit, os.environ)
                    # Vendor deprecations are announced where the backend is first chosen.
                    warn_deprecations(backend, os.environ)
                    backend.prepare()
                    backend.reason = reason
                    self._baseline = backend.counters()
                    self.tracker = StepTracker()
                    self._backend, self.reason = backend, reason
        return self._backend

    def use(self, name: str) -> Backend:
        with self._lock:
            from .selection import resolve

            backend, reason = resolve(self.host(), name, os.environ)
            self.explicit = name
            self._backend = None
            self.reason = reason
        return self.backend()

    def reset(self) -> None:
        """Forget plugins, selection and counters (tests; a fresh start after env changes)."""
        with self._lock:
            self.__init__()  # type: ignore[misc]

    @contextlib.contextmanager
    def scoped(self) -> Iterator[Runtime]:
        """Run a block whose backend choice and counters are its own; the state before comes back after.

        The pytest plugin runs each test on its backend inside one, so a test's
        ``ap.use`` (or ``reset``) never leaks into the next test.
        """
        with self._lock:
            saved = {key: value for key, value in vars(self).items() if key != "_lock"}
        try:
            yield self
        finally:
            with self._lock:
                vars(self).update(saved)

    def metrics(self) -> Metrics:
        backend = self.backend()
        now = backend.counters()
        values: dict[str, Any] = {}
        for key in COUNTER_FIELDS:
            if key not in now:
                values[key] = None
                continue
            value, base = now[key], self._baseline.get(key)
            if key in LEVEL_FIELDS or base is None:
                values[key] = value
            elif isinstance(value, dict):
                diff = {op: n - base.get(op, 0) for op, n in value.items()}
                values[key] = {op: n for op, n in diff.items() if n}
            else:
                values[key] = value - base
        t = self.tracker
        return Metrics(
            backend=backend.name,
            steps=t.steps,
            data_wait_seconds=t.data_wait,
            step_seconds=t.step_seconds,
            batch_signatures=len(t.signatures),
            compile_cache_dir=backend.compile_cache_dir(),
            **values,
        )


RUNTIME = Runtime()
