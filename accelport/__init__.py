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
    CompatMatrixError,
    DiagnosticWarning,
    PluginWarning,
    UnknownBackendError,
)
from accelport.plugins.hookspecs import hookimpl
from accelport import data  # noqa: E402 - torch-free; ap.data.BucketCollate etc.

if TYPE_CHECKING:
    import torch

    from accelport.device_loader import DeviceLoader
    from accelport.compat.verdict import Verdict

__version__ = "0.1.0"

__all__ = [
    "AccelportDeprecationWarning",
    "AccelportError",
    "Backend",
    "BackendInfo",
    "BackendUnavailableError",
    "CompatMatrixError",
    "CompatibilityWarning",
    "DiagnosticWarning",
    "Metrics",
    "PluginWarning",
    "Probe",
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
    if optimizer is not _checked[0]:  # checked once per optimizer, not on every step
        if not (callable(getattr(optimizer, "step", None)) and hasattr(optimizer, "param_groups")):
            raise TypeError(f"ap.optimizer_step needs a torch.optim.Optimizer, not {type(optimizer).__name__}")
        _checked[0] = optimizer
    return _RT.optimizer_step(optimizer, **kwargs)


_checked: list[Any] = [object()]  # the last optimizer that passed the check


def sync() -> None:
    """Wait for all queued device work (eager) or execute the pending graph (lazy)."""
    _RT.sync()


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

    Each has ``kind`` (recompilation, compile-limit, graph-break, host-sync,
    input-bound, graph-growth, cpu-fallback, non-finite, precision,
    deprecated-config), ``message`` (cause and fix), ``step``, ``evidence`` and
    ``severity`` ("problem" for compile-limit and non-finite). Empty when
    diagnostics are disabled (``ACCELPORT_DIAGNOSTICS=0``).
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


def save(obj: Any, path: str | os.PathLike[str]) -> None:
    """Checkpoint ``obj``: tensors to host, main process only, atomic (temp file, fsync, rename).

    Call it on every process or on the main one only; it never waits for the others.
    """
    _RT.backend().save(obj, path)


def load(path: str | os.PathLike[str], map_location: Any = None, *, weights_only: bool = True) -> Any:
    """Read a checkpoint written by :func:`save`, onto this process's device.

    ``weights_only=False`` allows arbitrary pickled objects: only for files you trust.
    """
    return _RT.backend().load(path, map_location, weights_only=weights_only)
