"""The eager family: one implementation for every native PyTorch device.

``cpu``, ``cuda``, ``tpu`` (TorchTPU) and ``neuron`` (TorchNeuron) differ only in
the constants below, so the code path ``cpu`` runs in every test run is the one
``tpu`` and ``neuron`` run on hardware.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

from .contract import Backend
from ._loader import prefetch_iter

__all__ = ["EagerBackend"]


#: Gradients are averaged in buckets of about this many bytes, one collective each
#: (DistributedDataParallel's default bucket size).
BUCKET_BYTES = 25 * 1024 * 1024


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


class EagerBackend(Backend):
    """A native PyTorch device: work runs as it is issued (or queued per op)."""

    lazy = False
    #: torch.device type: "cpu", "cuda", "tpu", "neuron".
    device_type: ClassVar[str]
    #: torch.distributed backend for several processes.
    dist_backend: ClassVar[str] = "gloo"
    #: torch.compile backend name.
    compile_backend: ClassVar[str] = "inductor"
    #: Device type for torch.autocast.
    autocast_device_type: ClassVar[str] = "cpu"
    #: How to wait for queued work: "none" (cpu), "module" (torch.<device_type>.synchronize)
    #: or "accelerator" (torch.accelerator.synchronize; TorchTPU forbids torch.tpu.* in user code).
    sync_api: ClassVar[str] = "none"
    #: Pin host memory and copy batches with non_blocking=True (CUDA-style DMA).
    pin_memory: ClassVar[bool] = False
    #: Whether the device is indexed per process (LOCAL_RANK) when several run on one host.
    per_process_device: ClassVar[bool] = True
    #: Batches ap.loader loads ahead when the caller does not say.
    default_prefetch: ClassVar[int] = 2

    def __init__(self) -> None:
        super().__init__()
        self._torch: Any = None
        self._device: Any = None

    # -- lifecycle ---------------------------------------------------------------------
    def prepare(self) -> None:
        import torch

        self._torch = torch
        if self.sync_api == "module" and self.per_process_device:
            module = getattr(torch, self.device_type, None)
            set_device = getattr(module, "set_device", None)
            if set_device is not None and _env_int("WORLD_SIZE", 1) > 1:
                set_device(_env_int("LOCAL_RANK", 0))
        if _env_int("WORLD_SIZE", 1) > 1:
            import torch.distributed as dist

            if dist.is_available() and not dist.is_initialized():
                dist.init_process_group(backend=self.dist_backend)

    def _t(self) -> Any:
        if self._torch is None:
            self.prepare()
        return self._torch

    # -- operations --------------------------------------------------------------------
    def device(self, index: int | None = None) -> Any:
        torch = self._t()
        if index is None and self._device is not None:
            return self._device
        if self.device_type == "cpu":
            dev = torch.device("cpu")
        else:
            idx = index if index is not None else (
                _env_int("LOCAL_RANK", 0) if self.per_process_device else 0)
            dev = torch.device(self.device_type, idx)
        if index is None:
            self._device = dev
        return dev

    def sync(self) -> None:
        torch = self._t()
        if self.sync_api == "module":
            getattr(torch, self.device_type).synchronize()
        elif self.sync_api == "accelerator":
            torch.accelerator.synchronize()

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self.world_size() > 1:
            self._average_gradients(optimizer)
        return optimizer.step(**kwargs)

    def _average_gradients(self, optimizer: Any) -> None:
        """Average every gradient over the replicas in a few coalesced collectives.

        Parameters are grouped by (device, dtype) and packed into buckets of about
        ``BUCKET_BYTES``; each bucket is one all-reduce, and all are issued before
        any is waited on, so packing one overlaps reducing the previous one. Every
        trainable parameter takes part, in ``param_groups`` order (the same on every
        replica), so buckets line up even when a parameter got no gradient on some
        replica: it contributes zeros, and a presence count travelling in the same
        bucket leaves ``grad`` as None only where no replica produced one. This is
        what DistributedDataParallel does with ``find_unused_parameters``, without
        the risk of mismatched collectives hanging the job.
        """
        torch = self._t()
        import torch.distributed as dist

        from .errors import AccelportError

        world = self.world_size()
        groups: dict[tuple[Any, Any], list[Any]] = {}
        seen: set[int] = set()
        for group in optimizer.param_groups:
            for p in group["params"]:
                if not p.requires_grad or id(p) in seen:
                    continue
                seen.add(id(p))
                if p.grad is not None and p.grad.layout is not torch.strided:
                    raise AccelportError(
                        f"a parameter of shape {tuple(p.shape)} has a {p.grad.layout} gradient, which "
                        "ap.optimizer_step cannot average over replicas; use a dense layer "
                        "(e.g. nn.Embedding(sparse=False)) or DistributedDataParallel for this model"
                    )
                groups.setdefault((p.device, p.dtype), []).append(p)
        with torch.no_grad():
            pending = []
            for (device, dtype), params in groups.items():
                for bucket in _buckets(params, BUCKET_BYTES):
                    total = sum(p.numel() for p in bucket)
                    # Gradients, then one presence flag per parameter.
                    flat = torch.empty(total + len(bucket), dtype=dtype, device=device)
                    offset = 0
                    for p in bucket:
                        n = p.numel()
                        if p.grad is None:
                            flat[offset:offset + n].zero_()
                        else:
                            flat[offset:offset + n].copy_(p.grad.reshape(-1))
                        offset += n
                    flat[total:].copy_(torch.tensor([p.grad is not None for p in bucket], dtype=dtype))
                    pending.append((dist.all_reduce(flat, async_op=True), flat, bucket, total))
            for work, flat, bucket, total in pending:
                work.wait()
                present = flat[total:].tolist() if any(p.grad is None for p in bucket) else None
                flat = flat[:total].div_(world)
                offset = 0
                for i, p in enumerate(bucket):
                    n = p.numel()
                    reduced = flat[offset:offset + n].view_as(p)
                    offset += n
                    if p.grad is not None:
                        p.grad.copy_(reduced)
                    elif present is not None and present[i] > 0:
                        p.grad = reduced.clone()

    def wrap_loader(self, iterable: Iterable[Any], *, prefetch: int | None) -> Iterator[Any]:
        device = self.device()
        if prefetch is None:
            prefetch = self.default_prefetch
        if self.device_type == "cpu":
            move = None  # batches already live on the host
        else:
            from .contract import tree_map_tensors

            pin = self.pin_memory

            def move(batch: Any) -> Any:
                def to_dev(t: Any) -> Any:
                    if pin and not t.is_pinned():
                        t = t.pin_memory()
                    return t.to(device, non_blocking=pin)

                return tree_map_tensors(batch, to_dev)

        return prefetch_iter(iterable, depth=prefetch, transform=move)

    # -- metrics -----------------------------------------------------------------------
    def _dynamo_counts(self) -> dict[str, Any]:
        # torch._dynamo is imported by torch.compile; if nothing imported it, nothing
        # was compiled, and importing it here would cost a second for nothing.
        utils = sys.modules.get("torch._dynamo.utils")
        if utils is None:
            return {"compilations": 0, "compile_seconds": 0.0}
        stats = utils.counters.get("stats", {})
        times = getattr(utils, "compilation_time_metrics", {}).get("_compile.compile_inner", [])
        return {"compilations": int(stats.get("unique_graphs", 0)), "compile_seconds": float(sum(times))}

    def counters(self) -> dict[str, Any]:
        out = self._dynamo_counts()
        if self.device_type != "cpu" and self._torch is not None:
            module = getattr(self._torch, self.device_type, None)
            for key, fn in (("memory_bytes", "memory_allocated"), ("peak_memory_bytes", "max_memory_allocated")):
                f = getattr(module, fn, None)
                if f is not None:
                    try:
                        out[key] = int(f())
                    except Exception:
                        pass
        return out

    def step_counters(self) -> dict[str, float]:
        utils = sys.modules.get("torch._dynamo.utils")
        if utils is None:
            return {"compilations": 0}
        return {"compilations": int(utils.counters.get("stats", {}).get("unique_graphs", 0))}

    # -- distributed -------------------------------------------------------------------
    def _dist(self) -> Any:
        if "torch.distributed" not in sys.modules and self._torch is None:
            return None
        import torch.distributed as dist

        return dist if dist.is_available() and dist.is_initialized() else None

    def world_size(self) -> int:
        dist = self._dist()
        return dist.get_world_size() if dist is not None else _env_int("WORLD_SIZE", 1)

    def rank(self) -> int:
        dist = self._dist()
        return dist.get_rank() if dist is not None else _env_int("RANK", 0)

    def barrier(self) -> None:
        dist = self._dist()
        if dist is not None:
            dist.barrier()

    def all_reduce(self, tensor: Any, op: str = "sum") -> Any:
        if op not in ("sum", "mean"):
            raise ValueError(f"all_reduce op must be 'sum' or 'mean', not {op!r}")
        # Checked at every world size, so a script that works alone works on many.
        if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
            raise TypeError(f"all_reduce(op='mean') needs a floating-point tensor, not {tensor.dtype}; "
                            "convert it with .float() or reduce with op='sum'")
        dist = self._dist()
        if dist is None or dist.get_world_size() == 1:
            return tensor
        if tensor.is_contiguous():
            dist.all_reduce(tensor)
        else:  # collectives need dense memory; reduce a packed copy and write it back
            packed = tensor.contiguous()
            dist.all_reduce(packed)
            tensor.copy_(packed)
        if op == "mean":
            tensor.div_(dist.get_world_size())
        return tensor


def _buckets(params: list[Any], limit: int) -> Iterator[list[Any]]:
    """Consecutive runs of ``params`` of about ``limit`` bytes each (the same on every replica)."""
    bucket: list[Any] = []
    size = 0
    for p in params:
        bucket.append(p)
        size += p.numel() * p.element_size()
        if size >= limit:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
