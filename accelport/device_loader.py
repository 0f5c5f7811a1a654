"""``ap.loader``: batches arrive on the device, prefetched, with the wait measured.

The backend decides how batches reach the device (a prefetch thread with
non-blocking copies on eager devices, ``MpDeviceLoader`` on XLA). This module
adds what every backend shares: the time the training loop spends blocked on
data, and each batch's signature (shapes and dtypes) so a diagnosis can say
which input changed shape.
"""

from __future__ import annotations

import collections
import itertools
import os
import queue
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

from accelport.contract import Backend
from accelport.errors import DiagnosticWarning

__all__ = ["BatchLook", "DeviceLoader", "LoaderRun", "LoaderTracker", "POSITION_ATTRIBUTE", "prefetch_iter",
           "shard_batches", "signature"]


class LoaderTracker(Protocol):
    """What ``ap.loader`` tells the run's step tracker (:class:`accelport.runtime.tracker.StepTracker`)."""

    loader_info: dict[str, Any]
    step_seconds: float
    data_wait: float

    def inspector(self) -> BatchLook | None: ...

    def batch_arrived(self, wait: float, sig: Any, batch: Any = None, *, blocked: float | None = None,
                      transfer: float = 0.0) -> None: ...

    def synced(self) -> None: ...

    def flush(self, *, pass_ended: bool = True, interrupted: bool = False) -> None: ...

    def failed(self, exc: BaseException) -> None: ...


class LoaderRun(Protocol):
    """What ``ap.loader`` needs of the run it feeds (:class:`accelport.runtime.state.Runtime`)."""

    @property
    def tracker(self) -> LoaderTracker: ...

    @property
    def baseline(self) -> Mapping[str, Any]: ...

    def backend(self) -> Backend: ...

    def first_time(self, key: str) -> bool: ...

_DONE = object()

#: The attribute through which a loader (or the DeviceLoader around it) carries its data position,
#: set by ``ap.Checkpointer.restore(loader=...)`` (accelport.resume): an object whose
#: ``begin(iterable, per_batch)`` gives what a new pass reads (the rest of a pass resumed from a
#: checkpoint) and whose ``advance()`` counts each batch handed to the loop.
POSITION_ATTRIBUTE = "_accelport_position"


_DTYPE_NAMES: dict[Any, str] = {}


def _dtype_name(dtype: Any) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def signature(batch: Any) -> tuple[Any, ...]:
    """Shapes and dtypes of every tensor in a (nested) batch, in order.

    Reads metadata only, so it never forces a lazy tensor to execute. It runs
    once per step: a flat tuple or list of tensors (the usual batch) takes a
    short path that costs a third of the general walk.
    """
    torch = sys.modules.get("torch")
    if torch is not None and type(batch) in (tuple, list):
        tensor, names = torch.Tensor, _DTYPE_NAMES
        flat = []
        for x in batch:
            if not isinstance(x, tensor):
                break
            dtype = x.dtype
            # torch.Size is a tuple (equal, same hash): no copy into a plain one.
            flat.append((x.shape, names.get(dtype) or _dtype_name(dtype)))
        else:
            return tuple(flat)
    out: list[Any] = []

    def walk(x: Any) -> None:
        shape = getattr(x, "shape", None)
        dtype = getattr(x, "dtype", None)
        if shape is not None and dtype is not None and hasattr(x, "device"):
            out.append((tuple(shape), _dtype_name(dtype)))
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


#: How long the interpreter's exit, or a loop left early, waits for prefetch threads to finish the batch they
#: are reading.
EXIT_WAIT_S = 60.0

#: Prefetch threads still running, with the event that stops each (see :func:`_stop_producers_at_exit`).
_PRODUCERS: dict[threading.Thread, threading.Event] = {}
_PRODUCERS_LOCK = threading.Lock()


def _stop_producers_at_exit(wait: float | None = None) -> list[threading.Thread]:
    """Stop every prefetch thread and wait for it; return those still running after ``wait`` seconds.

    A prefetch thread is a daemon (a source that never returns must not hold the exit
    forever), and on Python up to 3.13 a daemon thread inside a torch op when the
    interpreter finalises aborts the whole process with SIGABRT ("terminate called
    without an active exception"): torch's bindings release the GIL around an op, and
    taking it back after finalisation unwinds the thread through C++ that cannot be
    unwound. A loop that ends with ``break`` leaves its thread reading the next batch.
    At-exit hooks run while daemon threads still run normally, so each one is asked to
    stop here and waited for; one started meanwhile (a loader read by another loader's
    thread) is stopped too.
    """
    limit = EXIT_WAIT_S if wait is None else wait
    deadline = time.monotonic() + limit
    seen: dict[threading.Thread, threading.Event] = {}
    while True:
        with _PRODUCERS_LOCK:
            live = {t: stop for t, stop in _PRODUCERS.items() if t not in seen}
        if not live:
            break
        seen.update(live)
        for stop in live.values():
            stop.set()  # (one not started yet ends at its start, reading nothing)
        for thread in live:
            if thread.is_alive():  # (one whose start failed has nothing to wait for)
                thread.join(max(0.0, deadline - time.monotonic()))
        if time.monotonic() >= deadline:
            break
    late = [t for t in seen if t.is_alive()]
    if late:
        warnings.warn(f"accelport: {len(late)} ap.loader prefetch thread(s) still reading a batch after "
                      f"{limit:g} s at exit; the process may abort as it ends. "
                      "A source whose batches take that long should be read with prefetch=0.",
                      DiagnosticWarning, stacklevel=1)
    return late


def _register(thread: threading.Thread, stop: threading.Event) -> None:
    with _PRODUCERS_LOCK:
        if not _PRODUCERS:
            import atexit

            # Registered again after each time the set empties: at most once at any time (unregister first).
            atexit.unregister(_stop_producers_at_exit)
            atexit.register(_stop_producers_at_exit)
        _PRODUCERS[thread] = stop


def _unregister(thread: threading.Thread) -> None:
    with _PRODUCERS_LOCK:
        _PRODUCERS.pop(thread, None)


def _forget_producers_in_child() -> None:
    # A forked child has none of its parent's threads, and a lock that one of them held at the fork
    # would stay held there for good.
    global _PRODUCERS_LOCK
    _PRODUCERS_LOCK = threading.Lock()
    _PRODUCERS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_producers_in_child)


def prefetch_iter(
    iterable: Iterable[Any],
    *,
    depth: int = 2,
    transform: Callable[[Any], Any] | None = None,
) -> Iterator[Any]:
    """Iterate ``iterable`` in a background thread, ``depth`` batches ahead.

    ``transform`` (e.g. a non-blocking host-to-device copy) runs in the thread
    too. An exception in the producer is re-raised in the consumer; a consumer
    that stops early (``break``) stops the producer after the batch it is reading,
    and waits for that.
    The interpreter's exit stops every producer and waits for it
    (:func:`_stop_producers_at_exit`); a loop still open then simply ends.
    """
    if depth < 0:
        raise ValueError(f"prefetch depth must be >= 0, not {depth}")
    if depth == 0:
        for item in iterable:
            yield transform(item) if transform is not None else item
        return

    q: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()
    # read() takes the source out of here: the thread's closures must not keep it alive once read() is
    # done, so that its iterator goes in this thread, before the thread leaves the at-exit set.
    source = [iterable]
    del iterable

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        it: Any = None
        try:
            if stop.is_set():  # stopped before it started (the exit): not even the iterator is made
                return
            it = iter(source.pop())
            while not stop.is_set():  # checked before each batch: a stopped loop reads no further
                item = next(it, _DONE)
                if item is _DONE or stop.is_set():
                    break
                if transform is not None:
                    item = transform(item)
                if not put(item):
                    return
            put(_DONE)
        except BaseException as exc:  # forwarded to the consumer
            it = None  # the exception's traceback keeps this frame: not the source with it
            put(_Failure(exc))

    def produce() -> None:
        try:
            read()
        finally:
            # Only once read()'s frame is gone: the source's iterator went with it, in this thread (a
            # DataLoader ends its workers there), so the exit waited for that too.
            _unregister(threading.current_thread())

    thread = threading.Thread(target=produce, name="accelport-prefetch", daemon=True)
    _register(thread, stop)
    try:
        thread.start()
    except BaseException:
        _unregister(thread)
        raise
    try:
        while True:
            try:
                item = q.get(timeout=0.1)
            except queue.Empty:
                # Ended without a last word: stopped from outside (the interpreter's exit). A loop read
                # by another loader's thread ends so that this thread can end too; any other waits, as
                # it would for a batch (its loop must not go on as if the pass had ended).
                if thread.is_alive() or threading.current_thread() not in _PRODUCERS:
                    continue
                try:
                    item = q.get_nowait()  # what it put just before it ended
                except queue.Empty:
                    return
            if item is _DONE:
                return
            if isinstance(item, _Failure):
                raise item.exc
            yield item
    finally:
        stop.set()
        if thread is not threading.current_thread():
            # A loop left early (break) goes on once the thread has ended the batch it was reading: the
            # next pass must not share the source with it (a DataLoader with persistent workers hands
            # every pass the same iterator, and two readers at once break it).
            thread.join(EXIT_WAIT_S)
            if thread.is_alive():
                warnings.warn(f"accelport: an ap.loader prefetch thread was still reading a batch "
                              f"{EXIT_WAIT_S:g} s after its loop left it; a next pass over the same loader "
                              "may read beside it. "
                              "A source whose batches take that long should be read with prefetch=0.",
                              DiagnosticWarning, stacklevel=2)


def describe_loader(iterable: Any) -> dict[str, Any]:
    """What diagnostics need to know about a loader, read from its attributes."""
    info: dict[str, Any] = {"type": type(iterable).__name__}
    for key in ("num_workers", "batch_size", "drop_last"):
        if hasattr(iterable, key):
            info[key] = getattr(iterable, key)
    return info


def _tqdm() -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:
        from accelport.errors import AccelportError

        raise AccelportError("ap.loader(progress=True) needs tqdm: pip install tqdm") from None
    return tqdm


def _progress_bar(iterable: Any) -> Any:
    total = len(iterable) if hasattr(iterable, "__len__") else None
    # disable=None: quiet when the output is not a terminal (CI logs, files).
    return _tqdm()(total=total, unit="step", disable=None, dynamic_ncols=True)


def _advance(bar: Any, tracker: LoaderTracker, backend: Backend, base: Any) -> None:
    bar.update(1)
    if bar.n % 10 == 1 and not bar.disable:  # postfix formatting costs more than the update itself
        total = tracker.step_seconds or 1e-9
        compiles = backend.step_counters().get("compilations")
        bar.set_postfix(compiles=compiles - (base or 0) if compiles is not None else "-",
                        data_wait=f"{min(tracker.data_wait / total, 1.0):.0%}", refresh=False)

def shard_batches(iterable: Iterable[Any], rank: int, world: int) -> Iterator[Any]:
    """This replica's share of ``iterable``: batch ``rank`` of every run of ``world`` batches.

    A final run shorter than ``world`` is dropped on every replica, so all of them
    take the same number of steps (one replica stepping alone would wait forever
    in the gradient all-reduce).
    """
    it = iter(iterable)
    while True:
        run = list(itertools.islice(it, world))
        if len(run) < world:
            return
        yield run[rank]


def _unsharded_dataloader(iterable: Any) -> bool:
    """True for a torch DataLoader over a map-style dataset without a DistributedSampler."""
    data = sys.modules.get("torch.utils.data")
    if data is None or not isinstance(iterable, data.DataLoader):
        return False
    if isinstance(iterable.dataset, data.IterableDataset):
        return False  # it may shard itself (get_worker_info, rank); we cannot tell
    samplers = (iterable.sampler, getattr(iterable.batch_sampler, "sampler", None))
    return not any(isinstance(s, data.distributed.DistributedSampler) for s in samplers)


class _Busy:
    """How long the loader's source has been busy giving batches, in all (written by the thread that reads it)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.since: float | None = None  # when the fetch in progress started
        #: What the source raised (the pass then ends there, and ap.loader raises it in the loop).
        self.error: BaseException | None = None
        #: The loop left the pass: a group being read stops after the batch in hand (a break waits for one read).
        self.stopped = False

    def until(self, now: float) -> float:
        """Seconds busy up to ``now``, the fetch in progress included."""
        since = self.since
        return self.total + (now - since if since is not None else 0.0)


class BatchLook(Protocol):
    """The diagnostics' look at each host batch (:class:`accelport.observe.numerics.NumericsWatch`): what it hands
    back goes in the batch's signature's place, and the step tracker unpacks it."""

    def inspect(self, batch: Any, signature: Any) -> Any: ...

    def inspect_many(self, batches: list[Any], signatures: list[Any]) -> list[Any]: ...


def _signed(source: Iterable[Any], signatures: collections.deque[Any], busy: _Busy,
            look: BatchLook | None = None, ahead: int = 1) -> Iterator[Any]:
    """``source``, appending each batch's signature to ``signatures`` as it is read, and timing in ``busy`` how long
    the source took to give the batches.

    It runs where the backend reads its source: in the prefetch (or upload) thread
    when there is one, off the training loop's own thread. The host batch has the
    shapes and dtypes its device copy will have, and batches keep their order.
    Equal signatures come out as one object, so the loop compares them by identity.
    ``look.inspect(batch, signature)`` (the diagnostics' look at the host batch) may hand
    back something in the signature's place, which the step tracker unpacks.

    ``ahead`` > 1, for a backend that takes that many batches from its source at a time: they are read,
    signed and looked at together (``look.inspect_many``: one check of all their values), then handed on. A
    loop that leaves the pass (``busy.stopped``) stops a group's reading after the batch in hand.

    A ``None`` batch gets no signature (the loop takes none for it): torch_xla's loader drops it, and the
    signatures of the batches after it must stay theirs.

    An error of the source, or of the signature or the look at a batch, is kept for the loop (ap.loader raises
    it where the next batch would have come, after the batches before it), and the pass ends there: the thread
    that reads the source may not forward an error (torch_xla's ParallelLoader only prints it and ends the pass,
    as if the source had run out).
    """
    known: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    intern = known.setdefault
    clock = time.perf_counter
    it = iter(source)
    inspect = look.inspect if look is not None else None
    if ahead > 1 and look is not None:  # (without a look, a group would only make a break wait longer)
        while True:
            busy.since = start = clock()
            got: list[Any] = []
            try:
                while len(got) < ahead and not busy.stopped:
                    got.append(next(it))
            except StopIteration:
                pass
            except BaseException as exc:
                busy.error = exc
            if busy.stopped:
                return
            present = [batch for batch in got if batch is not None]  # (None: see below)
            try:
                sigs = look.inspect_many(present, [intern(sig := signature(batch), sig) for batch in present])
            except BaseException:  # one batch at a time: those before the one that fails go on, then its error
                sigs = []
                for i, batch in enumerate(got):
                    if batch is None:
                        continue
                    try:
                        sigs.append(look.inspect(batch, intern(sig := signature(batch), sig)))
                    except BaseException as exc:
                        busy.error = exc
                        del got[i:]
                        break
            signatures.extend(sigs)
            busy.total += clock() - start
            busy.since = None
            yield from got
            if len(got) < ahead or busy.error is not None:  # the source ran out, or raised
                return
    append = signatures.append
    while True:
        busy.since = start = clock()
        try:
            batch = next(it)
            if batch is not None:
                sig = intern(sig := signature(batch), sig)
                if inspect is not None:
                    sig = inspect(batch, sig)
        except StopIteration:
            busy.since = None
            return
        except BaseException as exc:
            busy.since = None
            busy.error = exc
            return
        if batch is not None:
            append(sig)
        busy.total += clock() - start
        busy.since = None
        yield batch


class DeviceLoader:
    """What ``ap.loader()`` returns: iterate it like the wrapped loader.

    Every ``iter()`` starts a new pass over the wrapped iterable (an epoch).
    ``len()`` is the wrapped loader's length (this replica's share with ``shard=True``).
    """

    def __init__(self, iterable: Iterable[Any], runtime: LoaderRun, prefetch: int | None = None,
                 shard: bool | None = None, progress: bool = False) -> None:
        if not hasattr(iterable, "__iter__"):
            raise TypeError(
                f"ap.loader() needs an iterable of batches (a DataLoader, a list, a generator), "
                f"not {type(iterable).__name__}"
            )
        if prefetch is not None and (not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0):
            raise ValueError(f"prefetch must be a non-negative int (batches to load ahead) or None "
                             f"(the backend's default), not {prefetch!r}")
        if not isinstance(progress, bool):
            raise TypeError(f"progress must be True or False, not {progress!r}")
        if shard is not None and not isinstance(shard, bool):
            raise TypeError(f"shard must be True, False or None, not {shard!r}")
        self.iterable = iterable
        self.prefetch = prefetch
        self.shard = shard
        self.progress = progress
        self._runtime = runtime
        if progress:
            _tqdm()  # fail now, at the call site, if tqdm is missing

    def __len__(self) -> int:
        n = len(self.iterable)  # type: ignore[arg-type]
        if self.shard:
            n //= self._runtime.backend().world_size()
        return n

    def _source(self, backend: Backend, iterable: Iterable[Any]) -> Iterable[Any]:
        world = backend.world_size()
        if world == 1:
            return iterable
        if self.shard:
            return shard_batches(iterable, backend.rank(), world)
        if self.shard is None and _unsharded_dataloader(self.iterable) and \
                self._runtime.first_time("unsharded-dataloader"):
            warnings.warn(
                f"ap.loader: this DataLoader has no DistributedSampler, so each of the {world} replicas "
                "reads the whole dataset and an epoch does no more than one replica would alone. "
                "Build it with sampler=torch.utils.data.DistributedSampler(dataset) (call "
                "sampler.set_epoch(epoch) each epoch), or pass ap.loader(..., shard=True) to split its "
                "batches between replicas; shard=False silences this warning.",
                DiagnosticWarning,
                stacklevel=3,
            )
        return iterable

    def __iter__(self) -> Iterator[Any]:
        runtime = self._runtime
        backend = runtime.backend()
        tracker = runtime.tracker
        tracker.loader_info = describe_loader(self.iterable)
        signatures: collections.deque[Any] = collections.deque()
        look = tracker.inspector()
        position = getattr(self, POSITION_ATTRIBUTE, None) or getattr(self.iterable, POSITION_ATTRIBUTE, None)
        source: Iterable[Any] = self.iterable
        if position is not None:  # a checkpointed run: this pass may resume one, and its batches are counted
            world = backend.world_size()
            source = position.begin(source, world if self.shard and world > 1 else 1)
        busy = _Busy()
        ahead = backend.loader_reads_ahead(self.prefetch)
        sharded = self._source(backend, source)
        signed = _signed(sharded, signatures, busy, look, ahead)
        wrapped = backend.wrap_loader(signed, prefetch=self.prefetch)
        it = iter(wrapped)
        del source, sharded, signed  # (a pass's generators) only what reads them holds them: a prefetch thread
        # lets go of them itself
        next_signature = signatures.popleft
        # Eager backends neither run a graph between batches nor defer a step's record.
        between = getattr(backend.end_of_batch, "__func__", None) is not Backend.end_of_batch or \
            getattr(backend.step_deferred, "__func__", None) is not Backend.step_deferred
        end_of_batch = backend.end_of_batch
        clock = time.perf_counter
        bar = _progress_bar(self) if self.progress else None
        first = True
        ended = False  # the source ran out (not a break, nor an error in the loop or at its sync)
        copied = backend.transfer_seconds  # the backend's copies of batches to the device so far
        try:
            while True:
                try:
                    if between and not first:
                        # The loop body is done with the previous batch; a lazy backend runs the
                        # step's graph now, and that (compile, dispatch) is not waiting for data.
                        end_of_batch()
                        tracker.synced()
                    first = False
                    t0 = clock()
                    before = busy.until(t0)
                    batch = next(it)
                except StopIteration:
                    raised: BaseException | None = busy.error
                    if raised is None:
                        ended = True
                        return
                except BaseException as exc:  # on XLA an out-of-memory error surfaces at the loop's sync
                    tracker.failed(exc)
                    raise
                else:
                    raised = None
                if raised is not None:  # the source raised: here, after the batches it gave before
                    busy.error = None
                    tracker.failed(raised)
                    raise raised
                now = clock()
                blocked = now - t0
                # Waiting for data is waiting while the source was busy giving batches: a loop that waited
                # longer, while its source had nothing to do, waited for a thread to be scheduled (a busy
                # machine), which more workers would not change. (Several batches may go up in one transfer:
                # all that the source did meanwhile counts.) Of the rest, what went to the backend's copies
                # of batches since the last one is transfer.
                wait = min(blocked, busy.until(now) - before)
                total = backend.transfer_seconds
                transfer = min(blocked - wait, total - copied) if total != copied else 0.0
                copied = total
                tracker.batch_arrived(wait, next_signature() if batch is not None else (), batch, blocked=blocked,
                                      transfer=transfer)
                if position is not None:
                    position.advance()
                if bar is not None:
                    _advance(bar, tracker, backend, runtime.baseline.get("compilations"))
                yield batch
        finally:
            busy.stopped = True  # (a group being read ends after the batch in hand)
            try:
                # The observers get every step of this loop now (see StepTracker). A pass left early (a break,
                # an error in the loop's body or at its sync) may leave a step midway: see flush's interrupted.
                runtime.tracker.flush(interrupted=not ended)
                if tracker is not runtime.tracker:
                    tracker.flush(interrupted=not ended)
            finally:
                try:
                    close = getattr(wrapped, "close", None)
                    if close is not None:  # (the backend's pass ends: its loader thread stops)
                        close()
                finally:
                    if bar is not None:
                        bar.close()
