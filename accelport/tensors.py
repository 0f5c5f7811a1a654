"""Helpers on nested tensors that both backend families and checkpoints use; torch is imported on call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["tree_map_tensors", "to_host"]


def tree_map_tensors(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every tensor inside nested dicts, lists, tuples and namedtuples."""
    import torch

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return fn(x)
        if isinstance(x, dict):
            out = type(x)((k, walk(v)) for k, v in x.items())
            # A module's state_dict carries version metadata that load_state_dict reads.
            if hasattr(x, "_metadata"):
                out._metadata = x._metadata  # type: ignore[attr-defined]
            return out
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
            return type(x)(*(walk(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    return walk(obj)


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
