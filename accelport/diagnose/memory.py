"""What a step's memory is made of, what each fix would save, and whether a run fits a device.

Shared by the ``out-of-memory`` rule (the budget of the last good step, and the fixes in order of
what they save) and ``ap.memory_estimate`` (the same budget from one step run on the host, with a
verdict per device). The figures come from the sensor (:mod:`accelport.observe.memory`); the
arithmetic is here, in one place, so what the finding says and what the estimate says agree.

A device counts as holding :data:`USABLE` of its memory for the step: the runtime, the compiler's
scratch space and fragmentation take the rest (XLA's own limit on a 32 GiB TPU v4 chip is 31.75 GiB;
CUDA's context takes hundreds of megabytes).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from accelport.diagnose import advice
from accelport.errors import AccelportError, UsageError

if TYPE_CHECKING:
    from accelport.compat.load import Matrix

__all__ = ["USABLE", "Budget", "Fix", "fixes", "human_bytes", "chip_capacity", "DeviceVerdict", "MemoryEstimate",
           "EstimateError", "EstimateUsageError", "SIGNATURE", "COMPILED_NOTE", "check_call", "is_compiled",
           "estimate", "verdict_for", "blocks_of"]

#: The share of a device's memory a step may count on (see the module's docstring).
USABLE = 0.9
#: The most devices a verdict or the sharding fix considers (powers of two up to it).
MAX_DEVICES = 1024


def human_bytes(n: float | None) -> str:
    """``1.5 GiB``, ``120.0 MiB``, ``512 B``: binary units, one decimal."""
    if n is None:
        return "unknown"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return ""  # pragma: no cover - unreachable


@dataclass(frozen=True)
class Budget:
    """One device's memory for a step: the static part (parameters, gradients, optimizer state), the
    activations, the capacity, and what the fixes need to know (batch size, the model's blocks)."""

    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    activation_bytes: int | None = None
    capacity_bytes: int | None = None
    batch_size: int | None = None
    #: Of the static part, the bytes held in float32 (what bf16 weights would halve).
    float32_bytes: int = 0
    #: The model's blocks (the units ap.shard gathers one at a time, the pieces to checkpoint) and the
    #: parameters of the largest one (gathered whole while it runs, when sharded).
    blocks: int | None = None
    largest_block_bytes: int = 0
    #: Replicas the run has now, and whether its parameters are sharded over them already.
    world_size: int = 1
    sharded: bool = False
    #: The model's buffers (registered, persistent or not): held whole on every device, never sharded.
    buffer_bytes: int = 0

    @property
    def shardable_bytes(self) -> int:
        """Parameters, gradients and optimizer state: what ap.shard splits over devices."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes

    @property
    def static_bytes(self) -> int:
        return self.shardable_bytes + self.buffer_bytes

    @property
    def total_bytes(self) -> int:
        return self.static_bytes + (self.activation_bytes or 0)

    @property
    def usable_bytes(self) -> int | None:
        return int(self.capacity_bytes * USABLE) if self.capacity_bytes else None

    def describe(self) -> str:
        """"16.0 MiB of parameters, 16.0 MiB of gradients, ..., 112.0 MiB in all of a 120.0 MiB device" (no colon:
        a finding's first colon ends what was seen)."""
        parts = [f"{human_bytes(self.parameter_bytes)} of parameters", f"{human_bytes(self.gradient_bytes)} of "
                 "gradients", f"{human_bytes(self.optimizer_state_bytes)} of optimizer state"]
        if self.buffer_bytes:
            parts.append(f"{human_bytes(self.buffer_bytes)} of buffers")
        parts.append(f"{human_bytes(self.activation_bytes)} of activations" if self.activation_bytes is not None
                     else "activations not measured")
        of = f" of a {human_bytes(self.capacity_bytes)} device" if self.capacity_bytes else ""
        return f"{', '.join(parts[:-1])} and {parts[-1]}, {human_bytes(self.total_bytes)} in all{of}"


@dataclass(frozen=True)
class Fix:
    """One way to make room: what it is (``kind``), what it saves per device and what is left after it."""

    kind: str  # "shard", "checkpoint", "batch", "bf16"
    saves_bytes: int
    after_bytes: int
    text: str
    numbers: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"fix": self.kind, "saves_bytes": self.saves_bytes, "after_bytes": self.after_bytes,
                "text": self.text, **dict(self.numbers)}


def _powers(limit: int = MAX_DEVICES) -> Iterable[int]:
    n = 2
    while n <= limit:
        yield n
        n *= 2


def _shard_fix(b: Budget, style: str) -> Fix | None:
    if b.shardable_bytes <= 0:
        return None
    have = b.world_size if b.sharded else 1  # the static figures are already per device over these

    def static_over(n: int) -> int:  # the buffers stay whole on every device
        return math.ceil(b.shardable_bytes * have / n) + (b.largest_block_bytes if n > 1 else 0) + b.buffer_bytes

    usable, activation = b.usable_bytes, b.activation_bytes or 0
    candidates = [n for n in _powers() if n > have]
    fitting = [n for n in candidates if usable is not None and static_over(n) + activation <= usable]
    if fitting:
        n = fitting[0]
    elif b.world_size > have:
        n = b.world_size  # the replicas the run has already
    else:
        n = max(2 * have, 8) if usable is not None else 2 * have
    after = static_over(n)
    saves = b.static_bytes - after
    if saves <= 0:
        return None
    split = after - b.buffer_bytes
    gathered = (f" (with the largest block's {human_bytes(b.largest_block_bytes)} of parameters gathered while "
                "it runs)") if b.largest_block_bytes else ""
    fits = ""
    if usable is not None and b.activation_bytes is not None:
        fits = "; then it fits" if after + activation <= usable else "; not enough alone"
    return Fix("shard", saves, after + activation, (
        f"{advice.shard_model(style, n)}: parameters, gradients and optimizer state take "
        f"{human_bytes(split)} per device{gathered} instead of {human_bytes(b.shardable_bytes)}, saving "
        f"{human_bytes(saves)}{fits}"), {"devices": n, "static_bytes_per_device": after})


def _checkpoint_fix(b: Budget) -> Fix | None:
    activation = b.activation_bytes
    if not activation:
        return None
    share = activation / b.total_bytes if b.total_bytes else 0.0
    if b.blocks and b.blocks >= 2:
        kept = math.ceil(activation / b.blocks)
        saves = activation - kept
        how = (f"wrap each of the model's {b.blocks} blocks in torch.utils.checkpoint.checkpoint: backward then "
               f"recomputes one block at a time, so about one block's activations ({human_bytes(kept)}) are held "
               f"instead of all of them ({human_bytes(activation)}, {share:.0%} of the step), saving about "
               f"{human_bytes(saves)} for a second forward pass")
    else:
        saves = activation
        how = (f"activation checkpointing (torch.utils.checkpoint.checkpoint on the model's largest blocks): the "
               f"activations are {human_bytes(activation)} ({share:.0%} of the step); it saves up to that, for a "
               "second forward pass")
    return Fix("checkpoint", saves, b.total_bytes - saves, how, {"activation_bytes": activation,
                                                                  "activation_share": round(share, 3),
                                                                  "blocks": b.blocks})


def _batch_fix(b: Budget, style: str) -> Fix | None:
    activation, batch = b.activation_bytes, b.batch_size
    if not activation or not batch or batch < 2:
        return None
    per_sample = activation / batch
    usable = b.usable_bytes
    if usable is None:
        fit = batch // 2
    else:
        fit = int((usable - b.static_bytes) // per_sample) if usable > b.static_bytes else 0
        if fit >= batch or fit < 1:
            return None  # the batch is not what is too large, or no batch would fit
    saves = int((batch - fit) * per_sample)
    steps = math.ceil(batch / fit)
    limit = ("the largest that fits" if usable is not None else "half the batch; the device's capacity is "
             "not known")
    return Fix("batch", saves, b.total_bytes - saves, (
        f"a batch of {fit} instead of {batch} ({limit}, at {human_bytes(per_sample)} of activations per sample), "
        f"saving {human_bytes(saves)}; keep the same effective batch by {advice.accumulate(style, steps)}"),
        {"batch_size": fit, "bytes_per_sample": int(per_sample), "accumulation_steps": steps})


def _bf16_fix(b: Budget) -> Fix | None:
    if b.float32_bytes <= 0:
        return None
    saves = b.float32_bytes // 2
    return Fix("bf16", saves, b.total_bytes - saves, (
        f"bf16 weights (model.to(torch.bfloat16)): the float32 parameters, gradients and optimizer state "
        f"({human_bytes(b.float32_bytes)}) halve, saving {human_bytes(saves)}; but an update smaller than half "
        "the gap between neighbouring bf16 values rounds away (4096 + 1 = 4096), and training stalls (the "
        "precision kind watches for it): keep float32 master weights where it matters, or use an optimizer "
        "that compensates the rounding"), {"float32_bytes": b.float32_bytes})


def fixes(b: Budget, style: str = "accelport") -> list[Fix]:
    """The ways to make room, most saved first, each with its numbers, spelled for a script of ``style``
    (:data:`accelport.diagnose.advice.STYLES`)."""
    found = [fix for fix in (_shard_fix(b, style), _checkpoint_fix(b), _batch_fix(b, style), _bf16_fix(b))
             if fix is not None]
    return sorted(found, key=lambda f: -f.saves_bytes)


# -- devices ----------------------------------------------------------------------------------------


def chip_capacity(matrix: Matrix, chip: str | None) -> tuple[int, str] | None:
    """(HBM per device, where that is from) for a chip the compatibility matrix has facts for; None otherwise."""
    from accelport.compat.machine import chip_name

    name = chip_name(chip) if chip else None
    fact = matrix.chips.get(name) if name else None
    if fact is None:
        return None
    per = "device" if fact.devices == 1 else f"device ({fact.devices} per chip)"
    return fact.device_bytes, f"the HBM per {per} of a {fact.title} chip, from the compatibility matrix"


@dataclass(frozen=True)
class DeviceVerdict:
    """Whether a run fits one kind of device: on how many, and with how much per device."""

    device: str  # "v5e", "host", "cuda"
    title: str  # "TPU v5e"
    capacity_bytes: int  # per device
    #: The fewest devices it fits on (1: alone; more: with ap.shard over them); None: not on MAX_DEVICES.
    devices: int | None
    bytes_per_device: int
    devices_per_chip: int = 1
    #: Where it fits on none: the fewest with activation checkpointing on the model's blocks too (None: not even).
    checkpointed_devices: int | None = None
    blocks: int | None = None
    #: The model's buffers, held whole on every device however many share the rest.
    buffer_bytes: int = 0

    def _count(self, n: int) -> str:
        if self.devices_per_chip == 1:
            return f"{n} device{'s' if n != 1 else ''}"
        chips = math.ceil(n / self.devices_per_chip)
        return f"{n} device{'s' if n != 1 else ''} ({chips} chip{'s' if chips != 1 else ''})"

    def text(self) -> str:
        cap = human_bytes(self.capacity_bytes)
        if self.device == "host":
            fits = "fits" if self.devices == 1 else "does not fit"
            return f"{fits} this host's memory ({human_bytes(self.bytes_per_device)} of {cap})"
        if self.devices is None:
            whole = (f"the activations and the buffers ({human_bytes(self.buffer_bytes)}, never sharded)"
                     if self.buffer_bytes else "the activations")
            said = (f"does not fit {self.title} devices ({cap} each) at this batch, even with ap.shard over "
                    f"{MAX_DEVICES}: {whole} alone need more")
            n = self.checkpointed_devices
            if n is not None:
                how = "alone" if n == 1 else f"with ap.shard over {self._count(n)}"
                return f"{said}; with activation checkpointing on the model's {self.blocks} blocks it fits {how}"
            return f"{said}; a smaller batch first"
        per = human_bytes(self.bytes_per_device)
        if self.devices == 1:
            return f"fits one {self.title} device ({per} of {cap})"
        return f"fits {self.title} with ap.shard over {self._count(self.devices)} ({per} each of {cap})"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "text": self.text()}


def _fewest(b: Budget, usable: float, activation: int) -> tuple[int, int] | None:
    """(devices, bytes per device) for the fewest devices with ``usable`` bytes each that hold ``b``."""
    if b.static_bytes + activation <= usable:
        return 1, b.static_bytes + activation
    for n in _powers():
        per = math.ceil(b.shardable_bytes / n) + b.largest_block_bytes + b.buffer_bytes + activation
        if per <= usable:
            return n, per
    return None


def verdict_for(b: Budget, device: str, title: str, capacity: int, devices_per_chip: int = 1) -> DeviceVerdict:
    """The fewest devices of ``capacity`` bytes each that hold ``b`` (sharded over them past one); where none
    does, the fewest with activation checkpointing on the model's blocks (about one block's activations)."""
    usable = capacity * USABLE
    activation = b.activation_bytes or 0
    found = _fewest(b, usable, activation)
    if found is not None:
        return DeviceVerdict(device, title, capacity, found[0], found[1], devices_per_chip,
                             buffer_bytes=b.buffer_bytes)
    checkpointed = None
    if b.blocks and b.blocks >= 2 and activation:
        with_checkpoints = _fewest(b, usable, math.ceil(activation / b.blocks))
        checkpointed = with_checkpoints[0] if with_checkpoints is not None else None
    return DeviceVerdict(device, title, capacity, None, b.total_bytes, devices_per_chip, checkpointed, b.blocks,
                         b.buffer_bytes)


# -- the model's blocks ------------------------------------------------------------------------------


def blocks_of(model: Any) -> tuple[int | None, int]:
    """(how many blocks, parameter bytes of the largest) of ``model``: the units ``ap.shard`` would make."""
    from accelport.sharding import choose_units, local_nbytes

    try:
        units = choose_units(model, None)
    except Exception:  # noqa: BLE001 - a model whose structure cannot be walked: no blocks known
        return None, 0
    units = [u for u in units if u is not model]
    if not units:
        return None, 0
    largest = max(sum(local_nbytes(p) for p in u.parameters()) for u in units)
    return len(units), largest


# -- ap.memory_estimate ------------------------------------------------------------------------------


class EstimateError(AccelportError, ValueError):
    """``ap.memory_estimate`` cannot run the step it was given: the message says what to change."""


class EstimateUsageError(UsageError, TypeError):
    """``ap.memory_estimate`` called with arguments it does not take (a TypeError too, as Python's own would be)."""


#: The signature ``ap.memory_estimate`` is called with, and what its batch is, for the error a wrong call gets.
SIGNATURE = ("memory_estimate(model, optimizer, sample_batch, *, loss_fn=None, chip=None): sample_batch is one "
             "batch as the training loop passes it to the model (model(*batch) for a tuple, model(**batch) for a "
             "dict, model(batch) for a tensor), and loss_fn(output) makes the loss from what the model returns; "
             "for an (x, y) batch whose y only the loss reads, pass x as sample_batch and "
             "loss_fn=lambda out: criterion(out, y)")

#: What the estimate measured for a torch.compile'd model.
COMPILED_NOTE = ("the model is torch.compile'd: its activations were measured by running its original modules "
                 "(model._orig_mod) eagerly, without compiling; a compiled step saves for backward what the "
                 "compiler's partitioner keeps, usually as much or less, so this is about the most it needs")

def check_call(sample_batch: Any, unexpected: Mapping[str, Any]) -> None:
    """Refuse a call of ``ap.memory_estimate`` with a keyword it does not take (``batch=``, ``input=``) or
    without the sample batch, naming its real signature (:data:`SIGNATURE`)."""
    if unexpected:
        names = ", ".join(f"{name}=" for name in sorted(unexpected))
        raise EstimateUsageError(f"ap.memory_estimate takes no {names} keyword: it is {SIGNATURE}")
    if sample_batch is None:
        raise EstimateUsageError(f"ap.memory_estimate needs the sample batch: it is {SIGNATURE}")


class _LossFnError(Exception):
    """``loss_fn`` raised on the model's output (the model itself ran)."""

    def __init__(self, error: BaseException, output: Any) -> None:
        super().__init__(str(error))
        self.error = error
        self.output = output


class _DtypeMismatch(RuntimeError):
    """An op that raises on every real device for inputs of different dtypes, which the meta device lets by."""


@dataclass(frozen=True)
class MemoryEstimate:
    """What one training step needs per device, measured on the host, and where it fits."""

    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    #: What autograd saved for backward in the forward pass (parameters left out), each storage once.
    activation_bytes: int
    batch_size: int | None
    blocks: int | None
    largest_block_bytes: int
    #: "meta" (shapes only, nothing allocated) or "cpu" (a copy run for real, where an op had no meta kernel).
    ran_on: str
    verdicts: tuple[DeviceVerdict, ...]
    #: For ``device`` (the chip asked about, or this machine's): the fixes, most saved first.
    fixes: tuple[Fix, ...]
    device: str | None
    float32_bytes: int = 0
    #: The model's buffers (registered, persistent or not), each storage once: on every device, whole.
    buffer_bytes: int = 0
    #: Whether the model (or a module in it) is torch.compile'd: its activations are then those of its
    #: original modules run eagerly (see :data:`COMPILED_NOTE`).
    compiled: bool = False

    @property
    def static_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes + self.buffer_bytes

    @property
    def total_bytes(self) -> int:
        return self.static_bytes + self.activation_bytes

    def budget(self, capacity: int | None = None) -> Budget:
        return Budget(self.parameter_bytes, self.gradient_bytes, self.optimizer_state_bytes, self.activation_bytes,
                      capacity, self.batch_size, self.float32_bytes, self.blocks, self.largest_block_bytes,
                      buffer_bytes=self.buffer_bytes)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("verdicts", "fixes")}
        out.update(total_bytes=self.total_bytes, static_bytes=self.static_bytes,
                   verdicts=[v.to_dict() for v in self.verdicts],
                   fixes=[f.to_dict() for f in self.fixes])
        return out

    def __str__(self) -> str:
        batch = f" at batch {self.batch_size}" if self.batch_size else ""
        lines = [f"one training step{batch} needs {human_bytes(self.total_bytes)} per device "
                 f"(measured on {self.ran_on}): {self.budget().describe()}"]
        if self.compiled:
            lines.append(f"  {COMPILED_NOTE}")
        lines += [f"  {v.text()}" for v in self.verdicts]
        if self.fixes:
            lines.append(f"to make room on {self.device}, most saved first:")
            lines += [f"  {i}. {f.text}" for i, f in enumerate(self.fixes, 1)]
        return "\n".join(lines)


def _tensors(batch: Any) -> list[Any]:
    """The tensors inside ``batch`` (nested dicts, lists, tuples), in order."""
    from accelport.tensors import tree_map_tensors

    found: list[Any] = []
    tree_map_tensors(batch, found.append)
    return found


def _check(model: Any, optimizer: Any, batch: Any) -> None:
    import torch

    if not isinstance(model, torch.nn.Module):
        raise EstimateError(f"ap.memory_estimate needs the model (a torch.nn.Module), not {type(model).__name__}")
    if not (hasattr(optimizer, "param_groups") and hasattr(optimizer, "state")):
        raise EstimateError(f"ap.memory_estimate needs the optimizer that trains the model (a "
                            f"torch.optim.Optimizer), not {type(optimizer).__name__}")
    from accelport.sharding import is_sharded

    if is_sharded(model):
        raise EstimateError("ap.memory_estimate takes the model as built, before ap.shard: the estimate says "
                            "what sharding it over N devices would leave on each")
    devices = {t.device.type for t in (*model.parameters(), *model.buffers())}
    away = sorted(devices - {"cpu", "meta"})
    if away:
        raise EstimateError(
            f"ap.memory_estimate runs the step on the host, but the model's tensors are on {', '.join(away)}: "
            "pass the model as built on the cpu, or under `with torch.device('meta'):` (nothing is allocated "
            "there), before .to(ap.device())")
    params = {id(p) for p in model.parameters()}
    stepped = [p for g in optimizer.param_groups for p in g["params"]]
    if not stepped or any(id(p) not in params for p in stepped):
        raise EstimateError("ap.memory_estimate: the optimizer does not step this model's parameters: build it "
                            "from model.parameters() of the model you pass")
    inputs = _tensors(batch)
    if not inputs:
        raise EstimateError(f"ap.memory_estimate needs a sample batch holding tensors (what the model is called "
                            f"with), not {type(batch).__name__}")
    away = sorted({t.device.type for t in inputs} - {"cpu", "meta"})
    if away:
        raise EstimateError(f"ap.memory_estimate: the sample batch is on {', '.join(away)}; pass it as the data "
                            "loader gives it, on the cpu")


def _compiled_wrapper(module: Any) -> bool:
    """Whether ``module`` is what ``torch.compile(module)`` returns (an OptimizedModule around ``_orig_mod``)."""
    import torch

    return type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None),
                                                                     torch.nn.Module)


def is_compiled(model: Any) -> bool:
    """Whether ``model`` or a module in it runs compiled: ``torch.compile(m)`` or ``m.compile()``."""
    return any(_compiled_wrapper(m) or getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


def _copy_to(model: Any, optimizer: Any, device: str) -> tuple[Any, Any]:
    """The model and its optimizer copied onto ``device`` together (the optimizer steps the copy's
    parameters); on "meta" nothing is allocated.

    The copy runs eagerly: each ``torch.compile`` wrapper is copied as the module it wraps, and
    ``m.compile()`` is not copied (``nn.Module`` leaves it out of a copy). Saved-tensor hooks do not
    see what a compiled graph saves for backward, so a compiled copy would measure no activations.
    """
    import torch

    memo: dict[int, Any] = {}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) in memo:
            continue
        if device == "meta":
            new = torch.empty_like(t, device="meta")
        else:
            new = t.detach().clone()
        memo[id(t)] = torch.nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(
            t, torch.nn.Parameter) else new
    if device == "meta":  # state the optimizer has already (a resumed run): its shapes, not its values
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    memo[id(value)] = torch.empty_like(value, device="meta")
    for module in reversed(list(model.modules())):  # the innermost first: a wrapper inside a wrapped module
        if _compiled_wrapper(module):
            memo[id(module)] = copy.deepcopy(module._orig_mod, memo)
    copied_model, copied_optimizer = copy.deepcopy((model, optimizer), memo)
    for module in copied_model.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None
    return copied_model, copied_optimizer


def _call(model: Any, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(*batch)
    return model(batch)


def _default_loss(output: Any) -> Any:
    outs = [t for t in _tensors(output) if t.is_floating_point() and t.requires_grad]
    if not outs:
        raise EstimateError("ap.memory_estimate: the model's output holds no floating tensor that needs a "
                            "gradient, so there is no backward pass to measure; pass loss_fn=(output -> loss)")
    total = outs[0].float().sum()
    for t in outs[1:]:
        total = total + t.float().sum()
    return total


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _shapes(batch: Any) -> str:
    return ", ".join(f"{tuple(t.shape)} {_dtype_name(t.dtype)}" for t in _tensors(batch)[:4])


def _what(output: Any) -> str:
    """What the model returned, in a few words: ``a tensor (32, 10) float32``, ``a dict``."""
    import torch

    if isinstance(output, torch.Tensor):
        return f"a tensor {tuple(output.shape)} {_dtype_name(output.dtype)}"
    if isinstance(output, Mapping):
        keys = ", ".join(repr(k) for k in list(output)[:6])
        return f"a {type(output).__name__} with keys {keys}"
    return f"a {type(output).__name__}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _autocasting() -> bool:
    """Whether autocast is on for any device type (the meta device does not cast: its dtypes are then not the
    real step's)."""
    import torch

    for device_type in ("cpu", "cuda", "xla", "xpu", "hpu", "mps"):
        try:
            if torch.is_autocast_enabled(device_type):
                return True
        except (RuntimeError, TypeError):  # a device type this torch does not know
            continue
    return False


def _dtype_guard() -> Any:
    """A dispatch mode for the step on the meta device that raises :class:`_DtypeMismatch` where every real
    device's kernel raises and the meta kernel does not: a matrix product of tensors of different dtypes (a
    float16 model called with a float32 batch), a layer norm whose weights are of another dtype than its
    input (but float32 weights on a float16 or bfloat16 input, which the kernels take). Off under autocast."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    products = {aten.mm, aten.addmm, aten.mv, aten.addmv, aten.bmm, aten.baddbmm, aten.dot}
    low = {torch.float16, torch.bfloat16}

    class DtypeGuard(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            packet = func.overloadpacket
            if packet in products and func._overloadname == "default" and not _autocasting():
                dtypes = list(dict.fromkeys(a.dtype for a in args if isinstance(a, torch.Tensor)))
                if len(dtypes) > 1:
                    raise _DtypeMismatch(f"{packet.__name__}: the tensors multiplied must have one dtype, but got "
                                         f"{' and '.join(_dtype_name(d) for d in dtypes)}")
            elif packet is aten.native_layer_norm and not _autocasting():
                x, params = args[0], [a for a in args[2:4] if isinstance(a, torch.Tensor)]
                odd = [p.dtype for p in params if p.dtype != x.dtype and not (p.dtype == torch.float32
                                                                               and x.dtype in low)]
                if odd:
                    raise _DtypeMismatch(f"layer_norm: a {_dtype_name(x.dtype)} input with {_dtype_name(odd[0])} "
                                         "weights")
            return func(*args, **(kwargs or {}))

    return DtypeGuard()


def _dtype_hint(model: Any, batch: Any) -> str:
    """Where the batch's floating tensors are of a dtype none of the model's parameters has: what to change."""
    have = {p.dtype for p in model.parameters() if p.is_floating_point()}
    given = {t.dtype for t in _tensors(batch) if t.is_floating_point()}
    if not have or not given or given & have:
        return ""
    want = _dtype_name(next(iter(have)))
    return (f" The batch is {', '.join(sorted(_dtype_name(d) for d in given))} and the model's parameters "
            f"{', '.join(sorted(_dtype_name(d) for d in have))}: pass the batch in the dtype the training loop "
            f"gives the model (x.to(torch.{want})), or run the step under torch.autocast.")


def _cannot_run(error: BaseException, model: Any, batch: Any, on_meta: bool) -> EstimateError:
    """The error for a step that raised: in loss_fn, at a dtype mismatch, or in the model."""
    if isinstance(error, _LossFnError):
        where = (" on the meta device, where tensors hold shapes and no values (a loss_fn that reads values "
                 "cannot run there: pass the model as built on the cpu)") if on_meta else ""
        return EstimateError(
            f"ap.memory_estimate: the model cannot run one step: the model ran, but loss_fn raised on its output "
            f"({_what(error.output)}){where}: {_first_line(error.error)}. loss_fn(output) gets what the model "
            "returns and returns the loss (one number); fix loss_fn for that output")
    hint = _dtype_hint(model, batch)
    if isinstance(error, _DtypeMismatch):
        return EstimateError(
            f"ap.memory_estimate: the step raises on a real device, so it is not estimated: dtype mismatch in "
            f"{error}.{hint or ' Give every input of an op one dtype.'}")
    what = ("the step did not run on the meta device with this batch" if on_meta
            else "the model cannot run one step on this sample batch")
    fix = hint or (" Pass one batch exactly as the training loop gives it to the model (model(*batch) for a "
                   "tuple, model(**batch) for a dict), and loss_fn where the model's output is not the loss")
    return EstimateError(f"ap.memory_estimate: {what} ({_shapes(batch)}): {type(error).__name__}: {error}.{fix}")


def _run(model: Any, optimizer: Any, batch: Any, device: str, loss_fn: Callable[[Any], Any] | None
         ) -> dict[str, int]:
    """One step of a copy on ``device``: the saved activations and the static part after the update."""
    import torch

    from accelport.observe.memory import SavedActivations
    from accelport.sharding import local_nbytes, memory_of
    from accelport.tensors import tree_map_tensors

    copy_model, copy_opt = _copy_to(model, optimizer, device)
    copy_model.train(model.training)
    inputs = tree_map_tensors(batch, lambda t: t.to(device))
    guard = _dtype_guard() if device == "meta" else contextlib.nullcontext()
    # The buffers are counted on their own line: one a step saves for backward (x * self.mask) is held anyway.
    with SavedActivations(exclude=[*copy_model.parameters(), *copy_model.buffers()]) as saved, guard:
        output = _call(copy_model, inputs)
        if loss_fn is None:
            loss = _default_loss(output)
        else:
            try:
                loss = loss_fn(output)
            except EstimateError:
                raise
            except Exception as exc:  # noqa: BLE001 - said as loss_fn's, with its first line
                raise _LossFnError(exc, output) from exc
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise EstimateError("ap.memory_estimate: loss_fn must return the loss, one number (a tensor of one "
                            f"element), not {type(loss).__name__}")
    loss.backward()
    copy_opt.step()
    counted = memory_of([copy_model], [copy_opt])
    counted["activation_bytes"] = saved.bytes
    counted["buffer_bytes"] = sum(local_nbytes(b) for b in copy_model.buffers())
    counted["blocks"], counted["largest_block_bytes"] = blocks_of(copy_model)  # type: ignore[assignment]
    return counted


def estimate(model: Any, optimizer: Any, sample_batch: Any, *, loss_fn: Callable[[Any], Any] | None = None,
             chip: str | None = None, matrix: Matrix | None = None, machine_chip: str | None = None,
             host_bytes: int | None = None) -> MemoryEstimate:
    """``ap.memory_estimate``: run one training step of a copy of ``model`` and ``optimizer`` on the meta
    device (or, where an op has no meta kernel and the model is on the cpu, on a cpu copy) with
    ``sample_batch``, and say what it needs per device and where it fits.

    ``chip`` picks the device the fixes are for (a matrix chip name: "v5e", "trn2"); by default
    ``machine_chip`` (the detected one), else none. Verdicts cover every chip the matrix has HBM figures
    for, and the host (``host_bytes``). The model and optimizer passed are never changed.

    The model's buffers count on their own line, whole on every device (ap.shard splits parameters,
    gradients and optimizer state only). A torch.compile'd model is measured by running its original
    modules eagerly (:data:`COMPILED_NOTE`). A step that would raise on a real device (loss_fn raising,
    a dtype mismatch the meta device lets by) raises :class:`EstimateError` saying so.
    """
    from accelport.compat.machine import chip_name, parse_chip

    _check(model, optimizer, sample_batch)
    chosen = parse_chip(chip) if chip is not None else chip_name(machine_chip)
    on_meta = any(p.device.type == "meta" for p in model.parameters())
    try:
        counted, ran_on = _run(model, optimizer, sample_batch, "meta", loss_fn), "meta"
    except EstimateError:
        raise
    except Exception as meta_error:
        size = sum(p.numel() * p.element_size() for p in (*model.parameters(), *model.buffers()))
        if on_meta or (host_bytes is not None and 4 * size > host_bytes):
            raise _cannot_run(meta_error, model, sample_batch, on_meta=True) from meta_error
        # An op without a meta kernel (or .item()), or a dtype mismatch the meta device does not check (the
        # cpu's kernels say it in their own words): a real step on a cpu copy.
        try:
            counted, ran_on = _run(model, optimizer, sample_batch, "cpu", loss_fn), "cpu"
        except EstimateError:
            raise
        except Exception as exc:
            raise _cannot_run(exc, model, sample_batch, on_meta=False) from exc
    first = _tensors(sample_batch)[0]
    batch = int(first.shape[0]) if first.dim() > 0 else None
    float32 = counted["float32_bytes"]
    budget = Budget(counted["parameter_bytes"], counted["gradient_bytes"], counted["optimizer_state_bytes"],
                    counted["activation_bytes"], None, batch, float32, counted["blocks"] or None,
                    counted["largest_block_bytes"], buffer_bytes=counted["buffer_bytes"])
    verdicts: list[DeviceVerdict] = []
    chosen_capacity = None
    if matrix is not None:
        for fact in matrix.chips.values():
            verdicts.append(verdict_for(budget, fact.name, fact.title, fact.device_bytes, fact.devices))
            if fact.name == chosen:
                chosen_capacity = fact.device_bytes
    if host_bytes:
        verdicts.append(verdict_for(budget, "host", "the host", host_bytes))
    with_capacity = replace(budget, capacity_bytes=chosen_capacity)
    # Fixes only where the step does not fit one device of the chip asked about.
    needed = chosen_capacity is not None and budget.total_bytes > chosen_capacity * USABLE
    return MemoryEstimate(
        counted["parameter_bytes"], counted["gradient_bytes"], counted["optimizer_state_bytes"],
        counted["activation_bytes"], batch, budget.blocks, budget.largest_block_bytes, ran_on, tuple(verdicts),
        tuple(fixes(with_capacity)) if needed else (), chosen if chosen_capacity else None, float32,
        counted["buffer_bytes"], is_compiled(model))
