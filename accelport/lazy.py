"""The lazy family: one implementation for every XLA graph backend.

``xla`` (torch_xla on a Cloud TPU, or on the host CPU with ``PJRT_DEVICE=CPU``)
and ``neuron-xla`` (torch-neuronx <= 2.9 on top of torch_xla) differ only in the
class constants below, so the code path ``xla`` runs on XLA:CPU in every test
run of the xla environment is the one ``neuron-xla`` runs on Trainium.

Work is recorded as a graph and runs at a sync, once per step: the loader
(torch_xla's ``ParallelLoader``, which ``MpDeviceLoader`` wraps) uploads batches
in the background and syncs when it hands out the next one; outside an
``ap.loader`` loop ``ap.optimizer_step`` syncs itself. ``ap.after_step``
callbacks run right after that sync, once the step's graph has executed.

Probing reads package metadata, ``/sys``, ``/dev`` and the environment only:
importing torch_xla on a TPU VM takes the TPU, so it is imported in
:meth:`LazyBackend.prepare`, after this backend was selected.
"""

from __future__ import annotations

import functools
import itertools
import operator
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from accelport import _packages
from accelport.collectives import Collectives
from accelport.contract import Backend, Probe
from accelport.errors import AccelportError, ending_with_error
from accelport.platform import PlatformInfo, detect
from accelport.settings import env_int, explicit_pjrt_device, is_true
from accelport.tensors import to_host

#: Set on accelport's own step closures: their host reads are counted here already
#: (``after_step_reads``), so a watcher of the script's own closures leaves them out.
OWN_CLOSURE = "_accelport_closure"

if TYPE_CHECKING:
    from accelport.doctor.finding import DoctorContext, Finding  # noqa: F401 - Finding: annotations

__all__ = ["LazyBackend", "Requirement", "doctor_findings", "pjrt_device", "requirement_problem"]

#: torch_xla's last release (PyPI, 2025-11-17); a newer torch has no torch_xla.
LAST_TORCH_XLA = "2.9"
#: Set to 1 to start torch_xla in SPMD mode (what ``ap.shard`` needs when the model is on the device first).
SPMD_ENV = "ACCELPORT_SPMD"


@dataclass(frozen=True)
class Requirement:
    """A distribution a lazy backend needs, checked through metadata only.

    ``specifier`` is a PEP 440 range the version must satisfy (``"<2.13"``);
    ``outside`` is the sentence used when it does not (``{version}`` is filled
    in). ``same_minor_as_torch`` demands torch's major.minor (torch_xla X.Y only
    works with torch X.Y: its C extension is built against that torch).
    """

    distribution: str
    specifier: str = ""
    same_minor_as_torch: bool = False
    missing: str = ""
    outside: str = ""


def pjrt_device(environ: Mapping[str, str] | None = None,
                platform: PlatformInfo | None = None) -> tuple[str, str]:
    """The PJRT device torch_xla would use here, and why; never imports torch_xla.

    Mirrors torch_xla's own default (``runtime._maybe_select_default_device``):
    ``PJRT_DEVICE`` if set; else TPU when libtpu and TPU chips are present; else
    NEURON when libneuronxla is installed; else CPU.
    """
    env = os.environ if environ is None else environ
    device = explicit_pjrt_device(env)
    if device is not None:
        return device, f"PJRT_DEVICE={env['PJRT_DEVICE'].strip()}"
    plat = detect(environ=env) if platform is None else platform
    if plat.name == "gcp-tpu" and _packages.has_module("libtpu"):
        return "TPU", f"libtpu and TPU chips found ({plat.describe()})"
    if _packages.has_module("libneuronxla"):
        return "NEURON", "libneuronxla is installed"
    return "CPU", "torch_xla's default without a TPU or Neuron runtime"


def _install_hint(req: Requirement, torch_version: str) -> str:
    """What to pip install for a missing requirement that must match torch's major.minor."""
    torch_release = _packages.release(torch_version) or (0, 0)
    mm = f"{torch_release[0]}.{torch_release[1]}"
    last = _packages.release(LAST_TORCH_XLA) or (0, 0)
    if req.distribution == "torch_xla" and last < torch_release[:2]:
        return (f"torch_xla X.Y needs torch X.Y and its last release is {LAST_TORCH_XLA}, older than "
                f"torch {torch_version} (pip install torch=={LAST_TORCH_XLA}.0 torch_xla=={LAST_TORCH_XLA}.0)")
    if req.same_minor_as_torch:
        return f"pip install {req.distribution}=={mm}.* (it needs the torch of the same major.minor)"
    return f"pip install {req.distribution}"


def _current(module: Any, name: str) -> Callable[..., Any] | None:
    """``module.name`` if it exists and the installed version does not mark it deprecated (PEP 702)."""
    fn = getattr(module, name, None)
    if not callable(fn) or getattr(fn, "__deprecated__", None):
        return None
    return fn


def _holds_tensor(values: Any, tensor: type) -> bool:
    """Whether a tensor is anywhere inside ``values`` (nested lists, tuples, dicts)."""
    if isinstance(values, tensor):
        return True
    if isinstance(values, dict):
        return any(_holds_tensor(v, tensor) for v in values.values())
    if isinstance(values, (list, tuple)):
        return any(_holds_tensor(v, tensor) for v in values)
    return False


def requirement_problem(req: Requirement, torch_version: str) -> tuple[str | None, str | None]:
    """(installed version, problem sentence or None) for one requirement."""
    found = _packages.version(req.distribution)
    if found is None:
        return None, f"{req.distribution} is not installed: {req.missing or _install_hint(req, torch_version)}"
    if req.specifier:
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version

        try:
            ok = Version(found) in SpecifierSet(req.specifier)
        except InvalidVersion:
            ok = False
        if not ok:
            return found, (req.outside or f"{req.distribution} {{version}} is outside {req.specifier}").format(
                version=found)
    if req.same_minor_as_torch and not _packages.same_minor(found, torch_version):
        mm = ".".join(map(str, (_packages.release(found) or (0, 0))[:2]))
        return found, (f"torch {torch_version} but {req.distribution} {found}: "
                       f"{req.distribution} {mm} needs torch {mm} exactly "
                       f"(pip install torch=={mm}.* next to it)")
    return found, None


class LazyBackend(Backend):
    """An XLA device through torch_xla: operations are recorded and run at a sync."""

    lazy = True
    device_type: ClassVar[str] = "xla"
    #: PJRT devices this backend drives. "CPU" (XLA on the host) is accepted only
    #: when PJRT_DEVICE=CPU is set explicitly; any other device needs its hardware.
    pjrt_devices: ClassVar[tuple[str, ...]]
    #: Top-level module of the PJRT plugin the hardware device needs ("libtpu", "libneuronxla").
    runtime_module: ClassVar[str | None] = None
    #: How to install the runtime module when it is missing.
    runtime_hint: ClassVar[str] = ""
    #: The hardware, in words, with where detection looks for it.
    hardware: ClassVar[str] = "accelerator"
    #: Distributions needed besides torch (torch_xla first).
    requires: ClassVar[tuple[Requirement, ...]] = (
        Requirement("torch_xla", same_minor_as_torch=True),
    )
    #: Filesystem root that hardware detection reads; None means ACCELPORT_SYSROOT, else "/"
    #: (tests point it at a fake tree).
    root: str | None = None

    def __init__(self) -> None:
        super().__init__()
        self._torch: Any = None
        self._xm: Any = None
        self._device: Any = None
        # ap.loader iterations in progress (they sync once per batch).
        self._loading = 0
        self._default_depth: int | None = None  # the ParallelLoader's default device queue depth, once read
        self._world: int | None = None
        self._flush_at_exit = False
        self._closures_pending = 0  # ap.after_step closures waiting for the next sync
        # Host reads made by ap.after_step callbacks (each one transfer), and the state
        # step_counters() keeps to avoid reading the transfer metric on most steps.
        self._after_step_reads = 0
        self._own_reads = 0  # those of them made by the diagnostics (diagnostic_read): not the user's
        self._checks_reads = 0  # host reads the diagnostics made inside the steps (own_reads): not the user's
        self._reads_seen = (0, 0)
        self._to_host = 0
        self._compiled_seen = (0, 0.0)
        self._memory_source: str | None = None  # "allocator", "host" (XLA:CPU) or "none": see memory_reading
        #: Where this backend's collectives wait (read by accelport launch's probe).
        self.collectives = Collectives()
        self._clock: Any = None  # the run's step clock (time_with)

    # -- detection ---------------------------------------------------------------------
    def _probe(self) -> Probe:
        torch_version = _packages.version("torch")
        if torch_version is None:
            return Probe(False, "torch is not installed: pip install torch", 0)
        details: dict[str, str] = {"torch": torch_version}
        problems: list[str] = []
        for req in self.requires:
            found, problem = requirement_problem(req, torch_version)
            if found is not None:
                details[req.distribution] = found
            if problem:
                problems.append(problem)

        plat = detect(self.root)
        device, why = pjrt_device(platform=plat)
        details["pjrt_device"] = device
        details["pjrt_device_source"] = why
        explicit = explicit_pjrt_device(os.environ) is not None
        count: int | None = None
        on_host = "CPU" in self.pjrt_devices
        if device == "CPU" and on_host and explicit:
            count = env_int(os.environ, "CPU_NUM_DEVICES", 1)
        else:
            if explicit and device not in self.pjrt_devices:
                wanted = " or ".join(f"PJRT_DEVICE={d}" for d in self.pjrt_devices)
                problems.append(f"{why} selects PJRT device {device}; this backend needs {wanted}")
            # Say what the hardware device would need, whatever PJRT_DEVICE says.
            present = plat.name == self.platform
            if present:
                count = plat.device_count
            else:
                hint = "; set PJRT_DEVICE=CPU to run XLA on the host CPU" if on_host and not explicit else ""
                problems.append(f"no {self.hardware} on this machine ({plat.describe()}){hint}")
            # A missing libtpu on a laptop is noise when XLA:CPU is the way to go there.
            if (present or not on_host) and self.runtime_module and not _packages.has_module(self.runtime_module):
                problems.append(f"{self.runtime_module} is not installed: {self.runtime_hint}")
        cache = self.compile_cache_dir()
        if cache:
            details["compile_cache"] = cache
        if problems:
            return Probe(False, "; ".join(problems), 0, details)
        xla_version = details.get("torch_xla", "?")
        where = "the host CPU" if device == "CPU" else plat.describe()
        return Probe(True, f"torch_xla {xla_version} with torch {torch_version} on PJRT device {device} "
                           f"({where})", count, details)

    # -- lifecycle ---------------------------------------------------------------------
    def prepare(self) -> None:
        import torch

        try:
            import torch_xla
            import torch_xla.core.xla_model as xm
            import torch_xla.debug.metrics as met
            import torch_xla.runtime as xr
        except ImportError as exc:  # versions pair (the probe said so), yet the build does not load
            found = _packages.version("torch_xla")
            raise AccelportError(
                f"torch_xla{' ' + found if found else ''} is installed but does not import: {exc}. "
                f"It was probably built for another torch build than torch {torch.__version__} (a CUDA or "
                "CPU wheel, another patch release): reinstall both together, "
                "pip install --force-reinstall torch==X.Y.Z torch_xla==X.Y.Z"
            ) from exc

        device_fn = _current(torch_xla, "device") or _current(xm, "xla_device")
        sync_fn = _current(torch_xla, "sync") or _current(xm, "mark_step")
        if device_fn is None or sync_fn is None:
            raise AccelportError(
                f"torch_xla {getattr(torch_xla, '__version__', '?')} has no usable device()/sync() API "
                "(both the current and the older spellings are missing or deprecated); "
                "install a torch_xla release between 2.1 and 2.9"
            )
        self._torch, self._xm, self._xr, self._met = torch, xm, xr, met
        self._device_fn, self._sync = device_fn, sync_fn
        # The C++ function itself where it exists: one Python call less per lookup.
        self._counter = getattr(getattr(torch_xla, "_XLAC", None), "_xla_counter_value", None) or \
            getattr(met, "counter_value", None)
        self._metric = getattr(met, "metric_data", None)
        if is_true(os.environ.get(SPMD_ENV)) and not xr.is_spmd():
            # Before any tensor reaches the device: torch_xla cannot switch to SPMD later (ap.shard).
            xr.use_spmd()
        # SPMD runs one replicated program per step (ExecuteReplicated); otherwise each
        # process executes its own (ExecuteComputation): counters() reads the one in use.
        spmd = getattr(xr, "is_spmd", None)
        self._execute_counters = (("ExecuteReplicated", "ExecuteComputation") if spmd is not None and spmd()
                                  else ("ExecuteComputation",))
        self._start_step_counts()

    def _x(self) -> Any:
        if self._xm is None:
            self.prepare()
        return self._xm

    # -- operations --------------------------------------------------------------------
    def device(self, index: int | None = None) -> Any:
        self._x()
        if index is None:
            if self._device is None:
                self._device = self._device_fn()
            return self._device
        return self._device_fn(index)

    def sync(self) -> None:
        self._x()
        self._timed_sync()

    def _timed_sync(self, phase: str = "sync") -> None:
        """Sync, the time going to ``phase`` of the run's step clock: on XLA the loop waits here for the
        device (the step before must release the buffers this one reuses) and compiles new graphs."""
        clock = self._clock
        if clock is None:
            self._sync()
            return
        clock.enter(phase)
        try:
            self._sync()
        finally:
            clock.leave(phase)

    # -- where a step's time goes ---------------------------------------------------------
    def time_phases(self) -> Mapping[str, str]:
        """The loop's own code traces the graph on the host (``other``); the device's time is where the
        loop waits for it, in the sync; host reads wait for a graph to run, and then copy."""
        return _LAZY_PHASES

    def time_with(self, clock: Any) -> None:
        from accelport.observe import tracer

        self._clock = clock
        self.collectives.timer = clock
        tracer.time_reads(self.device_type, clock)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        xm = self._xm or self._x()  # (a call less per step once prepared)
        # xm.optimizer_step all-reduces gradients across replicas (a no-op alone), then steps.
        result = xm.optimizer_step(optimizer, optimizer_args=kwargs)
        # End the step. Alone inside an ap.loader loop, the sync comes when the next batch
        # is asked for (end_of_batch), after zero_grad(), as with MpDeviceLoader: syncing
        # here as well would cost a second, empty sync per step and make the gradients
        # graph outputs (about 4% per step on a tiny model). With several replicas the
        # step's graph holds the gradient all-reduce: it runs here, on every replica at
        # once, so that a value read on one replica only (a rank-0 save, a print) never
        # executes that collective alone and hangs (torch_xla's barrier=True).
        if (self._world or self._replicas()) > 1:
            with self.collectives.waiting("ap.optimizer_step"):  # the graph holds the gradient all-reduce
                self._timed_sync("sync_collective")
        elif not self._loading:
            self._timed_sync()
        return result

    def shard(self, model: Any, *, policy: Any = None, reshard_after_forward: bool = True,
              mixed_precision: str | None = None) -> Any:
        """torch_xla's SPMD FSDP over every device (:func:`accelport.sharding.shard_spmd`)."""
        from accelport.sharding import shard_spmd

        self._x()
        out = shard_spmd(self, model, predicate=policy, reshard_after_forward=reshard_after_forward,
                         mixed_precision=mixed_precision)
        if self._xr.is_spmd():  # one replicated program per step from now on
            self._execute_counters = ("ExecuteReplicated", "ExecuteComputation")
        return out

    def _replicas(self) -> int:
        if self._world is None:
            self._world = self.world_size()
        return self._world

    def step_deferred(self) -> bool:
        # The condition under which optimizer_step leaves the sync to end_of_batch.
        return bool(self._loading) and (self._world or self._replicas()) == 1

    def end_of_batch(self) -> None:
        self._timed_sync()

    def loader_reads_ahead(self, prefetch: int | None) -> int:
        # The ParallelLoader's upload thread takes its device queue's depth of batches at once (prefetch, or
        # torch_xla's default depth, read from its signature: it differs between releases); prefetch=0 uploads
        # each batch as it is read.
        if prefetch is not None:
            return max(prefetch, 1)
        if self._default_depth is None:
            import inspect

            self._x()
            from torch_xla.distributed.parallel_loader import ParallelLoader

            depth = inspect.signature(ParallelLoader.__init__).parameters.get("device_prefetch_size")
            self._default_depth = depth.default if depth is not None and isinstance(depth.default, int) else 1
        return self._default_depth

    def wrap_loader(self, iterable: Iterable[Any], *, prefetch: int | None) -> Iterable[Any]:
        self._x()
        device = self.device()
        if prefetch == 0:
            return _Loading(self, None, self._unprefetched(iterable, device))
        from torch_xla.distributed.parallel_loader import ParallelLoader

        backend = self

        class TimedLoader(ParallelLoader):
            """ParallelLoader whose uploads are timed (ap.loader counts a wait for them as transfer)."""

            def send_cpu_data_to_device(self, batches: Any, device: Any) -> Any:
                start = time.perf_counter()
                try:
                    return super().send_cpu_data_to_device(batches, device)
                finally:
                    backend.transfer_seconds += time.perf_counter() - start

        # What MpDeviceLoader does (a ParallelLoader for this process's device), plus a
        # close() when the loop ends or breaks early, so no upload thread is left behind.
        # ``prefetch`` is the on-device queue, which is also how many batches go up in
        # one transfer; None keeps torch_xla's defaults, the same as a raw MpDeviceLoader.
        kwargs = {} if prefetch is None else {"device_prefetch_size": prefetch}
        parallel = TimedLoader(iterable, [device], **kwargs)
        return _Loading(self, parallel, parallel.per_device_loader(device), device)

    def _unprefetched(self, iterable: Iterable[Any], device: Any) -> Iterator[Any]:
        """prefetch=0: upload each batch in the loop's thread (end_of_batch syncs between batches)."""
        send = self._xm.send_cpu_data_to_device
        clock = time.perf_counter
        for batch in iterable:
            start = clock()
            moved = send([batch], device)[0]
            self.transfer_seconds += clock() - start
            yield moved

    # -- metrics -----------------------------------------------------------------------
    def _count(self, name: str) -> int:
        counter = self._counter
        value = counter(name) if counter is not None else None
        return int(value) if value else 0  # absent: it did not happen in this process

    def _samples(self, name: str) -> tuple[int, float]:
        """(samples recorded, their total in seconds) of a torch_xla metric; zeros if absent."""
        data = self._metric(name) if self._metric else None
        return (int(data[0]), float(data[1]) / 1e9) if data else (0, 0.0)  # accumulator is in ns

    def counters(self) -> dict[str, Any]:
        if self._xm is None:
            return {}
        out: dict[str, Any] = {}
        if self._counter is not None:
            out["compilations"] = self._count("UncachedCompile")
            # In-memory hits and persistent-cache hits both end as CachedCompile.
            out["cache_hits"] = self._count("CachedCompile")
            names = getattr(self._met, "counter_names", None)
            if names is not None:
                # Every aten:: counter is an op without an XLA lowering that ran on the host.
                out["cpu_fallback"] = {n: self._count(n) for n in names() if n.startswith("aten::")}
        if self._metric is not None:
            _, out["compile_seconds"] = self._samples("CompileTime")
            finished, out["execute_seconds"] = self._samples("ExecuteTime")
            out["host_to_device"] = self._samples("TransferToDeviceTime")[0]
            out["device_to_host"] = self._samples("TransferFromDeviceTime")[0] - self._own_reads - self._checks_reads
            # Executions run asynchronously after the sync that launched them: the counters
            # tick as each starts, ExecuteTime only once it has finished. Older versions
            # may lack the counters.
            dispatched = self._executions()
            out["executions"] = finished if dispatched is None else dispatched
        return out

    def memory_reading(self) -> dict[str, int]:
        """``xm.get_memory_info``: the PJRT device allocator's bytes in use, its peak (never reset: torch_xla
        has no reset) and its limit, without running anything. XLA:CPU has no allocator statistics (every
        call raises UNIMPLEMENTED: GetAllocatorStats is not supported) and its buffers are host memory, so
        there the process's resident memory is read instead; a device that refuses (an SPMD virtual device)
        is asked once."""
        if self._xm is None or self._memory_source == "none":
            return {}
        if self._memory_source != "host":
            try:
                info = self._xm.get_memory_info(self.device())
                self._memory_source = "allocator"
                return {"memory_bytes": int(info["bytes_used"]), "peak_memory_bytes": int(info["peak_bytes_used"]),
                        "capacity_bytes": int(info["bytes_limit"])}
            except Exception:
                if self._memory_source == "allocator":  # it answered before: a passing failure
                    return {}
                device_type = getattr(self._xr, "device_type", None)
                on_host = (device_type() if callable(device_type) else None) == "CPU"
                self._memory_source = "host" if on_host else "none"
                if not on_host:
                    return {}
        from accelport.observe.memory import process_memory

        return process_memory()

    def _executions(self) -> int | None:
        if self._counter is None:
            return None
        counts = [self._counter(name) for name in self._execute_counters]
        if all(n is None for n in counts):
            return None
        return sum(n or 0 for n in counts)

    def _start_step_counts(self) -> None:
        """Take the per-step counters' starting point (at selection)."""
        fetched = self._metric("TransferFromDeviceTime") if self._metric else None
        self._to_host = fetched[0] if fetched else 0
        self._reads_seen = (self._copy_calls(), self._after_step_reads)
        self._compiled_seen = (self._samples("TensorsGraphSize")[0], self._samples("CompileTime")[1])

    def _copy_calls(self) -> int:
        # Every host read of an XLA tensor passes through one of these two ops: .item(),
        # bool(), float() through _to_cpu; .cpu(), .to("cpu"), print, .tolist() through
        # _to_copy (which also counts device-side dtype casts: a false alarm costs one
        # read of the transfer metric, never a wrong count).
        counter = self._counter
        return (counter("xla::_to_cpu") or 0) + (counter("xla::_to_copy") or 0) if counter else 0

    def step_counters(self) -> dict[str, float]:
        # Counter lookups only (about 0.2 us each alone, several times that inside a
        # training loop). Host transfers have no counter: their metric
        # (TransferFromDeviceTime) copies up to 1024 samples per read (about 50 us once
        # full), so it is read only when a host read happened that was not one of
        # ap.after_step's own (each of those is one transfer, counted here in Python).
        # Loops that read nothing, or log through ap.after_step, never read it.
        counter = self._counter
        if counter is None or self._metric is None:
            return {}
        calls, deferred = self._copy_calls(), self._after_step_reads
        seen_calls, seen_deferred = self._reads_seen
        if calls - seen_calls != deferred - seen_deferred:
            fetched = self._metric("TransferFromDeviceTime")
            self._to_host = fetched[0] if fetched else 0
        else:
            self._to_host += deferred - seen_deferred
        self._reads_seen = (calls, deferred)
        own = self._own_reads
        return {"compilations": counter("UncachedCompile") or 0,
                "device_to_host": self._to_host - own - self._checks_reads,
                "after_step_reads": deferred - own}

    def compile_facts(self) -> dict[str, float]:
        # torch_xla records each synced graph's node count (TensorsGraphSize) and each
        # compile's duration (CompileTime, in ns). Reading a metric copies up to 1024
        # samples, so the step tracker asks only when the compile count changed: a graph
        # that grew is a new graph, and a new graph is always compiled first.
        if self._metric is None:
            return {}
        data = self._metric("TensorsGraphSize")
        compiled = self._samples("CompileTime")
        graphs_seen, compile_seconds_seen = self._compiled_seen
        out: dict[str, float] = {"compile_seconds": compiled[1] - compile_seconds_seen}
        if data:
            total, _, samples = data
            new = int(total) - graphs_seen
            if new > 0 and samples:
                out["graph_nodes"] = int(max(value for _, value in samples[-new:]))
            graphs_seen = int(total)
        self._compiled_seen = (graphs_seen, compiled[1])
        return out

    # -- compile cache -----------------------------------------------------------------
    def _computation_started(self) -> bool:
        self._x()
        return bool(self._count("UncachedCompile") or self._count("CachedCompile"))

    def compile_cache_dir(self) -> str | None:
        # torch_xla's xr.initialize_cache stores the path here; setting it before the
        # first computation has the same effect.
        return os.environ.get("XLA_PERSISTENT_CACHE_PATH") or None

    def enable_compile_cache(self, path: str | os.PathLike[str]) -> str:
        directory = os.path.abspath(os.fspath(path))
        if self.compile_cache_dir() == directory:
            return directory
        if self._computation_started():
            raise AccelportError(
                f"ap.compile_cache({os.fspath(path)!r}) came after the first computation on {self.name}; "
                "call it before the model or data touch the device (right after `import accelport`), "
                "or set XLA_PERSISTENT_CACHE_PATH before starting Python"
            )
        os.makedirs(directory, exist_ok=True)
        try:
            self._xr.initialize_cache(directory, readonly=False)
        except AssertionError as exc:  # torch_xla's own check, in case ours missed a computation
            raise AccelportError(f"torch_xla refused to set the compile cache: {exc}") from exc
        return directory

    # -- distributed -------------------------------------------------------------------
    def world_size(self) -> int:
        self._x()
        return int(self._xr.world_size())

    def has_peers(self) -> bool:
        # Several replicas, or SPMD over several processes (a multi-host slice): world_size() is 1 under SPMD,
        # while each host's graph holds collectives that the other hosts' graphs join.
        if (self._world or self._replicas()) > 1:
            return True
        count = getattr(self._xr, "process_count", None)
        return count is not None and int(count()) > 1

    def rank(self) -> int:
        self._x()
        return int(self._xr.global_ordinal())

    def barrier(self) -> None:
        xm = self._x()
        if self.world_size() > 1:
            with self.collectives.waiting("ap.barrier"):
                xm.rendezvous("accelport.barrier")

    def broadcast(self, tensors: list[Any], src: int) -> None:
        """torch_xla's collective_broadcast (what xm.broadcast_master_param runs), then a sync."""
        xm = self._x()
        if self.world_size() == 1 or not tensors:
            return
        xm.collective_broadcast(tensors, root_ordinal=src)
        with self.collectives.waiting("ap.broadcast"):  # the broadcast runs in this sync
            self._sync()

    def all_reduce(self, tensor: Any, op: str = "sum") -> Any:
        # tensor and op are checked once, in ap.all_reduce, for every backend.
        xm = self._x()
        world = self.world_size()
        if world == 1:
            return tensor
        # A list input is reduced in place.
        xm.all_reduce(xm.REDUCE_SUM, [tensor], scale=1.0 / world if op == "mean" else 1.0)
        return tensor

    # -- host values -------------------------------------------------------------------
    def after_step(self, fn: Callable[..., Any], tensors: tuple[Any, ...]) -> None:
        self._closure(fn, tensors, own=False)

    def diagnostic_read(self, fn: Callable[..., Any], tensors: tuple[Any, ...]) -> None:
        self._closure(fn, tensors, own=True)

    def own_reads(self, count: int) -> None:
        self._checks_reads += count

    def _closure(self, fn: Callable[..., Any], tensors: tuple[Any, ...], own: bool) -> None:
        # A step closure runs right after the next sync, when the tensors already hold
        # device data: reading them costs a transfer, never a second graph execution.
        xm = self._x()
        tensor = self._torch.Tensor
        if not self._closures_pending and not _holds_tensor(tensors, tensor):
            # Nothing to wait for and nothing queued before it (ap.print("epoch 3")): now, in
            # order with the builtin print, and not lost if the process dies before the sync.
            fn(*tensors)
            return
        self._closures_pending += 1

        def run(*ts: Any) -> None:
            self._closures_pending -= 1  # first: a raising fn must not hold back later text
            values = [to_host(t) for t in ts]
            # Counted so the host-sync diagnosis leaves these reads out: they wait for the
            # step that already ran and cut no graph, which is the point of after_step.
            n = sum(1 for t in ts if isinstance(t, tensor) and t.device.type != "cpu")
            self._after_step_reads += n
            if own:
                self._own_reads += n
            fn(*values)

        setattr(run, OWN_CLOSURE, True)
        xm.add_step_closure(run, args=tensors)
        if not self._flush_at_exit:
            # A closure added after the last step would otherwise never run (the final
            # "done" print of a script): one sync at interpreter exit runs what is pending.
            import atexit

            atexit.register(self._flush_pending)
            self._flush_at_exit = True

    def _flush_pending(self) -> None:
        try:
            if ending_with_error() and self.has_peers():
                return  # the pending graph may hold a collective that the other replicas never join: a hang
            self.sync()
        except Exception:  # the runtime may already be shutting down; nothing to report to
            pass

    # -- checkpoints -------------------------------------------------------------------
    def save(self, obj: Any, path: str | os.PathLike[str], *, background: bool = False) -> Any:
        # One execution for every pending tensor, then plain copies to the host;
        # without it each tensor's .to("cpu") would run its own graph.
        self.sync()
        return super().save(obj, path, background=background)


class _Loading:
    """A loop's device batches, counted as loading (the step's sync is left to the loop: see
    ``LazyBackend.optimizer_step``) until :meth:`close`, which ``ap.loader`` calls when its pass ends, as
    does the garbage collector."""

    def __init__(self, backend: LazyBackend, parallel: Any, it: Iterator[Any], device: Any = None) -> None:
        self._backend, self._parallel_loader, self._it, self._device = backend, parallel, it, device
        backend._loading += 1
        self._open = True

    def __iter__(self) -> Iterator[Any]:
        """The device batches. From a ParallelLoader: the first and the end through its per-device loader (a sync
        before the first batch, as a raw loop has, and the upload thread's error or the end), the others straight
        from its device queue (``ParallelLoader.next_item``): ``ap.loader`` syncs between batches itself, and the
        per-device loader's own check for a sync (three Python calls a batch) would only find one done. No layer
        of Python per batch between the loop and torch_xla's queue: ``chain`` and ``takewhile`` over ``map`` are C."""
        parallel, it = self._parallel_loader, self._it
        if parallel is None:
            return it
        # Until the queue says it is done (None), compared by identity: iter(callable, None) would compare each
        # batch with ``==`` (a NumPy array's or a class's own __eq__ raises; a tensor's is a slow TypeError).
        rest = itertools.takewhile(functools.partial(operator.is_not, None),
                                   map(parallel.next_item, itertools.repeat(self._device)))
        return itertools.chain(_first(it), rest, _first(it))

    def close(self) -> None:
        """The loop is done: count it out, and stop the upload thread (none is left behind on an early break)."""
        if not self._open:
            return
        self._open = False
        backend, parallel = self._backend, self._parallel_loader
        backend._loading -= 1
        if parallel is not None:
            parallel.close()

    def __del__(self) -> None:
        self.close()


def _first(it: Iterator[Any]) -> Iterator[Any]:
    """The next item of ``it``, alone (none where it has ended; its error raised)."""
    for item in it:
        yield item
        return


#: Where a step's time goes on a lazy backend (see LazyBackend.time_phases).
_LAZY_PHASES: Mapping[str, str] = {
    "pre": "other", "body": "other", "tail": "other", "sync": "device", "read": "host_sync",
    "collective": "collective", "sync_collective": "device+collective",
}


def doctor_findings(backend: type[LazyBackend], context: DoctorContext) -> list[Finding]:
    """``accelport doctor`` checks shared by the lazy backends (their plugins' ``accelport_doctor_checks``);
    reads metadata, /sys and env only.

    - a paired package that is installed but does not match torch (torch_xla X.Y needs torch X.Y);
    - ``PJRT_DEVICE`` naming this backend's hardware on a machine that does not have it.
    """
    from accelport.doctor.finding import Finding

    env = context.environ
    found: list[Finding] = []
    torch_version = context.packages.get("torch")
    if torch_version:
        for req in backend.requires:
            installed, problem = requirement_problem(req, torch_version)
            if installed is not None and problem:
                found.append(Finding("problem", f"{backend.name}: {problem}",
                                     f"install a matching pair: {_install_hint(req, torch_version)}"
                                     if req.same_minor_as_torch else problem, backend.name))
    device = explicit_pjrt_device(env)
    explicit = (env.get("PJRT_DEVICE") or "").strip()
    elsewhere = context.platform.name != backend.platform
    if device is not None and device in backend.pjrt_devices and device != "CPU" and elsewhere:
        found.append(Finding(
            "problem",
            f"PJRT_DEVICE={explicit} but there are no {backend.hardware} here ({context.platform.describe()}): "
            "torch_xla fails when it starts",
            "unset PJRT_DEVICE (torch_xla then picks what is present), or set PJRT_DEVICE=CPU to run XLA on "
            "the host CPU", backend.name))
    return found
