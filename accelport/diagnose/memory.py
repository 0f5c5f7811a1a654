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

import copy
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from accelport.diagnose import advice
from accelport.errors import AccelportError

if TYPE_CHECKING:
    from accelport.compat.load import Matrix

__all__ = ["USABLE", "Budget", "Fix", "fixes", "human_bytes", "chip_capacity", "DeviceVerdict", "MemoryEstimate",
           "EstimateError", "estimate", "verdict_for", "blocks_of"]

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

    @property
    def static_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes

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
    if b.static_bytes <= 0:
        return None
    have = b.world_size if b.sharded else 1  # the static figures are already per device over these

    def static_over(n: int) -> int:
        return math.ceil(b.static_bytes * have / n) + (b.largest_block_bytes if n > 1 else 0)

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
    gathered = (f" (with the largest block's {human_bytes(b.largest_block_bytes)} of parameters gathered while "
                "it runs)") if b.largest_block_bytes else ""
    fits = ""
    if usable is not None and b.activation_bytes is not None:
        fits = "; then it fits" if after + activation <= usable else "; not enough alone"
    return Fix("shard", saves, after + activation, (
        f"{advice.shard_model(style, n)}: parameters, gradients and optimizer state take "
        f"{human_bytes(after)} per device{gathered} instead of {human_bytes(b.static_bytes)}, saving "
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
            said = (f"does not fit {self.title} devices ({cap} each) at this batch, even with ap.shard over "
                    f"{MAX_DEVICES}: the activations alone need more")
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
        per = math.ceil(b.static_bytes / n) + b.largest_block_bytes + activation
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
        return DeviceVerdict(device, title, capacity, found[0], found[1], devices_per_chip)
    checkpointed = None
    if b.blocks and b.blocks >= 2 and activation:
        with_checkpoints = _fewest(b, usable, math.ceil(activation / b.blocks))
        checkpointed = with_checkpoints[0] if with_checkpoints is not None else None
    return DeviceVerdict(device, title, capacity, None, b.total_bytes, devices_per_chip, checkpointed, b.blocks)


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

    @property
    def static_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes

    @property
    def total_bytes(self) -> int:
        return self.static_bytes + self.activation_bytes

    def budget(self, capacity: int | None = None) -> Budget:
        return Budget(self.parameter_bytes, self.gradient_bytes, self.optimizer_state_bytes, self.activation_bytes,
                      capacity, self.batch_size, self.float32_bytes, self.blocks, self.largest_block_bytes)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("verdicts", "fixes")}
        out.update(total_bytes=self.total_bytes, verdicts=[v.to_dict() for v in self.verdicts],
                   fixes=[f.to_dict() for f in self.fixes])
        return out

    def __str__(self) -> str:
        batch = f" at batch {self.batch_size}" if self.batch_size else ""
        lines = [f"one training step{batch} needs {human_bytes(self.total_bytes)} per device "
                 f"(measured on {self.ran_on}): {self.budget().describe()}"]
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


def _copy_to(model: Any, optimizer: Any, device: str) -> tuple[Any, Any]:
    """The model and its optimizer copied onto ``device`` together (the optimizer steps the copy's
    parameters); on "meta" nothing is allocated."""
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
    return copy.deepcopy((model, optimizer), memo)


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


def _shapes(batch: Any) -> str:
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in _tensors(batch)[:4])


def _run(model: Any, optimizer: Any, batch: Any, device: str, loss_fn: Callable[[Any], Any] | None
         ) -> dict[str, int]:
    """One step of a copy on ``device``: the saved activations and the static part after the update."""
    import torch

    from accelport.observe.memory import SavedActivations
    from accelport.sharding import memory_of
    from accelport.tensors import tree_map_tensors

    copy_model, copy_opt = _copy_to(model, optimizer, device)
    copy_model.train(model.training)
    inputs = tree_map_tensors(batch, lambda t: t.to(device))
    with SavedActivations(exclude=list(copy_model.parameters())) as saved:
        output = _call(copy_model, inputs)
        loss = (loss_fn or _default_loss)(output)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise EstimateError("ap.memory_estimate: loss_fn must return the loss, one number (a tensor of one "
                            f"element), not {type(loss).__name__}")
    loss.backward()
    copy_opt.step()
    counted = memory_of([copy_model], [copy_opt])
    counted["activation_bytes"] = saved.bytes
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
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        if on_meta or (host_bytes is not None and 4 * size > host_bytes):
            raise EstimateError(
                f"ap.memory_estimate: the step did not run on the meta device with this batch "
                f"({_shapes(sample_batch)}): {type(meta_error).__name__}: {meta_error}. Pass one batch exactly "
                "as the training loop gives it to the model (model(*batch) for a tuple, model(**batch) for a "
                "dict), and loss_fn where the model's output is not the loss") from meta_error
        try:  # an op without a meta kernel (or .item()): a real step on a cpu copy
            counted, ran_on = _run(model, optimizer, sample_batch, "cpu", loss_fn), "cpu"
        except EstimateError:
            raise
        except Exception as exc:
            raise EstimateError(
                f"ap.memory_estimate: the model cannot run one step on this sample batch ({_shapes(sample_batch)}): "
                f"{type(exc).__name__}: {exc}. Pass one batch exactly as the training loop gives it to the model "
                "(model(*batch) for a tuple, model(**batch) for a dict), and loss_fn where the model's output is "
                "not the loss") from exc
    first = _tensors(sample_batch)[0]
    batch = int(first.shape[0]) if first.dim() > 0 else None
    float32 = counted["float32_bytes"]
    budget = Budget(counted["parameter_bytes"], counted["gradient_bytes"], counted["optimizer_state_bytes"],
                    counted["activation_bytes"], None, batch, float32, counted["blocks"] or None,
                    counted["largest_block_bytes"])
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
        tuple(fixes(with_capacity)) if needed else (), chosen if chosen_capacity else None, float32)
