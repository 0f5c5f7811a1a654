"""ap.loader: prefetching, wait accounting, signatures, failure and early exit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest

import accelport as ap
from accelport.device_loader import _PRODUCERS, _stop_producers_at_exit, prefetch_iter, signature
from accelport.errors import DiagnosticWarning
from tests.conftest import REPO


def test_signature_reads_shapes_and_dtypes_of_nested_batches() -> None:
    import torch

    batch = {"ids": torch.zeros(4, 7, dtype=torch.long), "extra": [torch.ones(4), 3, "text"]}
    assert signature(batch) == (((4, 7), "int64"), ((4,), "float32"))
    assert signature([1, 2]) == ()


def test_prefetch_preserves_order_and_items() -> None:
    assert list(prefetch_iter(range(50), depth=3)) == list(range(50))
    assert list(prefetch_iter(range(5), depth=0, transform=lambda v: v * 10)) == [0, 10, 20, 30, 40]


def test_producer_error_reaches_the_training_loop() -> None:
    def bad():  # type: ignore[no-untyped-def]
        yield 1
        raise KeyError("corrupt sample 17")

    it = prefetch_iter(bad(), depth=2)
    assert next(it) == 1
    with pytest.raises(KeyError, match="corrupt sample 17"):
        next(it)


def test_breaking_out_stops_the_producer_thread() -> None:
    produced = []

    def endless():  # type: ignore[no-untyped-def]
        i = 0
        while True:
            produced.append(i)
            yield i
            i += 1

    before = set(_PRODUCERS)
    it = prefetch_iter(endless(), depth=2)
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    [ours] = _new_producers(before)
    it.close()
    assert not ours.is_alive()  # the loop goes on once the thread has ended
    assert len(produced) <= 3 + 2 + 1  # consumed + queue depth + the one being put


#: A script whose prefetch thread is always inside torch ops (as a collate or a host-to-device copy is) when
#: the script ends as ``{end}`` says. A daemon thread inside a torch op when the interpreter finalises aborts
#: the process (SIGABRT), so the exit must stop it and wait for it.
_ENDS = """
import sys, torch, accelport as ap
def batches():
    x = torch.randn(256, 256)
    while True:
        for _ in range(1000):
            x = x.clone().mul_(1.0)
        yield x
{end}
"""


@pytest.mark.parametrize("end, status", [
    ("for b in ap.loader(batches(), prefetch=2): break", 0),  # the common `break`: the loop is closed
    ("it = iter(ap.loader(batches(), prefetch=2)); next(it)", 0),  # the loop is still open at exit
    ("for b in ap.loader(batches(), prefetch=2): raise SystemExit(3)", 3),
    ("for b in ap.loader(batches(), prefetch=2): raise KeyError('bad sample')", 1),  # its own traceback
])
def test_a_run_that_ends_while_its_prefetch_thread_runs_torch_ops_exits_with_its_own_status(
        end: str, status: int) -> None:
    script = textwrap.dedent(_ENDS).format(end=end)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert "terminate called" not in done.stderr
    assert done.returncode == status, done.stderr


def _new_producers(before: set[threading.Thread]) -> list[threading.Thread]:
    """The prefetch threads registered since ``before`` (other tests' may still be ending)."""
    return [t for t in set(_PRODUCERS) if t not in before]  # (a copy: a thread may leave meanwhile)


def test_at_exit_each_prefetch_thread_is_stopped_and_one_still_reading_is_named() -> None:
    reading, release = threading.Event(), threading.Event()
    produced = []

    def source():  # type: ignore[no-untyped-def]
        for i in range(1000):
            produced.append(i)
            if i == 3:
                reading.set()
                release.wait()  # a batch that takes longer than the exit waits
            yield i

    before = set(_PRODUCERS)
    it = prefetch_iter(source(), depth=2)
    try:
        assert next(it) == 0
        [ours] = _new_producers(before)
        assert reading.wait(300)  # (only a guard against a hang) the thread is inside batch 3, two ahead
        with pytest.warns(DiagnosticWarning, match=r"prefetch thread\(s\) still reading a batch after 0.2 s"):
            late = _stop_producers_at_exit(wait=0.2)  # the consumer never closed it: stopped all the same
        assert ours in late
    finally:
        release.set()
    ours.join()
    assert len(produced) == 4  # it stopped after the batch it was reading
    # (A loop still open then waits, as for a batch: it must not go on as if the pass had ended.)


@pytest.mark.parametrize("loop", ["closed", "open"])
def test_the_exit_also_waits_for_the_source_to_end_its_workers(loop: str) -> None:
    cleaning, release = threading.Event(), threading.Event()
    where = []

    def source():  # type: ignore[no-untyped-def]
        try:
            yield from range(1000)
        finally:  # as a DataLoader's iterator ends its worker processes when it goes
            where.append(threading.current_thread())
            cleaning.set()
            release.wait(300)

    def signed(batches):  # type: ignore[no-untyped-def]
        yield from batches  # as ap.loader hands the backend a generator over the loader

    before = set(_PRODUCERS)
    it = prefetch_iter(signed(source()), depth=2)
    try:
        assert next(it) == 0
        [ours] = _new_producers(before)
        closing = threading.Thread(target=it.close)
        if loop == "closed":  # a break: the thread lets go of the source as it stops, and the loop waits
            closing.start()
            assert cleaning.wait(300)  # (only a guard against a hang)
            assert closing.is_alive()
        # Open at exit (the loop still holds its iterator): the exit's stop makes the thread let go of it.
        with pytest.warns(DiagnosticWarning, match="still reading a batch"):
            late = _stop_producers_at_exit(wait=0.2)
        assert cleaning.wait(60), "the source was never let go of"
        assert where == [ours]  # in the prefetch thread, which the exit waits for: not later, at finalisation
        assert ours in late  # still counted while the source ends
    finally:
        release.set()
    ours.join()
    if loop == "closed":
        closing.join()
    else:
        it.close()


def _persistent_pass_data() -> object:
    import torch

    class Slow(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> object:
            time.sleep(0.2)  # the prefetch thread is inside a batch when the loop leaves the pass
            return torch.tensor(i)

    return torch.utils.data.DataLoader(Slow(), batch_size=1, num_workers=1, persistent_workers=True)


def test_a_pass_left_early_leaves_the_next_pass_the_whole_loader() -> None:
    ap.use("cpu")
    loop = ap.loader(_persistent_pass_data(), prefetch=2)
    for i, _ in enumerate(loop):
        if i == 1:
            break  # the usual "steps per epoch" cut
    # Persistent workers: every pass reads one iterator. The first pass's thread used to be still reading it
    # as the next pass reset it ("Invalid iterator state: shutdown or no outstanding tasks").
    assert [int(b) for b in loop] == list(range(8))


def test_a_loader_read_by_another_loaders_thread_does_not_hold_the_exit() -> None:
    before = set(_PRODUCERS)
    outer = prefetch_iter(prefetch_iter(iter(range(10**9)), depth=2), depth=2)
    assert next(outer) == 0
    inner_and_outer = _new_producers(before)
    assert len(inner_and_outer) == 2
    # Stopped from outside, the inner loop ends the outer thread's read instead of leaving it waiting.
    late = _stop_producers_at_exit(wait=300)  # (the limit only guards a hang)
    assert not set(inner_and_outer) & set(late)
    assert not any(t.is_alive() for t in inner_and_outer)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_a_forked_child_has_no_prefetch_threads_of_its_parent() -> None:
    release = threading.Event()

    def source():  # type: ignore[no-untyped-def]
        yield 0
        release.wait()
        yield 1

    it = prefetch_iter(source(), depth=1)
    try:
        assert next(it) == 0
        pid = os.fork()
        if pid == 0:  # the child: nothing to stop, and the registry's lock is free
            os._exit(0 if not _stop_producers_at_exit(wait=0) and not _PRODUCERS else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        release.set()
        it.close()


def test_bad_prefetch_and_non_iterables_are_rejected_with_advice() -> None:
    with pytest.raises(ValueError, match="non-negative int"):
        ap.loader([1], prefetch=-1)
    with pytest.raises(TypeError, match="iterable of batches"):
        ap.loader(42)  # type: ignore[arg-type]


def test_data_wait_is_measured_and_signatures_counted() -> None:
    import torch

    def slow():  # type: ignore[no-untyped-def]
        for n in (3, 3, 5):
            time.sleep(0.05)
            yield torch.zeros(n)

    ap.use("cpu")
    weight = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    out = []
    for batch in ap.loader(slow(), prefetch=0):
        out.append(batch.shape[0])
        (weight * batch.sum()).backward()
        ap.optimizer_step(optimizer)
    m = ap.metrics()
    assert out == [3, 3, 5]
    assert m.data_wait_seconds >= 0.15 * 0.9  # the sleeps happened while the loop waited
    assert m.batch_signatures == 2  # the shapes of the training steps' batches: (3,) and (5,)


def test_len_passes_through_and_each_iteration_is_a_new_epoch() -> None:
    ap.use("cpu")
    dl = ap.loader([1, 2, 3])
    assert len(dl) == 3
    assert list(dl) == [1, 2, 3] and list(dl) == [1, 2, 3]


def test_end_of_batch_runs_between_batches_outside_the_data_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from accelport import device_loader as _loader

    backend = ap.use("cpu")
    now = [0.0]
    calls: list[float] = []

    def end_of_batch() -> None:  # a lazy backend would run the step's graph here
        calls.append(now[0])
        now[0] += 100.0

    monkeypatch.setattr(_loader, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(backend, "end_of_batch", end_of_batch)
    assert list(ap.loader([1, 2, 3], prefetch=0)) == [1, 2, 3]
    assert len(calls) == 3  # before the 2nd and 3rd batch, and before the end
    assert ap.metrics().data_wait_seconds == 0.0


def test_progress_bar_counts_steps_and_shows_compilations_and_data_wait(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import io

    import tqdm.auto

    import accelport.device_loader as loader_mod

    stream = io.StringIO()
    real = tqdm.auto.tqdm
    bars = []

    def make(**kw):  # type: ignore[no-untyped-def]
        kw["disable"] = False  # a StringIO is no terminal: force the bar on to read it
        bar = real(file=stream, mininterval=0, **kw)
        bars.append(bar)
        return bar

    monkeypatch.setattr(loader_mod, "_tqdm", lambda: make)
    ap.use("cpu")
    import torch

    for _ in ap.loader([torch.zeros(2)] * 12, progress=True):
        ap.optimizer_step(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    assert bars[0].n == 12 and bars[0].total == 12
    text = stream.getvalue()
    assert "compiles=0" in text and "data_wait=" in text


def test_progress_bar_is_quiet_without_a_terminal(capsys) -> None:  # type: ignore[no-untyped-def]
    ap.use("cpu")
    assert list(ap.loader([1, 2, 3], progress=True)) == [1, 2, 3]
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


def test_progress_without_tqdm_says_how_to_install(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import sys

    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with pytest.raises(ap.AccelportError, match="pip install tqdm"):
        ap.loader([1], progress=True)


def _lazy_look() -> Any:
    """The step checks' look at host batches, as on a lazy backend (its checks are deferred)."""
    import types

    from accelport.observe.numerics import NumericsWatch

    return NumericsWatch(types.SimpleNamespace(lazy=True, name="xla"))


def test_batches_read_together_keep_their_order_and_the_one_with_a_nan_is_named() -> None:
    # XLA's loader takes 8 batches at a time: they are read, signed and looked at together (one check of all their
    # values), and a batch with a NaN is still named as when each is looked at alone.
    import collections

    import torch

    from accelport.device_loader import _Busy, _signed
    from accelport.observe.numerics import Inspected

    batches = [(torch.full((4, 3), float(i)), torch.arange(4)) for i in range(7)]
    batches[4][0][1, 2] = float("nan")
    sigs: collections.deque[Any] = collections.deque()
    busy = _Busy()
    look = _lazy_look()
    got = list(_signed(iter(batches), sigs, busy, look, 3))
    assert got == batches and busy.error is None
    assert [isinstance(s, Inspected) for s in sigs] == [i == 4 for i in range(7)]
    assert sigs[4].info == "input 0: 1 of 12 values are NaN or Inf"
    assert all(s is sigs[0] for i, s in enumerate(sigs) if i != 4)  # equal shapes: one signature object
    alone = [look.inspect(batch, signature(batch)) for batch in batches]  # one at a time: the same verdicts
    assert [getattr(s, "info", None) for s in alone] == [getattr(s, "info", None) for s in sigs]


def test_batches_read_together_of_two_float_dtypes_are_looked_at_one_by_one() -> None:
    import collections

    import torch

    from accelport.device_loader import _Busy, _signed
    from accelport.observe.numerics import Inspected

    batches = [(torch.zeros(2, 3), torch.zeros(2, dtype=torch.float64)) for _ in range(4)]
    batches[2][1][0] = float("inf")
    sigs: collections.deque[Any] = collections.deque()
    assert list(_signed(iter(batches), sigs, _Busy(), _lazy_look(), 8)) == batches
    assert [s.info if isinstance(s, Inspected) else None for s in sigs] == \
        [None, None, "input 1: 1 of 2 values are NaN or Inf", None]


def test_batches_read_together_end_at_a_source_error_after_the_batches_before_it() -> None:
    import collections

    import torch

    from accelport.device_loader import _Busy, _signed

    def source() -> Any:
        for i in range(7):
            if i == 5:
                raise ValueError("bad sample 5")
            yield (torch.full((2,), float(i)),)

    sigs: collections.deque[Any] = collections.deque()
    busy = _Busy()
    got = list(_signed(source(), sigs, busy, _lazy_look(), 3))
    assert [int(x[0]) for (x,) in got] == [0, 1, 2, 3, 4] and len(sigs) == 5
    assert isinstance(busy.error, ValueError) and str(busy.error) == "bad sample 5"  # (ap.loader raises it)


def test_a_group_being_read_stops_after_the_batch_in_hand_once_the_loop_left() -> None:
    # A loop that breaks waits for one read of its source, as when batches are read one at a time, not for a group.
    import collections

    from accelport.device_loader import _Busy, _signed

    busy = _Busy()
    read: list[int] = []

    def source() -> Any:
        for i in range(10):
            read.append(i)
            if i == 1:
                busy.stopped = True  # (what ap.loader sets as the loop leaves the pass)
            yield (i,)

    assert list(_signed(source(), collections.deque(), busy, _lazy_look(), 8)) == []
    assert read == [0, 1]


@pytest.mark.parametrize("ahead", [1, 3])
def test_an_error_of_the_look_at_a_batch_ends_the_pass_after_the_batches_before_it(ahead: int) -> None:
    # In torch_xla's reading thread an error would only be printed, and the pass would end as if the data had run
    # out: it is kept for the loop instead, as the source's own errors are.
    import collections

    import torch

    from accelport.device_loader import _Busy, _signed

    look = _lazy_look()
    plain = look.inspect

    def inspect(batch: Any, sig: Any) -> Any:
        if int(batch[0][0]) == 4:
            raise RuntimeError("the look failed on batch 4")
        return plain(batch, sig)

    look.inspect = inspect  # type: ignore[method-assign]
    look.inspect_many = lambda batches, sigs: [  # type: ignore[method-assign]
        inspect(b, s) for b, s in zip(batches, sigs, strict=True)]
    batches = [(torch.full((2,), float(i)),) for i in range(7)]
    sigs: collections.deque[Any] = collections.deque()
    busy = _Busy()
    got = list(_signed(iter(batches), sigs, busy, look, ahead))
    assert got == batches[:4] and len(sigs) == 4
    assert str(busy.error) == "the look failed on batch 4"


def test_the_look_at_a_batch_of_a_dtype_without_a_sum_passes_it_over() -> None:
    import torch

    from accelport.observe.numerics import _check_batch

    assert _check_batch((torch.zeros(4, dtype=torch.float8_e4m3fn), torch.arange(4))) == (None, False)
