"""Workers a watched script starts itself (``torch.multiprocessing.spawn`` / ``start_processes``,
``torch_xla.launch`` / ``xmp.spawn``, ``multiprocessing.Process`` targets of its own): each is watched in its own
process, and its run comes back to the parent.

torch_xla's launchers run the function in a thread per device of each process. One device per process (TPU v4
and later, Trainium) is one watched rank per process; where a process has several devices (TPU v2/v3, XLA:CPU
with ``CPU_NUM_DEVICES`` above 1) the first thread to start is watched and the others are said to be unwatched
(a watcher follows one thread: the steps of two loops in one process cannot be told apart by its hooks).

The launcher's function is handed over wrapped (:class:`WatchedWorker`): it travels to the worker as
the function itself would (pickled by reference under spawn and forkserver, inherited under fork), and
in the worker it runs the function under a :class:`~accelport.runtime.watch.Watcher` of that process.
When the function ends, however it ends, the worker writes its summary (:class:`RankRun`) whole into a
directory of the parent's; the parent reads them once the script ends (:func:`read_workers`) and judges
them as one job (:mod:`accelport.diagnose.job`). A script that starts workers more than once (training, then
evaluation) has each start's runs kept apart: the start that took the most optimizer steps is the job.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from accelport.diagnose.rule import RankRun
from accelport.runtime.watch import Watcher

__all__ = ["WatchedWorker", "WorkerRuns", "rank_run", "read_workers", "watch_workers"]

_PREFIX = "rank-"
#: A ``multiprocessing.Process`` target's run: a rank of the job only if it trained (a helper process does not).
_PROCESS_PREFIX = "process-"
#: A device thread of a process whose first thread is watched: a rank, not watched.
_UNWATCHED_PREFIX = "unwatched-"
#: A worker's step records, beside its run (``rank-0-1.jsonl``), where the parent asked for them.
_STEPS_SUFFIX = ".jsonl"


def rank_run(watcher: Watcher, exit_status: int, rank: int) -> RankRun:
    """``watcher``'s run as one rank's summary: seconds per step by category after the first step (which holds
    the start-up and the first compilations), and the seconds inside backward passes per step."""
    tracker = watcher.tracker
    steps = tracker.time_steps
    per_step: dict[str, float] = {}
    backward = 0.0
    if steps > 1:
        for category, seconds in tracker.time_total.items():
            per_step[category] = (seconds - tracker.first_breakdown.get(category, 0.0)) / (steps - 1)
        backward = (tracker.clock.backward - tracker.first_backward) / (steps - 1)
    elif steps == 1:
        per_step = dict(tracker.time_total)
    metrics = watcher.metrics()
    return RankRun(rank=rank, host=socket.gethostname(), pid=os.getpid(), steps=watcher.steps + watcher.manual_steps,
                   exit_status=exit_status, per_step={k: v for k, v in per_step.items() if v > 0},
                   backward=max(backward, 0.0), findings=[watcher.finding_dict(f) for f in watcher.findings],
                   compilations=int(metrics.get("compilations") or 0),
                   peak_memory_bytes=metrics.get("peak_memory_bytes"), backend=watcher.backend_name,
                   style=watcher.style, not_judged=dict(watcher.unjudged),
                   lazy=bool(getattr(watcher.backend, "lazy", False)))


#: What stays in the process a WatchedWorker is in: not pickled to a worker.
_LOCAL = ("_claim", "_claimed", "_others", "_active", "_written", "_writing", "_signalled")


class WatchedWorker:
    """A launcher's function, watched in the worker that runs it; its run written to ``directory``.

    ``process``: the function is a ``multiprocessing.Process`` target, the ``process``-th the script made (its
    arguments are its own); else a launcher's, called with the worker's index first (its rank)."""

    def __init__(self, fn: Callable[..., Any], directory: str, backend: str | None,
                 process: int | None = None, start: int = 0, steps: bool = False) -> None:
        self.fn = fn
        self.directory = directory
        self.backend = backend
        self.steps = steps  # write the worker's step records too (the parent draws the job's page from them)
        self.process = process
        self.start = start  # which of the script's launcher calls started this worker (0: the first)
        self._claim = threading.Lock()  # the first thread of this process to run the function is watched
        self._claimed = False
        self._others: set[int] = set()  # this process's further device threads: the watcher skips their steps
        self._active: tuple[Watcher, int, str] | None = None  # (the watcher, the rank, its files' prefix) while it runs
        self._written = threading.Lock()  # held once the run is written
        self._writing = False
        self._signalled: int | None = None  # a SIGTERM that came while the run was written

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in _LOCAL}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._claim, self._claimed, self._others = threading.Lock(), False, set()
        self._active, self._written, self._writing, self._signalled = None, threading.Lock(), False, None
        # Unpickled in the worker's main thread (spawn, forkserver; torch_xla's replicas then run the function in
        # a thread per device, where no signal handler can be installed): SIGTERM is taken here.
        self._on_sigterm()

    def _on_sigterm(self) -> None:
        """A launcher's stop (SIGTERM, where it would end the worker): write the run so far, then end by it."""
        try:
            current = signal.getsignal(signal.SIGTERM)
            # (a forked worker inherits the handler of the parent's `accelport diagnose`, which is not its own)
            if threading.current_thread() is threading.main_thread() and (
                    current == signal.SIG_DFL or getattr(current, "parent_only", False)):
                signal.signal(signal.SIGTERM, self._stopped)
        except (AttributeError, ValueError, OSError):  # no SIGTERM on this system
            pass

    def _stopped(self, signum: int, frame: Any) -> None:
        if self._writing:  # the run is being written (the function ended): the worker ends by the signal after
            self._signalled = signum
            return
        if self._active is not None:
            watcher, index, prefix = self._active
            self._conclude(watcher, index, prefix, 128 + signum)
        self._end(signum)

    @staticmethod
    def _end(signum: int) -> None:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def _conclude(self, watcher: Watcher, index: int, prefix: str, status: int) -> None:
        """Write the run once (the function's end, or a SIGTERM that came first)."""
        if not self._written.acquire(blocking=False):
            return
        self._writing = True
        try:
            watcher.finish()
            watcher.uninstall()
            _write(self.directory, rank_run(watcher, status, index), prefix)
        except Exception:  # noqa: BLE001 - never in the way of the worker's own end
            pass
        finally:
            self._writing = False
        if self._signalled is not None:  # a SIGTERM came while it was written: it ends the worker now
            self._end(self._signalled)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        index = self.process if self.process is not None else int(args[0])
        with self._claim:
            first, self._claimed = not self._claimed, True
        if not first:  # another device thread of this process is watched already
            self._others.add(threading.get_ident())
            _mark_unwatched(self.directory, self.start, index)
            return self.fn(*args, **kwargs)
        prefix = _PROCESS_PREFIX if self.process is not None else f"{_PREFIX}{self.start}-"
        records = os.path.join(self.directory, f"{prefix}{index}{_STEPS_SUFFIX}") if self.steps else None
        watcher = Watcher(backend=self.backend, other_loops=self._others, metrics_file=records)
        watcher.install()
        self._on_sigterm()  # (a worker that runs the function in its main thread: fork, or spawn's own call)
        self._active = (watcher, index, prefix)
        status = 0
        try:
            return self.fn(*args, **kwargs)
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            raise
        except BaseException as exc:
            status = 1
            watcher.failed(exc)
            raise
        finally:
            self._active = None
            self._conclude(watcher, index, prefix, status)


def watch_workers(directory: str, backend: str | None, steps: bool = False) -> Callable[..., Callable[..., Any]]:
    """What a Watcher wraps a launcher's function (or, with ``process=N``, a Process target) with, so each
    worker's run is written to ``directory``; ``steps``: its step records too."""
    def wrap(fn: Callable[..., Any], process: int | None = None, start: int = 0) -> Callable[..., Any]:
        return WatchedWorker(fn, directory, backend, process, start, steps)
    return wrap


def _write(directory: str, run: RankRun, prefix: str = _PREFIX) -> None:
    path = os.path.join(directory, f"{prefix}{run.rank}.json")
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(asdict(run), f, default=str)
    os.replace(temporary, path)


def _mark_unwatched(directory: str, start: int, rank: int) -> None:
    try:
        with open(os.path.join(directory, f"{_UNWATCHED_PREFIX}{start}-{rank}"), "w", encoding="utf-8"):
            pass
    except OSError:  # never in the way of the worker
        pass


@dataclass
class WorkerRuns:
    """What the workers a script started left: the job's ranks' runs, by rank, and the ranks that ran unwatched
    beside a watched one (torch_xla's further device threads). ``start``: which launcher call the job is (the
    one whose workers took the most optimizer steps); ``others``: each other start that left runs, as
    (start, workers, optimizer steps)."""

    runs: list[RankRun] = field(default_factory=list)
    unwatched: list[int] = field(default_factory=list)
    start: int | None = None
    others: list[tuple[int, int, int]] = field(default_factory=list)
    #: The step records of the job's first rank that wrote any (its number, the file), where asked for.
    records: tuple[int, str] | None = None


def _numbers(name: str, prefix: str, suffix: str = "") -> tuple[int, int] | None:
    """(start, rank) of a file named ``{prefix}{start}-{rank}{suffix}``; None for another name."""
    if not name.startswith(prefix) or not name.endswith(suffix):
        return None
    start, _, rank = name[len(prefix):len(name) - len(suffix)].partition("-")
    return (int(start), int(rank)) if start.isdigit() and rank.isdigit() else None


def read_workers(directory: str) -> WorkerRuns:
    """The workers' runs written to ``directory``; a file that is not one is left out.

    Process targets that took no optimizer step were helpers, not ranks: left out. Those that trained are
    ranks in the order the script made them, after the launchers' workers."""
    try:
        names = os.listdir(directory)
    except OSError:
        return WorkerRuns()
    starts: dict[int, dict[int, RankRun]] = {}
    processes: dict[int, RankRun] = {}
    unwatched: dict[int, list[int]] = {}
    for name in names:
        numbered = _numbers(name, _UNWATCHED_PREFIX)
        if numbered is not None:
            unwatched.setdefault(numbered[0], []).append(numbered[1])
            continue
        numbered = _numbers(name, _PREFIX, ".json")
        if numbered is None and not (name.startswith(_PROCESS_PREFIX) and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                run = RankRun.from_dict(json.load(f))
        except (OSError, ValueError):
            continue
        if numbered is None:
            processes[run.rank] = run
        else:
            starts.setdefault(numbered[0], {})[run.rank] = run
    # The job is the start that trained most (of equals, the last); a start that only evaluated is said apart.
    steps = {n: sum(r.steps for r in runs.values()) for n, runs in starts.items()}
    start = max(starts, key=lambda n: (steps[n], n)) if starts else None
    ordered = [starts[start][r] for r in sorted(starts[start])] if start is not None else []
    trained = [processes[n] for n in sorted(processes) if processes[n].steps]
    first = max((r.rank for r in ordered), default=-1) + 1
    others = [(n, len(starts[n]), steps[n]) for n in sorted(starts) if n != start]
    ranks = ordered + [replace(run, rank=first + i) for i, run in enumerate(trained)]
    files = [f"{_PREFIX}{start}-{run.rank}" for run in ordered] + [f"{_PROCESS_PREFIX}{run.rank}" for run in trained]
    written = [(run.rank, path) for run, name in zip(ranks, files, strict=True)
               if os.path.isfile(path := os.path.join(directory, name + _STEPS_SUFFIX)) and os.path.getsize(path)]
    return WorkerRuns(ranks, sorted(unwatched.get(start, [])) if start is not None else [], start, others,
                      written[0] if written else None)
