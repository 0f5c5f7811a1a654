"""The contract every backend fulfils, and the records it produces.

A backend is a class registered through the ``accelport_register_backends``
hook. Two families implement it (see :mod:`accelport.eager` and
:mod:`accelport.lazy`); a backend is normally a handful of constants on one of
them. Constructing a backend and probing it must be cheap and safe: no torch
import, no vendor import, no device touched.
"""

from __future__ import annotations

import abc
import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

__all__ = ["Probe", "Metrics", "StepRecord", "Backend", "BackendInfo", "COUNTER_FIELDS", "TIME_CATEGORIES",
           "TIME_PHASES"]


@dataclass(frozen=True)
class Probe:
    """What a cheap look at the machine says about a backend.

    ``reason`` is one sentence a user can act on: why it is available, or what
    is missing. ``details`` carries facts for ``accelport doctor`` (versions,
    the PJRT device it would use, ...).
    """

    available: bool
    reason: str
    device_count: int | None = None
    details: Mapping[str, str] = field(default_factory=dict)


# Fields of Metrics that come from the backend's own counters. A backend that
# cannot measure one leaves it out of ``counters()`` and the field is None.
COUNTER_FIELDS: tuple[str, ...] = (
    "compilations",
    "compile_seconds",
    "cache_hits",
    "executions",
    "execute_seconds",
    "host_to_device",
    "device_to_host",
    "cpu_fallback",
    "memory_bytes",
    "peak_memory_bytes",
    "parameter_bytes",
    "optimizer_state_bytes",
)
# Counters that are levels, not running totals: never subtracted from a baseline.
LEVEL_FIELDS = frozenset({"memory_bytes", "peak_memory_bytes", "parameter_bytes", "optimizer_state_bytes"})

#: Where a step's wall time goes (docs/diagnostics.md, "Where each step's time goes"), in the
#: order they are shown. A step's categories add up to its wall time. Where a backend cannot
#: tell two apart, the record holds them joined in this order ("device+host_sync"), never a guess.
TIME_CATEGORIES: tuple[str, ...] = ("data", "transfer", "compile", "device", "host_sync", "collective", "other",
                                     "between_steps")

#: The phases of the training loop the step clock (:mod:`accelport.observe.steptime`) tells
#: apart, and the category each is on a backend that says nothing else
#: (:meth:`Backend.time_phases`): "pre" is a step's start before its first batch or backward
#: (the forward pass of a loop without ``ap.loader`` is in it), "body" the forward, backward and
#: optimizer, "tail" the script's code after its backward and its optimizer step, "sync" a
#: sync of the backend, "read" a host read of a device tensor, "collective" a wait for the other
#: replicas, "sync_collective" a sync that runs the gradient all-reduce with the step.
TIME_PHASES: Mapping[str, str] = {
    "pre": "device+other", "body": "device+other", "tail": "other", "sync": "device", "read": "host_sync",
    "collective": "collective", "sync_collective": "device+collective",
}


@dataclass(frozen=True)
class Metrics:
    """A snapshot of a run, cumulative since the backend was selected.

    A field the backend cannot measure is ``None``, never 0: 0 means "measured,
    and it did not happen".
    """

    backend: str
    steps: int
    compilations: int | None = None
    compile_seconds: float | None = None
    cache_hits: int | None = None
    executions: int | None = None
    execute_seconds: float | None = None
    host_to_device: int | None = None
    device_to_host: int | None = None
    cpu_fallback: dict[str, int] | None = None
    #: The device's memory in use now (the allocator's bytes; where the host is the device, the
    #: process's resident memory), and the most seen in use during the run.
    memory_bytes: int | None = None
    peak_memory_bytes: int | None = None
    #: This rank's bytes of the parameters of the models passed to ``ap.shard`` and of every optimizer
    #: stepped (a DTensor by its local shard), counted from dtype and shape (None: neither yet).
    parameter_bytes: int | None = None
    #: This rank's bytes of the optimizers' state (those stepped by ``ap.optimizer_step``, or watched).
    optimizer_state_bytes: int | None = None
    data_wait_seconds: float = 0.0
    step_seconds: float = 0.0
    #: Distinct batch shapes seen (None: no batch came through a loader accelport sees).
    batch_signatures: int | None = None
    compile_cache_dir: str | None = None
    #: This rank's bytes of those parameters' gradients, where they exist now.
    gradient_bytes: int | None = None
    #: The largest step peak less the parameters, gradients and optimizer state: what the forward and
    #: backward passes held (None where no device peak is known: on ``cpu`` the peak is the process's).
    activation_bytes: int | None = None
    #: One device's memory: the allocator's limit (CUDA's total, XLA's ``bytes_limit``), the HBM per
    #: device of the machine's chip (compatibility matrix), or the host's memory on ``cpu``.
    capacity_bytes: int | None = None
    #: Seconds of the run's steps by category (TIME_CATEGORIES, or two joined where the backend
    #: cannot tell them apart): they add up to ``step_seconds``.
    time_breakdown: dict[str, float] = field(default_factory=dict)
    #: ``time_breakdown`` divided by the steps it covers.
    time_breakdown_per_step: dict[str, float] = field(default_factory=dict)
    #: One line saying where a step's time goes ("time per step 41.2 ms: data 17.0 (41%), ..."); "" before
    #: the first step.
    time_summary: str = ""
    #: The verdict on the steps after the first (input-bound, host-bound, compile-bound, device-bound,
    #: sync-bound) and its share; "" before the first step.
    time_verdict: str = ""
    #: The one fix that matters most for that verdict (the fix of the diagnosis kind it points at).
    time_fix: str = ""
    #: The model FLOPs of a step (forward, backward and the optimizer's matmuls), counted once on a sampled
    #: step per batch shape (torch.utils.flop_counter's formulas on the dispatched ops); None before.
    flops_per_step: int | None = None
    #: ``flops_per_step`` over the device time of a step (the ``device`` category, after the first step).
    achieved_flops: float | None = None
    #: ``achieved_flops`` over the chip's peak for the dtype the matmuls ran in (compatibility matrix, per
    #: device); None where the chip's peak is not known (cpu, an unlisted GPU).
    mfu: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(slots=True)
class StepRecord:
    """One finished step, as observers of ``accelport_step_end`` see it.

    Every observer gets the same record: read it, never change it. (It is not
    frozen because one is built per step: a frozen dataclass costs four times
    as much to build.)

    ``delta`` holds the change of the backend's cheap per-step counters
    (``Backend.step_counters()``) over this step and, where the compile count
    changed, what :meth:`Backend.compile_facts` says (``compile_seconds``,
    ``graph_nodes`` on lazy backends).

    The counters are read after every step for a run's first 40 steps and for
    40 steps after anything in them changed; in quiet stretches, once per 16
    steps (reading them costs more than the rest of the step's bookkeeping).
    Records then reach observers in order but up to 15 steps late: the last of
    those read together carries the change over all of them, and says how many
    steps that is in ``counted_steps``; the others have an empty ``delta`` and
    ``counted_steps == 0``.

    On a lazy backend inside an ``ap.loader`` loop a step's graph runs when the
    loop asks for the next batch; its record is finished after that sync, so
    ``seconds`` and ``delta`` include the step's own compilation and execution.
    """

    step: int
    backend: str
    lazy: bool
    seconds: float
    data_wait_seconds: float
    signature: tuple[Any, ...] | None
    delta: Mapping[str, float]
    time: float
    #: What the loader said about itself: num_workers, batch_size, type (empty if unknown).
    loader: Mapping[str, Any] = field(default_factory=dict)
    #: Steps ``delta`` covers: 1; k > 1 for the last of k steps read together; 0 if not read.
    counted_steps: int = 1
    #: The device's memory, read with the counters (None on records whose counters were not read):
    #: ``memory_bytes``, ``peak_memory_bytes`` (since the previous reading where the runtime resets its
    #: peak), ``capacity_bytes``, ``activation_bytes`` (that peak less the static part) and the static
    #: part as last counted (``parameter_bytes``, ``gradient_bytes``, ``optimizer_state_bytes``).
    memory: Mapping[str, int] | None = None
    #: Where the step's ``seconds`` went: category (TIME_CATEGORIES, or two joined where they
    #: cannot be told apart) -> seconds; they add up to ``seconds``.
    breakdown: Mapping[str, float] = field(default_factory=dict)
    #: On the last step of a profiled window (``ap.profile``, ``ACCELPORT_PROFILE``,
    #: ``accelport diagnose --profile``): what the profile found (see ``StepProfile.result``).
    profile: Mapping[str, Any] | None = None


class Backend(abc.ABC):
    """The contract. Subclasses set the class constants and implement the operations."""

    name: ClassVar[str]
    #: The platform this backend drives: cpu, nvidia-gpu, gcp-tpu or aws-neuron.
    platform: ClassVar[str]
    #: True for graph-building (XLA) backends whose work runs at a sync.
    lazy: ClassVar[bool] = False
    description: ClassVar[str] = ""
    #: Distributions whose installed versions matter to this backend (doctor shows them).
    packages: ClassVar[tuple[str, ...]] = ("torch",)
    #: Why this backend was selected (set by the selection; one readable sentence).
    reason: str = ""
    #: How ``accelport launch`` starts several processes: "torchrun" (torch.distributed.run,
    #: one process per device) or "xla" (torch_xla.launch, one process per chip it finds).
    #: None means by family: "xla" for lazy backends, "torchrun" for eager ones.
    launcher: ClassVar[str | None] = None
    #: "module:function" that ``accelport launch`` calls once, in a child of the launching
    #: process, before any worker starts, as ``function(nproc_per_node=N)`` (plus ``nnodes=M``
    #: on several hosts); every environment variable it sets is passed to the workers.
    #: TorchTPU needs this: "torch.tpu.distributed:set_tpu_launch_env".
    launch_env_function: ClassVar[str | None] = None
    #: The PJRT device types this backend drives (lazy backends: "TPU", "CPU", "NEURON");
    #: a PJRT_DEVICE naming one of them asks for this backend.
    pjrt_devices: ClassVar[tuple[str, ...]] = ()
    #: Seconds this backend's loaders spent copying batches to the device so far (in their
    #: threads too): ``ap.loader`` counts the part of a wait that went to them as ``transfer``.
    transfer_seconds: float = 0.0

    def __init__(self) -> None:
        self._probe_cache: Probe | None = None

    # -- detection -----------------------------------------------------------------
    def probe(self) -> Probe:
        """Whether this backend can run here. Cached; never raises; starts no runtime."""
        if self._probe_cache is None:
            try:
                found: Any = self._probe()
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # a probe must never take the caller down, SystemExit included
                found = Probe(False, f"probe failed: {type(exc).__name__}: {exc}")
            if not isinstance(found, Probe):
                text = repr(found)
                found = Probe(False, f"probe returned {text[:60]}, not an accelport.Probe (this backend's bug)")
            self._probe_cache = found
        return self._probe_cache

    @abc.abstractmethod
    def _probe(self) -> Probe:
        """Look at package metadata, /sys, /dev and the environment only."""

    # -- lifecycle --------------------------------------------------------------------
    def prepare(self) -> None:  # noqa: B027 - optional hook for subclasses
        """Called once when this backend is first used (imports, process group)."""

    # -- operations -------------------------------------------------------------------
    @abc.abstractmethod
    def device(self, index: int | None = None) -> torch.device:
        """The device this process should put its model and data on."""

    @abc.abstractmethod
    def sync(self) -> None:
        """Wait for (eager) or execute (lazy) all queued device work."""

    @abc.abstractmethod
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Average gradients across replicas, step, and flush lazy work."""

    @abc.abstractmethod
    def wrap_loader(self, iterable: Iterable[Any], *, prefetch: int | None) -> Iterable[Any]:
        """The batches of ``iterable`` already on ``self.device()`` (an iterator, or an iterable whose
        ``iter()`` is one pass).

        ``prefetch`` batches are loaded ahead; None means this backend's default. ``ap.loader``
        calls its ``close()``, where it has one, when the pass ends (finished, left early, or failed).
        """

    def loader_reads_ahead(self, prefetch: int | None) -> int:
        """How many batches :meth:`wrap_loader` with ``prefetch`` takes from its source at a time (torch_xla's
        ParallelLoader uploads its device queue's depth in one transfer). ``ap.loader`` then reads that many
        before handing them on, and looks at their values together: one check for NaN and Inf for all of them
        instead of one per batch, in the thread that reads the source. 1 (the default): one at a time."""
        return 1

    def end_of_batch(self) -> None:  # noqa: B027 - optional hook for subclasses
        """Called by ``ap.loader`` when the loop asks for its next batch, before the wait is timed.

        Lazy backends run the step's graph here (as torch_xla's MpDeviceLoader
        does), so compile and dispatch time never count as waiting for data.
        """

    def step_deferred(self) -> bool:
        """True when the step that just ended runs only at the next :meth:`end_of_batch`.

        Its record is then finished after that call, so that its time and
        counters include its own graph.
        """
        return False

    def counters(self) -> dict[str, Any]:
        """Every counter this backend can report (keys from COUNTER_FIELDS)."""
        return {}

    def step_counters(self) -> dict[str, float]:
        """The few counters cheap enough to read after every step (running totals)."""
        return {}

    def memory_reading(self) -> dict[str, int]:
        """The device's memory now, read without waiting for it (never a sync): ``memory_bytes`` (in use),
        ``peak_memory_bytes`` (the most in use since the previous reading, where the runtime keeps a peak it
        can reset; else its own peak so far), ``capacity_bytes`` (the device's total) and ``resident`` (1:
        the figures are the process's resident memory, where the host is the device). {} where unknown.

        The step tracker reads it when it reads the step counters (see StepRecord).
        """
        return {}

    def step_delta(self) -> dict[str, float]:
        """The change of :meth:`step_counters` since the previous call.

        The runtime calls it once when the backend is selected (the starting point),
        then the step tracker whenever it hands steps to the observers.
        """
        current = self.step_counters()
        last = getattr(self, "_last_step_counters", None) or {}
        self._last_step_counters = current
        return {k: v - last.get(k, 0) for k, v in current.items()}

    def compile_facts(self) -> dict[str, float]:
        """What the graphs compiled since the previous call cost: ``compile_seconds``, and
        ``graph_nodes`` (the largest graph run since then). Empty where unknown (eager).

        It may cost more than a counter lookup: the step tracker asks only when
        the compile count changed (a graph that grew is a new graph, compiled first).
        """
        return {}

    def compile_cache_dir(self) -> str | None:
        """Where compiled graphs are cached, if this backend has such a cache."""
        return None

    # -- where a step's time goes -----------------------------------------------------
    def time_phases(self) -> Mapping[str, str]:
        """The time category of each phase of the loop on this backend (see TIME_PHASES).

        A category joined from two ("device+host_sync") says this backend cannot tell them apart.
        """
        return TIME_PHASES

    def time_with(self, clock: Any) -> None:  # noqa: B027 - optional hook for subclasses
        """Mark on ``clock`` (an :class:`accelport.observe.steptime.StepClock`) the phases only this
        backend sees: its syncs, its waits for the other replicas, host reads of its tensors.

        The runtime calls it when it binds a run to this backend.
        """

    def compile(self, model: Any, **kwargs: Any) -> Any:
        """``torch.compile(model, **kwargs)`` with this backend's compiler as the default."""
        import torch

        return torch.compile(model, **kwargs)

    def autocast(self, dtype: Any = None, **kwargs: Any) -> Any:
        """A ``torch.autocast`` context for this backend's device (dtype None: torch's default)."""
        import torch

        if dtype is not None:
            kwargs["dtype"] = dtype
        return torch.autocast(device_type=self.device().type, **kwargs)

    def enable_compile_cache(self, path: str | os.PathLike[str]) -> str | None:
        """Turn on a persistent compile cache at ``path``; return the directory used.

        Must come before the first computation. A backend without such a cache
        returns None and says so in a warning: the portable script keeps running,
        and never believes it is caching when it is not.
        """
        import warnings

        from accelport.errors import CompatibilityWarning

        warnings.warn(
            f"ap.compile_cache({os.fspath(path)!r}) does nothing on backend {self.name!r}: it has no "
            "persistent compile cache that accelport turns on (xla and neuron-xla have one; torch.compile "
            "keeps its own cache). Nothing is cached and ap.metrics().compile_cache_dir stays None.",
            CompatibilityWarning,
            stacklevel=3,
        )
        return None

    # -- distributed ------------------------------------------------------------------
    @abc.abstractmethod
    def world_size(self) -> int: ...

    def has_peers(self) -> bool:
        """Whether other processes take part in the collectives of the work this one runs (several replicas): then,
        once an error ends a step midway, accelport runs none of that work (a hang in place of the error)."""
        return self.world_size() > 1

    @abc.abstractmethod
    def rank(self) -> int: ...

    @abc.abstractmethod
    def barrier(self) -> None: ...

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` in place over all replicas ("sum" or "mean") and return it."""

    # -- host values ------------------------------------------------------------------
    def after_step(self, fn: Callable[..., Any], tensors: tuple[Any, ...]) -> None:
        """Run ``fn`` with host copies of ``tensors`` once the step's work is flushed.

        Eager backends run it right away; lazy ones defer it to the next sync.
        """
        from accelport.tensors import to_host

        fn(*(to_host(t) for t in tensors))

    def diagnostic_read(self, fn: Callable[..., Any], tensors: tuple[Any, ...]) -> None:
        """:meth:`after_step` for accelport's own diagnostics, whose reads the transfer counts leave out.

        ``ap.metrics().device_to_host`` describes the user's run; a backend that counts
        transfers itself subtracts these (the lazy family does).
        """
        self.after_step(fn, tensors)

    def own_reads(self, count: int) -> None:
        """accelport's own diagnostics read ``count`` device values on the host inside the step (the NaN search's
        checks). A backend that counts transfers itself leaves them out of ``device_to_host``; the others count
        only reads made from the script's code, so they have nothing to do."""
        return None

    # -- sharding ---------------------------------------------------------------------
    #: What ``ap.shard`` registered on this backend (an ``accelport.sharding.ShardRegistry``), None before.
    shard_registry: Any = None

    def shard(self, model: Any, *, policy: Any = None, reshard_after_forward: bool = True,
              mixed_precision: str | None = None) -> Any:
        """Shard ``model`` over the replicas (``ap.shard``; arguments already checked).

        The default is for a backend without a sharding engine: alone it returns
        the model unchanged, with replicas it raises a ShardingError.
        """
        from accelport.sharding import shard_unsupported

        return shard_unsupported(self, model)


    # -- checkpoints ------------------------------------------------------------------
    def save(self, obj: Any, path: str | os.PathLike[str], *, background: bool = False) -> Any:
        """Write ``obj`` to ``path`` (:func:`accelport.checkpoint.save`): one file from the main
        process, or a directory written by every rank when ``obj`` holds a sharded model."""
        from accelport.checkpoint import save

        return save(self, obj, path, background=background)

    def load(self, path: str | os.PathLike[str], map_location: Any = None, *,
             weights_only: bool = True, into: Any = None) -> Any:
        """Read a checkpoint written by :meth:`save` onto this backend's device (:func:`accelport.checkpoint.load`)."""
        from accelport.checkpoint import load

        return load(self, path, map_location if map_location is not None else self.device(),
                    weights_only=weights_only, into=into)

    def __repr__(self) -> str:
        return f"<accelport backend {self.name!r} ({self.platform})>"


@dataclass(frozen=True)
class BackendInfo:
    """One registered backend as ``ap.backends()`` lists it."""

    name: str
    platform: str
    lazy: bool
    available: bool
    reason: str
    device_count: int | None
    plugin: str
    selected: bool
    description: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)
