"""``ap.shard``: parameters, gradients and optimizer state split over the replicas.

Each family shards on the engine its ecosystem already trusts:

- eager backends (``cpu``, ``cuda``, ``tpu``, ``neuron``): FSDP2,
  ``torch.distributed.fsdp.fully_shard`` (public from torch 2.6), over a 1-D
  device mesh of every rank, applied per block and then to the root;
- lazy XLA backends: torch_xla's SPMD FSDP (``SpmdFullyShardedDataParallel``,
  "FSDPv2", torch_xla 2.2 and later) over a mesh of every XLA device that
  the one process drives.

Alone (one rank, one device) the model comes back unchanged, so the same script
runs anywhere. What was passed to ``ap.shard`` is registered on the backend
(:class:`ShardRegistry`), so that ``ap.metrics().parameter_bytes`` counts its parameters
before an optimizer steps them (:func:`memory_of`). Nothing here is imported by ``import accelport``; torch
is imported inside the functions.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from accelport.errors import CompatibilityWarning, ShardingError, did_you_mean

__all__ = [
    "FSDP2_SINCE",
    "SPMD_FSDP_SINCE",
    "MIXED_PRECISION",
    "ShardRegistry",
    "check_arguments",
    "choose_units",
    "is_sharded",
    "optimizer_is_sharded",
    "local_nbytes",
    "memory_of",
    "shard_fsdp2",
    "shard_spmd",
    "shard_unsupported",
    "tied_groups",
]

#: torch release whose ``torch.distributed.fsdp`` exports ``fully_shard`` (pytorch/pytorch#141868).
FSDP2_SINCE = "2.6"
#: torch_xla release that ships ``torch_xla.experimental.spmd_fully_sharded_data_parallel`` (pytorch/xla#6187).
SPMD_FSDP_SINCE = "2.2"
#: The values ``mixed_precision`` accepts besides None.
MIXED_PRECISION: tuple[str, ...] = ("bf16",)

#: The default policy looks inside a module holding more than this share of the parameters ...
SPLIT_SHARE = 0.5
#: ... and makes a unit of any other submodule holding at least this share.
MIN_SHARE = 0.01


# -- arguments ----------------------------------------------------------------------------


def check_arguments(model: Any, policy: Any, reshard_after_forward: Any,
                    mixed_precision: Any) -> Callable[[Any], bool] | None:
    """Check ``ap.shard``'s arguments the same way on every backend; return the policy as a predicate.

    ``policy`` is None (the default units), a module class, a set (or list, tuple)
    of module classes, or a callable taking a module and returning True for the
    ones that become units.
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"ap.shard needs a torch.nn.Module, not {type(model).__name__}")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"ap.shard(reshard_after_forward=...) takes True or False, not {reshard_after_forward!r}")
    if mixed_precision is not None and mixed_precision not in MIXED_PRECISION:
        hint = did_you_mean(str(mixed_precision), MIXED_PRECISION) if isinstance(mixed_precision, str) else ""
        raise ValueError(f"ap.shard(mixed_precision={mixed_precision!r}) is not a mixed-precision setting "
                         f"accelport knows{hint}: use 'bf16' (bfloat16 compute, float32 gradient reduction "
                         "and master weights) or None (the model's own dtype)")
    if policy is None:
        return None
    if isinstance(policy, type):
        policy = {policy}
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = tuple(policy)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, torch.nn.Module))]
        if bad or not classes:
            raise TypeError(f"ap.shard(policy=...) takes module classes such as {{nn.TransformerEncoderLayer}}; "
                            f"{bad[0]!r} is not one" if bad else "ap.shard(policy=...) got an empty set of classes")
        predicate: Callable[[Any], bool] = lambda module: isinstance(module, classes)  # noqa: E731
        predicate.__name__ = "{" + ", ".join(c.__name__ for c in classes) + "}"
        return predicate
    if callable(policy):
        return policy
    raise TypeError(f"ap.shard(policy=...) takes a set of module classes or a callable(module) -> bool, "
                    f"not {type(policy).__name__}")


def _containers() -> tuple[type, ...]:
    import torch

    # Modules without a forward of their own: a unit there would never gather its parameters.
    return (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.ParameterList, torch.nn.ParameterDict)


def choose_units(model: Any, predicate: Callable[[Any], bool] | None) -> list[Any]:
    """The submodules that become units of their own (the root is always the last unit).

    Without a policy: every block of a stack (each item of an ``nn.ModuleList`` or
    ``nn.Sequential``, such as transformer layers) and every other submodule
    holding at least ``MIN_SHARE`` of the parameters, looking inside any module
    that holds more than ``SPLIT_SHARE`` of them. Returned in ``model.modules()``
    order, so ``reversed`` is bottom-up.
    """
    import torch

    containers = _containers()
    if predicate is not None:
        units = [m for m in model.modules()
                 if m is not model and not isinstance(m, containers) and predicate(m)]
        if not units:
            classes = sorted({type(m).__name__ for m in model.modules() if m is not model})
            blocks = [type(m).__name__ for m in choose_units(model, None)]
            example = max(blocks, key=blocks.count) if blocks else (classes[0] if classes else "nn.Linear")
            name = getattr(predicate, "__name__", repr(predicate))
            raise ShardingError(
                f"ap.shard: policy {name} matched no submodule of {type(model).__name__} (its submodules are "
                f"{', '.join(classes) or 'none'}): pass the classes of its blocks, e.g. policy={{{example}}}, "
                "or leave policy=None for the default")
        return units

    sizes: dict[int, int] = {}
    for m in model.modules():
        sizes[id(m)] = sum(p.numel() for p in m.parameters())
    total = sizes[id(model)]
    chosen: set[int] = set()
    if total == 0:
        return []

    def visit(parent: Any) -> None:
        stack = isinstance(parent, (torch.nn.ModuleList, torch.nn.Sequential))
        for child in parent.children():
            n = sizes[id(child)]
            if n == 0:
                continue
            has_children = any(sizes[id(c)] for c in child.children())
            if isinstance(child, containers) or (n > SPLIT_SHARE * total and has_children):
                visit(child)
            elif stack or n >= MIN_SHARE * total:
                chosen.add(id(child))

    visit(model)
    return [m for m in model.modules() if id(m) in chosen]


def tied_groups(model: Any, units: list[Any]) -> list[list[Any]]:
    """``units`` as the groups FSDP2 shards together, in an order ``fully_shard`` can apply them.

    A parameter used by two modules (a language model's embedding tied to its output
    head, or one module registered in two places) must belong to one FSDP group:
    units sharing one become a single group of several modules
    (``fully_shard([emb, head])``); a unit sharing one with its own ancestor unit, or
    with a module outside every unit, is left to that enclosing unit (the root at
    the top). Groups come bottom-up: each after every group inside its modules.
    """
    occurrences = list(model.named_modules(remove_duplicate=False))
    inside = {id(u): {id(m) for m in u.modules()} - {id(u)} for u in units}
    current = list(units)
    while True:
        classes, with_root = _sharing(occurrences, current)
        drop = {id(u) for u in with_root}
        for members in classes:  # a unit tied to its own ancestor unit is left to that one
            drop.update(id(u) for u in members if any(id(u) in inside[id(v)] for v in members if v is not u))
        if not drop:
            ordered, cycle = _bottom_up(classes[::-1], inside)  # as reversed(model.modules()) visits them
            if not cycle:
                return ordered
            # Groups that must each come after the other (a module of one inside a module of the
            # other, both ways round): no order can shard them. Their inner modules are left to the
            # units that hold them, which then share those ties and become one group.
            drop = {id(u) for group in cycle for u in group
                    if any(id(u) in inside[id(v)] for other in cycle for v in other)}
        current = [u for u in current if id(u) not in drop]


def _bottom_up(groups: list[list[Any]], inside: Mapping[int, set[int]]) -> tuple[list[list[Any]], list[list[Any]]]:
    """``groups`` ordered so that each comes after every group inside its modules, and no cycle; where
    no such order exists, no order and the groups of one cycle."""
    if all(len(g) == 1 for g in groups):
        return groups, []  # (one module each: bottom-up already)
    from graphlib import CycleError, TopologicalSorter

    order: TopologicalSorter[int] = TopologicalSorter()
    for i, group in enumerate(groups):
        below = {m for u in group for m in inside[id(u)]}
        order.add(i, *(j for j, other in enumerate(groups) if j != i and any(id(u) in below for u in other)))
    try:
        return [groups[i] for i in order.static_order()], []
    except CycleError as exc:  # args[1]: the cycle's nodes, the first one again at the end
        return [], [groups[i] for i in dict.fromkeys(exc.args[1])]


def _sharing(occurrences: list[tuple[str, Any]], units: list[Any]) -> tuple[list[list[Any]], list[Any]]:
    """``units`` in classes that share parameters (in ``units`` order), and the units sharing one with the root.

    ``occurrences`` is ``named_modules(remove_duplicate=False)``: a module registered
    in two places is seen in both, under whichever unit holds each place.
    """
    root = 0  # no module's id
    unit_ids = {id(u) for u in units}
    at_path = dict(occurrences)

    def owner(path: str) -> int:
        # The nearest unit on the way from this place up to the root (the root if none).
        while True:
            if id(at_path[path]) in unit_ids:
                return id(at_path[path])
            if not path:
                return root
            path = path.rpartition(".")[0]

    users: dict[int, set[int]] = {}
    for path, module in occurrences:
        who = owner(path)
        for p in module.parameters(recurse=False):
            users.setdefault(id(p), set()).add(who)
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    for sharers in users.values():
        first, *rest = sharers
        for other in rest:
            a, b = find(first), find(other)
            if a != b:
                parent[b] = a
    classes: dict[int, list[Any]] = {}
    for u in units:
        classes.setdefault(find(id(u)), []).append(u)
    tied_to_root = classes.pop(find(root), [])
    return list(classes.values()), tied_to_root


# -- what is sharded ------------------------------------------------------------------------


def _dtensor_class() -> Any:
    # FSDP2 imports torch.distributed.tensor; if nothing did, no DTensor exists.
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_sharded(model: Any) -> bool:
    """True when ``model`` or a submodule was sharded (by ``ap.shard``, ``fully_shard`` or FSDPv2)."""
    dtensor = _dtensor_class()
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp_module = getattr(fsdp, "FSDPModule", None)
    spmd = sys.modules.get("torch_xla.experimental.spmd_fully_sharded_data_parallel")
    spmd_module = getattr(spmd, "SpmdFullyShardedDataParallel", None)
    for m in model.modules():
        if (fsdp_module is not None and isinstance(m, fsdp_module)) or \
                (spmd_module is not None and isinstance(m, spmd_module)):
            return True
    return dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters())


_OPTIMIZER_KINDS: weakref.WeakKeyDictionary[Any, tuple[tuple[int, ...], bool]] = weakref.WeakKeyDictionary()


def optimizer_is_sharded(optimizer: Any) -> bool:
    """Whether ``optimizer`` steps FSDP2-sharded parameters (whose gradients FSDP already averaged).

    Cached per optimizer while its parameter groups keep their sizes. Raises
    :class:`ShardingError` when it steps sharded and replicated parameters at once.
    """
    dtensor = _dtensor_class()
    if dtensor is None:
        return False
    signature = tuple(len(g["params"]) for g in optimizer.param_groups)
    cached = _OPTIMIZER_KINDS.get(optimizer)
    if cached is not None and cached[0] == signature:
        return cached[1]
    sharded: list[Any] = []
    plain: list[Any] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            (sharded if isinstance(p, dtensor) else plain).append(p)
    if sharded and plain:
        raise ShardingError(
            f"ap.optimizer_step: this {type(optimizer).__name__} steps {len(sharded)} sharded parameter(s) and "
            f"{len(plain)} replicated one(s) (the first of shape {tuple(plain[0].shape)}). The sharded backward "
            "pass already averages the gradients of the first kind; averaging all of them again would be wrong, "
            "and skipping it would leave the others unaveraged. Pass every model this optimizer steps through "
            "ap.shard, or give the replicated parameters an optimizer of their own")
    result = bool(sharded)
    _OPTIMIZER_KINDS[optimizer] = (signature, result)
    return result


def _xla_local_numel(t: Any) -> int:
    """Elements of ``t`` on each device, from its SPMD sharding spec (no transfer)."""
    import re

    xlac = getattr(sys.modules.get("torch_xla"), "_XLAC", None)
    spec = xlac._get_xla_sharding_spec(t) if xlac is not None else ""
    match = re.search(r"devices=\[([\d,]+)\]", spec or "")
    if not match:
        return int(t.numel())  # replicated, or not sharded at all
    tiles = [int(n) for n in match.group(1).split(",")]
    if "last_tile_dim_replicate" in spec:
        tiles = tiles[:-1]
    numel = 1
    for size, parts in zip(t.shape, tiles, strict=False):
        numel *= -(-int(size) // max(parts, 1))
    return numel


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (FSDP2's sharded parameters and their gradients)."""
    dtensor = _dtensor_class()
    return dtensor is not None and isinstance(t, dtensor)


def local_shard(t: Any) -> Any:
    """This rank's shard of a DTensor, else ``t`` itself: reading it is never a collective."""
    return t.to_local() if is_dtensor(t) else t


def local_nbytes(t: Any) -> int:
    """Bytes of ``t`` held on this rank (a DTensor's local shard; an XLA tensor's per-device tile)."""
    if is_dtensor(t):
        t = t.to_local()
    elif getattr(t, "device", None) is not None and t.device.type == "xla":
        return _xla_local_numel(t) * t.element_size()
    return int(t.numel()) * t.element_size()


def memory_of(models: Iterable[Any], optimizers: Iterable[Any]) -> dict[str, int]:
    """Bytes this rank holds for ``models``' parameters and ``optimizers``': ``parameter_bytes`` (the models'
    parameters and every parameter an optimizer steps, each once), ``gradient_bytes`` (those of their
    gradients that exist now), ``optimizer_state_bytes`` (the tensors in the optimizers' state), and
    ``float32_bytes``: of all three, the float32 tensors of one element or more dimensions (what bf16
    weights would halve; a step counter stays as it is).

    Counted from the tensors themselves (dtype and shape, never their values): a DTensor by its
    local shard, an SPMD-sharded XLA tensor by its per-device tile (:func:`local_nbytes`).
    """
    params: dict[int, Any] = {id(p): p for m in models for p in m.parameters()}
    stepped = [(optimizer, p) for optimizer in optimizers for group in optimizer.param_groups
               for p in group["params"]]
    for _, p in stepped:
        params.setdefault(id(p), p)
    totals = {"parameter_bytes": 0, "gradient_bytes": 0, "optimizer_state_bytes": 0, "float32_bytes": 0}
    float32 = getattr(sys.modules.get("torch"), "float32", None)

    def add(key: str, t: Any) -> None:
        n = local_nbytes(t)
        totals[key] += n
        if t.dtype is float32 and t.dim() > 0:
            totals["float32_bytes"] += n

    for p in params.values():
        add("parameter_bytes", p)
        grad = getattr(p, "grad", None)
        if grad is not None:
            add("gradient_bytes", grad)
    counted: set[int] = set()
    for optimizer, p in stepped:
        if id(p) in counted:
            continue
        counted.add(id(p))
        for value in optimizer.state.get(p, {}).values():
            if hasattr(value, "element_size"):
                add("optimizer_state_bytes", value)
    return totals


class ShardRegistry:
    """The models passed to ``ap.shard`` on one backend (their bytes count in ``ap.metrics()``).

    Held weakly: a model the script dropped stops counting.
    """

    def __init__(self) -> None:
        self.models: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        #: The device mesh (FSDP2) or SPMD mesh every sharded model on this backend uses.
        self.mesh: Any = None
        #: The process group of background checkpoint saves, and the save still being written.
        self.checkpoint_group: Any = None
        self.pending: Any = None

    def add(self, model: Any, engine: str) -> None:
        self.models[model] = engine


def registry(backend: Any) -> ShardRegistry:
    if backend.shard_registry is None:
        backend.shard_registry = ShardRegistry()
    return backend.shard_registry


# -- checks shared by the engines -------------------------------------------------------------


def _refuse_sharded(model: Any) -> None:
    if is_sharded(model):
        raise ShardingError(
            f"ap.shard: this {type(model).__name__} is already sharded (ap.shard, fully_shard or "
            "SpmdFullyShardedDataParallel was applied to it or to one of its submodules): call ap.shard once, "
            "on the model as built, and keep the model it returns")


def _check_devices(model: Any, allowed: Iterable[str], backend: Any, target: str) -> None:
    found = {t.device.type for t in list(model.parameters()) + list(model.buffers())}
    wrong = sorted(found - set(allowed))
    if wrong:
        raise ShardingError(
            f"ap.shard: the model's tensors are on {', '.join(wrong)}, but backend {backend.name!r} shards on "
            f"{target}: move it there first with model.to(ap.device()) (or build it on the cpu"
            f"{' or the meta device' if 'meta' in allowed else ''} and let ap.shard place the shards)")


def _warn_alone(mixed_precision: str | None, backend: Any) -> None:
    if mixed_precision is None:
        return
    from accelport.errors import warn_user

    warn_user(f"ap.shard(mixed_precision={mixed_precision!r}) does nothing alone: with one replica on "
              f"{backend.name!r} the model is not sharded and keeps its own dtype; for bfloat16 compute here, "
              "run the forward pass under `with ap.autocast(torch.bfloat16):`", CompatibilityWarning)


# -- the engines ---------------------------------------------------------------------------------


def shard_unsupported(backend: Any, model: Any) -> Any:
    """For a backend without a sharding engine: unchanged alone, refused with replicas."""
    _refuse_sharded(model)
    if backend.world_size() == 1:
        registry(backend).add(model, "none")
        return model
    raise ShardingError(f"ap.shard: backend {backend.name!r} has no sharding engine; with "
                        f"{backend.world_size()} replicas, train replicated (leave out ap.shard) or give the "
                        "backend a shard() method (see docs/plugins.md)")


def shard_fsdp2(backend: Any, model: Any, *, predicate: Callable[[Any], bool] | None,
                reshard_after_forward: bool, mixed_precision: str | None) -> Any:
    """FSDP2: ``fully_shard`` on every unit, bottom-up, then on the root, over all ranks."""
    import torch

    _refuse_sharded(model)
    _check_devices(model, {backend.device_type, "cpu", "meta"}, backend, f"{backend.device_type} devices")
    units = choose_units(model, predicate)
    world = backend.world_size()
    if world == 1:
        _warn_alone(mixed_precision, backend)
        registry(backend).add(model, "none")
        return model
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError as exc:
        raise ShardingError(
            f"ap.shard needs FSDP2 (torch.distributed.fsdp.fully_shard), public from torch {FSDP2_SINCE}; "
            f"torch {torch.__version__} does not have it: pip install 'torch>={FSDP2_SINCE}'") from exc
    from torch.distributed.device_mesh import init_device_mesh

    shards = registry(backend)
    if shards.mesh is None:
        shards.mesh = init_device_mesh(backend.device_type, (world,))
    kwargs: dict[str, Any] = {"mesh": shards.mesh, "reshard_after_forward": reshard_after_forward}
    if mixed_precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for group in tied_groups(model, units):  # children before their parents; tied modules together
        fully_shard(group[0] if len(group) == 1 else group, **kwargs)
    fully_shard(model, **kwargs)
    shards.add(model, "fsdp2")
    return model


def shard_spmd(backend: Any, model: Any, *, predicate: Callable[[Any], bool] | None,
               reshard_after_forward: bool, mixed_precision: str | None) -> Any:
    """torch_xla's SPMD FSDP over a mesh of every device this one process drives."""
    _refuse_sharded(model)
    _check_devices(model, {"xla", "cpu"}, backend, "the XLA device")
    units = choose_units(model, predicate)
    if mixed_precision is not None:
        raise ShardingError(
            f"ap.shard(mixed_precision={mixed_precision!r}) is not available on {backend.name!r}: torch_xla's SPMD "
            "FSDP has no mixed-precision policy. Leave mixed_precision=None and run the forward pass under "
            "`with ap.autocast(torch.bfloat16):` (the same line works on every backend)")
    if backend.world_size() > 1:
        raise ShardingError(
            f"ap.shard on {backend.name!r} uses SPMD, where one process per host drives every device, but this job "
            f"runs {backend.world_size()} replica processes: start it as one process per host "
            "(`accelport launch --nprocs 1`, or plain `python train.py`)")
    import torch_xla
    import torch_xla.runtime as xr

    devices = int(xr.global_runtime_device_count())
    shards = registry(backend)
    if devices == 1:
        registry(backend).add(model, "none")
        return model
    try:
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel
    except ImportError as exc:
        raise ShardingError(
            f"ap.shard on {backend.name!r} needs torch_xla's SPMD FSDP (SpmdFullyShardedDataParallel), shipped "
            f"from torch_xla {SPMD_FSDP_SINCE}; torch_xla {getattr(torch_xla, '__version__', '?')} does not "
            f"have it: install a torch_xla between {SPMD_FSDP_SINCE} and 2.9 with the torch of the same "
            "major.minor") from exc
    import warnings

    import numpy as np
    import torch_xla.distributed.spmd as xs

    if not xr.is_spmd():
        if torch_xla._XLAC._xla_get_spmd_config_is_locked():
            # Measured with torch_xla 2.9 on XLA:CPU: switching after that makes the first backward
            # fail in the autograd engine, or the process crash at exit.
            raise ShardingError(
                f"ap.shard on {backend.name!r}: tensors are already on the XLA device, and torch_xla cannot switch "
                "to SPMD after that. Set ACCELPORT_SPMD=1 before the run (accelport then starts torch_xla in SPMD "
                "mode), or pass the model as built, before model.to(ap.device()): ap.shard places it")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its note on replicating existing tensors: there are none
            xr.use_spmd()
    if shards.mesh is None:
        shards.mesh = xs.get_global_mesh() or xs.Mesh(np.arange(devices), (devices, 1), ("fsdp", "model"))
        xs.set_global_mesh(shards.mesh)
    mesh = shards.mesh
    if not reshard_after_forward:
        from accelport.errors import warn_user

        warn_user(f"ap.shard(reshard_after_forward=False) has no effect on {backend.name!r}: under SPMD the XLA "
                  "compiler schedules the parameter gathers itself", CompatibilityWarning)
    # SPMD FSDP wraps one module at a time: modules sharing a parameter stay with the unit around them.
    wanted = {id(g[0]) for g in tied_groups(model, units) if len(g) == 1}

    def auto_wrap(module: Any, recurse: bool, **_: Any) -> bool:
        return True if recurse else id(module) in wanted

    wrapped = SpmdFullyShardedDataParallel(model, mesh=mesh, auto_wrap_policy=auto_wrap if units else None)
    wrapped.register_forward_pre_hook(_input_sharder(mesh, xs, torch_xla))
    shards.add(wrapped, "spmd-fsdp")
    return wrapped


def _input_sharder(mesh: Any, xs: Any, torch_xla: Any) -> Callable[..., None]:
    """A forward pre-hook that splits each input tensor's first dimension (the batch) over the mesh.

    Under SPMD one process feeds every device the global batch; without this each
    device would compute all of it.
    """
    spec_of = torch_xla._XLAC._get_xla_sharding_spec

    def hook(module: Any, args: tuple[Any, ...]) -> None:
        for a in args:
            if getattr(a, "device", None) is not None and a.device.type == "xla" and a.dim() >= 1 \
                    and not spec_of(a):
                xs.mark_sharding(a, mesh, ("fsdp",) + (None,) * (a.dim() - 1))

    return hook
