"""Memory: what the device holds, how much there is, what an out-of-memory error said, and what keeps it.

What is measured here, never judged (the rules ``memory-growth`` and ``out-of-memory`` judge it):

- the device's memory at the steps whose counters are read (``Backend.memory_reading``: the
  allocator's bytes in use and its peak, where the runtime keeps them; the process's resident
  memory where the host is the device), and its capacity;
- the static part of a step's memory, counted from the tensors themselves (dtype and shape, a
  DTensor by its local shard: :func:`accelport.sharding.memory_of`): the parameters, their
  gradients and the optimizers' state, at steps 1 to 3 and every :data:`BUDGET_EVERY` steps, so an
  out-of-memory error is explained by the budget of the last good step, without touching a tensor
  of the step that failed (on XLA that can crash the process);
- an out-of-memory error, recognised by its vendor's exception type and message
  (:data:`SIGNATURES`, one place, each with its source), with what the failing allocation asked for
  when the message says it;
- on request (a rule that sees memory grow), the script's own variables that hold more tensors
  with an autograd graph at one step than at the step before (``losses.append(loss)``, a running
  ``total += loss``): looked for in the frames of the training loop at two step ends.

Nothing here imports torch at module level, and nothing waits for the device.
"""

from __future__ import annotations

import os
import re
import sys
import types
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from accelport.heap import live_instances
from accelport.sharding import is_dtensor, memory_of

__all__ = ["MemoryWatch", "OutOfMemory", "Signature", "SIGNATURES", "KeptGraph", "SavedActivations",
           "out_of_memory", "parse_size", "process_memory", "host_capacity", "watch_uncaught",
           "BUDGET_EVERY"]

#: After steps 1 to 3 (the optimizer's state appears at its first step), the static part is counted
#: every this many steps: the parameters, gradients and state rarely change size (and ap.metrics()
#: counts afresh).
BUDGET_EVERY = 200
#: A kept-graph search looks at this many of the user's innermost frames, and at most this many
#: elements of a container or nodes of an autograd graph.
SEARCH_FRAMES = 4
SEARCH_ITEMS = 20_000
GRAPH_NODES = 2_000


# -- sizes --------------------------------------------------------------------------------------

_UNITS = {"": 1, "B": 1, "BYTES": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_SIZE = re.compile(r"^\s*([\d.]+)\s*([KMGTP]?)(I?B|BYTES)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int | None:
    """Bytes of a size as runtimes print it: ``3.15 GiB``, ``180.59M``, ``4.000GB``, ``6400000000``.

    Every unit is binary, as the runtimes that print them count (CUDA's ``format_size`` divides by
    1024; XLA's sizes and the Neuron runtime's are of the same kind); None if it is no size.
    """
    m = _SIZE.match(text or "")
    if m is None:
        return None
    try:
        value = float(m.group(1))
    except ValueError:
        return None
    return int(value * _UNITS[m.group(2).upper()])


# -- out of memory -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Signature:
    """How one vendor's out-of-memory error looks: its exception types and its message, and where that is from.

    ``pattern`` may name the groups ``requested`` (what the failing allocation asked for) and
    ``capacity`` (the device's total, where the message says it).
    """

    vendor: str
    #: Qualified names of the exception classes (any class in the error's MRO matches).
    types: tuple[str, ...]
    pattern: re.Pattern[str]
    source: str
    #: False where the text comes from a runtime's strings or logs, not a raised error seen in a source.
    established: bool = True


#: Every out-of-memory error accelport recognises, the more specific first (the first match wins). Keep this the
#: one list.
SIGNATURES: tuple[Signature, ...] = (
    Signature("cuda", ("torch.OutOfMemoryError",), re.compile(
        r"CUDA out of memory\. Tried to allocate (?P<requested>[\d.]+ (?:bytes|KiB|MiB|GiB))"
        r"(?:\. GPU \d+ has a total capacity of (?P<capacity>[\d.]+ (?:bytes|KiB|MiB|GiB)))?"),
        "pytorch/pytorch c10/cuda/CUDACachingAllocator.cpp: TORCH_CHECK_WITH(OutOfMemoryError, ..., \"CUDA out "
        "of memory. Tried to allocate \", format_size(alloc_size), \". GPU \", device, \" has a total capacity "
        "of \", format_size(device_total), ...) (format_size: bytes, KiB, MiB, GiB); torch.OutOfMemoryError is "
        "torch.cuda.OutOfMemoryError, a RuntimeError"),
    Signature("xla", ("builtins.ValueError", "builtins.RuntimeError"), re.compile(
        r"Ran out of memory in memory space \w+\. Used (?P<requested>[\d.]+[KMGT]?) of "
        r"(?P<capacity>[\d.]+[KMGT]?) \w+"),
        "XLA's compiler on TPU: \"RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
        "space hbm. Used 21.95G of 15.48G hbm. Exceeded hbm capacity by 6.47G.\" (pytorch/xla#3532, #9524); "
        "torch_xla 2.9 raises compile failures as ValueError (torch_xla/csrc/runtime/util.h "
        "RaisePythonValueErrorOnFailure), other status errors as RuntimeError"),
    Signature("xla", ("builtins.RuntimeError", "builtins.ValueError"), re.compile(
        r"Attempting to (?:allocate|reserve) (?P<requested>[\d.]+[KMGT]?)\b"),
        "XLA's TPU runtime: \"Resource exhausted: Attempting to allocate 180.59M. That was not possible. There are "
        "142.58M free.\" (pytorch/xla#2569), \"RESOURCE_EXHAUSTED: Attempting to reserve 10.51G at the bottom of "
        "memory.\" (huggingface/transformers#22328)"),
    Signature("xla", ("builtins.RuntimeError", "builtins.ValueError"), re.compile(
        r"Out of memory allocating (?P<requested>\d+) bytes"),
        "XLA:CPU, torch_xla 2.9: \"Error preparing computation: Out of memory allocating 4503599761588224 bytes.\" "
        "(test/test_ops_error_message.py) and, under an address-space limit, \"Out of memory allocating "
        "6400000000 bytes.\" at the next blocking point after the sync: both reproduced here"),
    Signature("tpu", ("builtins.RuntimeError",), re.compile(
        r"ran out of memory while awaiting the materialization"),
        "TorchTPU 0.2.0 (torch-tpu wheel): the string \"the TPU ran out of memory while awaiting the "
        "materialization of value \" in libpywrap_2_13_0_common.so (TranslateXlaTensorOomError); the exception "
        "type (RuntimeError) and the rest of the message are not established", established=False),
    Signature("neuron", ("builtins.RuntimeError",), re.compile(
        r"Failed to allocate (?P<requested>[\d.]+ ?[KMGT]?i?B) \(alignment: [\w-]+, usage: [\w ]+\)"),
        "the Neuron runtime's out-of-memory line, \"Failed to allocate 4.000GB (alignment: none, usage: "
        "tensors) on ND 0:NC 4\" (aws-neuron-sdk neuron-runtime/explore/device-memory.rst); it is the "
        "runtime's log text: the exception torch-neuronx raises with it is not established", established=False),
    Signature("neuron", ("builtins.RuntimeError",), re.compile(r"\bNRT_RESOURCE\b"),
              "NRT_RESOURCE (4), \"Failed to allocate a resource for requested operation\" (aws-neuron-sdk "
              "neuron-runtime/api/nrt_status.rst); how torch-neuronx words it is not established",
              established=False),
    Signature("xla", ("builtins.RuntimeError", "builtins.ValueError"), re.compile(r"RESOURCE_EXHAUSTED"),
              "the status code of every XLA out-of-memory error (\"Bad StatusOr access: RESOURCE_EXHAUSTED\", "
              "pytorch/xla#7827)"),
    Signature("cpu", ("builtins.RuntimeError",), re.compile(
        r"DefaultCPUAllocator: can't allocate memory: you tried to allocate (?P<requested>\d+) bytes"),
        "pytorch/pytorch c10/core/impl/alloc_cpu.cpp: \"[enforce fail at alloc_cpu.cpp:127] err == 0. "
        "DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes. Error code 12 (Cannot "
        "allocate memory)\" (RuntimeError), reproduced here with torch 2.13"),
    Signature("cpu", ("builtins.MemoryError",), re.compile(r""), "Python's own MemoryError"),
)


@dataclass(frozen=True)
class OutOfMemory:
    """An out-of-memory error as it was raised: whose, what it asked for, and its first line."""

    vendor: str
    error: str  # the exception's qualified type name
    message: str  # its message, cut to its first line and 300 characters
    requested_bytes: int | None
    capacity_bytes: int | None
    source: str
    established: bool
    #: The step that raised it (the one after the last finished step), set by the step tracker.
    step: int = 0
    #: "file:line" of the script's innermost frame in the error's traceback (None where none is the script's).
    site: str | None = None

    @property
    def host(self) -> bool:
        """The host's memory ran out (a CPU allocation), not a device's."""
        return self.vendor == "cpu"


def _type_names(exc: BaseException) -> set[str]:
    return {f"{cls.__module__}.{cls.__qualname__}" for cls in type(exc).__mro__}


def _raised_at(exc: BaseException) -> str | None:
    """"file:line" of the innermost frame of ``exc``'s traceback outside torch, accelport and the libraries."""
    from accelport.observe.frames import library_file

    tb, site = exc.__traceback__, None
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not filename.startswith("<") and not library_file(filename):
            site = f"{filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return site


def out_of_memory(exc: BaseException) -> OutOfMemory | None:
    """What ``exc`` says if it is an out-of-memory error of a runtime in :data:`SIGNATURES`, else None.

    Only the exception's type and text are read (never a tensor).
    """
    names = _type_names(exc)
    try:
        text = str(exc)
    except Exception:  # a broken __str__: not ours to explain
        return None
    for sig in SIGNATURES:
        if names.isdisjoint(sig.types):
            continue
        m = sig.pattern.search(text)
        if m is None:
            continue
        groups = m.groupdict()
        first = text.strip().splitlines()[0] if text.strip() else ""
        return OutOfMemory(
            vendor=sig.vendor, error=f"{type(exc).__module__}.{type(exc).__qualname__}".replace("builtins.", ""),
            message=first[:300], requested_bytes=parse_size(groups.get("requested") or ""),
            capacity_bytes=parse_size(groups.get("capacity") or ""), source=sig.source,
            established=sig.established)
    return None


# -- the host's memory ----------------------------------------------------------------------------

_STATM: list[tuple[int, int]] = []  # (pid, descriptor of /proc/self/statm) of the process that opened it
_CAPACITY: list[int | None] = []


def _statm() -> int | None:
    pid = os.getpid()
    if _STATM and _STATM[0][0] == pid:
        return _STATM[0][1]
    try:  # /proc/self is resolved at open: a forked child opens its own
        fd = os.open("/proc/self/statm", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    _STATM[:] = [(pid, fd)]
    return fd


def process_memory() -> dict[str, int]:
    """The process's resident memory (``memory_bytes``) and the host's memory (``capacity_bytes``), with
    ``resident`` = 1; {} where /proc cannot say (not Linux). About 5 microseconds: a descriptor kept open is
    read again. (Not ``getrusage``'s high-water mark: in a process with many threads, torch's, it costs
    hundreds of microseconds; the sensor keeps the highest reading instead.)"""
    fd = _statm()
    if fd is None:
        return {}
    try:
        resident = int(os.pread(fd, 128, 0).split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return {}
    out = {"memory_bytes": resident, "resident": 1}
    capacity = host_capacity()
    if capacity:
        out["capacity_bytes"] = capacity
    return out


def _read_number(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def host_capacity(root: str = "/") -> int | None:
    """The memory this process may use on the host: MemTotal, or a lower cgroup limit (v2 ``memory.max``,
    v1 ``memory.limit_in_bytes``). Read once per process for the real root."""
    if root == "/" and _CAPACITY:
        return _CAPACITY[0]
    total = None
    try:
        with open(os.path.join(root, "proc/meminfo"), encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        total = None
    for limit_file in ("sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory/memory.limit_in_bytes"):
        limit = _read_number(os.path.join(root, limit_file))
        if limit and (total is None or limit < total):
            total = limit
    if root == "/":
        _CAPACITY[:] = [total]
    return total


# -- what keeps memory: tensors with an autograd graph in the script's variables -------------------


@dataclass(frozen=True)
class KeptGraph:
    """A variable of the script that held more tensors with an autograd graph at one step end than at the one before."""

    name: str  # "losses", "self.history", "total"
    where: str  # "train.py, main()"
    kind: str  # "container": tensors kept in it; "graph": one tensor whose graph grew (a running sum)
    before: int  # tensors with a graph in it (container) or nodes of its graph, at the first look
    after: int  # the same at the second look, one step later
    steps: tuple[int, int]  # the steps of the two looks

    def describe(self) -> str:
        if self.kind == "container":
            return (f"{self.name} ({self.where}) holds {self.after} tensors that carry their autograd graph, "
                    f"{self.after - self.before} more at step {self.steps[1]} than at step {self.steps[0]}")
        return (f"{self.name} ({self.where}) is a tensor whose autograd graph grew from {self.before} to "
                f"{self.after} nodes between steps {self.steps[0]} and {self.steps[1]}: a running sum of "
                "tensors that carry their graphs")


def _has_graph(x: Any, tensor: Any) -> bool:
    return isinstance(x, tensor) and x.grad_fn is not None


def _graph_nodes(t: Any) -> int:
    """Nodes of ``t``'s autograd graph, up to GRAPH_NODES."""
    seen: set[int] = set()
    stack = [t.grad_fn]
    while stack and len(seen) < GRAPH_NODES:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        try:
            stack.extend(n for n, _ in node.next_functions)
        except (AttributeError, RuntimeError):
            continue
    return len(seen)


def _measure(value: Any, tensor: Any) -> tuple[str, int] | None:
    """("graph", nodes) for a tensor with a graph, ("container", tensors with a graph) for a list, tuple,
    deque, set or dict holding some; None for anything else."""
    if isinstance(value, tensor):
        return ("graph", _graph_nodes(value)) if value.grad_fn is not None else None
    if isinstance(value, Mapping):
        items: Iterable[Any] = value.values()
    elif isinstance(value, (list, tuple, set, frozenset)) or type(value).__name__ == "deque":
        items = value
    else:
        return None
    count = 0
    for i, item in enumerate(items):
        if i >= SEARCH_ITEMS:
            break
        if _has_graph(item, tensor):
            count += 1
    return ("container", count) if count else None


def _user_frames(frame: types.FrameType | None) -> list[types.FrameType]:
    from accelport.observe.frames import LIBRARIES

    found: list[types.FrameType] = []
    while frame is not None and len(found) < SEARCH_FRAMES:
        module = frame.f_globals.get("__name__") or ""
        if module.partition(".")[0] not in LIBRARIES and not frame.f_code.co_filename.startswith("<frozen "):
            found.append(frame)
        frame = frame.f_back
    return found


def _places(frame: types.FrameType | None) -> dict[tuple[str, str], tuple[str, int]]:
    """(name, where) -> (kind, size) for every variable of the training loop's frames that holds tensors with
    an autograd graph: its locals (and one level of ``self``'s attributes), and its module's globals."""
    import torch

    tensor = torch.Tensor
    out: dict[tuple[str, str], tuple[str, int]] = {}
    seen: set[int] = set()
    for f in _user_frames(frame):
        where = f"{os.path.basename(f.f_code.co_filename)}, " + (
            "at module level" if f.f_code.co_name == "<module>" else f"{f.f_code.co_name}()")
        variables = [(name, value) for name, value in f.f_locals.items()]
        owner = f.f_locals.get("self")
        if owner is not None and hasattr(owner, "__dict__") and not isinstance(owner, torch.nn.Module):
            variables += [(f"self.{name}", value) for name, value in vars(owner).items()]
        if f.f_globals is not f.f_locals:
            variables += [(name, value) for name, value in f.f_globals.items()]
        for name, value in variables:
            if id(value) in seen or name.startswith("__"):
                continue
            seen.add(id(value))
            measured = _measure(value, tensor)
            if measured is not None:
                out[(name, where)] = measured
    return out


@dataclass
class _Search:
    """Looks at the training loop's variables at two step ends, one step apart."""

    first: dict[tuple[str, str], tuple[str, int]] | None = None
    first_step: int = 0


# -- saved activations (ap.memory_estimate) ----------------------------------------------------------


class SavedActivations:
    """Counts the bytes autograd saves for backward while it is active (``with SavedActivations() as saved:``):
    each storage once, the tensors in ``exclude`` (the parameters) left out; ``saved.bytes`` after.

    Through ``torch.autograd.graph.saved_tensors_hooks``, which hands each tensor back unchanged. Meta
    tensors count by dtype and shape like any other.
    """

    def __init__(self, exclude: Iterable[Any] = ()) -> None:
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._exclude = {self._key(t) for t in exclude}
        self._sizes: dict[int, int] = {}

    @staticmethod
    def _key(t: Any) -> int:
        return int(t.untyped_storage()._cdata)

    def _pack(self, t: Any) -> Any:
        try:
            key = self._key(t)
            if key not in self._exclude:
                self._sizes[key] = max(self._sizes.get(key, 0), int(t.untyped_storage().nbytes()))
        except (RuntimeError, NotImplementedError, AttributeError):  # a tensor without a plain storage
            self._sizes[id(t)] = int(t.numel()) * t.element_size()
        return t

    @staticmethod
    def _unpack(t: Any) -> Any:
        return t

    @property
    def bytes(self) -> int:
        return sum(self._sizes.values())

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


# -- the sensor ----------------------------------------------------------------------------------------


@dataclass
class _Reading:
    step: int
    values: dict[str, int] = field(default_factory=dict)


class MemoryWatch:
    """The run's memory: read with the step counters, the static part counted at sampled steps, an
    out-of-memory error recognised, and (asked by a rule) what in the script keeps autograd graphs.

    ``capacity_bytes``: the device's capacity where the backend's reading does not say it (the HBM per
    device of the machine's chip, from the compatibility matrix), with ``capacity_source`` naming it.
    """

    def __init__(self, backend: Any, capacity_bytes: int | None = None, capacity_source: str | None = None) -> None:
        self._backend = backend
        self._optimizers: list[weakref.ReferenceType[Any]] = []
        self._last_optimizer: Any = None
        self._next_budget = 1
        self._broken = False
        self._fallback_capacity = capacity_bytes
        #: Where the capacity comes from: "the backend's reading" or what the runtime said (a chip's HBM).
        self.capacity_source = capacity_source
        #: The static part at the last step it was counted (parameter_bytes, gradient_bytes,
        #: optimizer_state_bytes, float32_bytes), and that step.
        self.budget: dict[str, int] = {}
        self.budget_step = 0
        #: The last reading (step and figures), the highest in-use or peak figure read, and the largest
        #: activation figure (a step's peak less the static part, where the reading has a device peak).
        self.last: _Reading | None = None
        self.peak: int | None = None
        self.activation: int | None = None
        #: Whether the figures are the process's resident memory (the host is the device).
        self.resident = False
        #: The out-of-memory error a step raised (the first), once recognised.
        self.oom: OutOfMemory | None = None
        #: The variables found keeping autograd graphs (a search asked for by a rule): None until one
        #: finished; an empty tuple when it found none.
        self.kept: tuple[KeptGraph, ...] | None = None
        self._search: _Search | None = None
        #: Whether the parameters stepped are sharded (DTensors): the figures are this rank's share.
        self.sharded = False

    # -- each step ---------------------------------------------------------------------------------
    def step_end(self, step: int, optimizer: Any) -> None:
        """An optimizer step ended (called on the training loop's own stack)."""
        if optimizer is not None and optimizer is not self._last_optimizer:
            self._last_optimizer = optimizer
            if all(ref() is not optimizer for ref in self._optimizers):
                self._optimizers.append(weakref.ref(optimizer))
        if step >= self._next_budget:
            self.count(step)
        if self._search is not None:
            self._look(step)

    def optimizers(self) -> list[Any]:
        return [o for o in (ref() for ref in self._optimizers) if o is not None]

    def count(self, step: int) -> dict[str, int]:
        """Count the static part now (from dtype and shape, never a value); the next count is scheduled."""
        registry = getattr(self._backend, "shard_registry", None)
        models = list(registry.models) if registry is not None else []
        optimizers = self.optimizers()
        self.budget = memory_of(models, optimizers)
        self.budget_step = step
        self.sharded = any(is_dtensor(g["params"][0]) for o in optimizers for g in o.param_groups if g["params"])
        self._next_budget = step + 1 if step < 3 else step + BUDGET_EVERY
        return self.budget

    def read(self, step: int) -> dict[str, int] | None:
        """The device's memory now, for the record of ``step`` (the tracker calls it with the counters)."""
        if self._broken:
            return None
        try:
            values = dict(self._backend.memory_reading())
        except Exception:  # a backend's reading that fails once is not asked again
            self._broken = True
            return None
        if not values and not self.budget:
            return None
        self.resident = bool(values.get("resident", 0))
        if "capacity_bytes" not in values and self._fallback_capacity:
            values["capacity_bytes"] = self._fallback_capacity
        highest = max((values.get(k, 0) for k in ("memory_bytes", "peak_memory_bytes")), default=0)
        if highest:
            self.peak = max(self.peak or 0, highest)
        static = self.static_bytes
        if not self.resident and "peak_memory_bytes" in values and static is not None:
            activation = max(values["peak_memory_bytes"] - static, 0)
            values["activation_bytes"] = activation
            self.activation = max(self.activation or 0, activation)
        values.update({k: v for k, v in self.budget.items() if k != "float32_bytes"})
        self.last = _Reading(step, values)
        return values

    @property
    def static_bytes(self) -> int | None:
        """Parameters, gradients and optimizer state at the last count (None before the first)."""
        if not self.budget:
            return None
        return self.budget["parameter_bytes"] + self.budget["gradient_bytes"] + self.budget["optimizer_state_bytes"]

    @property
    def capacity_bytes(self) -> int | None:
        last = self.last.values.get("capacity_bytes") if self.last is not None else None
        return last or self._fallback_capacity

    def metrics(self) -> dict[str, int | None]:
        """``ap.metrics()``'s memory fields, read now (the static part counted afresh; the gradients are the
        step's, as counted at the last step's end where none exist now)."""
        if self.optimizers() or getattr(getattr(self._backend, "shard_registry", None), "models", None):
            registry = getattr(self._backend, "shard_registry", None)
            budget = memory_of(list(registry.models) if registry is not None else [], self.optimizers())
        else:
            budget = {}
        if budget and self.budget:
            # The step's gradients, however late it is read: after zero_grad() (set to None) they are gone
            # now, but the step holds them again; the count at the last step's end has them.
            budget["gradient_bytes"] = max(budget["gradient_bytes"], self.budget["gradient_bytes"])
        try:
            now = {} if self._broken else dict(self._backend.memory_reading())
        except Exception:
            now = {}
        resident = bool(now.pop("resident", 0)) or self.resident
        highest = max((now.get(k, 0) for k in ("memory_bytes", "peak_memory_bytes")), default=0)
        peak = max(self.peak or 0, highest) or None
        if not resident and "peak_memory_bytes" in now and budget:
            static = budget["parameter_bytes"] + budget["gradient_bytes"] + budget["optimizer_state_bytes"]
            self.activation = max(self.activation or 0, now["peak_memory_bytes"] - static)
            self.peak = peak
        return {
            "memory_bytes": now.get("memory_bytes"),
            "peak_memory_bytes": peak,
            "parameter_bytes": budget.get("parameter_bytes"),
            "gradient_bytes": budget.get("gradient_bytes"),
            "optimizer_state_bytes": budget.get("optimizer_state_bytes"),
            "activation_bytes": None if resident else self.activation,
            "capacity_bytes": now.get("capacity_bytes") or self.capacity_bytes,
        }

    def model(self) -> Any:
        """The model being trained: the largest passed to ``ap.shard``, else the module that holds most of the
        stepped parameters (searched for among the live objects: once, when a finding needs its blocks)."""
        registry = getattr(self._backend, "shard_registry", None)
        models = list(registry.models) if registry is not None else []
        if models:
            return max(models, key=lambda m: sum(p.numel() for p in m.parameters()))
        wanted = {id(p) for o in self.optimizers() for g in o.param_groups for p in g["params"]}
        if not wanted:
            return None
        import torch

        best, most = None, 0
        for obj in live_instances(torch.nn.Module):
            try:
                held = sum(1 for p in obj.parameters() if id(p) in wanted)
            except Exception:  # noqa: BLE001 - a half-built module in the heap
                continue
            if held > most:
                best, most = obj, held
        return best

    # -- out of memory ----------------------------------------------------------------------------------
    def raised(self, exc: BaseException, step: int) -> OutOfMemory | None:
        """A step raised ``exc``: recognised as out of memory, it is kept (the first one) and returned."""
        found = out_of_memory(exc)
        if found is None:
            return None
        if self.oom is None:
            self.oom = replace(found, step=step, site=_raised_at(exc))
        return self.oom

    # -- what keeps autograd graphs -------------------------------------------------------------------
    def look_for_kept_graphs(self) -> None:
        """Look at the training loop's variables at the next two step ends (a rule that saw memory grow asks)."""
        if self._search is None and self.kept is None:
            self._search = _Search()

    def _look(self, step: int) -> None:
        search = self._search
        assert search is not None
        try:
            places = _places(sys._getframe(2))
        except Exception:  # a frame whose variables cannot be read: nothing found
            places = {}
        if search.first is None:
            search.first, search.first_step = places, step
            return
        if step == search.first_step:
            return
        found = []
        for (name, where), (kind, after) in places.items():
            before = search.first.get((name, where))
            if before is not None and before[0] == kind and after > before[1]:
                found.append(KeptGraph(name, where, kind, before[1], after, (search.first_step, step)))
        found.sort(key=lambda k: (k.kind != "container", -(k.after - k.before)))
        self.kept = tuple(found)
        self._search = None


# -- an exception that ends the program ---------------------------------------------------------------

_UNCAUGHT: list[weakref.WeakMethod[Callable[[BaseException], object]]] = []
_PREVIOUS: list[Callable[..., Any]] = []


def _excepthook(kind: type[BaseException], exc: BaseException, tb: types.TracebackType | None) -> None:
    for ref in list(_UNCAUGHT):
        callback = ref()
        if callback is None:
            _UNCAUGHT.remove(ref)
            continue
        try:
            callback(exc)
        except Exception:  # never in the way of the traceback
            pass
    previous = _PREVIOUS[0] if _PREVIOUS else sys.__excepthook__
    previous(kind, exc, tb)


def watch_uncaught(callback: Callable[[BaseException], object]) -> None:
    """Call ``callback(exc)`` (a bound method, held weakly) for an exception that ends the program, before
    Python prints it: ``sys.excepthook`` is chained once per process, the hook found there is called after."""
    ref = weakref.WeakMethod(callback)
    if ref not in _UNCAUGHT:
        _UNCAUGHT.append(ref)
    if sys.excepthook is not _excepthook:
        _PREVIOUS[:] = [sys.excepthook]
        sys.excepthook = _excepthook
