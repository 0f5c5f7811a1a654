"""Watch an unmodified PyTorch or torch_xla script: the same step records, for the same rules, as ``ap.*`` gives.

``accelport diagnose`` runs a script in this process (:func:`run_watched`) with a
:class:`Watcher` installed. It sees, without a line of the script changed:

- the steps: torch's global optimizer post-hook runs after every ``optimizer.step()``,
  including the one inside ``xm.optimizer_step``;
- on XLA, the syncs: ``torch_xla.sync`` (which ``xm.mark_step``, ``MpDeviceLoader`` and
  ``xm.optimizer_step(barrier=True)`` call) or, on torch_xla releases before it, ``xm.mark_step``;
  and the host reads made inside ``xm.add_step_closure`` callbacks (they wait for a step that
  already ran, like ``ap.after_step``'s, so host-sync leaves them out);
- the data: the wait for each batch and its shapes, from the torch DataLoader's iterator and
  from torch_xla's per-device loader (``MpDeviceLoader``, ``ParallelLoader``), in the thread
  that trains; the loader's ``num_workers`` and ``batch_size``.

Each is installed when the script itself imports the module it lives in (a post-import hook
on ``sys.meta_path``), so nothing is imported that the script does not import, and nothing
is computed differently: every wrapper calls the original and returns what it returned.

The backend is the one that drives the device of the parameters being stepped (or
``--backend``). The steps go through the same :class:`~accelport.runtime.tracker.StepTracker`
and the same backend counters (``step_delta``, ``compile_facts``) as ``ap.optimizer_step``, in
a runtime of their own, so every registered rule (the built-in kinds, a third party's) and every
step observer (the metrics file) sees a diagnosed script exactly as a ported one. One
fact only the watcher has: on a lazy backend, how many times the script synced during each
step (``delta["syncs"]``), which the ``graph-growth`` rule reads.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import io
import linecache
import marshal
import os
import pkgutil
import re
import runpy
import signal
import sys
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from accelport.device_loader import describe_loader, signature
from accelport.errors import AccelportError, DiagnosticWarning, mark_ending_with_error
from accelport.lazy import OWN_CLOSURE
from accelport.observe import tracer
from accelport.observe.dynamo import CompileEvents
from accelport.observe.frames import Site, library_file, user_site
from accelport.observe.steptime import watch_backward
from accelport.runtime.job_hooks import JobHooks
from accelport.runtime.state import Runtime
from accelport.runtime.tracker import StepTracker

if TYPE_CHECKING:
    from accelport.contract import Backend
    from accelport.diagnose.resume_check import StepRecorder
    from accelport.diagnose.rule import Diagnosis
    from accelport.observe.profile import StepProfile
    from accelport.plugins.host import PluginHost
    from accelport.redact import Redactor

__all__ = ["Watcher", "Outcome", "Site", "run_watched", "entry_spec", "where"]

#: Which place a finding of each kind is best shown at, best first: where the batches are built (a
#: user's collate_fn or dataset), the loop over the data (where batches come from) or the optimizer
#: step (where a sync belongs).
#: "file:12" or "file:12: reason" (a file name never holds ": ", which starts the reason).
_SITE = re.compile(r"^(?P<file>(?:(?!: ).)+?):(?P<line>\d+)(?=: |$)")
_FUNCTION_SITE = re.compile(r"\((?P<file>.+):(?P<line>\d+)\)$")
_PLACES = {"recompilation": ("data", "loop"), "compile-limit": ("data", "loop"), "input-bound": ("samples", "loop"),
           "graph-growth": ("step",)}


def where(finding: Any, sites: Mapping[str, Site]) -> Site | None:
    """The script's line a finding is best shown at: the host read itself, else where the batches are built, the
    loop or the step (each labelled: the line a finding points at is always the user's, never a library's)."""
    evidence = getattr(finding, "evidence", None) or {}
    # A host read's or a graph break's line ("file:12" or "file:12: reason"), then the
    # compiled function that recompiled ("forward (file:3)").
    for site in evidence.get("sites") or ():
        m = _SITE.match(str(site))
        if m and not library_file(m.group("file")):
            return Site(m.group("file"), int(m.group("line")))
    m = _FUNCTION_SITE.search(str(evidence.get("function") or ""))
    if m and not library_file(m.group("file")):  # (torch's Sequential.forward says nothing of the script)
        return Site(m.group("file"), int(m.group("line")), "the compiled function")
    kind = getattr(finding, "kind", "")
    places = _PLACES.get(kind, ())
    if kind in ("recompilation", "compile-limit") and (evidence.get("distinct_signatures") or 0) < 2:
        places = ("loop",)  # the batches kept their shape: where they are built says nothing
    for place in places:
        if place in sites:
            return sites[place]
    return sites.get(kind) or sites.get("step")


#: A lazy step that waits for its sync and has no optimizer (a loop that updates its weights by hand).
_NO_OPTIMIZER = object()


class _Overlay(Mapping[str, str]):
    """``top`` over ``base``: the watcher's settings over the process's environment, read as it changes."""

    def __init__(self, top: Mapping[str, str], base: Mapping[str, str]) -> None:
        self._top, self._base = top, base

    def __getitem__(self, key: str) -> str:
        return self._top[key] if key in self._top else self._base[key]

    def __iter__(self) -> Iterator[str]:
        yield from self._top
        yield from (key for key in self._base if key not in self._top)

    def __len__(self) -> int:
        return len(set(self._top) | set(self._base))


class _PostImport(importlib.abc.MetaPathFinder):
    """Calls back once a module has been imported (by the script), without importing anything itself."""

    def __init__(self, callbacks: Mapping[str, Callable[[types.ModuleType], None]]) -> None:
        self.pending = dict(callbacks)
        self._asking: set[tuple[int, str]] = set()  # (thread, module) this finder is asking the others about

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None) -> Any:
        callback = self.pending.get(fullname)
        key = (threading.get_ident(), fullname)
        # A finder of the script's that delegates to the others (this one too) asks again from
        # inside the loop below: that question is not this finder's to answer.
        if callback is None or key in self._asking:
            return None
        self._asking.add(key)
        try:
            for finder in list(sys.meta_path):
                if finder is self:
                    continue
                find = getattr(finder, "find_spec", None)
                spec = find(fullname, path, target) if find is not None else None
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._asking.discard(key)
        loader = spec.loader
        if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
            return spec  # a loader shared by many modules (builtin, frozen): left alone
        original = loader.exec_module
        pending = self.pending

        def exec_module(module: types.ModuleType) -> None:
            # On this loader instance only (each file gets its own): the module's __loader__
            # stays the real one, so source lookups and resources work as before.
            original(module)
            vars(loader).pop("exec_module", None)
            if pending.pop(fullname, None) is not None:
                callback(module)

        loader.exec_module = exec_module
        return spec


@dataclass
class Outcome:
    """How the script ended: the status the shell sees, and the signal the process ends by, if one does."""

    exit_status: int
    #: The signal that ends the process, as it would have ended under ``python`` (SIGINT after an
    #: unhandled Ctrl-C, SIGTERM); ``exit_status`` is then 128 + it, as a shell reports it.
    ended_by: int | None = None
    #: True in a process the script forked, once the script has ended there: the parent reports the run.
    forked: bool = False


class Watcher(JobHooks):
    """Feeds a running script's steps, syncs and batches to a plugin host of its own.

    ``environ`` is what the host reads (default: the process's, read as it changes);
    ``backend`` names the backend whose counters are read (default: the one that drives
    the device of the first parameter being stepped); ``metrics_file`` gets one JSON line
    per step, as ``ACCELPORT_METRICS_FILE`` would; ``redactor``, where given, is the pass
    the diagnoses shown while the script runs go through. ``find_nan``: the first step to
    check op by op for the operation that made the first NaN (``--find-nan``; None: no
    search), its repro written in ``find_nan_dir``; ``command``: the arguments diagnose ran
    the script with, for the findings that say how to run it again; ``profile``, a window of
    steps to profile (``--profile``), whose messages become notes. ``recorder``: what records each step's
    state for ``accelport verify-resume`` (none for diagnose: nothing of it runs then). ``imports``: the
    caller's own callbacks, module name -> what to do once the script has imported it. ``other_loops``: the
    idents of threads whose optimizer steps belong to another loop (a worker's further device threads); it is
    read as steps happen, so a thread may join it after the watcher is built.

    A process the script forks is not watched: its copy of the watcher stops at the fork.
    """

    def __init__(self, environ: Mapping[str, str] | None = None, *, backend: str | None = None,
                 metrics_file: str | None = None, redactor: Redactor | None = None, find_nan: int | None = None,
                 find_nan_dir: str | None = None, command: Sequence[str] | None = None,
                 profile: StepProfile | None = None, recorder: StepRecorder | None = None,
                 workers: Callable[..., Callable[..., Any]] | None = None,
                 imports: Mapping[str, Callable[[types.ModuleType], None]] | None = None,
                 other_loops: Collection[int] = ()) -> None:
        self._recorder = recorder
        # Threads that run a loop of their own, not the watched one (a torch_xla worker's further device
        # threads): their optimizer steps are not counted. Read live: a thread joins it as it starts.
        self._other_loops = other_loops
        #: The caller's own callbacks on the script's imports (module name -> what to do once it is imported).
        self._imports = dict(imports or {})
        #: The exception the script ended with, if it raised one (run_watched says so through :meth:`failed`).
        self.error: BaseException | None = None
        # Workers the script starts itself (mp.spawn, torch_xla.launch) run their function wrapped by this, which
        # watches it in the worker (accelport.runtime.workers); None: only this process is watched.
        self._wrap_worker = workers
        self._init_job_hooks()
        self._environ = os.environ if environ is None else environ
        self._find_nan = find_nan
        self._find_nan_dir = find_nan_dir
        self._command = tuple(command) if command is not None else None
        self._backend_name = backend
        self._metrics_file = metrics_file
        self._redactor = redactor
        self.tracker = StepTracker()
        self.runtime: Runtime | None = None
        self.backend: Backend | None = None
        self.host: PluginHost | None = None
        #: What is worth saying besides the findings: the backend read, what could not be watched.
        self.notes: list[str] = []
        #: Every optimizer step the script took (also those after the watching stopped).
        self.steps = 0
        #: "step" (the first optimizer step's line), "loop" (the line that asked for the first
        #: step's batch), "data" (the user's collate_fn or dataset that builds the batches), "samples" (its
        #: dataset's __getitem__ first, where a slow loader's time goes) and each
        #: kind reported (the line it was reported at) -> the Site.
        self.sites: dict[str, Site] = {}
        #: How the script trains ("torch", "torch_xla", "transformers", "lightning"): the rules spell
        #: their fixes in its terms. Told at its first step.
        self.style = "torch"
        #: Where watching stopped: (step, why), or None while it goes on.
        self.stopped: tuple[int, str] | None = None
        #: The backend whose counters were wanted but cannot be read here, and why (None: read, or none wanted).
        self.unavailable: tuple[str, str] | None = None
        #: Backward passes seen, and those with no optimizer step ever (a hand-written update).
        self.backwards = 0
        self._manual = False
        #: Processes the script started to train in: (launcher, where, process count or None for "every device").
        self.spawned: list[tuple[str, Site | None, int | None]] = []
        #: The script's syncs and the host reads of its step closures (lazy backends), running totals.
        self.syncs = 0
        self.closure_reads = 0
        self._active = False  # between install() and finish(): the wrappers watch, else they only pass on
        self._feeding = False  # steps and batches go to the tracker
        self._open: Any = None  # lazy: the optimizer of the last step, which waits for the script's next sync
        self._sync_depth = 0
        self._sync_seconds = 0.0
        # The thread that runs the script: the main thread, or in a torch_xla worker the device's own thread.
        self._main = threading.get_ident()
        self._interned: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self._patches: list[tuple[Any, str, Any, Any]] = []
        self._finder: _PostImport | None = None
        self._hook: Any = None
        self._showwarning: Any = None
        self._copies: Callable[[], int] | None = None
        self._prebuilt: Runtime | None = None
        self._compile_events: CompileEvents | None = None
        self._pre_hook: Any = None
        #: Seconds torch_xla's loaders spent uploading batches (their threads), for the transfer share.
        self.transfer_seconds = 0.0
        self._uploaded = 0.0
        if profile is not None:
            # Why it was not profiled is a note at the end; what it found comes after the findings.
            profile.on_message, profile.say_result = self.notes.append, False
            self.tracker.profile = profile  # armed when the backend is chosen, at the first step

    # -- installing and removing -------------------------------------------------------
    def install(self) -> None:
        """Hook into torch and torch_xla as the script imports them (at once for what is already imported)."""
        callbacks: dict[str, Callable[[types.ModuleType], None]] = {
            "torch.optim.optimizer": self._on_optimizer,
            "torch.utils.data.dataloader": self._on_dataloader,
            "torch.autograd": self._on_autograd,
            "torch.multiprocessing": self._on_multiprocessing,
            "multiprocessing.process": self._on_process,
            "torch.distributed": self._on_distributed,
            "torch_xla": self._on_torch_xla,
            "torch_xla.core.xla_model": self._on_xla_model,
            "torch_xla.distributed.parallel_loader": self._on_parallel_loader,
            "torch_xla.distributed.xla_multiprocessing": self._on_xla_multiprocessing,
        }
        if self._find_nan is not None:
            self._start_search(callbacks)
        if self._recorder is not None:
            callbacks.update(self._recorder.imports())
        for name, extra in self._imports.items():
            callbacks[name] = _both(callbacks[name], extra) if name in callbacks else extra
        self._active = self._feeding = True
        if hasattr(os, "register_at_fork"):  # (weakly: the registration outlives the watcher)
            os.register_at_fork(after_in_child=functools.partial(_stop_in_child, weakref.ref(self)))
        # torch.compile's records count from here: the script's first compile is before its first step.
        self._compile_events = CompileEvents()
        self._prebuilt = self._prebuild()
        self._showwarning = warnings.showwarning
        warnings.showwarning = self._show_warning
        self._finder = _PostImport({name: self._guarded(fn) for name, fn in callbacks.items()
                                    if name not in sys.modules})
        sys.meta_path.insert(0, self._finder)
        for name, fn in callbacks.items():
            if name in sys.modules:
                self._guarded(fn)(sys.modules[name])

    def uninstall(self) -> None:
        """Take every hook and wrapper out again (where nothing replaced them since)."""
        self._active = self._feeding = False
        if self.tracker.nan_search is not None:
            self.tracker.nan_search.finish()
        if self._finder is not None and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._pre_hook is not None:
            self._pre_hook.remove()
            self._pre_hook = None
        for owner, name, original, wrapper in reversed(self._patches):
            if vars(owner).get(name) is wrapper:
                setattr(owner, name, original)
        self._patches = []
        if self._recorder is not None:
            self._recorder.close(self.steps)
        if warnings.showwarning == self._show_warning:
            warnings.showwarning = self._showwarning

    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = vars(owner).get(name)
        if original is None:
            return
        wrapper = functools.wraps(original)(make(original))
        setattr(owner, name, wrapper)
        self._patches.append((owner, name, original, wrapper))

    def _guarded(self, fn: Callable[..., None]) -> Callable[..., None]:
        """``fn`` that never raises into the script: a failure stops the watching and is said at the end."""

        def run(*args: Any) -> None:
            if not self._feeding:
                return
            try:
                fn(*args)
            except Exception as exc:  # the script runs on as if it were not watched
                self._stop(exc)

        return run

    def _stop(self, exc: BaseException) -> None:
        if self._feeding:
            self._feeding = False
            self.stopped = (self.steps, f"{type(exc).__name__}: {exc}")

    # -- torch ----------------------------------------------------------------------------
    def _start_search(self, callbacks: dict[str, Callable[[types.ModuleType], None]]) -> None:
        """--find-nan: the search counts steps from the script's start, and checks from torch's import if step 1
        is to be checked (the ops before the first optimizer step are step 1's)."""
        from accelport.observe.nan_search import NanSearch

        search = NanSearch(int(self._find_nan or 1), self._find_nan_dir or os.getcwd(), option="--find-nan-dir",
                           redactor=self._redactor)
        self.tracker.nan_search = search

        def on_torch(module: types.ModuleType) -> None:
            try:
                search.attach()
            except Exception as exc:  # the script runs on, unsearched
                search.problem = f"the search for the operation that made a NaN could not start: {exc}"

        callbacks["torch"] = on_torch

    def _on_optimizer(self, module: types.ModuleType) -> None:
        register = getattr(module, "register_optimizer_step_post_hook", None)
        if register is None:
            self.notes.append("this torch has no global optimizer step hook (torch < 2.0): no step was seen")
            return
        self._hook = register(self._after_step)
        before = getattr(module, "register_optimizer_step_pre_hook", None)
        if before is not None:  # the optimizer's time is the step's body (see accelport.observe.steptime)
            self._pre_hook = before(self._before_step)
        watch_backward(self.tracker.clock)

    #: torch.distributed's collectives a script calls itself: the time in them is a wait for the other ranks.
    def _on_dataloader(self, module: types.ModuleType) -> None:
        watcher = self
        clock = time.perf_counter
        get_ident = threading.get_ident

        def make_iter(original: Any) -> Any:
            def __iter__(loader: Any) -> Any:
                if watcher._feeding:
                    watcher.tracker.loader_info = describe_loader(loader)
                    if "data" not in watcher.sites:
                        site = _data_site(loader)
                        if site is not None:
                            watcher.sites["data"] = site
                        # Where the time of a slow loader goes: each sample's reading, done batch_size times a batch.
                        site = _data_site(loader, samples_first=True)
                        if site is not None:
                            watcher.sites["samples"] = site
                return original(loader)
            return __iter__

        # _next_data rather than __next__: torch warns from __next__ with stacklevel=2, and those
        # warnings must go on pointing at the script's line, not at a wrapper.
        def make_next(original: Any) -> Any:
            def _next_data(it: Any) -> Any:
                if watcher._recorder is not None and watcher._active:
                    watcher._recorder.next_batch(it)  # (it may end the process here: the kill of verify-resume)
                if not watcher._feeding or get_ident() != watcher._main:
                    return original(it)  # a loader thread (MpDeviceLoader's): not the loop's own wait
                start = clock()
                batch = original(it)
                watcher._batch(clock() - start, batch)
                return batch
            return _next_data

        self._patch(module.DataLoader, "__iter__", make_iter)
        base = getattr(module, "_BaseDataLoaderIter", None)
        for cls in base.__subclasses__() if base is not None else ():
            self._patch(cls, "_next_data", make_next)

    def _batch(self, wait: float, batch: Any, on_host: bool = True, transfer: float = 0.0) -> None:
        """A batch reached the loop after ``wait`` seconds (and ``transfer`` more waiting for the loader's
        uploads); ``on_host``: a DataLoader's, not yet moved."""
        try:
            sig = signature(batch)
            sig = self._interned.setdefault(sig, sig)  # equal shapes, one object: as ap.loader hands them
            if not self.steps:  # the batch of the first step: its line is the training loop's
                site = user_site()
                if site:
                    self.sites["loop"] = Site(*site, "the training loop")
            # As ap.loader hands them over: a host batch is looked at for NaN and Inf now where
            # the device is not the host, and goes with the step where it is (from the first
            # step on: the backend, and with it the checks, is chosen there).
            watch = self.tracker.numerics if on_host else None
            if watch is not None and watch.deferred:
                sig = watch.inspect(batch, sig)
            self.tracker.batch_arrived(wait, sig, batch if on_host else None, blocked=wait + transfer,
                                       transfer=transfer)
        except Exception as exc:
            self._stop(exc)

    # -- steps -----------------------------------------------------------------------------
    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._recorder is not None and self._active:
            self._recorder.before_step(optimizer)
        if self._feeding and threading.get_ident() == self._main:
            self.tracker.optimizer_started()

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._other_loops and threading.get_ident() in self._other_loops:
            return  # another loop's (a further device thread of torch_xla's launcher): not the watched one
        self.steps += 1
        if self._recorder is not None and self._active:
            self._recorder.after_step(optimizer, self.steps)
        if not self._feeding:
            return
        try:
            if self.steps == 1:
                site = user_site()
                if site:
                    self.sites["step"] = Site(*site, "the optimizer step")
                self.style = _style(sys._getframe(), self.style)
            backend = self.backend or self._select(optimizer)
            if backend is None:
                return
            if self._open is not None:  # the step before never synced: it ends here, without its graph run
                self._close()
            # The optimizer goes with the step: the non-finite and precision checks look at its
            # parameters after the update, as they do after ap.optimizer_step.
            if backend.lazy:
                self._open = optimizer  # its graph runs at the script's next sync: the record waits for that
            else:
                self.tracker.step_end(optimizer)
        except Exception as exc:  # never into the script's optimizer.step()
            self._stop(exc)

    def _close(self) -> None:
        optimizer, self._open = self._open, None
        if self.backend is not None:
            self.tracker.step_end(None if optimizer is _NO_OPTIMIZER else optimizer)

    def _runtime(self, on_host: bool) -> Runtime:
        """A runtime of the watcher's own (not the process's ``ap.*`` one), reading the watcher's settings."""
        # The host-read trace (file and line of each .item()) where the device is not the host; on
        # cpu there is no such read to find, and its Tensor wrappers are best kept from compiled code.
        overrides = {"ACCELPORT_DIAGNOSTICS": "1" if on_host else "trace"}
        if self._metrics_file:
            overrides["ACCELPORT_METRICS_FILE"] = self._metrics_file
        # The batches before the first step belong to it, and so do the compilations since install().
        return Runtime(_Overlay(overrides, self._environ), tracker=self.tracker, compile_events=self._compile_events,
                       from_process_start=True, command=self._command)

    def _prebuild(self) -> Runtime | None:
        """The plugin host and matrix for a run on the host CPU, built before the script starts.

        Loading the plugins and the matrix costs tens of milliseconds, which would otherwise land
        in the script's first step; on an accelerator steps are longer, and the trace needs a host
        of its own, built at the first step.
        """
        if self._backend_name not in (None, "cpu"):
            return None
        runtime = self._runtime(on_host=True)
        try:
            runtime.host()
            runtime.matrix()
            runtime.diagnostics()
        except Exception:  # said, if it matters, when the first step tries again
            return None
        return runtime

    def _select(self, optimizer: Any) -> Backend | None:
        """The backend whose counters describe this run, chosen at its first step; None (said why) if none."""
        return self._select_for(_device_type(optimizer))

    def _select_for(self, device_type: str | None) -> Backend | None:
        on_host = device_type in (None, "cpu") and self._backend_name in (None, "cpu")
        runtime = self._prebuilt if on_host and self._prebuilt is not None else self._runtime(on_host)
        self._prebuilt = None
        host = runtime.host()
        name = self._backend_name or _backend_for(host, device_type)
        if name is None:
            self._feeding = False
            self.unavailable = (str(device_type), f"no accelport backend drives the parameters' device type "
                                f"{device_type!r}; --backend NAME reads the counters of the backend named")
            return None
        if self.style == "torch" and host.backends[name].lazy:
            self.style = "torch_xla"  # a raw torch_xla loop: torch_xla's spelling of each fix first
        runtime.trains_as(self.style)
        backend = host.backends[name]
        if backend.lazy:
            self._count_syncs(backend)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                runtime.use(name)
        except AccelportError as exc:
            self._feeding = False
            self.unavailable = (name, str(exc))
            return None
        why = f"--backend {name}" if self._backend_name else f"the parameters being trained are on {device_type}"
        self.notes.append(f"counters from the {name} backend ({why})")
        # Said at the end with the findings: in the middle of the first step they would be lost.
        self.notes += [str(w.message) for w in caught]
        self.runtime, self.host, self.backend = runtime, host, runtime.backend()
        return self.backend

    def _count_syncs(self, backend: Backend) -> None:
        # The script syncs by itself (no ap.optimizer_step does it for it): its syncs, and the
        # host reads of its step closures, go with this backend's per-step counters, so the
        # tracker's deltas and the metrics file carry them like any other counter.
        own = backend.step_counters

        def step_counters() -> dict[str, float]:
            out = own()
            out["syncs"] = self.syncs
            if "after_step_reads" in out:
                out["after_step_reads"] += self.closure_reads
            return out

        backend.step_counters = step_counters  # type: ignore[method-assign]

    # -- torch_xla -------------------------------------------------------------------------
    def _on_torch_xla(self, module: types.ModuleType) -> None:
        self._patch(module, "sync", self._sync_wrapper)
        self._patch(module, "launch", self._spawn_wrapper("torch_xla.launch", None, "debug_single_process", None))
        counter = getattr(getattr(module, "_XLAC", None), "_xla_counter_value", None)
        if counter is not None:
            # Every host read of an XLA tensor goes through one of these two ops (see accelport.lazy).
            self._copies = lambda: (counter("xla::_to_cpu") or 0) + (counter("xla::_to_copy") or 0)

    def _on_autograd(self, module: types.ModuleType) -> None:
        watcher = self

        def make(original: Any) -> Any:
            def backward(*args: Any, **kwargs: Any) -> Any:
                result = original(*args, **kwargs)
                if watcher._feeding and threading.get_ident() == watcher._main:
                    watcher._backward(args[0] if args else kwargs.get("tensors"))
                return result
            return backward

        self._patch(module, "backward", make)

    #: Backward passes with no optimizer step ever that make a loop one that updates its weights by hand
    #: (gradient accumulation over this many micro-batches before a first step is rare).
    MANUAL_AFTER = 32

    def _backward(self, tensors: Any) -> None:
        """A backward pass ended. A loop with no optimizer step after many of them updates its weights by hand
        (``p.data.add_(p.grad, alpha=-lr)``): from then on, each backward pass ends a step."""
        self.backwards += 1
        if self.steps:
            return
        try:
            if not self._manual:
                if self.backwards < self.MANUAL_AFTER:
                    return
                self._manual = True
                site = user_site()
                if site:
                    self.sites.setdefault("step", Site(*site, "the backward pass"))
            device = getattr(tensors[0] if isinstance(tensors, (list, tuple)) and tensors else tensors, "device", None)
            backend = self.backend or self._select_for(getattr(device, "type", None))
            if backend is None:
                return
            if self._open is not None:
                self._close()
            if backend.lazy:
                self._open = _NO_OPTIMIZER
            else:
                self.tracker.step_end(None)
        except Exception as exc:  # never into the script's backward()
            self._stop(exc)

    @property
    def manual_steps(self) -> int:
        """The backward passes taken as steps (a loop that updates its weights by hand), 0 otherwise."""
        return self.backwards - self.MANUAL_AFTER + 1 if self._manual and not self.steps else 0

    def _on_xla_model(self, module: types.ModuleType) -> None:
        mark_step = getattr(module, "mark_step", None)
        # Where mark_step is deprecated it calls torch_xla.sync, which is watched: wrapping it too
        # would point its DeprecationWarning at the wrapper instead of at the script's line.
        if mark_step is not None and not getattr(mark_step, "__deprecated__", None):
            self._patch(module, "mark_step", self._sync_wrapper)
        for name in self.XLA_COLLECTIVES:
            self._patch(module, name, self._collective_wrapper("xm"))
        watcher = self

        def make(original: Any) -> Any:
            def add_step_closure(closure: Any, *args: Any, **kwargs: Any) -> Any:
                # accelport's own reads are counted by the backend; a further device thread's are its own loop's
                if getattr(closure, OWN_CLOSURE, False) or (watcher._other_loops
                                                            and threading.get_ident() in watcher._other_loops):
                    return original(closure, *args, **kwargs)
                return original(watcher._counted(closure), *args, **kwargs)
            return add_step_closure

        self._patch(module, "add_step_closure", make)

    def _counted(self, closure: Callable[..., Any]) -> Callable[..., Any]:
        """``closure``, counting the host reads it makes (they come after the step ran, as ap.after_step's)."""

        def counted(*args: Any, **kwargs: Any) -> Any:
            copies = self._copies
            before = copies() if copies is not None else 0
            try:
                return closure(*args, **kwargs)
            finally:
                if copies is not None:
                    self.closure_reads += copies() - before

        return counted

    def _sync_wrapper(self, original: Any) -> Any:
        watcher = self
        clock = time.perf_counter
        get_ident = threading.get_ident

        def sync(*args: Any, **kwargs: Any) -> Any:
            # (xm.mark_step calling torch_xla.sync: one sync.) A further device thread's syncs are its own loop's:
            # counted, they would end the watched loop's steps and nest into its syncs.
            if watcher._sync_depth or not watcher._active or (watcher._other_loops
                                                              and get_ident() in watcher._other_loops):
                return original(*args, **kwargs)
            watcher._sync_depth += 1
            start = clock()
            timed = watcher._feeding and get_ident() == watcher._main
            if timed:  # the loop waits for the device here (see accelport.lazy)
                watcher.tracker.clock.enter("sync")
            ran = False
            try:
                out = original(*args, **kwargs)
                ran = True
                return out
            finally:
                watcher._sync_depth -= 1
                if timed:
                    watcher.tracker.clock.leave("sync")
                if ran:
                    watcher._synced(clock() - start)
                else:  # the open step's graph failed here (out of memory): that step failed, it did not end
                    watcher._open = None

        return sync

    def _synced(self, seconds: float) -> None:
        self.syncs += 1
        self._sync_seconds += seconds
        if self._open is not None and self._feeding:
            try:
                self._close()
            except Exception as exc:
                self._stop(exc)

    def _on_parallel_loader(self, module: types.ModuleType) -> None:
        watcher = self
        clock = time.perf_counter
        get_ident = threading.get_ident

        def make(original: Any) -> Any:
            def next_batch(loader: Any) -> Any:
                if not watcher._feeding or get_ident() != watcher._main:
                    return original(loader)
                synced = watcher._sync_seconds
                start = clock()
                batch = original(loader)
                # It syncs first (the step before runs then, and its record ends), then waits for data;
                # what of that wait went to the loader's uploads since the last batch is transfer.
                wait = max(clock() - start - (watcher._sync_seconds - synced), 0.0)
                uploaded, watcher._uploaded = watcher.transfer_seconds - watcher._uploaded, watcher.transfer_seconds
                transfer = min(wait, uploaded)
                if watcher._open is not None and watcher._feeding:
                    try:
                        watcher._close()  # it did not sync this time (batches_per_execution > 1)
                    except Exception as exc:  # never into the script's next(loader)
                        watcher._stop(exc)
                watcher._batch(wait - transfer, batch, on_host=False, transfer=transfer)
                return batch
            return next_batch

        def make_send(original: Any) -> Any:
            def send_cpu_data_to_device(loader: Any, *args: Any, **kwargs: Any) -> Any:
                start = clock()
                try:
                    return original(loader, *args, **kwargs)
                finally:  # (in the loader's upload thread: a float added, read by the loop's thread)
                    watcher.transfer_seconds += clock() - start
            return send_cpu_data_to_device

        self._patch(module.PerDeviceLoader, "next", make)
        parallel = getattr(module, "ParallelLoader", None)
        if parallel is not None:
            self._patch(parallel, "send_cpu_data_to_device", make_send)

    # -- warnings --------------------------------------------------------------------------
    def _show_warning(self, message: Any, category: type[Warning], filename: str, lineno: int,
                      file: Any = None, line: str | None = None) -> None:
        # A diagnosis is raised inside torch's optimizer hook or a sync: show it at the script's
        # line, where a ported script's warning would point, and remember that line.
        if isinstance(category, type) and issubclass(category, DiagnosticWarning):
            text = str(message)
            kind = text[1:text.find("]")] if text.startswith("[") and "]" in text else ""
            engine = self.runtime.diagnostics() if self.runtime is not None else None
            if kind and engine is not None and kind in engine.kinds:
                # A finding: said once, in the summary at the end, with the run's totals. Only its line is kept.
                here = user_site(also=engine.rule_files)
                if here:
                    self.sites.setdefault(kind, Site(*here, "where it was found"))
                return
            if self._redactor is not None:  # accelport's own message: no credential, no control character
                message, filename, line = _redacted(self._redactor, message, category, filename, lineno, line)
        self._showwarning(message, category, filename, lineno, file, line)

    def failed(self, exc: BaseException) -> None:
        """The script raised ``exc``: an out-of-memory error is a finding, made before its traceback is printed."""
        self.error = exc
        mark_ending_with_error()  # (the process's exit hooks: this process fails, though diagnose caught it)
        if self._feeding:
            try:
                self.tracker.failed(exc)
            except Exception as error:  # never in the way of the script's own traceback
                self._stop(error)

    # -- results -----------------------------------------------------------------------------
    def finish(self) -> None:
        """End the last step and hand every step to the observers: the script is done."""
        search = self.tracker.nan_search
        try:
            if search is not None:
                search.finish()  # (before the last flush: the rules judge what it found)
            if self._feeding:
                if self._open is not None:
                    self._close()
                self.tracker.end_run(failed=self.error is not None)
            elif self.tracker.profile is not None and self.tracker.profile.state in ("running", "stopped"):
                self.tracker.profile.run_ended(self.tracker.steps)  # (watching stopped: its traces still written)
        except Exception as exc:
            self._stop(exc)
        finally:
            self._active = self._feeding = False
            if search is not None:
                self.notes += search.notes()

    def finding_dict(self, finding: Diagnosis) -> dict[str, Any]:
        """A finding as JSON holds it, with the script's line it is at (``evidence.where``) where one is known."""
        item: dict[str, Any] = finding.to_dict()
        site = where(finding, self.sites)
        if site:
            item["evidence"]["where"] = f"{site.file}:{site.line}"
            if site.label:
                item["evidence"]["where_is"] = site.label
        return item

    @property
    def findings(self) -> list[Diagnosis]:
        """The diagnoses so far (as ``ap.diagnostics()`` gives them), without judging the steps not yet handed over."""
        engine = self.runtime.diagnostics() if self.runtime is not None else None
        return engine.current() if engine is not None else []

    @property
    def kinds(self) -> list[str]:
        """The kinds the rules of this run look for (none before the backend is chosen)."""
        engine = self.runtime.diagnostics() if self.runtime is not None else None
        return list(engine.kinds) if engine is not None else []

    @property
    def unjudged(self) -> dict[str, str]:
        """kind -> why its rule did not judge this run ("needs 10 steps"); empty when every rule judged it."""
        engine = self.runtime.diagnostics() if self.runtime is not None else None
        return engine.unjudged() if engine is not None else {}

    @property
    def rule_failures(self) -> list[str]:
        """One line per rule that raised and was disabled: what it did not judge."""
        engine = self.runtime.diagnostics() if self.runtime is not None else None
        return list(engine.failures) if engine is not None else []

    @property
    def backend_name(self) -> str | None:
        return self.backend.name if self.backend is not None else None

    def time_summary(self) -> list[str]:
        """Where the watched run's step time went, and the verdict (none when no step was read)."""
        if self.runtime is None or self.backend is None:
            return []
        self.tracker.hand_over_finished()
        return self.runtime.time_summary()

    def metrics(self) -> dict[str, Any]:
        """``ap.metrics()`` of the watched run as a dict; empty when no backend was read."""
        if self.runtime is None or self.backend is None:
            return {}
        return self.runtime.metrics().to_dict()

    def efficiency(self) -> dict[str, Any] | None:
        """How much of the chip the watched run's steps used (``Runtime.efficiency``); None when no backend was read."""
        if self.runtime is None or self.backend is None:
            return None
        return self.runtime.efficiency()


def _redacted(redactor: Redactor, message: Any, category: type[Warning], filename: str, lineno: int,
              line: str | None) -> tuple[Any, str, str]:
    """A diagnosis's warning as shown: its text, the file name and the source line under it, redacted."""
    if line is None:  # what showwarning would print under it, read while the file name is the real one
        line = linecache.getline(filename, lineno)
    shown = redactor.text(str(message))
    if shown != str(message):
        try:
            message = category(shown)
        except Exception:  # a category that takes other arguments: the text alone
            message = shown
    return message, redactor.text(filename), redactor.text(line.strip())


def _both(first: Callable[[types.ModuleType], None], then: Callable[[types.ModuleType], None]
          ) -> Callable[[types.ModuleType], None]:
    def call(module: types.ModuleType) -> None:
        first(module)
        then(module)
    return call


def _stop_in_child(ref: weakref.ReferenceType[Watcher]) -> None:
    """In a process the script forked: that copy of the watcher watches nothing (the parent reports)."""
    watcher = ref()
    if watcher is not None:
        watcher._active = watcher._feeding = False


#: Which framework a loop lives in, by the top-level package of a frame that runs the optimizer step.
_FRAMEWORK_STYLES = {"transformers": "transformers", "accelerate": "transformers", "trl": "transformers",
                     "lightning": "lightning", "pytorch_lightning": "lightning", "lightning_fabric": "lightning"}


def _style(frame: types.FrameType | None, default: str) -> str:
    """How the script trains, from the frames that run its first optimizer step: a framework's loop
    (HuggingFace Trainer or Accelerate, Lightning), else ``default``."""
    while frame is not None:
        package = (frame.f_globals.get("__name__") or "").partition(".")[0]
        if package in _FRAMEWORK_STYLES:
            return _FRAMEWORK_STYLES[package]
        frame = frame.f_back
    return default


def _data_site(loader: Any, samples_first: bool = False) -> Site | None:
    """Where the user's code builds a DataLoader's batches: its collate_fn (where their shapes are made), else its
    dataset's __getitem__; ``samples_first``: __getitem__ first (where a slow loader spends its time), else the
    collate_fn. None where both are a library's: default_collate, a HuggingFace collator or dataset."""
    collate = getattr(loader, "collate_fn", None)
    getitem = getattr(type(getattr(loader, "dataset", None)), "__getitem__", None)
    places = [("collate_fn", collate), ("the dataset's __getitem__", getitem)]
    for what, fn in places[::-1] if samples_first else places:
        code = _code_of(fn)
        if code is None or library_file(code.co_filename) or code.co_filename.startswith("<"):
            continue
        name = f" {code.co_qualname if hasattr(code, 'co_qualname') else code.co_name}" if what == "collate_fn" else ""
        return Site(code.co_filename, code.co_firstlineno, f"{what}{name}, where the batches are built")
    return None


def _code_of(fn: Any) -> types.CodeType | None:
    """The code object a callable runs: a function or method, a functools.partial's, a callable object's."""
    for _ in range(4):
        if fn is None:
            return None
        code = getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None
        if isinstance(code, types.CodeType):
            return code
        # A functools.partial's function, else the __call__ of a callable object's class (or a base's).
        fn = getattr(fn, "func", None) or next(
            (vars(c)["__call__"] for c in type(fn).__mro__ if "__call__" in vars(c)), None)
    return None


def _device_type(optimizer: Any) -> str | None:
    for group in getattr(optimizer, "param_groups", ()):
        for p in group.get("params", ()):
            device = getattr(p, "device", None)
            if device is not None:
                return str(device.type)
    return None


def _backend_for(host: PluginHost, device_type: str | None) -> str | None:
    """The backend for a device type; where several drive it (xla, neuron-xla), one that can run here."""
    candidates = [b for b in host.backends.values() if getattr(b, "device_type", None) == (device_type or "cpu")]
    available = [b for b in candidates if b.probe().available]
    chosen = (available or candidates)[:1]
    return chosen[0].name if chosen else None


# -- running the script ------------------------------------------------------------------------

#: Files of the wrappers above and of the host-read trace: never part of the script's traceback.
_WRAPPER_FILES = frozenset({os.path.abspath(__file__), os.path.abspath(tracer.__file__)})


def _leading(tb: types.TracebackType) -> bool:
    """A frame of what runs the script (accelport's CLI, runpy), before the script's own."""
    frame = tb.tb_frame
    module = frame.f_globals.get("__name__") or ""
    return module.partition(".")[0] in ("accelport", "runpy") or frame.f_code.co_filename == "<frozen runpy>"


def _script_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` as the script alone would have it: without the frames that ran it or watched it."""
    while tb is not None and _leading(tb):
        tb = tb.tb_next
    head = tb
    while tb is not None:
        following = tb.tb_next
        while following is not None and os.path.abspath(following.tb_frame.f_code.co_filename) in _WRAPPER_FILES:
            following = following.tb_next
        tb.tb_next = following
        tb = following
    return head


def _exit_status(code: Any) -> int:
    """The status Python exits with after ``SystemExit(code)``, as the shell sees it: None is 0; an int (True
    too) is itself as the system keeps it (its low 8 bits; one too large for a C long is -1); anything else
    is printed on stderr and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        status = int(code) if -(1 << 63) <= code < (1 << 63) else -1
        return status & 0xFF if os.name == "posix" else status
    try:
        print(code, file=sys.stderr)
    except Exception:  # the script closed its stderr: Python says nothing either
        pass
    return 1


def entry_spec(path: str) -> importlib.machinery.ModuleSpec | None:
    """How ``python path`` runs ``path``: None for a file run as a script (source or ``.pyc``); for a
    directory or a zip archive (a zipapp), the spec of its ``__main__`` module. LookupError where it has none.

    Python tells them apart as this does: by asking ``sys.path_hooks`` for an importer of the path.
    """
    importer = pkgutil.get_importer(os.path.abspath(path))
    if importer is None:
        return None
    find = getattr(importer, "find_spec", None)
    spec = find("__main__") if find is not None else None
    if spec is None or spec.loader is None:
        raise LookupError(f"can't find '__main__' module in {path!r}")
    return spec


def _fresh_main(**attributes: Any) -> types.ModuleType:
    import builtins

    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __annotations__={}, **attributes)
    return main


def _execute(code: types.CodeType, main: types.ModuleType) -> None:
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def _run_file(path: str) -> None:
    """Run the file at ``path`` as ``python path`` does: a fresh ``__main__`` whose ``__file__`` (and code) has
    the absolute path, while ``sys.argv[0]`` stays as typed (``runpy.run_path`` would change it).

    A ``.pyc`` is told from source as Python tells it (by its name or its magic number) and run
    from its code object; source is compiled from bytes, so a coding declaration holds.
    """
    full = os.path.abspath(path)
    with io.open_code(full) as f:
        data = f.read()
    magic = importlib.util.MAGIC_NUMBER
    loader: Any
    if full.endswith(".pyc") or data[:2] == magic[:2]:
        if data[:4] != magic:
            raise RuntimeError("Bad magic number in .pyc file")
        code = marshal.loads(data[16:])  # after the 16-byte header: magic, flags, and mtime and size or hash
        if not isinstance(code, types.CodeType):
            raise RuntimeError("Bad code object in .pyc file")
        loader = importlib.machinery.SourcelessFileLoader("__main__", full)
    else:
        code = compile(data, full, "exec", dont_inherit=True)
        loader = importlib.machinery.SourceFileLoader("__main__", full)
    _execute(code, _fresh_main(__file__=full, __cached__=None, __loader__=loader, __spec__=None,
                               __package__=None))


def _run_main_module(spec: importlib.machinery.ModuleSpec) -> None:
    """Run the ``__main__`` module of a directory or zipapp as ``python DIR`` does (as runpy runs it: the
    module's spec, file and loader), in a fresh ``__main__``, ``sys.argv[0]`` as typed."""
    assert spec.loader is not None
    code = spec.loader.get_code(spec.name)  # type: ignore[attr-defined]
    if code is None:
        raise ImportError(f"No code object available for {spec.name}")
    _execute(code, _fresh_main(__file__=spec.origin if spec.has_location else None, __cached__=spec.cached,
                               __loader__=spec.loader, __spec__=spec, __package__=spec.parent))


def _first_path(script: str | None, spec: importlib.machinery.ModuleSpec | None) -> str | None:
    """What Python puts first on ``sys.path`` for this run: the script's directory, the directory or
    archive run, or (``-m``) the working directory; nothing for a script or module under ``-P``."""
    if spec is not None:
        return os.path.abspath(str(script))  # added under -P too, as Python adds it
    if getattr(sys.flags, "safe_path", False):
        return None
    return os.path.dirname(os.path.abspath(script)) if script is not None else os.getcwd()


def _put_first(entry: str | None) -> Callable[[], None]:
    """Make ``entry`` the script's ``sys.path[0]``; return what puts the path back afterwards.

    Where Python put an entry of its own first for accelport (no ``-P``), the script's replaces
    it, as it would have been the only one; under ``-P`` it goes before the rest.
    """
    if entry is None:
        return lambda: None
    if sys.path and not getattr(sys.flags, "safe_path", False):
        saved = sys.path[0]
        sys.path[0] = entry

        def restore() -> None:
            if sys.path and sys.path[0] == entry:
                sys.path[0] = saved
    else:
        sys.path.insert(0, entry)

        def restore() -> None:
            if sys.path and sys.path[0] == entry:
                del sys.path[0]
    return restore


def _startup_modules() -> frozenset[str] | None:
    """The top-level modules plain ``python`` has imported when a script's first line runs (the interpreter's
    own, and what ``site`` and ``.pth`` files import), asked of a fresh interpreter with this one's flags; None
    where it cannot be asked. These a file beside the script never shadows: they are imported before
    ``sys.path[0]`` is the script's directory."""
    import subprocess

    if not sys.executable:
        return None
    flags = ["-I"] if sys.flags.isolated else [
        flag for flag, on in (("-E", sys.flags.ignore_environment), ("-s", sys.flags.no_user_site)) if on]
    flags += ["-S"] if sys.flags.no_site else []
    flags += [f"-X{name}" if value is True else f"-X{name}={value}" for name, value in sys._xoptions.items()]
    try:  # (the timeout guards against a hang; a python that starts takes well under a second)
        done = subprocess.run([sys.executable, *flags, "-c", "import sys; print(' '.join(sys.modules))"],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    if done.returncode != 0:
        return None
    return frozenset(name.partition(".")[0] for name in done.stdout.split())


def _shadowed(entry: str) -> list[tuple[str, str]]:
    """(module, file) for each top-level module imported before the script runs that ``python`` would import
    from ``entry`` (the script's ``sys.path[0]``) if it were not imported yet: ``NAME.py``, a package or an
    extension there. A builtin or frozen module is found before any path, and a bare directory (a namespace
    portion) gives way to a module further on, so neither is shadowed."""
    machinery = importlib.machinery
    found = []
    for name in sorted({key.partition(".")[0] for key in list(sys.modules)}):
        module = sys.modules.get(name)
        if module is None or name == "__main__":
            continue
        try:
            if machinery.BuiltinImporter.find_spec(name) or machinery.FrozenImporter.find_spec(name):
                continue
            spec = machinery.PathFinder.find_spec(name, [entry])
        except Exception:  # noqa: BLE001 - a name no finder can look up: nothing there shadows it
            continue
        if spec is None or spec.origin is None or not spec.has_location:
            continue
        current = getattr(module, "__file__", None)
        if isinstance(current, str) and os.path.abspath(current) == os.path.abspath(spec.origin):
            continue  # (already the script's: accelport was started from its directory)
        found.append((name, spec.origin))
    return found


class _SetAside:
    """The standard library's modules accelport imported that a file beside the script shadows, out of
    ``sys.modules`` while the script runs, so its ``import random`` gets its own ``random.py`` as under
    ``python script.py``; not those plain ``python`` imports before any script (``os``).

    accelport's modules keep the ones they imported (their names are bound); :meth:`restore` puts
    them back once the script has ended, for accelport's findings. accelport itself and the packages
    it imports lazily (``packaging``) stay accelport's: ``notes`` names each file the script does not
    get, and why.
    """

    def __init__(self, entry: str | None) -> None:
        self.modules: dict[str, types.ModuleType] = {}
        self.notes: list[str] = []
        shadows = _shadowed(entry) if entry is not None else []
        stdlib = [name for name, _ in shadows if name in sys.stdlib_module_names]
        startup = _startup_modules() if stdlib else frozenset()
        for name, origin in shadows:
            if startup is not None and name in startup:
                continue  # plain python imported it before the script's directory was on sys.path too
            had = getattr(sys.modules[name], "__file__", None) or "the one imported before it ran"
            if name not in stdlib:
                self.notes.append(f"{origin} beside the script shadows {name}, which accelport itself uses: the "
                                  f"script's `import {name}` gets accelport's ({had}), where plain python would "
                                  f"import {origin}; rename {origin} to run the same under both")
            elif startup is None:
                self.notes.append(f"{origin} beside the script shadows the standard library's {name}, which "
                                  f"accelport had imported: the script's `import {name}` gets the standard one "
                                  f"({had}), where plain python may import {origin} (accelport could not start "
                                  f"python to tell); rename {origin} to be sure")
            else:
                self.modules.update({key: sys.modules.pop(key) for key in list(sys.modules)
                                     if key == name or key.startswith(name + ".")})

    def _names(self) -> list[str]:
        names = {key.partition(".")[0] for key in self.modules}
        return [key for key in list(sys.modules) if key.partition(".")[0] in names]

    def restore(self) -> None:
        """accelport's modules back in ``sys.modules``, the script's (its random.py) out."""
        for key in self._names():
            del sys.modules[key]
        sys.modules.update(self.modules)


def _pool_threads() -> set[threading.Thread]:
    """The threads of concurrent.futures pools (torch's compile workers among them). Python tells them to
    stop at exit before it waits for threads, through these registries of theirs; waited for here, they
    would never end."""
    threads: set[threading.Thread] = set()
    for module, registry in (("concurrent.futures.thread", "_threads_queues"),
                             ("concurrent.futures.process", "_threads_wakeups")):
        threads.update(list(getattr(sys.modules.get(module), registry, None) or ()))
    return threads


def _wait_for_threads(before: set[threading.Thread]) -> None:
    """Wait for the threads the script started and did not make daemons, as Python does before it exits:
    what they do (steps too) is part of the run. Pools' threads are left to Python's own shutdown."""
    current = threading.current_thread()
    while True:
        pools = _pool_threads()
        waiting = [t for t in threading.enumerate()
                   if t not in before and t is not current and not t.daemon and t.is_alive() and t not in pools]
        if not waiting:
            return
        for thread in waiting:
            thread.join()


def _print_exception(exc: BaseException) -> None:
    """The script's error as Python prints it: its traceback, without the frames that ran it or watched it."""
    tb = _script_traceback(exc.__traceback__)
    try:  # (the display reads the exception's own traceback, so it is trimmed there)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
    except Exception:  # the script closed or replaced its stderr: Python loses the traceback too
        pass


def run_watched(watcher: Watcher, *, script: str | None = None, module: str | None = None,
                args: Sequence[str] = ()) -> Outcome:
    """Run ``script`` (a path) or ``module`` (as ``python -m`` does) as ``__main__`` with ``args``, watched.

    As ``python`` would: ``sys.argv`` is the script and its arguments, ``sys.path[0]`` the
    script's directory (the directory or zipapp itself; the working directory for a module;
    none under ``-P``); the working directory and the standard streams are the process's own.
    A ``.pyc``, a directory or a zipapp with a ``__main__`` runs as under ``python``. An
    exception is printed through ``sys.excepthook`` without accelport's frames and gives
    status 1 (Ctrl-C: 130, ended by SIGINT); ``SystemExit`` gives the status Python would.
    The threads the script started are waited for, as Python does before it exits. ``sys.argv``
    and ``sys.path[0]`` are put back afterwards, and every hook is taken out.

    The watcher is installed before the script's directory goes on ``sys.path``, so what
    accelport imports is never a file of the script's that shadows the standard library. The
    script still gets those files, as under ``python``: a standard module accelport imported
    (``random``) that a file beside the script shadows (``random.py``) is out of ``sys.modules``
    while the script runs, unless plain ``python`` imports it before any script (see :class:`_SetAside`).
    LookupError: a directory or archive without ``__main__`` (see :func:`entry_spec`).
    """
    if (script is None) == (module is None):
        raise ValueError("run_watched runs a script or a module: give one of them")
    spec = entry_spec(script) if script is not None else None
    watcher.install()
    pid = os.getpid()
    before = set(threading.enumerate())
    saved_argv = sys.argv[:]
    first = _first_path(script, spec)
    # After accelport's own imports (install's too): what of them the script's files shadow is the script's.
    set_aside = _SetAside(first)
    watcher.notes += set_aside.notes
    restore_path = _put_first(first)
    sys.argv = [script if script is not None else str(module), *args]
    outcome = Outcome(0)
    try:
        try:
            if module is not None:
                runpy.run_module(str(module), run_name="__main__", alter_sys=True)
            elif spec is None:
                _run_file(str(script))
            else:
                _run_main_module(spec)
        except SystemExit as exc:
            outcome = Outcome(_exit_status(exc.code))
        except BaseException as exc:  # the script's own error, as Python prints it
            watcher.failed(exc)  # (out of memory: the finding first, then the traceback as it was)
            _print_exception(exc)
            outcome = Outcome(130, signal.SIGINT) if isinstance(exc, KeyboardInterrupt) else Outcome(1)
        try:
            _wait_for_threads(before)
        except KeyboardInterrupt:  # Ctrl-C while Python would have been waiting for them
            outcome = Outcome(130, signal.SIGINT)
    finally:
        try:
            watcher.finish()
        finally:
            watcher.uninstall()
            sys.argv = saved_argv
            restore_path()
            set_aside.restore()
    outcome.forked = os.getpid() != pid
    return outcome
