"""``ap.Checkpointer``: a run that checkpoints itself, resumes where it stopped, and saves when asked to stop.

    ckpt = ap.Checkpointer("ckpt/", every_steps=500)
    start = ckpt.restore(model=model, optimizer=opt, scheduler=sched, loader=train_loader)
    for step, (x, y) in enumerate(ap.loader(train_loader), start):
        ...
        ap.optimizer_step(opt)
        ckpt.step()        # saves when due, and at once after a stop request (SIGTERM), then exits

One checkpoint is a directory ``step-<8 digits>/`` under the checkpointer's directory:

    state             model, optimizer, scheduler state and the step, through ap.save: one file, or
                      the directory of shards every rank writes when the model is sharded (DCP)
    rank-<r>.pt       rank r's own: every RNG state and the data position
    checkpoint.json   written last, by rank 0, once every rank's part is in place: the step, the
                      world size, and every file with its size

``checkpoint.json`` is also what marks a directory as the checkpointer's: it is written
first, saying the save has begun, and replaced last by the complete one. A directory
whose ``checkpoint.json`` says its save did not finish, or whose files are not all there
at the sizes it lists, is torn (a kill during the save, a copy cut short):
:meth:`Checkpointer.restore` skips it with a :class:`~accelport.errors.CheckpointWarning`
and takes the newest complete one. A ``step-N`` directory without accelport's
``checkpoint.json`` (another tool's checkpoint, a user's results) is foreign: it is
ignored, never removed, and never saved over.

The data position is kept by the loader given to ``restore``, while its batches come
through ``ap.loader``: how many batches of the pass in progress the loop consumed and
what its order was drawn from (the RNG states at the start of the pass), so a resumed
run reads the rest of the same pass in the same order, without loading the batches it
skips. torchdata's ``StatefulDataLoader`` keeps its own position (``state_dict()``).

Nothing here imports torch at import time: ``accelport doctor`` lists checkpoints with
:func:`find_checkpoints`.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import signal
import socket
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from accelport.device_loader import POSITION_ATTRIBUTE
from accelport.errors import AccelportError, CheckpointError, CheckpointWarning, UsageError, warn_user
from accelport.launch.stop import EXIT_PREEMPTED, deadline_s, record_stop, signal_name, unsaved_status
from accelport.safe_io import fsync_dir, remove_own_temps

__all__ = ["Checkpointer", "CHECKPOINT_DIR_ENV", "EXIT_PREEMPTED", "Found", "find_checkpoints", "newest_complete"]

#: Where checkpoints go when ``Checkpointer()`` is given no directory; ``accelport doctor`` reports it.
CHECKPOINT_DIR_ENV = "ACCELPORT_CHECKPOINT_DIR"
MARKER = "checkpoint.json"
FORMAT = "accelport.run"
STATE = "state"
_PREFIX = "step-"
#: Seconds between two agreements of the ranks on a stop request or a time-based save (several ranks).
AGREE_INTERVAL_S = 0.25


# -- what is on disk (torch-free) ------------------------------------------------------------------


@dataclass(frozen=True)
class Found:
    """One checkpoint directory as found on disk."""

    path: str
    step: int
    #: Whether it may be loaded: its checkpoint.json is there and every file it lists, at its size.
    complete: bool
    #: Why it is not complete ("" when it is).
    problem: str = ""
    #: When it was completed (seconds since the epoch), from checkpoint.json.
    time: float | None = None
    world_size: int | None = None
    #: Not written by accelport (no checkpoint.json of its own): never loaded, removed or replaced.
    foreign: bool = False


def _step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"{_PREFIX}{step:08d}")


def _read_marker(path: str) -> tuple[dict[str, Any] | None, str]:
    """``path``'s checkpoint.json when accelport wrote it, else None and why it is not accelport's."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            marker = json.load(f)
    except FileNotFoundError:
        return None, f"it has no {MARKER}"
    except (OSError, ValueError) as exc:
        return None, f"its {MARKER} cannot be read ({type(exc).__name__}: {_first_line(exc)})"
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        return None, f"its {MARKER} is not one accelport wrote"
    return marker, ""


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _empty(path: str) -> bool:
    try:
        return not os.listdir(path)
    except OSError:
        return False


def _check(path: str, step: int) -> Found:
    marker, why = _read_marker(path)
    if marker is None:
        if why == f"it has no {MARKER}" and _empty(path):  # a save killed as it made the directory
            return Found(path, step, False, f"it has no {MARKER} and is empty: its save did not finish (killed, or out "
                                             "of space)")
        return Found(path, step, False, f"{why}: accelport did not write it", foreign=True)
    if not isinstance(marker.get("files"), dict):
        return Found(path, step, False, f"its {MARKER} says its save did not finish (killed, or out of space)")
    for name, size in sorted(marker["files"].items()):
        try:
            held = os.path.getsize(os.path.join(path, name))
        except OSError:
            return Found(path, step, False, f"{name} is missing")
        if held != size:
            return Found(path, step, False, f"{name} holds {held} bytes, not the {size} it was saved with")
    when = marker.get("time")
    world = marker.get("world_size")
    return Found(path, step, True, "", float(when) if isinstance(when, (int, float)) else None,
                 world if isinstance(world, int) else None)


class _Damaged(Exception):
    """A complete checkpoint whose files do not hold what it says (the message: what is wrong)."""


def _damage(found: Found) -> str:
    """What is wrong with the complete checkpoint ``found`` beyond its sizes ("" if nothing): a file that
    must be there and is not listed, or a byte changed in a file torch wrote (the CRC32 each of its zip
    archive's members carries). (The shards of a sharded state carry no checksum.)"""
    import zipfile

    marker, why = _read_marker(found.path)
    if marker is None:
        return why
    files = marker.get("files") or {}
    world = found.world_size or 1
    needed = [STATE] + [f"rank-{r}.pt" for r in range(world)]
    for name in needed:
        if name not in files and not any(n.startswith(name + "/") for n in files):
            return f"its {MARKER} does not list {name}, which every checkpoint holds"
    for name in sorted(files):
        full = os.path.join(found.path, name)
        if name != STATE and not name.endswith(".pt"):
            continue
        if name == STATE and os.path.isdir(full):
            continue
        try:
            with zipfile.ZipFile(full) as archive:
                bad = archive.testzip()
        except (OSError, zipfile.BadZipFile, ValueError, EOFError, RuntimeError) as exc:
            return f"{name} is not the archive torch wrote ({_first_line(exc)})"
        if bad is not None:
            return f"{name} does not hold the bytes it was saved with ({bad} fails its CRC32 check)"
    return ""


def _remove_ours(path: str) -> None:
    """Remove the checkpoint directory ``path`` if accelport wrote it (its marker), or if it is empty."""
    if _read_marker(path)[0] is not None:
        shutil.rmtree(path, ignore_errors=True)
        return
    try:
        os.rmdir(path)  # only ever an empty one: a save killed as it made the directory
    except OSError:
        pass


def find_checkpoints(directory: str | os.PathLike[str]) -> list[Found]:
    """Every ``step-N`` directory under ``directory``, oldest step first, each checked for completeness."""
    directory = os.fspath(directory)
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        number = name[len(_PREFIX):]
        path = os.path.join(directory, name)
        if name.startswith(_PREFIX) and number.isdigit() and os.path.isdir(path):
            found.append(_check(path, int(number)))
    return sorted(found, key=lambda f: f.step)


def newest_complete(found: Sequence[Found]) -> Found | None:
    """The newest complete checkpoint of ``found``, or None."""
    return next((f for f in reversed(found) if f.complete), None)


# -- the data position --------------------------------------------------------------------------

_END = object()


class _Skipped:
    """A sampler (or batch sampler) less its first ``skip`` items: indices only, no sample is loaded.

    ``before``: run as the order is drawn (after the DataLoader's iterator has drawn its workers' seed),
    to give the sampler the RNG states the original pass drew its order from."""

    def __init__(self, sampler: Any, skip: int, before: Callable[[], None] | None = None) -> None:
        self.sampler, self.skip, self.before = sampler, skip, before

    def __iter__(self) -> Iterator[Any]:
        if self.before is not None:
            self.before()
        it = iter(self.sampler)  # the order is drawn here, as the original pass drew it
        for _ in range(self.skip):
            if next(it, _END) is _END:
                return
        yield from it

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)


class _IgnoreStop:
    """A DataLoader's ``worker_init_fn`` that leaves the stop signals to the main process.

    torchrun signals a worker's whole process group; a loader worker killed by it would
    fail the training step before it reaches the boundary where the checkpoint is saved.
    So the loader worker blocks the stop signals and a thread of its own waits for them:
    one sent by the process that started it (the DataLoader ending its workers, Python's
    multiprocessing at exit) ends it as the signal would; one from anyone else (torchrun,
    the platform, a terminal) is left to the main process.
    """

    def __init__(self, inner: Any, signals: tuple[int, ...]) -> None:
        self.inner, self.signals = inner, signals

    def __call__(self, worker_id: int) -> None:
        if hasattr(signal, "sigwaitinfo") and hasattr(signal, "pthread_sigmask"):
            parent = os.getppid()
            wanted = set(self.signals)
            signal.pthread_sigmask(signal.SIG_BLOCK, wanted)  # threads started after this inherit it

            def watch() -> None:
                while True:
                    info = signal.sigwaitinfo(wanted)
                    if info.si_pid == parent or os.getppid() != parent:
                        os._exit(128 + info.si_signo)

            threading.Thread(target=watch, name="accelport-loader-worker-stop", daemon=True).start()
        if self.inner is not None:
            self.inner(worker_id)


def _generators(loader: Any) -> dict[str, Any]:
    """The torch.Generator objects a DataLoader's order is drawn from, by where they are."""
    import torch

    found: dict[str, Any] = {}
    seen: set[int] = set()
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    for name, owner in (("loader", loader), ("sampler", sampler), ("batch_sampler", batch_sampler),
                        ("batch_sampler.sampler", getattr(batch_sampler, "sampler", None))):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator) and id(g) not in seen:
            seen.add(id(g))
            found[name] = g
    return found


def _persistent(loader: Any) -> bool:
    """Whether ``loader`` keeps its iterator (and workers) from pass to pass (``persistent_workers=True``)."""
    return bool(getattr(loader, "persistent_workers", False)) and int(getattr(loader, "num_workers", 0) or 0) > 0


def _epoch_owner(loader: Any) -> Any:
    """The sampler whose ``set_epoch`` picks the order (DistributedSampler), or None."""
    for owner in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if callable(getattr(owner, "set_epoch", None)) and isinstance(getattr(owner, "epoch", None), int):
            return owner
    return None


def _loader_kind(loader: Any) -> str:
    data = sys.modules.get("torch.utils.data")
    if callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None)):
        return "stateful"  # torchdata's StatefulDataLoader, or any loader that keeps its own position
    if data is not None and isinstance(loader, data.DataLoader):
        return "iterable" if isinstance(loader.dataset, data.IterableDataset) else "map"
    if isinstance(loader, Sequence):
        return "sequence"
    return "iterable"


class _Position:
    """Where the training loop is in one loader: the pass (epoch), and the batches it consumed of it.

    ``ap.loader`` calls :meth:`begin` when a pass starts (it returns what to read: the
    loader itself, or the rest of a pass resumed from a checkpoint) and :meth:`advance`
    for every batch it hands to the loop. What is read ahead in a prefetch thread is not
    consumed until the loop gets it.
    """

    def __init__(self, loader: Any, kind: str) -> None:
        self.loader, self.kind = loader, kind
        self.epoch = -1
        self.consumed = 0
        self._per_batch = 1
        self._length: int | None = None
        self._start: dict[str, Any] | None = None  # map: the RNG states the pass in progress was drawn from
        self._exhausted = False  # map: the pass in progress has run its sampler out
        self._snapshots: deque[Any] = deque()  # stateful: the loader's state after each batch read
        self._state: Any = None  # stateful: after the last batch consumed
        self._live = True  # stateful: read in the loop's own thread, so its state_dict() is the loop's position
        self._consumer: int | None = None
        self._resume: dict[str, Any] | None = None
        #: Whether the loop read the loader through ap.loader (else its position is never known).
        self.read = False
        #: map, resumed: the passes after the resumed one reuse the loader's iterator, as they did in the
        #: run that was stopped (its first pass made it); made, without a draw, before the next pass.
        self._warm = False
        #: Batches the loop reads of a pass at most (restore's ``batches_per_pass``), or None: the whole pass.
        self.max_batches: int | None = None

    # -- ap.loader's side -----------------------------------------------------------------------
    def begin(self, iterable: Iterable[Any], per_batch: int) -> Iterable[Any]:
        self.read = True
        self._per_batch = per_batch
        self._consumer = threading.get_ident()
        resume, self._resume = self._resume, None
        if self.kind == "map":
            read = self._map_pass(resume)
        elif self.kind == "stateful":
            read = self._stateful_pass(resume)
        elif self.kind == "sequence":
            read = self._sequence_pass(iterable, resume)
        else:
            read = self._plain_pass(iterable, resume)
        return read if self.max_batches is None else self._limited(read, self.max_batches * per_batch)

    def _limited(self, items: Iterable[Any], limit: int) -> Iterator[Any]:
        """``items`` ended once the pass holds ``limit`` source batches, those consumed before a resume
        included: a resumed pass reads only the rest of the batches the stopped run's pass would have read."""
        it = iter(items)
        first = next(it, _END)  # the pass starts here: its position (a resumed one's batches consumed) is set
        if first is _END:
            return
        read = self.consumed
        if read >= limit:
            return
        yield first
        read += 1
        while read < limit:  # checked before the next batch is read: none is loaded past the end
            batch = next(it, _END)
            if batch is _END:
                return
            read += 1
            yield batch

    def advance(self) -> None:
        self.consumed += self._per_batch
        # One snapshot per source batch read: a sharded loop's batch is the last of its run of per_batch.
        snapshots = self._snapshots
        for _ in range(min(self._per_batch, len(snapshots))):
            self._state = snapshots.popleft()

    def _length_of(self, loader: Any) -> int | None:
        try:
            return len(loader)
        except TypeError:
            return None

    def _map_pass(self, resume: dict[str, Any] | None) -> Iterator[Any]:
        loader = self.loader
        self._length = self._length_of(loader)
        if resume is None or not resume.get("consumed"):
            self.epoch = resume["next"] if resume is not None else self.epoch + 1
            self.consumed = 0
            if self._warm:
                self._warm = False
                _keep_iterator(loader, lambda: self._capture(loader), lambda states: self._apply(loader, states))
            self._start = self._capture(loader)
            self._exhausted = False
            yield from self._run_out(iter(loader), self._length)
            return
        # The rest of the pass in progress at the checkpoint: its order drawn again from the
        # same RNG states, its first batches skipped as indices, never loaded.
        self.epoch, self.consumed, self._start = resume["epoch"], resume["consumed"], resume["start"]
        training = _host_rng()  # restored at restore(): what the loop draws from next
        start = self._start
        if start.get("fresh", True):
            self._apply(loader, start)
            it = iter(_remaining(loader, self.consumed))
        else:  # a persistent iterator's later pass: the order alone was drawn from these states
            it = iter(_remaining(loader, self.consumed, before=lambda: self._apply(loader, start)))
        try:
            first = next(it, _END)  # the pass's own draws (its order, the workers' seed) happen here
        finally:
            _set_host_rng(training)
        self._exhausted = first is _END
        if first is _END:
            return
        left = self._length - self.consumed if self._length is not None else None
        yield from self._run_out(itertools.chain([first], it), left)

    def _run_out(self, it: Iterator[Any], left: int | None) -> Iterator[Any]:
        """``it``'s batches, of which ``left`` are left by ``len()``. The one after the last is asked for before
        the last is handed out: the sampler runs out there, drawing what it draws then (RandomSampler draws once
        more), so a checkpoint at the last batch holds the generators as the next pass finds them, whether or not
        the loop asks for another batch (a loop may leave a pass at its last batch)."""
        n = 0
        for batch in it:
            n += 1
            if left is not None and n >= left:
                after = next(it, _END)  # past the sampler's end: indices only, no sample is loaded
                if after is _END:
                    self._exhausted = True
                    yield batch
                    return
                left = None  # len() was short of the truth: read on as it comes
                yield batch
                yield after
                continue
            yield batch
        self._exhausted = True

    def _capture(self, loader: Any) -> dict[str, Any]:
        owner = _epoch_owner(loader)
        # A DataLoader's new iterator draws its workers' base seed before the sampler draws the order; a
        # persistent one's later passes reuse the iterator (DataLoader.__iter__: _iterator._reset) and draw
        # the order alone. Which of the two this pass was decides how a resumed pass draws it again.
        fresh = not (_persistent(loader) and getattr(loader, "_iterator", None) is not None)
        # (Python's and numpy's generators too: a sampler may shuffle with them.)
        return {**_host_rng(), "generators": {k: g.get_state() for k, g in _generators(loader).items()},
                "sampler_epoch": owner.epoch if owner is not None else None, "fresh": fresh}

    def _apply(self, loader: Any, states: Mapping[str, Any]) -> None:
        _set_host_rng(states)
        for name, g in _generators(loader).items():
            if name in states.get("generators", {}):
                g.set_state(states["generators"][name])
        owner = _epoch_owner(loader)
        if owner is not None and isinstance(states.get("sampler_epoch"), int):
            owner.set_epoch(states["sampler_epoch"])

    def _stateful_pass(self, resume: dict[str, Any] | None) -> Iterator[Any]:
        loader = self.loader
        self._length = self._length_of(loader)
        # This pass's own: a previous pass's prefetch thread, still reading when its loop left it (a break),
        # appends to its own pass's deque, never to this one.
        snapshots: deque[Any] = deque()
        self._snapshots = snapshots
        self._state = None
        # Read ahead in another thread (a prefetch thread), the loader's state is past the loop's: keep its
        # state after each batch (state_dict() costs about a batch's loading), to hand the loop's on.
        self._live = threading.get_ident() == self._consumer
        resumed = resume is not None and resume.get("state") is not None
        if resumed:
            assert resume is not None
            loader.load_state_dict(resume["state"])
            self.epoch, self.consumed = resume["epoch"], resume["consumed"]
        else:
            self.epoch = resume["next"] if resume is not None else self.epoch + 1
            self.consumed = 0
        if resumed:
            import torch

            # A pass that goes on: what its iterator draws as it starts again (the workers' base seed) was
            # drawn when the pass began, before the RNG state the loop continues from.
            training = torch.get_rng_state()
            try:
                it = iter(loader)
                first = next(it, _END)
            finally:
                torch.set_rng_state(training)
        else:
            it = iter(loader)
            first = next(it, _END)
        if first is _END and resumed:
            # The pass had ended at the checkpoint: the next one starts, as it would have.
            self.epoch, self.consumed = self.epoch + 1, 0
            it = iter(loader)
            first = next(it, _END)
        if first is _END:
            return
        if self._live:
            yield first
            yield from it
            return
        snapshots.append(loader.state_dict())
        yield first
        for batch in it:
            snapshots.append(loader.state_dict())  # in the thread that reads the loader
            yield batch

    def _sequence_pass(self, items: Iterable[Any], resume: dict[str, Any] | None) -> Iterator[Any]:
        skip = int(resume.get("consumed") or 0) if resume is not None else 0
        self.epoch = resume["next"] if resume is not None else self.epoch + 1
        self.consumed = skip
        self._length = self._length_of(items)
        yield from itertools.islice(items, skip, None)

    def _plain_pass(self, items: Iterable[Any], resume: dict[str, Any] | None) -> Iterator[Any]:
        self.epoch = resume["next"] if resume is not None else self.epoch + 1
        self.consumed = 0
        yield from items

    # -- the checkpointer's side -------------------------------------------------------------------
    def ended(self) -> bool:
        """Whether the pass in progress can give the loop no further batch."""
        if self.max_batches is not None and self.consumed >= self.max_batches * self._per_batch:
            return True
        return self._length is not None and self._length - self.consumed < self._per_batch

    def _shape(self) -> dict[str, int | None]:
        """What a pass's batches are cut from: the batch size, the dataset's length, the batches a pass holds."""
        loader = self.loader
        batch_size = getattr(loader, "batch_size", None)
        return {"batch_size": batch_size if isinstance(batch_size, int) else None,
                "dataset_length": self._length_of(getattr(loader, "dataset", None)) if hasattr(loader, "dataset")
                else None,
                "batches": self._length_of(loader)}

    def refusal(self, saved: Mapping[str, Any], path: str) -> str:
        """Why the pass in progress in ``saved`` cannot go on with this loader ("" if it can): another batch
        size or dataset length would skip or repeat samples, since the position is kept in batches."""
        if saved.get("kind") != self.kind or self.kind == "iterable" or saved.get("ended") \
                or not int(saved.get("consumed") or 0):
            return ""
        now = self._shape()
        names = {"batch_size": "batch size", "dataset_length": "dataset length", "batches": "batches a pass"}
        changed = [(names[k], saved[k], now[k]) for k in names
                   if isinstance(saved.get(k), int) and isinstance(now[k], int) and saved[k] != now[k]]
        if not changed:
            return ""
        said = ", ".join(f"{name} {was} then, {is_} now" for name, was, is_ in changed)
        return (f"ap.Checkpointer: {path} was saved {saved['consumed']} batches into pass {saved.get('epoch')}, and "
                f"the loader given to restore() differs ({said}): the position is kept in batches, so going on with "
                "this loader would skip or repeat samples of that pass. Resume with the loader as it was saved (the "
                "same batch size and dataset) at least to the end of that pass, or start from another directory")

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "epoch": self.epoch, "consumed": self.consumed,
                               "ended": self.ended(), **self._shape()}
        if self.kind == "map":
            out["start"] = self._start
            out["now"] = {"generators": {k: g.get_state() for k, g in _generators(self.loader).items()}}
            out["exhausted"], out["per_batch"] = self._exhausted, self._per_batch
        elif self.kind == "stateful":
            out["state"] = self.loader.state_dict() if self._live else self._state
        return out

    def resume_at(self, saved: Mapping[str, Any]) -> str:
        """Continue from ``saved`` at the next pass; returns what a resumed run cannot restore ("" if none)."""
        epoch, consumed, ended = int(saved.get("epoch", -1)), int(saved.get("consumed", 0)), bool(saved.get("ended"))
        self._resume = None
        if epoch < 0:
            return ""
        if saved.get("kind") != self.kind:
            self.epoch = epoch if ended else epoch - 1
            return ("" if ended or not consumed else
                    f"the checkpoint's data position is of a {saved.get('kind')} loader and this one is {self.kind}: "
                    "the pass in progress starts again from its first batch")
        if self.kind == "map":
            start = saved.get("start")
            # A pass that ended with source batches left unread (a sharded loop drops a last short run of them):
            # the loop's next read runs the sampler out. One it left early (batches_per_pass) never does.
            limited = self.max_batches is not None and consumed >= self.max_batches * int(saved.get("per_batch") or 1)
            unread = ended and not saved.get("exhausted") and not limited
            try:
                drawn = unread and isinstance(start, Mapping) and self._draw_to_end(start)
            except Exception:  # noqa: BLE001 - a sampler that cannot run again here: the state at the last batch
                drawn = False
            if not drawn:
                self._apply(self.loader, dict(saved.get("now") or {}))
            self._warm = _persistent(self.loader)
        if self.kind == "stateful" and saved.get("state") is not None:
            # The loader's own state, even at the end of a pass: its order for the next one depends on it.
            self._resume = {"epoch": epoch, "next": epoch + 1 if ended else epoch, "consumed": consumed,
                            "state": saved["state"]}
            return ""
        if ended:
            self.epoch = epoch  # the next pass is a new one
            return ""
        self._resume = {"epoch": epoch, "next": epoch, "consumed": consumed, "start": saved.get("start")}
        if self.kind == "iterable" and consumed:
            self._resume["consumed"] = 0
            return (f"{type(self.loader).__name__} over an iterable dataset keeps no position: the pass in progress "
                    f"at the checkpoint (epoch {epoch}, {consumed} batches in) starts again from its first batch; "
                    "torchdata's StatefulDataLoader resumes such a dataset where it was")
        return ""

    def _draw_to_end(self, start: Mapping[str, Any]) -> bool:
        """Leave the loader's generators as a pass read to its end left them: its order drawn again from the
        states it started from, every index skipped, nothing loaded. The state saved before its sampler ran out
        is not that: a sampler draws again as it runs out (RandomSampler's last ``randperm``)."""
        loader = self.loader
        training = _host_rng()
        try:
            if start.get("fresh", True):
                self._apply(loader, start)
                skipped = _remaining(loader, sys.maxsize, load=False)
            else:  # a persistent iterator's later pass drew its order alone
                skipped = _remaining(loader, sys.maxsize, before=lambda: self._apply(loader, start), load=False)
            for _ in skipped:
                pass
        finally:
            _set_host_rng(training)
        return True

    def next_epoch(self) -> int:
        """The epoch the loop's next pass is: the one in progress at the checkpoint, or the one after it."""
        if self._resume is not None:
            return int(self._resume["next"])
        return self.epoch + 1


def _keep_iterator(loader: Any, capture: Callable[[], Any], apply: Callable[[Any], None]) -> None:
    """Give a persistent ``loader`` the iterator the stopped run's later passes reused, leaving every RNG as
    it was: its next pass then draws its order alone, as the stopped run's did. (Its workers start here;
    the few batches they read ahead are dropped by that pass's reset.)"""
    if not _persistent(loader) or getattr(loader, "_iterator", None) is not None:
        return
    states = capture()
    try:
        iter(loader)
    finally:
        apply(states)


def _remaining(loader: Any, skip: int, before: Callable[[], None] | None = None, *, load: bool = True) -> Any:
    """A DataLoader like ``loader`` whose sampler leaves out the first ``skip`` batches (as indices);
    ``before`` runs as the sampler draws its order (see :class:`_Skipped`). ``load=False``: no workers and
    no pinning, for a pass that only draws its order and loads nothing."""
    import inspect

    from torch.utils.data import DataLoader

    accepted = inspect.signature(DataLoader.__init__).parameters
    workers = loader.num_workers if load else 0
    kwargs: dict[str, Any] = {
        "num_workers": workers, "collate_fn": loader.collate_fn, "pin_memory": loader.pin_memory and load,
        "timeout": loader.timeout if workers else 0, "worker_init_fn": loader.worker_init_fn,
        "generator": loader.generator, "persistent_workers": False,
    }
    if workers > 0:
        kwargs["multiprocessing_context"] = loader.multiprocessing_context
        kwargs["prefetch_factor"] = loader.prefetch_factor
    if "in_order" in accepted and hasattr(loader, "in_order"):
        kwargs["in_order"] = loader.in_order
    if loader.batch_sampler is not None:
        return DataLoader(loader.dataset, batch_sampler=_Skipped(loader.batch_sampler, skip, before), **kwargs)
    return DataLoader(loader.dataset, sampler=_Skipped(loader.sampler, skip, before), batch_size=None, **kwargs)


#: Persistent loaders given to restore(), whose workers are ended before the interpreter's own exit.
_PERSISTENT: weakref.WeakSet[Any] = weakref.WeakSet()
_SHUTDOWN_REGISTERED: list[bool] = []


def _shutdown_persistent() -> None:
    """Shut down the workers of each persistent loader's iterator, as its pass's end would.

    A persistent loader keeps its iterator (and workers) past a ``sys.exit`` or a stop
    mid-pass. Left to the end of the interpreter, multiprocessing's own exit hook
    terminates the workers first, and their SIGTERM exit (143) was reported by the
    DataLoader as a worker that "exited unexpectedly". This hook is registered after
    multiprocessing's, so it runs before it (atexit is last in, first out)."""
    for loader in list(_PERSISTENT):
        iterator = getattr(loader, "_iterator", None)
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - the interpreter is going away; a worker already gone is fine
                pass


def _attach(loader: Any, signals: tuple[int, ...]) -> _Position:
    from accelport.device_loader import DeviceLoader

    if not hasattr(loader, "__iter__"):
        raise TypeError(f"Checkpointer.restore(loader=...) takes the DataLoader (or ap.loader(...)) the loop reads, "
                        f"not {type(loader).__name__}")
    holder = loader
    inner = loader.iterable if isinstance(loader, DeviceLoader) else loader
    existing = getattr(inner, POSITION_ATTRIBUTE, None) or getattr(holder, POSITION_ATTRIBUTE, None)
    if isinstance(existing, _Position):
        return existing
    position = _Position(inner, _loader_kind(inner))
    try:
        setattr(inner, POSITION_ATTRIBUTE, position)
    except (AttributeError, TypeError):  # a list, a tuple: ap.loader(...) of it carries the position
        if holder is inner:
            raise TypeError(
                f"Checkpointer.restore(loader=...) cannot keep the position of a {type(inner).__name__}: pass "
                f"ap.loader(...) of it, and iterate that same object (train = ap.loader(batches); "
                "ckpt.restore(..., loader=train); for batch in train: ...)") from None
        setattr(holder, POSITION_ATTRIBUTE, position)
    if _persistent(inner):
        if not _SHUTDOWN_REGISTERED:
            _SHUTDOWN_REGISTERED.append(True)
            import atexit
            import multiprocessing.util  # noqa: F401 - its exit hook is registered first, so runs after this one

            atexit.register(_shutdown_persistent)
        _PERSISTENT.add(inner)
    data = sys.modules.get("torch.utils.data")
    if signals and data is not None and isinstance(inner, data.DataLoader) and inner.num_workers > 0 \
            and not isinstance(inner.worker_init_fn, _IgnoreStop):
        inner.worker_init_fn = _IgnoreStop(inner.worker_init_fn, signals)
    return position


# -- RNG states -----------------------------------------------------------------------------------


def _device_rng(backend: Any) -> tuple[str, Any, Any] | None:
    """(name, get, set) of the selected device's generators, or None where the host's is the device's."""
    import torch

    if getattr(backend, "lazy", False):
        import torch_xla.core.xla_model as xm

        return "xla", xm.get_rng_state, xm.set_rng_state
    device_type = getattr(backend, "device_type", "cpu")
    if device_type == "cpu":
        return None
    module = getattr(torch, getattr(backend, "module_name", device_type), None)
    for get, put in (("get_rng_state_all", "set_rng_state_all"), ("get_rng_state", "set_rng_state")):
        if callable(getattr(module, get, None)) and callable(getattr(module, put, None)):
            return device_type, getattr(module, get), getattr(module, put)
    return device_type, None, None


def _host_rng() -> dict[str, Any]:
    """The host's global generators: torch's, Python's ``random`` and numpy's (where numpy is loaded), in
    forms a ``weights_only`` load accepts."""
    import torch

    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        out["numpy"] = (str(kind), [int(k) for k in keys], int(pos), int(has_gauss), float(gauss))
    return out


#: Marks a numpy array or scalar in a saved loader position. A loader's own state (a dataset's counters, its
#: generator) may hold them, and a weights_only load refuses numpy's own pickles: they are kept as bytes.
_NUMPY = "__accelport_numpy__"


def _plain(value: Any) -> Any:
    """``value`` with its numpy arrays and scalars as tagged bytes, so that ``weights_only=True`` loads it."""
    np = sys.modules.get("numpy")
    if np is None:
        return value
    from accelport.tensors import tree_map

    return tree_map(value, _encoded, lambda x: isinstance(x, (np.ndarray, np.generic)) and not x.dtype.hasobject)


def _encoded(value: Any) -> dict[str, Any]:
    import numpy as np
    import torch
    from numpy.lib.format import dtype_to_descr

    raw = np.ascontiguousarray(value).tobytes()
    # (as a uint8 tensor: an empty bytes object pickles as a call that weights_only refuses)
    return {_NUMPY: "array" if isinstance(value, np.ndarray) else "scalar", "dtype": dtype_to_descr(value.dtype),
            "shape": list(np.shape(value)), "data": torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            if raw else torch.empty(0, dtype=torch.uint8)}


def _is_encoded(value: Any) -> bool:
    return isinstance(value, dict) and value.get(_NUMPY) in ("array", "scalar") \
        and set(value) == {_NUMPY, "dtype", "shape", "data"} and callable(getattr(value["data"], "numpy", None))


def _decoded(value: dict[str, Any]) -> Any:
    import numpy as np
    from numpy.lib.format import descr_to_dtype

    raw = value["data"].numpy().tobytes()
    array = np.frombuffer(raw, dtype=descr_to_dtype(value["dtype"])).reshape(value["shape"]).copy()
    return array if value[_NUMPY] == "array" else array[()]


def _restored(value: Any) -> Any:
    """What :func:`_plain` took, as it was."""
    from accelport.tensors import tree_map

    return tree_map(value, _decoded, _is_encoded)


def _set_host_rng(saved: Mapping[str, Any]) -> None:
    """Put back what :func:`_host_rng` took (the parts ``saved`` has)."""
    import torch

    if saved.get("torch") is not None:
        torch.set_rng_state(saved["torch"])
    if saved.get("python") is not None:
        version, internal, gauss = saved["python"]
        random.setstate((version, tuple(internal), gauss))
    if saved.get("numpy") is not None:
        import numpy as np  # saved with it: the script uses numpy's global generator

        kind, keys, pos, has_gauss, gauss = saved["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def _rng_states(backend: Any) -> dict[str, Any]:
    out = _host_rng()
    device = _device_rng(backend)
    if device is not None and device[1] is not None:
        out["device"] = (device[0], device[1]())
    return out


def _set_rng_states(backend: Any, saved: Mapping[str, Any]) -> list[str]:
    """Restore ``saved``; returns the generators that could not be restored."""
    missed = []
    _set_host_rng(saved)
    device = _device_rng(backend)
    if device is not None:
        name, _, put = device
        if saved.get("device") is not None and saved["device"][0] == name and put is not None:
            put(saved["device"][1])
        else:
            missed.append(f"the {name} device's")
    return missed


# -- stop requests --------------------------------------------------------------------------------


#: Signals that report a crash (a fault of the process itself), never a request to stop.
_CRASH_SIGNALS = ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGTRAP", "SIGSYS")


def _parse_signals(stop_on: Any) -> tuple[int, ...]:
    if isinstance(stop_on, (str, int)):
        stop_on = (stop_on,)
    if not isinstance(stop_on, Iterable):
        raise UsageError(f"Checkpointer(stop_on=...) takes signal names such as ('SIGTERM', 'SIGINT'), or () for "
                         f"none, not {stop_on!r}")
    out = []
    for item in stop_on:
        try:
            sig = signal.Signals[item.upper() if item.upper().startswith("SIG") else "SIG" + item.upper()] \
                if isinstance(item, str) else signal.Signals(item)
        except (KeyError, ValueError, AttributeError):
            raise UsageError(f"Checkpointer(stop_on=...) takes signal names such as 'SIGTERM' and 'SIGINT', not "
                             f"{item!r}") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            raise UsageError(f"Checkpointer(stop_on=...): {sig.name} cannot be caught (or means no stop); "
                             "use SIGTERM, SIGINT, SIGHUP, SIGUSR1 or SIGUSR2")
        if sig.name in _CRASH_SIGNALS:
            # Its handler only records a request: the faulting instruction runs again, forever (a hang, not a save).
            raise UsageError(f"Checkpointer(stop_on=...): {sig.name} means the process crashed, and a crash cannot "
                             "be saved at the next step (it would hang instead of ending); use SIGTERM, SIGINT, "
                             "SIGHUP, SIGUSR1 or SIGUSR2")
        out.append(int(sig))
    return tuple(dict.fromkeys(out))


class _StopSignals:
    """The stop signals turned into a request the loop answers at its next step boundary, with a deadline.

    The handler only records the request. A watcher thread learns of the signal at
    once (through ``signal.set_wakeup_fd`` where no one else uses it, else from the
    handler) and, if the process is still there ``deadline`` seconds later (a step
    longer than that, a collective waiting for a dead peer), ends it: with
    :data:`EXIT_PREEMPTED` if the checkpoint was saved, else as the signal would have.
    """

    def __init__(self, signals: tuple[int, ...], deadline: float) -> None:
        self.signals, self.deadline = signals, deadline
        self.requested = False
        self.signum: int | None = None
        self.saved = False
        #: (step, directory) of the save being written now, or None.
        self.saving: tuple[int, str] | None = None
        self._closed = threading.Event()
        self._previous: dict[int, Any] = {}
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._wakeup = False
        try:
            for s in signals:
                self._previous[s] = signal.signal(s, self._handler)
        except ValueError:  # not the main thread
            self._restore_handlers()
            os.close(self._read)
            os.close(self._write)
            raise UsageError("ap.Checkpointer handles stop signals, and Python sets signal handlers only in the main "
                             "thread: create it there, or pass stop_on=() to handle none") from None
        previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        if previous == -1:
            self._wakeup = True
        else:
            signal.set_wakeup_fd(previous)  # someone's (an event loop's): leave it, the handler tells the watcher
        threading.Thread(target=self._watch, name="accelport-stop-deadline", daemon=True).start()

    def _handler(self, signum: int, frame: Any) -> None:
        if not self.requested:
            self.signum = signum
            self.requested = True
        try:
            os.write(self._write, bytes([signum]))
        except OSError:
            pass

    def _watch(self) -> None:
        wanted = set(self.signals)
        signum = None
        while signum is None:
            try:
                data = os.read(self._read, 64)
            except OSError:
                return
            if not data or 0 in data:
                return  # closed
            # (The wakeup descriptor is written for a signal whichever Python handler takes it: one the
            # script installed after this one is the script's to answer, with no deadline of accelport's.)
            signum = next((b for b in data if b in wanted and self._handles(b)), None)
        if self._closed.wait(self.deadline):
            return
        status = EXIT_PREEMPTED if self.saved else unsaved_status(signum)
        saving = self.saving
        if self.saved:
            what = "after saving the checkpoint"
        elif saving is not None:
            remove_own_temps(saving[1])  # a state file cut short: hundreds of MB no later save would remove
            what = (f"without a checkpoint: the deadline cut short the save of step {saving[0]} in {saving[1]} (its "
                    "temporary files are removed; the checkpoints before it are whole; raise "
                    "ACCELPORT_STOP_DEADLINE_S above the time a save takes)")
        else:
            what = "without a checkpoint (no step boundary reached)"
        try:
            os.write(2, f"accelport: {signal_name(signum)}: {self.deadline:g} s deadline passed; exiting {what} "
                        f"with status {status}\n".encode())
        finally:
            os._exit(status)

    def _handles(self, signum: int) -> bool:
        """Whether this object's handler is still the one that answers ``signum``."""
        try:
            return bool(signal.getsignal(signum) == self._handler)
        except (ValueError, OSError):
            return False

    def _restore_handlers(self) -> None:
        for s, handler in self._previous.items():
            try:
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)
            except (ValueError, TypeError):
                pass
        self._previous.clear()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._restore_handlers()
        if self._wakeup:
            try:
                signal.set_wakeup_fd(-1)
            except ValueError:
                pass
        try:
            os.write(self._write, b"\0")
        except OSError:
            pass


# -- several ranks agree -----------------------------------------------------------------------------


class _Agreement:
    """Every rank decides at the same step boundary to save (a time-based save) and to stop.

    A rank's stop request or clock is its own; acting on it alone would leave the others
    waiting in a collective. Every few steps (so that a check falls about every
    :data:`AGREE_INTERVAL_S` seconds, from the ranks' mean step time, which every rank
    learns from the same sum) the ranks add their flags in one small all-reduce on a
    gloo group of its own: issued at one boundary, read at the next, so a step never
    waits for it. With steps longer than the interval it is read at once.
    """

    def __init__(self, backend: Any) -> None:
        import torch.distributed as dist

        self._backend = backend
        self.world = backend.world_size()
        self._dist = dist if dist.is_available() and dist.is_initialized() else None
        self._group = self._dist.new_group(backend="gloo") if self._dist is not None else None
        self._every = 1
        self._issue_at = 1
        self._wait_at = 0
        self._issued = 0
        self._work: Any = None
        self._buffer: Any = None
        self._since = time.monotonic()
        self._since_step = 0

    def boundary(self, step: int, stop: bool, due: bool, written: bool) -> tuple[bool, bool, bool]:
        """(save now, stop after saving, every rank's background save written), the same on every rank."""
        decision = (False, False, False)
        if self._work is not None:
            if step < self._wait_at:
                return decision
            self._work.wait()
            self._work = None
            decision = self._decide(self._buffer)
            self._issue_at = self._issued + self._every
        if step >= self._issue_at:
            now = self._issue(step, stop, due, written)
            decision = (decision[0] or now[0], decision[1] or now[1], decision[2] or now[2])
        return decision

    def _issue(self, step: int, stop: bool, due: bool, written: bool) -> tuple[bool, bool, bool]:
        import torch

        now = time.monotonic()
        per_step_us = int(1e6 * (now - self._since) / max(1, step - self._since_step))
        self._since, self._since_step = now, step
        buffer = torch.tensor([int(stop), int(due), int(written), per_step_us], dtype=torch.int64)
        if self._group is not None and self._every > 1:
            self._work = self._dist.all_reduce(buffer, group=self._group, async_op=True)  # type: ignore[union-attr]
            self._buffer, self._issued, self._wait_at = buffer, step, step + 1
            return False, False, False
        if self._group is not None:
            self._dist.all_reduce(buffer, group=self._group)  # type: ignore[union-attr]
        else:  # no torch.distributed group (XLA replicas): the backend's own collective
            from accelport.tensors import collective_device

            buffer = buffer.to(collective_device(self._backend))
            self._backend.all_reduce(buffer)
            buffer = buffer.cpu()
        decision = self._decide(buffer)
        self._issue_at = step + self._every
        return decision

    def _decide(self, buffer: Any) -> tuple[bool, bool, bool]:
        stop, due, written, total_us = (int(v) for v in buffer.tolist())
        mean_us = max(1, total_us // self.world)
        self._every = max(1, min(1000, int(AGREE_INTERVAL_S * 1e6) // mean_us))
        return bool(due or stop), bool(stop), written == self.world


# -- the checkpointer ---------------------------------------------------------------------------------


def _api() -> Any:
    import accelport

    return accelport


class Checkpointer:
    """Periodic checkpoints of a training run, resumed where it stopped; a stop request saves at once.

    ``directory``: where the checkpoints go (default ``ACCELPORT_CHECKPOINT_DIR``); on several
    hosts, storage every host shares. ``every_steps`` / ``every_seconds``: when :meth:`step`
    saves (either, both, or neither: then only on a stop request and :meth:`save`).
    ``keep_last``: complete checkpoints kept (None: all). ``stop_on``: the signals that mean
    "save and stop" (``("SIGTERM", "SIGINT")`` to add Ctrl-C; ``()`` for none); the process then
    exits with status 75 after the save, or 128 + the signal's number if the deadline
    (``ACCELPORT_STOP_DEADLINE_S``, default 30 s) passes first.
    """

    #: The exit status after a stop request whose checkpoint was saved: run again to resume.
    EXIT_PREEMPTED = EXIT_PREEMPTED

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, every_steps: int | None = None,
                 every_seconds: float | None = None, keep_last: int | None = 3,
                 stop_on: Iterable[str | int] | str = ("SIGTERM",), background: bool = False) -> None:
        if directory is None:
            directory = (os.environ.get(CHECKPOINT_DIR_ENV) or "").strip() or None
            if directory is None:
                raise UsageError(f"ap.Checkpointer needs a directory: pass one (ap.Checkpointer('ckpt/', ...)) or set "
                                 f"{CHECKPOINT_DIR_ENV}")
        if not isinstance(directory, (str, os.PathLike)) or os.fspath(directory) in ("", b""):
            raise UsageError(f"ap.Checkpointer needs the path of a directory, such as 'ckpt/', not {directory!r}")
        if every_steps is not None and (isinstance(every_steps, bool) or not isinstance(every_steps, int)
                                        or every_steps < 1):
            raise UsageError(f"every_steps must be a whole number of steps, 1 or more (or None: no step-based saves), "
                             f"not {every_steps!r}")
        if every_seconds is not None and (isinstance(every_seconds, bool) or not isinstance(every_seconds, (int, float))
                                          or not every_seconds > 0):
            raise UsageError(f"every_seconds must be a number of seconds above 0 (or None), not {every_seconds!r}")
        if not isinstance(background, bool):
            raise UsageError(f"background must be True or False, not {background!r}")
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise UsageError(f"keep_last must be 1 or more (complete checkpoints to keep), or None to keep all, "
                             f"not {keep_last!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.every_steps = every_steps
        self.every_seconds = float(every_seconds) if every_seconds is not None else None
        self.keep_last = keep_last
        self.background = background
        signals = _parse_signals(stop_on)
        deadline = deadline_s(os.environ)
        self._check_directory()
        self.steps = 0
        self.last_saved: str | None = None
        self._objects: dict[str, Any] | None = None
        self._position: _Position | None = None
        self._said_unread = False
        self._said_foreign: set[str] = set()
        #: Who writes this run's checkpoints (in checkpoint.json), and what other runs had written when it restored.
        self._run = {"id": os.urandom(6).hex(), "host": socket.gethostname(), "pid": os.getpid()}
        self._seen_runs: dict[str, Any] = {}
        self._agreement: _Agreement | None = None
        self._last_save_time = time.monotonic()
        self._saved_step: int | None = None
        self._pending: tuple[Any, str, int] | None = None  # a background save: its handle, directory, step
        self._stop = _StopSignals(signals, deadline) if signals else None
        # The goodput account (accelport.goodput): seconds of training steps (busy) and of the loop waiting for
        # saves (blocked), split at a mark that each blocking section moves past itself; rank 0's journal.
        self._busy = 0.0
        self._blocked = 0.0
        self._clock = time.monotonic()
        self._blocking_now = False
        self._journal: Any = None

    # -- public ----------------------------------------------------------------------------------------
    @property
    def stop_requested(self) -> bool:
        """Whether this process got a stop signal (the checkpoint is saved at the next :meth:`step`)."""
        return self._stop is not None and self._stop.requested

    @property
    def epoch(self) -> int:
        """The epoch (pass over the loader given to :meth:`restore`) to start from: 0 without a checkpoint;
        after a restore, the pass in progress at the checkpoint, or the next one if it had ended.
        ``for epoch in range(ckpt.epoch, epochs):`` resumes an epoch loop."""
        if self._position is None:
            return 0
        return max(0, self._position.next_epoch())

    def restore(self, *, model: Any = None, optimizer: Any = None, scheduler: Any = None, loader: Any = None,
                batches_per_pass: int | None = None) -> int:
        """Load the newest complete checkpoint into these objects; returns the step to start from (0 when none).

        These are also what every later save holds. A torn or incomplete checkpoint is
        skipped with a :class:`CheckpointWarning`; RNG states (torch, the device's, Python's
        ``random``, numpy's global one) and the loader's position come back too.

        ``batches_per_pass``: a loop that leaves each pass early (``max_steps_per_epoch``, a
        ``break`` after N batches) says N here; each pass of ``ap.loader(loader)`` then ends
        after N batches, counting those read before a resume, so a pass resumed from a
        checkpoint reads only the rest of them, and one saved at its Nth batch resumes
        at the next pass (a ``break`` of the loop's own, counting from 0, could not know).
        """
        if batches_per_pass is not None and (isinstance(batches_per_pass, bool)
                                             or not isinstance(batches_per_pass, int) or batches_per_pass < 1):
            raise UsageError(f"Checkpointer.restore(batches_per_pass=...) takes the number of batches the loop reads "
                             f"of each pass, 1 or more (or None: every batch), not {batches_per_pass!r}")
        if batches_per_pass is not None and loader is None:
            raise UsageError("Checkpointer.restore(batches_per_pass=...) limits the passes of the loader it is given: "
                             "pass loader= too")
        for name, value, check, what in (("model", model, "module", "torch.nn.Module"),
                                         ("optimizer", optimizer, "optimizer", "torch.optim.Optimizer")):
            if value is not None and not _is(value, check):
                raise TypeError(f"Checkpointer.restore({name}=...) takes a {what}, not {type(value).__name__}")
        if scheduler is not None and not (callable(getattr(scheduler, "state_dict", None))
                                          and callable(getattr(scheduler, "load_state_dict", None))):
            raise TypeError(f"Checkpointer.restore(scheduler=...) takes a learning-rate scheduler (with state_dict() "
                            f"and load_state_dict()), not {type(scheduler).__name__}")
        began = time.time()
        api = _api()
        backend = api.backend()
        self._objects = {k: v for k, v in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler))
                         if v is not None}
        if loader is not None:
            self._position = _attach(loader, self._stop.signals if self._stop is not None else ())
            self._position.max_batches = batches_per_pass
        world = backend.world_size()
        if world > 1 and self._agreement is None and (self._stop is not None or self.every_seconds is not None
                                                      or self.background):
            self._agreement = _Agreement(backend)
        self._seen_runs = self._runs()
        found = find_checkpoints(self.directory)
        for foreign in found:
            if foreign.foreign and foreign.path not in self._said_foreign:
                self._said_foreign.add(foreign.path)
                warn_user(f"ap.Checkpointer: ignored {foreign.path}: {foreign.problem}; it is not loaded, and never "
                          "removed or saved over. Give the checkpointer a directory of its own", CheckpointWarning)
        # Newest first: a torn or damaged checkpoint gives way to the one before it.
        skipped = [(f, f.problem) for f in found if not f.complete and not f.foreign]
        candidates = [f for f in reversed(found) if f.complete]
        while True:
            chosen = None
            for f in candidates:
                problem = _damage(f)
                if not problem:
                    chosen = f
                    break
                skipped.append((f, f"it is damaged: {problem}"))
            candidates = candidates[candidates.index(chosen) + 1:] if chosen is not None else []
            for skip, why in skipped:
                if chosen is None or skip.step > chosen.step:
                    warn_user(f"ap.Checkpointer: skipped the checkpoint at {skip.path}: {why}; "
                              + (f"resuming from step {chosen.step}" if chosen else "no complete checkpoint to resume "
                                 "from, starting at step 0"), CheckpointWarning)
            skipped = []
            if world > 1:
                from accelport.tensors import same_on_every_rank

                if not same_on_every_rank(backend, chosen.step if chosen else None):
                    raise CheckpointError(f"ap.Checkpointer: the ranks found different newest checkpoints in "
                                          f"{self.directory} (here rank {backend.rank()}: "
                                          f"{chosen.path if chosen else 'none'}): put the directory on storage every "
                                          "host shares, and start every rank on the same one")
            if chosen is None:
                self.steps = 0
                self._last_save_time = time.monotonic()
                self._open_account(backend, began)
                return 0
            try:
                self._load(api, backend, chosen)
            except _Damaged as exc:  # found before anything was loaded in place: the one before it is tried
                skipped.append((chosen, f"it is damaged: {exc}"))
                continue
            self._last_save_time = time.monotonic()
            self._open_account(backend, began)
            return self.steps

    def step(self) -> None:
        """End of a training step: save when one is due, or when a stop was requested (then exit)."""
        self.steps += 1
        steps = self.steps
        if self._objects is None:
            raise CheckpointError("ap.Checkpointer.step() before restore(): call ckpt.restore(model=model, "
                                  "optimizer=opt, ...) once before the loop; it names what every checkpoint holds")
        due = self.every_steps is not None and steps % self.every_steps == 0
        stop = self._stop is not None and self._stop.requested
        pending = self._pending
        if self._agreement is not None:
            timely = self.every_seconds is not None and time.monotonic() - self._last_save_time >= self.every_seconds
            save, stop, written = self._agreement.boundary(steps, stop, timely,
                                                           pending is not None and pending[0].done())
            due = due or save
            if written and pending is not None:
                self._finish_background()
        else:
            if self.every_seconds is not None and not due:
                due = time.monotonic() - self._last_save_time >= self.every_seconds
            if pending is not None and pending[0].done() and self._agreement is None and self._world_one():
                self._finish_background()
        if due or stop:
            if self._saved_step != steps:
                self.save()
            if not stop and self._agreement is None and self._stop is not None and self._stop.requested:
                stop = True  # asked during this save (one process): it is the checkpoint to stop on, not the next
            if stop:
                self._finish_background()
                self._tick()
                self._account_ends("stopped")
                self._exit()
        self._tick()

    def save(self) -> str:
        """Write a checkpoint of the step reached now, on every rank together; returns its directory.

        A step already saved (by this run, or the checkpoint it resumed from) is not written again: its
        checkpoint holds this step's state, and writing it anew would first remove a complete checkpoint."""
        if self._objects is None:
            raise CheckpointError("ap.Checkpointer.save() before restore(): call ckpt.restore(model=model, "
                                  "optimizer=opt, ...) first; it names what the checkpoint holds")
        if self._saved_step == self.steps and self.last_saved == _step_dir(self.directory, self.steps) \
                and os.path.isdir(self.last_saved):
            return self.last_saved
        api = _api()
        backend = api.backend()
        if self._stop is not None:
            self._stop.saving = (self.steps, _step_dir(self.directory, self.steps))
        outer = self._block_begins()
        try:
            path = self._write(api, backend, self.steps)
        finally:
            if self._stop is not None:
                self._stop.saving = None
            waited = self._block_ends(outer)
        if self._journal is not None:
            self._journal.saved(self.steps, waited, self._busy, background=self.background)
        self._saved_step = self.steps
        self._last_save_time = time.monotonic()
        self.last_saved = path
        return path

    def wait(self) -> None:
        """Complete a background save still being written (call it on every rank, as :meth:`step`)."""
        self._finish_background()

    def close(self) -> None:
        """Complete a background save (on every rank together), and give the stop signals back."""
        self._close("finished")

    def goodput(self) -> dict[str, Any] | None:
        """The job's goodput account so far, from this directory's journal (:mod:`accelport.goodput`): every run
        since the job began, restarts included; None before :meth:`restore` on rank 0 or where none is kept."""
        from accelport.goodput import account_of_directory

        return account_of_directory(self.directory)

    def _close(self, how: str) -> None:
        try:
            self._finish_background()
        finally:
            try:
                self._tick()
                self._account_ends(how)
            finally:
                if self._stop is not None:
                    self._stop.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is not None:
            self._pending = None  # this rank fails: no waiting for the others, the save stays incomplete
        failed = isinstance(kind, type) and not issubclass(kind, SystemExit)
        self._close("failed" if failed else "finished")

    def __repr__(self) -> str:
        return f"<Checkpointer {self.directory!r} step {self.steps}>"

    # -- inside ------------------------------------------------------------------------------------
    def _check_directory(self) -> None:
        import tempfile

        if os.path.lexists(self.directory) and not os.path.isdir(self.directory):
            raise CheckpointError(f"ap.Checkpointer: {self.directory!r} is a file, not a directory; give the path of "
                                  "a directory (it is created if missing)")
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".accelport-probe.", dir=self.directory)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise CheckpointError(f"ap.Checkpointer: cannot write in {self.directory!r}: "
                                  f"{exc.strerror or type(exc).__name__}; give a directory this process can create "
                                  "and write") from exc

    def _world_one(self) -> bool:
        return _api().world_size() == 1

    # -- the goodput account ------------------------------------------------------------------------
    def _open_account(self, backend: Any, began: float) -> None:
        """Start the clock of the steps, and (rank 0) this run's lines in the directory's journal."""
        self._busy = self._blocked = 0.0
        self._clock = time.monotonic()
        restored = time.time()  # the same moment: the steps' seconds begin where the start-up's end
        if backend.rank() != 0:
            return
        from accelport.goodput import POINTER, Journal

        if self._journal is not None and self._journal.last is not None:
            self._journal.end("finished", *self._journal.last)  # restored again: the run so far is one run
        settings = {"every_steps": self.every_steps, "every_seconds": self.every_seconds, "background": self.background,
                    "world_size": backend.world_size(), "host": self._run["host"]}
        self._journal = Journal(self.directory, os.urandom(6).hex(), resumed_from=self.steps, restore_began=began,
                                restored=restored, environ=os.environ, settings=settings)
        launch_dir = os.environ.get("ACCELPORT_LAUNCH_DIR")
        if launch_dir:  # accelport launch says the job's goodput at its end
            from accelport.launch.heartbeat import write_json

            write_json(os.path.join(launch_dir, POINTER), {"directory": self.directory})

    def _tick(self) -> None:
        """The end of a step: the seconds since the mark were the loop's own; rank 0 says the step reached."""
        now = time.monotonic()
        self._busy += now - self._clock
        self._clock = now
        if self._journal is not None:
            self._journal.step(self.steps, self._busy, self._blocked)

    def _block_begins(self) -> bool:
        """The loop waits for a checkpoint from now: the steps' clock stops. False inside another such wait."""
        if self._blocking_now:
            return False
        now = time.monotonic()
        self._busy += now - self._clock
        self._clock = now
        self._blocking_now = True
        return True

    def _block_ends(self, outer: bool) -> float:
        """The seconds waited since :meth:`_block_begins` (0 for an inner one); the steps' clock goes on."""
        if not outer:
            return 0.0
        now = time.monotonic()
        waited = now - self._clock
        self._blocked += waited
        self._clock = now
        self._blocking_now = False
        return waited

    def _account_ends(self, how: str) -> None:
        if self._journal is not None:
            self._journal.end(how, self.steps, self._busy, self._blocked)

    def _finish_background(self) -> None:
        """Wait for the background save on every rank, then complete its checkpoint (rank 0)."""
        if self._pending is None:
            return
        from accelport import checkpoint

        pending, target, step = self._pending
        self._pending = None
        backend = _api().backend()
        outer = self._block_begins()
        try:
            try:
                pending.wait()  # every rank, at the same step boundary; a failure is raised on all of them
            except CheckpointError:
                if backend.rank() == 0:
                    shutil.rmtree(target, ignore_errors=True)
                raise
            self._complete(checkpoint, backend, target, step)
        finally:
            waited = self._block_ends(outer)
        if outer and self._journal is not None:
            self._journal.waited(waited)

    def _complete(self, checkpoint: Any, backend: Any, target: str, step: int) -> None:
        failure = None
        if backend.rank() == 0:
            try:
                self._mark(target, step, backend.world_size())
                self._prune(step)
            except Exception as exc:  # noqa: BLE001 - one rank's error reaches every rank
                failure = _as_checkpoint_error(exc)
        self._agreed(checkpoint, backend, failure, target)

    def _write(self, api: Any, backend: Any, step: int) -> str:
        from accelport import checkpoint

        self._finish_background()
        rank, world = backend.rank(), backend.world_size()
        target = _step_dir(self.directory, step)
        failure: CheckpointError | None = None
        if rank == 0:
            try:
                self._begin(target, step, world)
            except CheckpointError as exc:
                failure = exc
            except OSError as exc:
                failure = CheckpointError(f"ap.Checkpointer: cannot create {target!r}: "
                                          f"{exc.strerror or type(exc).__name__}")
        checkpoint.agree(backend, failure)
        state: dict[str, Any] = {}
        for key, value in self._objects.items():  # type: ignore[union-attr]
            state[key] = value.state_dict() if key == "scheduler" else value
        state["step"] = step
        failure = None
        pending = None
        try:
            pending = api.save(state, os.path.join(target, STATE), background=self.background)
        except Exception as exc:  # noqa: BLE001 - one rank's error (a full disk on rank 0) reaches every rank
            if _sharded(self._objects.get("model")):  # type: ignore[union-attr]
                raise  # ap.save of a sharded model raised it on every rank already
            failure = _as_checkpoint_error(exc)
        position = self._position
        if position is not None and not position.read and not self._said_unread:
            self._said_unread = True
            warn_user(f"ap.Checkpointer: the loader given to restore() was not read through ap.loader by step {step}: "
                      "its position is not saved, so a resumed run starts its data at the first batch of a new pass; "
                      "iterate ap.loader(loader) in the training loop", CheckpointWarning)
        if failure is None:
            try:
                mine = {"rank": rank, "world_size": world, "step": step, "rng": _rng_states(backend),
                        "data": _plain(self._position.state()) if self._position is not None else None}
                import torch

                checkpoint.atomic_torch_save(torch, mine, os.path.join(target, f"rank-{rank}.pt"))
            except Exception as exc:  # noqa: BLE001 - as above
                failure = _as_checkpoint_error(exc)
        self._agreed(checkpoint, backend, failure, target)
        if pending is not None and not pending.done():
            self._pending = (pending, target, step)  # completed once every rank's shards are written
            return target
        self._complete(checkpoint, backend, target, step)
        return target

    def _agreed(self, checkpoint: Any, backend: Any, failure: CheckpointError | None, target: str) -> None:
        try:
            checkpoint.agree(backend, failure)
        except CheckpointError:
            if backend.rank() == 0:
                shutil.rmtree(target, ignore_errors=True)  # never left to be taken for a checkpoint, nor fill a disk
            raise

    def _begin(self, target: str, step: int, world: int) -> None:
        """Make ``target`` this step's checkpoint directory, marked as accelport's before anything is in it.

        What is there already goes only if accelport wrote it (a torn save of this step, or this step saved
        again); anything else is someone else's, and is refused, never removed."""
        self._check_alone()
        if os.path.lexists(target):
            if _read_marker(target)[0] is None and not _empty(target):
                raise CheckpointError(
                    f"ap.Checkpointer: {target!r} is already there and accelport did not write it (it has no "
                    f"{MARKER} of accelport's): saving step {step} would replace it. Give the checkpointer a "
                    "directory of its own (ap.Checkpointer('ckpt/accelport', ...)), or move that directory away")
            _remove_ours(target)
        os.makedirs(target)
        self._write_marker(target, {"format": FORMAT, "version": 1, "step": step, "world_size": world,
                                    "complete": False, "run": self._run})

    def _runs(self) -> dict[str, Any]:
        """Each of the checkpointer's step directories, with the run that wrote it (its marker's)."""
        out = {}
        for f in find_checkpoints(self.directory):
            marker = _read_marker(f.path)[0]
            if marker is not None:
                out[f.path] = marker.get("run")
        return out

    def _check_alone(self) -> None:
        """Refuse to save when another run has written in the directory since this one restored: two jobs
        sharing a directory replace and prune each other's checkpoints, and resume from each other's."""
        for path, run in self._runs().items():
            if not isinstance(run, dict) or run.get("id") == self._run["id"] or self._seen_runs.get(path) == run:
                continue
            raise CheckpointError(
                f"ap.Checkpointer: another job writes checkpoints in {self.directory} too: {path} was written by run "
                f"{run.get('id')} (host {run.get('host')}, pid {run.get('pid')}) after this one (run "
                f"{self._run['id']}) began; jobs sharing a checkpoint directory replace, prune and resume from each "
                "other's checkpoints. Give each job a directory of its own (one job at a time per directory)")

    def _write_marker(self, target: str, marker: Mapping[str, Any]) -> None:
        tmp = os.path.join(target, f".{MARKER}.tmp")
        with open(tmp, "w") as f:
            json.dump(marker, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(target, MARKER))
        fsync_dir(target)

    def _mark(self, target: str, step: int, world: int) -> None:
        files = _sizes(target)
        missing = [f"rank-{r}.pt" for r in range(world) if f"rank-{r}.pt" not in files]
        # On NFS another host's file can be missing from this host's cached listing for a few seconds after it
        # was written (close-to-open consistency holds for a file opened by name, not for a directory listing).
        deadline = time.monotonic() + MARK_WAIT_S
        while missing and time.monotonic() < deadline:
            time.sleep(0.2)
            for name in list(missing):
                size = _size_by_name(os.path.join(target, name))
                if size is not None:
                    files[name] = size
                    missing.remove(name)
        if missing:
            raise CheckpointError(f"ap.Checkpointer: {target!r} lacks {', '.join(missing)} after every rank wrote its "
                                  "part: the directory must be on storage every host shares")
        marker = {"format": FORMAT, "version": 1, "step": step, "world_size": world, "time": time.time(),
                  "files": files, "run": self._run,
                  "classes": {k: _class_name(v) for k, v in (self._objects or {}).items()
                              if k in ("optimizer", "scheduler")}}
        self._write_marker(target, marker)

    def _prune(self, step: int) -> None:
        found = [f for f in find_checkpoints(self.directory) if not f.foreign]  # never someone else's
        complete = [f for f in found if f.complete]
        drop = [f for f in found if not f.complete and f.step < step]
        if self.keep_last is not None:
            drop += complete[:-self.keep_last]
        for f in drop:
            _remove_ours(f.path)

    def _load(self, api: Any, backend: Any, found: Found) -> None:
        objects = self._objects or {}
        self._check_classes(found, objects)
        rank, world = backend.rank(), backend.world_size()
        saved_world = found.world_size or world
        from accelport.checkpoint import load_file

        own = os.path.join(found.path, f"rank-{rank}.pt" if rank < saved_world else "rank-0.pt")
        # This rank's part first: what it refuses is refused before anything is loaded in place.
        damage = None
        try:
            mine = load_file(own, "cpu")
            if isinstance(mine, dict) and mine.get("data") is not None:
                mine["data"] = _restored(mine["data"])
            if not isinstance(mine, Mapping) or mine.get("step") != found.step:
                damage = (f"{os.path.basename(own)} is of step {mine.get('step') if isinstance(mine, Mapping) else '?'}"
                          f", not of the step {found.step} the checkpoint is")
        except (AccelportError, OSError) as exc:
            damage = f"{os.path.basename(own)} cannot be read ({_first_line(exc)})"
        from accelport import checkpoint

        if world > 1:  # every rank together: one rank's damaged part is an error on all of them
            checkpoint.agree(backend, CheckpointError(f"ap.Checkpointer: {found.path} is damaged: {damage}; remove "
                                                      "it to resume from the checkpoint before it") if damage else None)
        elif damage:
            raise _Damaged(damage)
        # On another number of ranks each rank's share of a pass differs by design, and the position is
        # taken as it can be (said below, among what was not restored): compare the pass's cut only on
        # the same number of ranks.
        refusal = self._position.refusal(mine["data"], found.path) \
            if self._position is not None and isinstance(mine.get("data"), Mapping) and saved_world == world else ""
        checkpoint.agree(backend, CheckpointError(refusal) if refusal else None)  # every rank refuses together
        into = {k: v for k, v in objects.items() if k in ("model", "optimizer")}
        try:
            plain = api.load(os.path.join(found.path, STATE), into=into)
        except CheckpointError:
            raise  # the objects given do not fit it: not a damage another checkpoint would mend
        except (AccelportError, OSError) as exc:  # unreadable: raised before anything was loaded in place
            if world > 1:
                raise
            raise _Damaged(f"{STATE} cannot be read ({_first_line(exc)})") from exc
        if not isinstance(plain, Mapping) or not isinstance(plain.get("step"), int):
            raise CheckpointError(f"ap.Checkpointer: {found.path!r} holds no step count: not a checkpoint it wrote")
        scheduler = objects.get("scheduler")
        if scheduler is not None:
            if "scheduler" not in plain:
                raise CheckpointError(f"ap.Checkpointer: {found.path!r} holds no scheduler state (it was saved without "
                                      "scheduler=): restore without scheduler=, or start from a new directory")
            scheduler.load_state_dict(plain["scheduler"])
        unused = [k for k in ("optimizer", "scheduler") if k in plain and k not in objects] + \
            [k for k in ("model",) if k not in objects and _holds(found.path, k)]
        if unused:
            warn_user(f"ap.Checkpointer: {found.path} holds {', '.join(unused)} state that restore() was not given "
                      f"({', '.join(k + '=' for k in unused)}): it is not restored, and the run will not continue as "
                      "it would have", CheckpointWarning)
        notes = []
        if rank < saved_world:
            notes += [f"{what} RNG state" for what in _set_rng_states(backend, mine["rng"])]
        if saved_world != world and rank == 0:
            notes.append(f"the world size: the checkpoint was written by {saved_world} rank(s), this run has {world}; "
                         "model, optimizer and scheduler are restored (resharded), each rank's RNG state only where "
                         "that rank existed, and every rank's data position from its own rank or rank 0's")
        if self._position is not None and mine.get("data") is not None:
            problem = self._position.resume_at(mine["data"])
            if problem:
                notes.append(problem)
        for note in notes:
            warn_user(f"ap.Checkpointer: resuming from {found.path}, not restored exactly: {note}", CheckpointWarning)
        self.steps = int(plain["step"])
        self._saved_step = self.steps
        self.last_saved = found.path

    def _check_classes(self, found: Found, objects: Mapping[str, Any]) -> None:
        """Refuse, before anything is loaded, an optimizer or scheduler of another class than the one saved:
        its state would fail to load later (AdamW's into SGD) or load as the saved class's (AdamW's into Adam)."""
        marker, _ = _read_marker(found.path)
        saved = marker.get("classes") if marker is not None else None
        if not isinstance(saved, Mapping):
            return  # saved before the classes were recorded
        for key in ("optimizer", "scheduler"):
            given = objects.get(key)
            was = saved.get(key)
            if given is None or not isinstance(was, str) or was == _class_name(given):
                continue
            short = was.rsplit(".", 1)[-1]
            raise CheckpointError(
                f"ap.Checkpointer: {found.path} was saved with {key} {short} ({was}), and restore() was given "
                f"{type(given).__name__} ({_class_name(given)}): its state does not carry over to another class. "
                f"Restore with {key} class {short}, or start from another directory (or restore without {key}= "
                "to take the rest alone)")

    def _exit(self) -> None:
        assert self._stop is not None
        self._stop.saved = True
        api = _api()
        backend = api.backend()
        signum = self._stop.signum or signal.SIGTERM
        record_stop(os.environ.get("ACCELPORT_LAUNCH_DIR"), backend.rank(),
                    {"step": self.steps, "path": self.last_saved, "signal": signal_name(signum), "time": time.time(),
                     "pid": os.getpid()})
        if backend.rank() == 0:
            print(f"accelport: {signal_name(signum)}: saved the checkpoint of step {self.steps} in {self.last_saved} "
                  f"and stopped; run again to resume (exit status {EXIT_PREEMPTED})", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_PREEMPTED)


#: How long rank 0 looks again for another rank's part that its listing of a checkpoint lacks (shared storage).
MARK_WAIT_S = 10.0


def _size_by_name(path: str) -> int | None:
    """The size of ``path`` as its storage says on opening it by name (NFS revalidates a file's attributes on
    open, not on a listing's stat); None if it is not there."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _sizes(target: str) -> dict[str, int]:
    """Every file of a checkpoint directory (but its marker) with its size, each file opened by name."""
    files: dict[str, int] = {}
    for root, _dirs, names in os.walk(target):
        for name in names:
            if root == target and name in (MARKER, f".{MARKER}.tmp"):
                continue
            full = os.path.join(root, name)
            size = _size_by_name(full)
            if size is not None:
                files[os.path.relpath(full, target)] = size
    return files


def _sharded(model: Any) -> bool:
    from accelport.sharding import is_dtensor

    return model is not None and any(is_dtensor(p) for p in model.parameters())


def _class_name(value: Any) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


def _is(value: Any, kind: str) -> bool:
    import torch

    return isinstance(value, torch.nn.Module if kind == "module" else torch.optim.Optimizer)


def _holds(path: str, key: str) -> bool:
    """Whether the checkpoint at ``path`` holds a sharded ``key`` (from its manifest; a file is not opened)."""
    from accelport.checkpoint import MANIFEST

    try:
        with open(os.path.join(path, STATE, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return False
    return key in manifest.get("modules", [])


def _as_checkpoint_error(exc: BaseException) -> CheckpointError:
    if isinstance(exc, CheckpointError):
        return exc
    error = CheckpointError(str(exc) if str(exc) else f"ap.Checkpointer: {type(exc).__name__}")
    error.__cause__ = exc
    return error
