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
from typing import TYPE_CHECKING, Any

from accelport.errors import (
    AccelportDeprecationWarning,
    AccelportError,
    BackendUnavailableError,
    CheckpointError,
    CheckpointWarning,
    CompatibilityWarning,
    CompatMatrixError,
    DiagnosticWarning,
    PluginWarning,
    ProfileWarning,
    ShardingError,
    UnknownBackendError,
)

if TYPE_CHECKING:
    import torch

    from accelport import data
    from accelport.checkpoint import PendingSave
    from accelport.compat.verdict import Verdict
    from accelport.contract import Backend, BackendInfo, Metrics, Probe, StepRecord
    from accelport.device_loader import DeviceLoader
    from accelport.diagnose.memory import MemoryEstimate
    from accelport.diagnose.rule import Diagnosis, Rule, RunView
    from accelport.observe.profile import StepProfile
    from accelport.plugins.hookspecs import hookimpl
    from accelport.resume import Checkpointer
    from accelport.runtime.state import Runtime

__version__ = "0.1.0"

__all__ = [
    "AccelportDeprecationWarning",
    "AccelportError",
    "Backend",
    "BackendInfo",
    "BackendUnavailableError",
    "CheckpointError",
    "CheckpointWarning",
    "Checkpointer",
    "CompatMatrixError",
    "CompatibilityWarning",
    "DiagnosticWarning",
    "Diagnosis",
    "Metrics",
    "PluginWarning",
    "Probe",
    "ProfileWarning",
    "Rule",
    "RunView",
    "ShardingError",
    "StepRecord",
    "UnknownBackendError",
    "after_step",
    "all_reduce",
    "autocast",
    "backend",
    "backends",
    "barrier",
    "broadcast",
    "compile",
    "compile_cache",
    "data",
    "diagnostics",
    "device",
    "hookimpl",
    "is_main_process",
    "load",
    "loader",
    "memory_estimate",
    "metrics",
    "optimizer_step",
    "print",
    "profile",
    "rank",
    "recommend",
    "save",
    "shard",
    "sync",
    "use",
    "world_size",
]


#: Public names defined elsewhere, imported on first use so that ``import accelport`` stays
#: light (no pluggy, dataclasses or the runtime until something asks for them).
_LAZY = {
    "Backend": "accelport.contract",
    "BackendInfo": "accelport.contract",
    "Metrics": "accelport.contract",
    "Probe": "accelport.contract",
    "StepRecord": "accelport.contract",
    "Diagnosis": "accelport.diagnose.rule",
    "Rule": "accelport.diagnose.rule",
    "RunView": "accelport.diagnose.rule",
    "Checkpointer": "accelport.resume",
    "hookimpl": "accelport.plugins.hookspecs",
}


def __getattr__(name: str) -> Any:
    if name == "data":  # a submodule: importing it binds it on the package
        import accelport.data

        return accelport.data
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'accelport' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def _rt() -> Runtime:
    """The process's runtime (imported on first use; then a global lookup, on every step's path)."""
    runtime = _RUNTIME[0]
    if runtime is None:
        from accelport.runtime.state import RUNTIME

        runtime = _RUNTIME[0] = RUNTIME
    return runtime


_RUNTIME: list[Runtime | None] = [None]


def backend() -> Backend:
    """The selected backend (chosen on first call). Its ``reason`` says why it was chosen."""
    return _rt().backend()


def use(name: str) -> Backend:
    """Choose the backend explicitly; wins over ``ACCELPORT_BACKEND`` and the matrix.

    Raises :class:`UnknownBackendError` (with the nearest known name) or
    :class:`BackendUnavailableError` (with the probe's reason).
    """
    if not isinstance(name, str):
        raise UnknownBackendError(repr(name), _rt().host().backends, "ap.use()")
    return _rt().use(name)


def backends() -> list[BackendInfo]:
    """Every registered backend, available or not, with its probe's reason.

    Cheap and safe: probes read metadata and /sys only, nothing is imported.
    """
    from accelport.contract import BackendInfo
    from accelport.runtime.selection import resolve

    rt = _rt()
    host = rt.host()
    try:
        current = rt.selected
        selected = current.name if current else resolve(host, rt.explicit, rt.environ, matrix=rt.matrix())[0].name
    except AccelportError:
        selected = None
    out = []
    for name, b in list(host.backends.items()):
        p = host.probe(name)
        out.append(BackendInfo(name, b.platform, b.lazy, p.available, p.reason, p.device_count,
                               host.backend_plugin.get(name, "?"), name == selected, b.description))
    return out


def recommend(platform: str | None = None, torch_version: str | None = None, *,
              chip: str | None = None, python: str | None = None) -> Verdict:
    """What the compatibility matrix says for ``platform``, ``torch_version``, ``chip`` and ``python``.

    Defaults: the detected platform and chip, the installed torch (read from package
    metadata, never imported) and the running Python. ``chip`` is one of
    ``accelport.compat.machine.CHIPS`` (``"trn1"``, ``"v6e"``; it implies its platform),
    ``python`` a major.minor (``"3.12"``); anything else raises ``ValueError`` naming the
    valid ones. The verdict names the recommended backend (or none, with the nearest
    working combinations), every backend's status, message and patch release, and the
    sources. See ``accelport matrix``.
    """
    from accelport.compat.machine import parse_chip
    from accelport.compat.verdict import recommend as _recommend

    rt = _rt()
    return _recommend(platform, torch_version, chip=parse_chip(chip) if chip is not None else None,
                      python=python, matrix=rt.matrix(), environ=rt.environ)


def device(index: int | None = None) -> torch.device:
    """The device to put the model and data on (this process's device when several run)."""
    if index is not None and (isinstance(index, bool) or not isinstance(index, int) or index < 0):
        raise ValueError(f"ap.device(index) takes a device number (0, 1, ...) or nothing, not {index!r}")
    return _rt().backend().device(index)


def loader(
    iterable: Iterable[Any], *, prefetch: int | None = None, shard: bool | None = None, progress: bool = False
) -> DeviceLoader:
    """Wrap a DataLoader (or any iterable of batches): batches arrive on the device, prefetched.

    ``prefetch`` is how many batches to load ahead; None takes the backend's own
    default (2 on eager devices; torch_xla's ParallelLoader defaults on XLA, which
    upload several batches per transfer). 0 loads each batch in the loop's thread.
    A loop that ends early (``break``) stops the prefetch thread after the batch it
    is reading, and goes on once that batch is read (the next pass must not share
    the loader with it: persistent workers hand every pass one iterator). At exit
    every prefetch thread still running is stopped and waited for (up to 60 s): a
    thread left inside a torch op as Python finalises would abort the process with
    SIGABRT.

    The time the loop waits for data and each batch's shapes are recorded for
    ``ap.metrics()`` and the diagnostics. With several replicas, ``shard=True``
    gives each one its own share of the batches (every replica the same number);
    by default a DataLoader without a DistributedSampler draws one warning.
    ``progress=True`` shows a progress bar (needs tqdm) with steps per second,
    compilations so far and the data-wait share; it stays quiet when the output
    is not a terminal.
    """
    from accelport.device_loader import DeviceLoader

    return DeviceLoader(iterable, _rt(), prefetch=prefetch, shard=shard, progress=progress)


def optimizer_step(optimizer: Any, **kwargs: Any) -> Any:
    """Average gradients over replicas, step the optimizer, and end the step (lazy work runs)."""
    if optimizer is not _checked[0]:  # checked once per optimizer, not on every step
        if not (callable(getattr(optimizer, "step", None)) and hasattr(optimizer, "param_groups")):
            raise TypeError(f"ap.optimizer_step needs a torch.optim.Optimizer, not {type(optimizer).__name__}")
        _checked[0] = optimizer
    return (_RUNTIME[0] or _rt()).optimizer_step(optimizer, **kwargs)  # (a call less per step)


_checked: list[Any] = [object()]  # the last optimizer that passed the check


def sync() -> None:
    """Wait for all queued device work (eager) or execute the pending graph (lazy)."""
    _rt().sync()


def metrics() -> Metrics:
    """A snapshot: steps, compilations, compile time, transfers, CPU fallbacks, data wait."""
    return _rt().metrics()


def memory_estimate(model: Any, optimizer: Any, sample_batch: Any = None, *,
                    loss_fn: Callable[[Any], Any] | None = None, chip: str | None = None,
                    **unexpected: Any) -> MemoryEstimate:
    """What one training step of ``model`` with ``optimizer`` on ``sample_batch`` needs per device, before a run.

    The step runs on a copy, on the meta device (shapes only, nothing allocated; where an op has no
    meta kernel, on a cpu copy): ``model`` and ``optimizer`` are never changed. ``model`` is the model
    as built, on the cpu or under ``torch.device("meta")``; ``sample_batch`` what the model is called
    with (``model(*batch)`` for a tuple, ``model(**batch)`` for a dict); ``loss_fn(output)`` makes the
    loss (default: the sum of the outputs, as costly to differentiate). Returns the budget
    (``parameter_bytes``, ``gradient_bytes``, ``optimizer_state_bytes``, ``activation_bytes``), a
    verdict per device the compatibility matrix knows the memory of and for the host ("fits one TPU
    v5e device", "fits TPU v5e with ap.shard over 4 devices"), and, for ``chip`` (default: this
    machine's), the fixes in the order of what they save; ``print()`` it to read it.
    Buffers count on their own line; a ``torch.compile``'d model is measured by running its original
    modules eagerly (the printed estimate says so).
    Raises ``accelport.diagnose.memory.EstimateError`` (a ValueError) for a model on another device,
    a batch the model cannot run (a dtype mismatch included), a ``loss_fn`` that raises, or an optimizer
    of another model; :class:`UsageError` (a TypeError too) for a keyword it does not take (``batch=``).
    """
    from accelport.diagnose.memory import check_call, estimate
    from accelport.observe.memory import host_capacity
    from accelport.platform import detect

    check_call(sample_batch, unexpected)

    rt = _rt()
    return estimate(model, optimizer, sample_batch, loss_fn=loss_fn, chip=chip, matrix=rt.matrix(),
                    machine_chip=detect(environ=rt.environ).chip, host_bytes=host_capacity())


def profile(steps: Any, dir: str | os.PathLike[str] | None = None) -> StepProfile:  # noqa: A002 - the issue's name
    """Profile ``steps`` (``range(100, 110)``: steps 100 to 109; steps count from 1) with the backend's own
    profiler, writing its traces under ``dir`` (default ``./accelport-profile``).

    ``torch.profiler`` on eager backends (a Chrome trace that TensorBoard and Perfetto open),
    torch_xla's profiler on XLA (xplane files for TensorBoard's profile plugin and xprof); it starts
    when the step before the window ends and stops when the window's last step ends. When the window
    is done, a ``ProfileWarning`` says where the traces are, the window's time breakdown, the ten
    operators with the most self time and the share of the window the device had no work; the
    returned :class:`~accelport.observe.profile.StepProfile` holds the same (``result``, ``files``).
    Profiling never breaks training: a bad window, a directory that cannot be written or a
    profiler that fails says why in a ``ProfileWarning`` and the run goes on unprofiled
    (``state == "off"``, ``problem``). ``ACCELPORT_PROFILE=100:110`` does the same without a line of code.
    """
    return _rt().profile(steps, dir)


def compile_cache(path: str | os.PathLike[str]) -> str | None:
    """Keep compiled graphs in ``path`` across runs; call before the first computation.

    Returns the directory, which ``ap.metrics().compile_cache_dir`` reports too.
    Raises :class:`AccelportError` after the first computation. On a backend
    without a persistent compile cache it returns None with a
    :class:`CompatibilityWarning`, so the same script runs everywhere.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"ap.compile_cache needs a directory path (str or os.PathLike), not {type(path).__name__}")
    return _rt().backend().enable_compile_cache(path)


def after_step(fn: Callable[..., Any], *tensors: Any) -> None:
    """Call ``fn`` with host values of ``tensors`` without forcing an extra device round trip."""
    if not callable(fn):
        raise TypeError(f"after_step needs a callable first, not {type(fn).__name__}")
    _rt().backend().after_step(fn, tensors)


def diagnostics() -> list[Diagnosis]:
    """What the diagnosis rules found so far in this run (:class:`Diagnosis` items).

    Each has ``kind`` (the built-in ones: recompilation, compile-limit, graph-break, host-sync,
    input-bound, graph-growth, cpu-fallback, non-finite, precision, deprecated-config; a
    plugin's rules add theirs), ``message`` (cause and fix), ``step``, ``evidence`` and
    ``severity`` ("problem" for compile-limit, non-finite, precision and a loop that never syncs). Empty when
    diagnostics are disabled (``ACCELPORT_DIAGNOSTICS=0``).
    """
    return _rt().findings()


def compile(model: Any, **kwargs: Any) -> Any:  # noqa: A001 - the torch.compile of this API
    """``torch.compile`` with the selected backend's compiler (``tpu``, ``neuron``, inductor ...).

    Keyword arguments go to torch.compile; where the compiler rejects
    ``dynamic=True`` (TorchTPU, TorchNeuron) that is a ValueError saying what to do.
    """
    if not callable(model):
        raise TypeError(f"ap.compile needs a model or function to compile, not {type(model).__name__}")
    return _rt().backend().compile(model, **kwargs)


def autocast(dtype: Any = None, **kwargs: Any) -> Any:
    """A ``torch.autocast`` context for the selected device (``dtype`` None: torch's default)."""
    b = _rt().backend()
    import torch

    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"ap.autocast needs a torch dtype such as torch.bfloat16 or torch.float16, not {dtype!r}")
    return b.autocast(dtype, **kwargs)


def rank() -> int:
    """This process's rank among all replicas (0 when alone)."""
    return _rt().backend().rank()


def world_size() -> int:
    """How many replicas train together (1 when alone)."""
    return _rt().backend().world_size()


def is_main_process() -> bool:
    """True on rank 0: the process that logs and writes checkpoints."""
    return _rt().backend().rank() == 0


def barrier() -> None:
    """Wait until every replica reaches this point (no-op when alone)."""
    _rt().backend().barrier()


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` in place over replicas; ``op`` is "sum" or "mean".

    Checked the same way at every world size and on every backend, so a script
    that works alone works on many: 8-bit and bool tensors are refused (their sums
    wrap around). On eager backends with several replicas, every replica must pass
    the same shape, dtype and op: one small extra collective checks it on the first
    8 calls and every 100th after (every call with ``ACCELPORT_CHECK_COLLECTIVES=1``);
    without it a mismatch sums wrong memory or hangs.
    """
    rt = _rt()
    b = rt.backend()
    import torch

    problem = _all_reduce_problem(tensor, op, torch)  # from the arguments alone: the same wherever they are
    if not b.lazy and b.world_size() > 1:
        collectives = getattr(b, "collectives", None)
        if collectives is None or collectives.check_due(rt.environ):
            from accelport.tensors import same_on_every_rank

            # Taken also with a bad argument: a rank that raised here alone would strand the others
            # in this collective (or pair it with their next one).
            if isinstance(tensor, torch.Tensor):
                key: tuple[Any, ...] = (str(tensor.dtype), tuple(tensor.shape), op)
                mine = f"shape {tuple(tensor.shape)}, {tensor.dtype}, op={op!r}"
            else:
                key, mine = (type(tensor).__qualname__, op), f"a {type(tensor).__name__}, op={op!r}"
            if collectives is None:
                same = same_on_every_rank(b, key)
            else:
                with collectives.waiting("ap.all_reduce"):  # (its host read waits for the others on a device)
                    same = same_on_every_rank(b, key)
            if not same:
                raise ValueError(f"ap.all_reduce: the replicas passed different tensors (here rank {b.rank()}: "
                                 f"{mine}); every replica must pass the same shape, dtype and op, in the same "
                                 "order") from problem
    if problem is not None:
        raise problem
    return b.all_reduce(tensor, op)


def _all_reduce_problem(tensor: Any, op: Any, torch: Any) -> Exception | None:
    """What is wrong with ``ap.all_reduce(tensor, op)``'s arguments at any world size, or None."""
    if not isinstance(tensor, torch.Tensor):
        return TypeError(f"ap.all_reduce needs a tensor, not {type(tensor).__name__}")
    if op not in ("sum", "mean"):
        return ValueError(f"all_reduce op must be 'sum' or 'mean', not {op!r}")
    if tensor.dtype in (torch.uint8, torch.int8, torch.bool):
        return TypeError(f"ap.all_reduce of a {tensor.dtype} tensor would wrap around (as uint8, 200 + 200 is "
                         "144): convert it first with .long() (or .int()), and back after if needed")
    if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
        return TypeError(f"all_reduce(op='mean') needs a floating-point tensor, not {tensor.dtype}; "
                         "convert it with .float() or reduce with op='sum'")
    return None


def broadcast(obj: Any, src: int = 0) -> Any:
    """Give every replica rank ``src``'s values: a tensor, a list of tensors, or a module's parameters
    and buffers (``xm.broadcast_master_param``), overwritten in place; returns ``obj``.

    Call it on every replica, e.g. after building the model, so all start from the
    same weights. A no-op alone. A sharded model (broadcast it before ``ap.shard``)
    and sparse tensors are refused at every world size.
    """
    b = _rt().backend()
    import torch

    from accelport.sharding import is_dtensor, is_sharded

    if isinstance(obj, torch.nn.Module):
        if is_sharded(obj):
            raise ShardingError(
                f"ap.broadcast: this {type(obj).__name__} is sharded (ap.shard): each rank holds its own part of "
                "every parameter, so there is nothing to copy from one rank. Broadcast the model as built, "
                "before ap.shard (ap.broadcast(model), then model = ap.shard(model)), or restore it with "
                "ap.load(path, into={'model': model})")
        tensors = list({id(t): t for t in (*obj.parameters(), *obj.buffers())}.values())  # shared ones once
    elif isinstance(obj, torch.Tensor):
        tensors = [obj]
    elif isinstance(obj, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in obj):
        tensors = list(obj)
    else:
        raise TypeError(f"ap.broadcast needs a tensor, a list of tensors or a torch.nn.Module, not "
                        f"{type(obj).__name__}")
    for t in tensors:
        if is_dtensor(t):
            raise ShardingError("ap.broadcast: a DTensor (a sharded model's parameter) holds a different part on "
                                "each rank; broadcast the tensor before sharding, or its .full_tensor()")
        if t.layout is not torch.strided:
            raise TypeError(f"ap.broadcast takes dense tensors, not a {t.layout} one (shape {tuple(t.shape)}): "
                            "broadcast t.to_dense(), or a sparse COO tensor's .indices() and .values()")
    world = b.world_size()
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world:
        raise ValueError(f"ap.broadcast(src=...) takes the rank whose values every replica gets, between 0 and "
                         f"{world - 1} here (world size {world}), not {src!r}")
    if world == 1:
        return obj
    send = getattr(b, "broadcast", None)
    if send is None:
        raise AccelportError(f"backend {b.name!r} has no broadcast: copy rank {src}'s values with ap.all_reduce "
                             "(zeros on the other ranks, op='sum'), or ask the backend's authors for one")
    send(tensors, src)
    return obj


def print(*values: Any, sep: str = " ", end: str = "\n", file: Any = None, flush: bool = False) -> None:
    """``print`` on the main process only, with tensors shown as host values.

    Safe on every backend and at every rank: nothing is forced to run early (on a
    lazy backend a line holding a tensor waits for the step's sync, and so does any
    line after it; text alone prints at once), and the other processes return at
    once without touching their tensors.
    """
    b = _rt().backend()
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
    return _rt().backend().shard(model, policy=predicate, reshard_after_forward=reshard_after_forward,
                               mixed_precision=mixed_precision)


def save(obj: Any, path: str | os.PathLike[str], *, background: bool = False) -> PendingSave | None:
    """Checkpoint ``obj``; modules and optimizers in a dict are saved as their state.

    Unsharded: tensors to host, main process only, atomic (temp file, fsync,
    rename); call it on every process or on the main one only. When a model in the
    dict was sharded by :func:`shard`, ``path`` becomes a directory that every rank
    writes its shard into (torch.distributed.checkpoint), so call it on every rank;
    it replaces the previous checkpoint only once complete, and a failure on any
    rank is raised on every rank. ``background=True`` returns at once with a
    handle whose ``wait()`` blocks until it is in place.
    """
    return _rt().backend().save(obj, path, background=background)


def load(path: str | os.PathLike[str], map_location: Any = None, *, weights_only: bool = True,
         into: Any = None) -> Any:
    """Read a checkpoint written by :func:`save`, onto this process's device.

    ``into={"model": model, "opt": opt}`` restores those modules and optimizers in
    place (sharded or not, on any number of ranks) and returns the other values; a
    checkpoint directory needs it, and is refused (on every rank) when it does not
    fit the objects given or its files are damaged. ``weights_only=False`` allows
    arbitrary pickled objects: only for files you trust.
    """
    return _rt().backend().load(path, map_location, weights_only=weights_only, into=into)
