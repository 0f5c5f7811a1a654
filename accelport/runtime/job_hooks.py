"""The watcher's hooks that make one job of the processes a script runs (:class:`JobHooks`, mixed into
:class:`~accelport.runtime.watch.Watcher`).

- The launchers a script starts its own workers with (``torch.multiprocessing.spawn`` / ``start_processes``,
  ``torch_xla.launch``, ``xmp.spawn``) get its function wrapped, and its ``multiprocessing.Process`` targets
  too: each worker runs it watched in its own process (:mod:`accelport.runtime.workers`).
- The collectives that block the loop's thread until the other ranks arrive (``torch.distributed``'s, and
  torch_xla's host rendezvous) are timed as ``collective``: where one rank waits for another. While the loop
  is inside one, :meth:`JobHooks.waiting_in` says which, for the job's progress.

The job's judgement lives elsewhere (:mod:`accelport.diagnose.job`, the job rules); this is only what the
watcher of one process hooks for it.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from accelport.observe.frames import LIBRARIES, Site, user_site

if TYPE_CHECKING:
    from accelport.runtime.tracker import StepTracker

__all__ = ["JobHooks"]


class JobHooks:
    """What a watcher hooks so that the processes a script runs are watched as one job. The watcher calls
    :meth:`_init_job_hooks` as it is built, and registers the ``_on_*`` methods for the modules they name."""

    # What of the watcher's own state these hooks read (set by Watcher.__init__).
    _active: bool
    _feeding: bool
    _main: int
    _environ: Mapping[str, str]
    _wrap_worker: Callable[..., Callable[..., Any]] | None
    spawned: list[tuple[str, Site | None, int | None]]
    tracker: StepTracker

    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        raise NotImplementedError  # (the watcher's: it undoes every patch at uninstall)

    def _init_job_hooks(self) -> None:
        #: multiprocessing.Process targets of the script's own wrapped so far (each gets its number).
        self._processes = 0
        self._launching = 0  # inside a launcher's call (another launcher it calls is part of it)
        # The collective the loop's thread is inside now, and the frame that called it: where a rank that never
        # ends waits (read from the job's progress thread).
        self._in_collective: tuple[str, types.FrameType] | None = None

    # -- the collectives ---------------------------------------------------------------------
    COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
                   "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list",
                   "reduce", "gather", "scatter", "barrier",
                   # FSDP2's all-gathers and reduce-scatters (torch 2.13 and later; earlier: the *_tensor ones)
                   "all_gather_single", "reduce_scatter_single")

    #: torch_xla's collectives that block the host until every process arrives (its others, xm.all_reduce and
    #: the like, only add to the step's graph: their waiting is in the sync, see JobView.meeting).
    XLA_COLLECTIVES = ("mesh_reduce", "rendezvous")

    def _on_distributed(self, module: types.ModuleType) -> None:
        for name in self.COLLECTIVES:
            self._patch(module, name, self._collective_wrapper("dist"))

    def _collective_wrapper(self, prefix: str) -> Callable[[Any], Any]:
        """What wraps a collective that blocks the loop's thread: its time is ``collective``, and while the loop
        is inside it, :meth:`waiting_in` says which (``prefix.name``) and where the script called it."""
        watcher = self
        clock = self.tracker.clock

        def make(original: Any) -> Any:
            label = f"{prefix}.{getattr(original, '__name__', 'collective')}"

            def collective(*args: Any, **kwargs: Any) -> Any:
                if not (watcher._feeding and threading.get_ident() == watcher._main):
                    return original(*args, **kwargs)
                outer = watcher._in_collective
                if outer is None:  # (one collective calling another is where the script called the first)
                    watcher._in_collective = (label, sys._getframe(1))
                clock.enter("collective")
                try:
                    return original(*args, **kwargs)
                finally:
                    clock.leave("collective")
                    watcher._in_collective = outer
            return collective

        return make

    def waiting_in(self) -> str | None:
        """The torch.distributed collective the loop is inside now, and the script's line that called it
        (``"dist.all_reduce (called from train.py:57)"``: a library's, as FSDP2's all-gathers, from the line
        of the script that led to it); None outside one. Safe from another thread."""
        inside = self._in_collective
        if inside is None:
            return None
        label, frame = inside
        site = user_site(frame)
        return label + (f" (called from {os.path.basename(site[0])}:{site[1]})" if site else "")

    # -- the workers ------------------------------------------------------------------------
    def _on_xla_multiprocessing(self, module: types.ModuleType) -> None:
        self._patch(module, "spawn", self._spawn_wrapper("xmp.spawn", None))

    def _on_multiprocessing(self, module: types.ModuleType) -> None:
        self._patch(module, "spawn", self._spawn_wrapper("torch.multiprocessing.spawn", 1))
        self._patch(module, "start_processes", self._spawn_wrapper("torch.multiprocessing.start_processes", 1))

    def _spawn_wrapper(self, launcher: str, default: int | None, single: str | None = None,
                       position: int | None = 2) -> Callable[[Any], Any]:
        """A wrapper of a launcher that trains in processes of its own (nprocs: argument ``position`` or the keyword,
        ``default`` when not given, None meaning every device; ``single``: the flag that keeps it in this process)."""
        watcher = self

        def make(original: Any) -> Any:
            def launch(*args: Any, **kwargs: Any) -> Any:
                # torch_xla.launch calls xmp.spawn: the outer launcher's call is the script's, said once.
                if watcher._active and not watcher._launching:
                    given = args[position] if position is not None and len(args) > position else default
                    nprocs = kwargs.get("nprocs", given)
                    if single is not None and (kwargs.get(single) or (len(args) > 3 and args[3] is True)):
                        nprocs = 1
                    if launcher == "torch_xla.launch" and watcher._environ.get("TORCHELASTIC_RUN_ID"):
                        nprocs = 1  # under torchrun it calls the function here, in this process
                    if nprocs != 1:
                        site = user_site()
                        watcher.spawned.append((launcher, Site(*site) if site else None,
                                                nprocs if isinstance(nprocs, int) else None))
                        if watcher._wrap_worker is not None:
                            wrap = functools.partial(watcher._wrap_worker, start=len(watcher.spawned) - 1)
                            args, kwargs = watcher._watched_fn(wrap, args, kwargs)
                watcher._launching += 1
                try:
                    return original(*args, **kwargs)
                finally:
                    watcher._launching -= 1
            return launch

        return make

    def _on_process(self, module: types.ModuleType) -> None:
        """A ``multiprocessing.Process`` whose target is the script's own (not a DataLoader worker's, a library's
        or the standard library's) runs it watched in the new process; a target that trains is a rank."""
        watcher = self

        def make(original: Any) -> Any:
            def __init__(process: Any, *args: Any, **kwargs: Any) -> None:
                original(process, *args, **kwargs)
                target = getattr(process, "_target", None)
                if (watcher._active and watcher._wrap_worker is not None and target is not None
                        and threading.get_ident() == watcher._main and _scripts_own(target)):
                    process._target = watcher._wrap_worker(target, process=watcher._processes)
                    watcher._processes += 1
            return __init__

        base = getattr(module, "BaseProcess", None)
        if base is not None:
            self._patch(base, "__init__", make)

    @staticmethod
    def _watched_fn(wrap: Callable[..., Callable[..., Any]], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A launcher's arguments with its function (first, or ``fn=``) wrapped by ``wrap``."""
        if args:
            return (wrap(args[0]), *args[1:]), kwargs
        if "fn" in kwargs:
            return args, {**kwargs, "fn": wrap(kwargs["fn"])}
        return args, kwargs


def _scripts_own(target: Any) -> bool:
    """Whether a Process target is the script's code: not torch's, a framework's or the standard library's."""
    while isinstance(target, functools.partial):
        target = target.func
    top = str(getattr(target, "__module__", None) or "").partition(".")[0]
    return bool(top) and top not in LIBRARIES and top not in sys.stdlib_module_names
