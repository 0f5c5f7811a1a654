"""accelport: one PyTorch training script on TPU, Trainium, GPU and CPU.

    import accelport as ap

    model = Net().to(ap.device())
    for x, y in ap.loader(train_loader):
        loss = loss_fn(model(x), y)
        loss.backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
    print(ap.metrics())

Importing accelport imports neither torch nor any vendor library; the backend is
chosen (and torch imported) on first use.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from accelport.runtime.state import RUNTIME as _RT
from accelport.contract import Backend, Metrics, Probe, StepRecord
from accelport.errors import (
    AccelportDeprecationWarning,
    AccelportError,
    BackendUnavailableError,
    CompatibilityWarning,
    CheckpointError,
    CompatMatrixError,
    DiagnosticWarning,
    PluginWarning,
    ShardingError,
    UnknownBackendError,
)
from accelport.plugins.hookspecs import hookimpl
from accelport import data  # noqa: E402 - torch-free; ap.data.BucketCollate etc.

if TYPE_CHECKING:
    import torch

    from accelport.checkpoint import PendingSave
    from accelport.device_loader import DeviceLoader
    from accelport.compat.verdict import Verdict

__version__ = "0.1.0"

__all__ = [
    "AccelportDeprecationWarning",
    "AccelportError",
    "Backend",
    "BackendInfo",
    "BackendUnavailableError",
    "CheckpointError",
    "CompatMatrixError",
    "CompatibilityWarning",
    "DiagnosticWarning",
    "Metrics",
    "PluginWarning",
    "Probe",
    "ShardingError",
    "StepRecord",
    "UnknownBackendError",
    "after_step",
    "all_reduce",
    "autocast",
    "backend",
    "backends",
    "barrier",
    "compile",
    "compile_cache",
    "data",
    "diagnostics",
    "device",
    "hookimpl",
    "is_main_process",
    "load",
    "loader",
    "metrics",
    "optimizer_step",
    "print",
    "rank",
    "recommend",
    "save",
    "shard",
    "sync",
    "use",
    "world_size",
]


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


def backend() -> Backend:
    """The selected backend (chosen on first call). Its ``reason`` says why it was chosen."""
    return _RT.backend()


def use(name: str) -> Backend:
    """Choose the backend explicitly; wins over ``ACCELPORT_BACKEND`` and the matrix.

    Raises :class:`UnknownBackendError` (with the nearest known name) or
    :class:`BackendUnavailableError` (with the probe's reason).
    """
    if not isinstance(name, str):
        raise UnknownBackendError(repr(name), _RT.host().backends, "ap.use()")
    return _RT.use(name)


def backends() -> list[BackendInfo]:
    """Every registered backend, available or not, with its probe's reason.

    Cheap and safe: probes read metadata and /sys only, nothing is imported.
    """
    from accelport.runtime.selection import resolve

    host = _RT.host()
    try:
        current = _RT.selected
        selected = current.name if current else resolve(host, _RT.explicit, _RT.environ, matrix=_RT.matrix())[0].name
    except AccelportError:
        selected = None
    out = []
    for name, b in host.backends.items():
        p = b.probe()
        out.append(BackendInfo(name, b.platform, b.lazy, p.available, p.reason, p.device_count,
                               host.backend_plugin.get(name, "?"), name == selected, b.description))
    return out


def recommend(platform: str | None = None, torch_version: str | None = None) -> Verdict:
    """What the compatibility matrix says for ``platform`` and ``torch_version``.

    Defaults: the detected platform and the installed torch (read from package
    metadata, never imported). The verdict names the recommended backend (or
    none, with the nearest working combinations), every backend's status and
    message, and the sources. See ``accelport matrix``.
    """
    from accelport.compat.verdict import recommend as _recommend

    return _recommend(platform, torch_version, matrix=_RT.matrix(), environ=_RT.environ)


def device(index: int | None = None) -> torch.device:
    """The device to put the model and data on (this process's device when several run)."""
    if index is not None and (isinstance(index, bool) or not isinstance(index, int) or index < 0):
        raise ValueError(f"ap.device(index) takes a device number (0, 1, ...) or nothing, not {index!r}")
    return _RT.backend().device(index)


def loader(
    iterable: Iterable[Any], *, prefetch: int | None = None, shard: bool | None = None, progress: bool = False
) -> DeviceLoader:
    """Wrap a DataLoader (or any iterable of batches): batches arrive on the device, prefetched.

    ``prefetch`` is how many batches to load ahead; None takes the backend's own
    default (2 on eager devices; torch_xla's ParallelLoader defaults on XLA, which
    upload several batches per transfer). 0 loads each batch in the loop's thread.

    The time the loop waits for data and each batch's shapes are recorded for
    ``ap.metrics()`` and the diagnostics. With several replicas, ``shard=True``
    gives each one its own share of the batches (every replica the same number);
    by default a DataLoader without a DistributedSampler draws one warning.
    ``progress=True`` shows a progress bar (needs tqdm) with steps per second,
    compilations so far and the data-wait share; it stays quiet when the output
    is not a terminal.
    """
    from accelport.device_loader import DeviceLoader

    return DeviceLoader(iterable, _RT, prefetch=prefetch, shard=shard, progress=progress)


def optimizer_step(optimizer: Any, **kwargs: Any) -> Any:
    """Average gradients over replicas, step the optimizer, and end the step (lazy work runs)."""
    if not (callable(getattr(optimizer, "step", None)) and hasattr(optimizer, "param_groups")):
        raise TypeError(f"ap.optimizer_step needs a torch.optim.Optimizer, not {type(optimizer).__name__}")
    return _RT.optimizer_step(optimizer, **kwargs)


def sync() -> None:
    """Wait for all queued device work (eager) or execute the pending graph (lazy)."""
    _RT.backend().sync()


def metrics() -> Metrics:
    """A snapshot: steps, compilations, compile time, transfers, CPU fallbacks, data wait."""
    return _RT.metrics()


def compile_cache(path: str | os.PathLike[str]) -> str | None:
    """Keep compiled graphs in ``path`` across runs; call before the first computation.

    Returns the directory, which ``ap.metrics().compile_cache_dir`` reports too.
    Raises :class:`AccelportError` after the first computation. On a backend
    without a persistent compile cache it returns None with a
    :class:`CompatibilityWarning`, so the same script runs everywhere.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"ap.compile_cache needs a directory path (str or os.PathLike), not {type(path).__name__}")
    return _RT.backend().enable_compile_cache(path)


def after_step(fn: Callable[..., Any], *tensors: Any) -> None:
    """Call ``fn`` with host values of ``tensors`` without forcing an extra device round trip."""
    if not callable(fn):
        raise TypeError(f"after_step needs a callable first, not {type(fn).__name__}")
    _RT.backend().after_step(fn, tensors)


def diagnostics() -> list[Any]:
    """What the built-in diagnostics found so far in this run (``Diagnosis`` items).

    Each has ``kind`` (recompilation, host-sync, input-bound, graph-growth,
    cpu-fallback, deprecated-config), ``message`` (cause and fix), ``step`` and
    ``evidence``. Empty when diagnostics are disabled (``ACCELPORT_DIAGNOSTICS=0``).
    """
    _RT.tracker.flush()  # steps not yet handed to the observers (see StepRecord)
    plugin = _RT.host().pm.get_plugin("diagnostics")
    return list(getattr(plugin, "findings", []))


def compile(model: Any, **kwargs: Any) -> Any:  # noqa: A001 - the torch.compile of this API
    """``torch.compile`` with the selected backend's compiler (``tpu``, ``neuron``, inductor ...).

    Keyword arguments go to torch.compile; where the compiler rejects
    ``dynamic=True`` (TorchTPU, TorchNeuron) that is a ValueError saying what to do.
    """
    if not callable(model):
        raise TypeError(f"ap.compile needs a model or function to compile, not {type(model).__name__}")
    return _RT.backend().compile(model, **kwargs)


def autocast(dtype: Any = None, **kwargs: Any) -> Any:
    """A ``torch.autocast`` context for the selected device (``dtype`` None: torch's default)."""
    b = _RT.backend()
    import torch

    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"ap.autocast needs a torch dtype such as torch.bfloat16 or torch.float16, not {dtype!r}")
    return b.autocast(dtype, **kwargs)


def rank() -> int:
    """This process's rank among all replicas (0 when alone)."""
    return _RT.backend().rank()


def world_size() -> int:
    """How many replicas train together (1 when alone)."""
    return _RT.backend().world_size()


def is_main_process() -> bool:
    """True on rank 0: the process that logs and writes checkpoints."""
    return _RT.backend().rank() == 0


def barrier() -> None:
    """Wait until every replica reaches this point (no-op when alone)."""
    _RT.backend().barrier()


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` in place over replicas; ``op`` is "sum" or "mean".

    Checked the same way at every world size and on every backend, so a script
    that works alone works on many.
    """
    b = _RT.backend()
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"ap.all_reduce needs a tensor, not {type(tensor).__name__}")
    if op not in ("sum", "mean"):
        raise ValueError(f"all_reduce op must be 'sum' or 'mean', not {op!r}")
    if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"all_reduce(op='mean') needs a floating-point tensor, not {tensor.dtype}; "
                        "convert it with .float() or reduce with op='sum'")
    return b.all_reduce(tensor, op)


def print(*values: Any, sep: str = " ", end: str = "\n", file: Any = None, flush: bool = False) -> None:
    """``print`` on the main process only, with tensors shown as host values.

    Safe on every backend and at every rank: nothing is forced to run early (on a
    lazy backend the print waits for the step's sync), and the other processes
    return at once without touching their tensors.
    """
    b = _RT.backend()
    if b.rank() != 0:
        return
    import builtins

    b.after_step(lambda *host: builtins.print(*host, sep=sep, end=end, file=file, flush=flush), values)


def shard(model: Any, *, policy: Any = None, reshard_after_forward: bool = True,
          mixed_precision: str | None = None) -> Any:
    """Shard ``model``'s parameters, gradients and optimizer state over the replicas; use what it returns.

    Eager backends use FSDP2 (``fully_shard``, torch 2.6+) over every rank, lazy XLA
    backends torch_xla's SPMD FSDP over every device. Alone (one replica or device)
    the model comes back unchanged. ``policy`` picks the blocks that are gathered
    one at a time: a set of module classes or a callable(module) -> bool (default:
    the items of each layer stack, such as transformer layers, and any other
    submodule with at least 1% of the parameters). ``reshard_after_forward=False``
    keeps gathered parameters until backward (more memory, less communication).
    ``mixed_precision="bf16"`` computes in bfloat16 with float32 master weights and
    gradient reduction (FSDP2). Build the optimizer from the returned model's parameters.
    """
    from accelport.sharding import check_arguments

    predicate = check_arguments(model, policy, reshard_after_forward, mixed_precision)
    return _RT.backend().shard(model, policy=predicate, reshard_after_forward=reshard_after_forward,
                               mixed_precision=mixed_precision)


def save(obj: Any, path: str | os.PathLike[str], *, background: bool = False) -> PendingSave | None:
    """Checkpoint ``obj``; modules and optimizers in a dict are saved as their state.

    Unsharded: tensors to host, main process only, atomic (temp file, fsync,
    rename); call it on every process or on the main one only. When a model in the
    dict was sharded by :func:`shard`, ``path`` becomes a directory that every rank
    writes its shard into (torch.distributed.checkpoint), so call it on every rank;
    it replaces the previous checkpoint only once complete. ``background=True``
    returns at once with a handle whose ``wait()`` blocks until it is in place.
    """
    return _RT.backend().save(obj, path, background=background)


def load(path: str | os.PathLike[str], map_location: Any = None, *, weights_only: bool = True,
         into: Any = None) -> Any:
    """Read a checkpoint written by :func:`save`, onto this process's device.

    ``into={"model": model, "opt": opt}`` restores those modules and optimizers in
    place (sharded or not, on any number of ranks) and returns the other values; a
    checkpoint directory needs it. ``weights_only=False`` allows arbitrary pickled
    objects: only for files you trust.
    """
    return _RT.backend().load(path, map_location, weights_only=weights_only, into=into)
