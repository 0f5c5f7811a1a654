"""Helpers on nested tensors that both backend families and checkpoints use; torch is imported on call."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

__all__ = ["tree_map", "tree_map_tensors", "to_host", "collective_device", "same_on_every_rank"]


def tree_map(obj: Any, fn: Callable[[Any], Any], leaf: Callable[[Any], bool]) -> Any:
    """Apply ``fn`` to every value ``leaf`` accepts inside nested dicts, lists, tuples and namedtuples, each
    container rebuilt in its own class."""

    def walk(x: Any) -> Any:
        if leaf(x):
            return fn(x)
        if isinstance(x, dict):
            out = _rebuilt(x, {k: walk(v) for k, v in x.items()})
            # A module's state_dict carries version metadata that load_state_dict reads.
            if hasattr(x, "_metadata"):
                out._metadata = x._metadata  # type: ignore[attr-defined]
            return out
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
            return type(x)(*(walk(v) for v in x))
        if isinstance(x, (list, tuple)):
            # Made from a list, not a generator: tuple() grows a tuple from a generator in place, which
            # fails (SystemError) if anything holds it meanwhile, as gc.get_objects() in another thread
            # does (the step checks name a parameter that way while a prefetch thread moves a batch).
            items = [walk(v) for v in x]
            return items if type(x) is list else type(x)(items)
        return x

    return walk(obj)


def _rebuilt(like: dict[Any, Any], items: dict[Any, Any]) -> dict[Any, Any]:
    """``items`` in a mapping of ``like``'s class: made from the items, or where its constructor takes something
    else first (a defaultdict's factory), copied and refilled."""
    if type(like) is dict:
        return items
    try:
        return type(like)(items)
    except TypeError:
        out = copy.copy(like)
        out.clear()
        out.update(items)
        return out


def tree_map_tensors(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every tensor inside nested dicts, lists, tuples and namedtuples."""
    import torch

    return tree_map(obj, fn, lambda x: isinstance(x, torch.Tensor))


def to_host(value: Any) -> Any:
    """A tensor as a Python number (0-d) or a CPU tensor; anything else unchanged."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is always present when tensors are
        return value
    if isinstance(value, torch.Tensor):
        value = value.detach()
        return value.item() if value.ndim == 0 else value.to("cpu")
    return value


def collective_device(backend: Any) -> Any:
    """Where ``backend``'s collectives take their tensors: gloo reduces host tensors, nccl and the
    accelerators' process groups device ones."""
    return "cpu" if getattr(backend, "dist_backend", "gloo") == "gloo" else backend.device()


def same_on_every_rank(backend: Any, key: object) -> bool:
    """Whether every rank passed an equal ``key`` (its ``repr``), in one collective of four integers.

    Each rank adds two 20-bit hashes ``h`` of its key and their squares; the sums satisfy
    ``sum(h) ** 2 == world * sum(h * h)`` only when every ``h`` is the same (Cauchy-Schwarz).
    Different keys pass unnoticed only when both hashes collide (about 1 in 2**40).
    """
    import zlib

    import torch

    text = repr(key).encode()
    hashes = [zlib.crc32(text) & 0xFFFFF, zlib.adler32(text) & 0xFFFFF]
    values = torch.tensor([v for h in hashes for v in (h, h * h)], dtype=torch.int64,
                          device=collective_device(backend))
    backend.all_reduce(values)
    sums = [int(v) for v in values.tolist()]
    world = backend.world_size()
    return all(sums[i] ** 2 == world * sums[i + 1] for i in (0, 2))
