"""``ap.loader``: batches arrive on the device, prefetched, with the wait measured.

The backend decides how batches reach the device (a prefetch thread with
non-blocking copies on eager devices, ``MpDeviceLoader`` on XLA). This module
adds what every backend shares: the time the training loop spends blocked on
data, and each batch's signature (shapes and dtypes) so a diagnosis can say
which input changed shape.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["DeviceLoader", "prefetch_iter", "signature"]

_DONE = object()


def signature(batch: Any) -> tuple[Any, ...]:
    """Shapes and dtypes of every tensor in a (nested) batch, in order.

    Reads metadata only, so it never forces a lazy tensor to execute.
    """
    out: list[Any] = []

    def walk(x: Any) -> None:
        shape = getattr(x, "shape", None)
        dtype = getattr(x, "dtype", None)
        if shape is not None and dtype is not None and hasattr(x, "device"):
            out.append((tuple(shape), str(dtype).replace("torch.", "")))
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(batch)
    return tuple(out)


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def prefetch_iter(
    iterable: Iterable[Any],
    *,
    depth: int = 2,
    transform: Callable[[Any], Any] | None = None,
) -> Iterator[Any]:
    """Iterate ``iterable`` in a background thread, ``depth`` batches ahead.

    ``transform`` (e.g. a non-blocking host-to-device copy) runs in the thread
    too. An exception in the producer is re-raised in the consumer; a consumer
    that stops early (``break``) stops the producer.
    """
    if depth < 0:
        raise ValueError(f"prefetch depth must be >= 0, not {depth}")
    if depth == 0:
        for item in iterable:
            yield transform(item) if transform is not None else item
        return

    q: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in iterable:
                if transform is not None:
                    item = transform(item)
                if not put(item):
                    return
            put(_DONE)
        except BaseException as exc:  # forwarded to the consumer
            put(_Failure(exc))

    thread = threading.Thread(target=produce, name="accelport-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, _Failure):
                raise item.exc
            yield item
    finally:
        stop.set()


class DeviceLoader:
    """What ``ap.loader()`` returns: iterate it like the wrapped loader.

    Every ``iter()`` starts a new pass over the wrapped iterable (an epoch).
    ``len()`` is the wrapped loader's length when it has one.
    """

    def __init__(self, iterable: Iterable[Any], runtime: Any, prefetch: int | None = None) -> None:
        if not hasattr(iterable, "__iter__"):
            raise TypeError(
                f"ap.loader() needs an iterable of batches (a DataLoader, a list, a generator), "
                f"not {type(iterable).__name__}"
            )
        if prefetch is not None and (not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0):
            raise ValueError(f"prefetch must be a non-negative int (batches to load ahead) or None "
                             f"(the backend's default), not {prefetch!r}")
        self.iterable = iterable
        self.prefetch = prefetch
        self._runtime = runtime

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        runtime = self._runtime
        backend = runtime.backend()
        tracker = runtime.tracker
        it = iter(backend.wrap_loader(self.iterable, prefetch=self.prefetch))
        end_of_batch = backend.end_of_batch
        clock = time.perf_counter
        first = True
        while True:
            if not first:
                # The loop body is done with the previous batch; a lazy backend runs the
                # step's graph now, and that (compile, dispatch) is not waiting for data.
                end_of_batch()
            first = False
            t0 = clock()
            try:
                batch = next(it)
            except StopIteration:
                return
            tracker.batch_arrived(clock() - t0, signature(batch))
            yield batch
