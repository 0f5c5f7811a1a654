"""The eager family: one implementation for every native PyTorch device.

``cpu``, ``cuda``, ``tpu`` (TorchTPU) and ``neuron`` (TorchNeuron) differ only in
the constants below, so the code path ``cpu`` runs in every test run is the one
``tpu`` and ``neuron`` run on hardware. The few calls into a device runtime
(synchronize, set the device, count devices, memory figures) are resolved in one
place, :meth:`EagerBackend.device_api`, from the ``sync_api`` constant.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar

from accelport.collectives import Collectives
from accelport.contract import Backend
from accelport.device_loader import prefetch_iter
from accelport.errors import BackendUnavailableError, ending_with_error
from accelport.settings import env_int
from accelport.sharding import optimizer_is_sharded
from accelport.tensors import tree_map_tensors

__all__ = ["EagerBackend", "ACCELERATOR_EQUIVALENTS", "skip_teardown_at_exit", "teardown_process_group"]

#: Device-module function -> its ``torch.accelerator`` equivalent (torch >= 2.6).
ACCELERATOR_EQUIVALENTS: Mapping[str, str] = {
    "synchronize": "synchronize",
    "set_device": "set_device_index",
    "device_count": "device_count",
    "memory_allocated": "memory_allocated",
    "max_memory_allocated": "max_memory_allocated",
    "reset_peak_memory_stats": "reset_peak_memory_stats",
    "mem_get_info": "get_memory_info",
}


#: Gradients are averaged in buckets of about this many bytes, one collective each
#: (DistributedDataParallel's default bucket size).
BUCKET_BYTES = 25 * 1024 * 1024
#: Seconds a replica that finished waits at exit for the others before it tears its process
#: group down all the same (``ACCELPORT_EXIT_BARRIER_S``): enough for a main process that
#: writes a last checkpoint, bounded for a replica whose peers will never come.
EXIT_BARRIER_S = 60
_teardowns = 0  # process groups torn down in this process: names each exit barrier


def _exit_barrier(dist: Any, timeout: float) -> bool:
    """Wait until every replica reached its exit, through the rendezvous store; False after ``timeout``.

    Not a collective: a replica that finished early would pair its barrier with a peer's
    gradient all-reduce. torchrun's store is at MASTER_ADDR:MASTER_PORT (the agent's).
    """
    from datetime import timedelta

    world = dist.get_world_size()
    if world == 1:
        return True
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    wait = timedelta(seconds=max(timeout, 0.001))
    if host and port and port.isdigit():
        store = dist.TCPStore(host, int(port), is_master=False, timeout=wait)
    else:  # a group the script set up another way: its own store
        store = dist.distributed_c10d._get_default_store()
    key = "/".join(["accelport-exit", os.environ.get("TORCHELASTIC_RUN_ID", ""),
                    os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), str(_teardowns)])
    if store.add(key + "/arrived", 1) >= world:
        store.set(key + "/all", "1")
    try:
        store.wait([key + "/all"], wait)
    except Exception:  # DistStoreError (torch >= 2.4) or RuntimeError: the others did not come in time
        return False
    return True


def teardown_process_group(timeout: float | None = None) -> bool | None:
    """Destroy the default process group once every replica has finished (or ``timeout`` passed).

    Left to interpreter exit, gloo's threads are destroyed while a peer may still talk to
    them, and about one launch in twelve of a correct two-process script ended in SIGABRT
    ("terminate called without an active exception"). Returns True when every replica
    arrived, False when the wait timed out (the group is destroyed all the same), None
    when there was no group.
    """
    global _teardowns
    if "torch.distributed" not in sys.modules:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    wait = env_int(os.environ, "ACCELPORT_EXIT_BARRIER_S", EXIT_BARRIER_S) if timeout is None else timeout
    try:
        met = _exit_barrier(dist, wait)
    except Exception:  # no store to meet at: destroy without waiting, as before
        met = False
    _teardowns += 1
    try:
        dist.destroy_process_group()
    except Exception:  # already torn down by the script, or the runtime is going away
        pass
    return met


def _teardown_at_exit() -> None:
    # After an uncaught exception the peers may be inside a collective this process will
    # never join: waiting for them, or destroying gloo's threads under them, could hang.
    # (A SystemExit sets neither: a launched worker says so with skip_teardown_at_exit.)
    if not ending_with_error():
        teardown_process_group()


def skip_teardown_at_exit() -> None:
    """This process is ending with an error: at exit, leave its process group as it is.

    Neither wait for the other replicas (they may run for much longer, or wait in a
    collective this process never joins: the launch would be held for the whole
    exit barrier) nor destroy gloo's threads under them. Python records no exception
    for ``sys.exit("message")`` or ``SystemExit(1)``, so the at-exit hook cannot tell
    those from a clean end by itself; the worker wrapper calls this before they propagate.
    """
    atexit.unregister(_teardown_at_exit)


class EagerBackend(Backend):
    """A native PyTorch device: work runs as it is issued (or queued per op)."""

    lazy = False
    #: torch.device type: "cpu", "cuda", "tpu", "neuron".
    device_type: ClassVar[str]
    #: The ``torch.<name>`` module that drives the device (torch.cuda, torch.neuron);
    #: None means the same as device_type.
    device_module: ClassVar[str | None] = None
    #: Module that registers the device with torch when it is not autoloaded
    #: ("torch_neuronx"); imported by prepare(), never by a probe.
    vendor_module: ClassVar[str | None] = None
    #: torch.distributed backend for several processes.
    dist_backend: ClassVar[str] = "gloo"
    #: torch.compile backend name.
    compile_backend: ClassVar[str] = "inductor"
    #: Whether that compiler accepts dynamic=True (TorchTPU and TorchNeuron reject it).
    compile_dynamic: ClassVar[bool] = True
    #: Device type for torch.autocast.
    autocast_device_type: ClassVar[str] = "cpu"
    #: How to reach the device runtime: "none" (the host), "module" (torch.<device_module>.X,
    #: falling back to torch.accelerator where the module lacks X) or "accelerator"
    #: (torch.accelerator only; TorchTPU forbids torch.tpu.* in user code).
    sync_api: ClassVar[str] = "none"
    #: Pin host memory and copy batches with non_blocking=True (CUDA-style DMA).
    pin_memory: ClassVar[bool] = False
    #: Whether the loader copies batches to the device (False only where host and device are one).
    transfer_batches: ClassVar[bool] = True
    #: Whether the device is indexed per process (LOCAL_RANK) when several run on one host.
    per_process_device: ClassVar[bool] = True
    #: Batches ap.loader loads ahead when the caller does not say.
    default_prefetch: ClassVar[int] = 2

    def __init__(self) -> None:
        super().__init__()
        self._torch: Any = None
        self._device: Any = None
        self._device_counters_broken = False
        self._memory_broken: set[str] = set()  # device-module functions that failed: not called again
        self._capacity: int | None = None  # the device's total memory, read once
        # Host reads: counted on accelerators (see accelport.observe.tracer), never on the host.
        self._reads: Callable[[str], int] | None = None
        self._guard_compiles: Callable[[], None] = lambda: None
        self._observer: Any = None  # torch.compile's records (accelport.observe.dynamo)
        self._compile_seconds_seen = 0.0
        self._world_env = 1
        self._dist_module: Any = None
        self._clock: Any = None  # the run's step clock (time_with)
        #: Where this backend's collectives wait (read by accelport launch's probe) and when
        #: ap.all_reduce checks its arguments across ranks.
        self.collectives = Collectives()

    # -- lifecycle ---------------------------------------------------------------------
    def prepare(self) -> None:
        import torch

        self._torch = torch
        self._load_device_module(torch)
        self._check_device_count(torch)
        from accelport.observe import dynamo, tracer

        self._observer = dynamo.observer()
        if self.sync_api != "none":  # an accelerator: a host read stalls it (on cpu, the host is the device)
            tracer.count_reads(self.device_type)
            self._reads = tracer.reads
            self._guard_compiles = tracer.guard_compiles
        world = self._world_env = env_int(os.environ, "WORLD_SIZE", 1)
        if world > 1 and self.per_process_device and self.sync_api != "none":
            set_device = self.device_api("set_device")
            if set_device is not None:
                set_device[1](env_int(os.environ, "LOCAL_RANK", 0))
        if world > 1:
            import torch.distributed as dist

            if dist.is_available() and not dist.is_initialized():
                dist.init_process_group(backend=self.dist_backend)
                atexit.register(_teardown_at_exit)  # the group accelport made, it tears down

    def _load_device_module(self, torch: Any) -> None:
        """Make sure torch.<device_module> exists, importing the vendor module if needed."""
        if self.sync_api == "none" or self.vendor_module is None:
            return
        if getattr(torch, self.module_name, None) is not None:
            return
        import importlib

        try:
            importlib.import_module(self.vendor_module)
        except ImportError as exc:
            raise BackendUnavailableError(
                self.name, f"import {self.vendor_module} failed ({exc})") from exc
        if getattr(torch, self.module_name, None) is None:
            raise BackendUnavailableError(
                self.name, f"{self.vendor_module} did not register torch.{self.module_name}; "
                "is the device present and its runtime installed?")

    def _check_device_count(self, torch: Any) -> None:
        """Refuse early, with a reason, when the runtime sees no device the probe promised.

        The count comes from the device module (torch.cuda.device_count asks NVML
        first, so it does not initialise CUDA and a later fork stays safe) or
        torch.accelerator.device_count.
        """
        if self.sync_api == "none":
            return
        api = self.device_api("device_count")
        if api is None:
            return
        try:
            count = int(api[1]())
        except Exception as exc:
            raise BackendUnavailableError(
                self.name, f"{api[0]}() failed: {type(exc).__name__}: {exc}") from exc
        if count == 0:
            raise BackendUnavailableError(
                self.name,
                f"torch {torch.__version__} sees no {self.device_type} device ({api[0]}() is 0) although "
                "the hardware is present: check the visible-devices variables and that the driver "
                "supports this torch build",
            )

    def _t(self) -> Any:
        if self._torch is None:
            self.prepare()
        return self._torch

    @property
    def module_name(self) -> str:
        return self.device_module or self.device_type

    def device_api(self, name: str) -> tuple[str, Callable[..., Any]] | None:
        """The runtime function behind ``name`` and its dotted name, per ``sync_api``.

        ``name`` is a device-module function (synchronize, set_device, device_count,
        memory_allocated, max_memory_allocated, reset_peak_memory_stats, mem_get_info). "module" prefers
        ``torch.<device_module>.<name>`` and falls back to its ``torch.accelerator``
        equivalent; "accelerator" uses only the latter; "none" has no runtime.
        """
        if self.sync_api == "none":
            return None
        torch = self._t()
        if self.sync_api == "module":
            fn = getattr(getattr(torch, self.module_name, None), name, None)
            if callable(fn):
                return f"torch.{self.module_name}.{name}", fn
        equivalent = ACCELERATOR_EQUIVALENTS.get(name)
        fn = getattr(getattr(torch, "accelerator", None), equivalent, None) if equivalent else None
        if callable(fn):
            return f"torch.accelerator.{equivalent}", fn
        return None

    # -- operations --------------------------------------------------------------------
    def device(self, index: int | None = None) -> Any:
        torch = self._t()
        if index is None and self._device is not None:
            return self._device
        if index is not None:
            dev = torch.device(self.device_type, index)
        elif self.per_process_device:
            dev = torch.device(self.device_type, env_int(os.environ, "LOCAL_RANK", 0))
        else:
            dev = torch.device(self.device_type)
        if index is None:
            self._device = dev
        return dev

    def sync(self) -> None:
        api = self.device_api("synchronize")
        if api is not None:
            clock = self._clock
            if clock is not None:
                clock.enter("sync")
            try:
                api[1]()
            finally:
                if clock is not None:
                    clock.leave("sync")

    # -- where a step's time goes ---------------------------------------------------------
    def time_phases(self) -> Mapping[str, str]:
        """On the host (``cpu``) the forward, backward and optimizer are the device's work; on an
        accelerator the host only issues it and waits for it without a sync per step, where it is
        queued and where a host read waits: the device's time and the host's waits are one there."""
        return _HOST_PHASES if self.sync_api == "none" else _ACCELERATOR_PHASES

    def time_with(self, clock: Any) -> None:
        self._clock = clock
        self.collectives.timer = clock
        if self.sync_api != "none":  # a host read waits for the device (on cpu it is a plain read)
            from accelport.observe import tracer

            tracer.time_reads(self.device_type, clock)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        # The world size as world_size() says it, without its lookups on every step: a
        # process group, once initialised, decides; before that, WORLD_SIZE as read at prepare().
        dist = self._dist_module
        if dist is None and "torch.distributed" in sys.modules:
            import torch.distributed

            dist = self._dist_module = torch.distributed if torch.distributed.is_available() else False
        world = dist.get_world_size() if dist and dist.is_initialized() else self._world_env
        # FSDP2 reduce-scatters (averages) the gradients of sharded parameters in backward.
        if world > 1 and not optimizer_is_sharded(optimizer):
            self._average_gradients(optimizer)
        return optimizer.step(**kwargs)

    def shard(self, model: Any, *, policy: Any = None, reshard_after_forward: bool = True,
              mixed_precision: str | None = None) -> Any:
        """FSDP2 over every rank (:func:`accelport.sharding.shard_fsdp2`)."""
        from accelport.sharding import shard_fsdp2

        return shard_fsdp2(self, model, predicate=policy, reshard_after_forward=reshard_after_forward,
                           mixed_precision=mixed_precision)

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

        from accelport.errors import AccelportError

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
                # Issued async: the wait waits for the other ranks (and a host read of the result, where
                # a device backend's wait does not hold the host).
                with self.collectives.waiting("ap.optimizer_step"):
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
        if not self.transfer_batches:
            # Batches already live on the device: by default no thread, which would only move
            # the loop's own iteration elsewhere (a DataLoader's workers prefetch already) and
            # cost a hand-over per batch. prefetch=N still loads ahead in a thread.
            return prefetch_iter(iterable, depth=prefetch) if prefetch else iter(iterable)
        if prefetch is None:
            prefetch = self.default_prefetch
        device = self.device()
        pin = self.pin_memory
        clock = time.perf_counter

        def to_device(t: Any) -> Any:
            # Pinned (page-locked) host memory lets the copy run as DMA while the
            # device computes; non_blocking only overlaps when the source is pinned.
            if pin and t.device.type == "cpu" and not t.is_pinned():
                t = t.pin_memory()
            return t.to(device, non_blocking=pin)

        def move(batch: Any) -> Any:
            start = clock()
            try:
                return tree_map_tensors(batch, to_device)
            finally:  # (ap.loader counts as transfer the part of a wait that went to these copies)
                self.transfer_seconds += clock() - start

        # The copy runs in the prefetch thread, so it overlaps with the step in flight.
        return prefetch_iter(iterable, depth=prefetch, transform=move)

    def compile(self, model: Any, **kwargs: Any) -> Any:
        """torch.compile with this device's compiler; dynamic=True refused where it is unsupported."""
        if not self.compile_dynamic:
            if kwargs.get("dynamic"):
                raise ValueError(
                    f"the {self.compile_backend!r} torch.compile backend ({self.name}) does not support "
                    "dynamic=True: every new input shape compiles its own graph. Pad or bucket inputs to "
                    "a few fixed shapes and compile with dynamic=False"
                )
            kwargs.setdefault("dynamic", False)
        kwargs.setdefault("backend", self.compile_backend)
        return self._t().compile(model, **kwargs)

    def autocast(self, dtype: Any = None, **kwargs: Any) -> Any:
        """torch.autocast for this device type (dtype None: torch's default for the device)."""
        torch = self._t()
        if dtype is not None:
            kwargs["dtype"] = dtype
        return torch.autocast(device_type=self.autocast_device_type, **kwargs)

    # -- metrics -----------------------------------------------------------------------
    def _dynamo_counts(self) -> dict[str, Any]:
        # torch._dynamo is imported by torch.compile; if nothing imported it, nothing
        # was compiled, and importing it here would cost a second for nothing.
        utils = sys.modules.get("torch._dynamo.utils")
        if utils is None:
            return {"compilations": 0, "compile_seconds": 0.0}
        stats = utils.counters.get("stats", {})
        times = getattr(utils, "compilation_time_metrics", {})
        # A backward graph not found in inductor's cache compiles at its first call, outside the frame's compile.
        seconds = sum(times.get("_compile.compile_inner", [])) + sum(times.get("backward._backward_impl", []))
        return {"compilations": int(stats.get("unique_graphs", 0)), "compile_seconds": float(seconds)}

    def device_counters(self) -> dict[str, Any]:
        """Counters the device runtime itself keeps (compile cache); {} where it keeps none.

        Overridden where a runtime exposes them; called only once the backend is in use.
        """
        return {}

    def _safe_device_counters(self) -> dict[str, Any]:
        # A private vendor API may change or raise: stop asking after the first failure
        # rather than pay for (and hide) the same exception every step.
        if self._device_counters_broken or self._torch is None:
            return {}
        try:
            return self.device_counters()
        except Exception:
            self._device_counters_broken = True
            return {}

    def counters(self) -> dict[str, Any]:
        out = self._dynamo_counts()
        out.update(self._safe_device_counters())
        if self._reads is not None:
            out["device_to_host"] = self._reads(self.device_type)
        return out

    def memory_reading(self) -> dict[str, int]:
        """The device allocator's figures where the runtime keeps them (``torch.cuda.memory_allocated``,
        ``max_memory_allocated`` then ``reset_peak_memory_stats``, the total of ``mem_get_info``, or their
        ``torch.accelerator`` equivalents); on ``cpu``, where the host is the device, the process's resident
        memory (:func:`accelport.observe.memory.process_memory`). No call here waits for the device; one
        that fails is not made again (the fields it gives stay None)."""
        if self._torch is None:
            return {}
        if self.sync_api == "none":
            from accelport.observe.memory import process_memory

            return process_memory()
        out: dict[str, int] = {}
        for key, fn in (("memory_bytes", "memory_allocated"), ("peak_memory_bytes", "max_memory_allocated"),
                        ("", "reset_peak_memory_stats"), ("capacity_bytes", "mem_get_info")):
            if fn in self._memory_broken or (key == "capacity_bytes" and self._capacity is not None):
                continue
            if key == "" and "peak_memory_bytes" not in out:
                continue  # nothing to reset the peak for
            api = self.device_api(fn)
            if api is None:
                self._memory_broken.add(fn)
                continue
            try:
                value = api[1]()
            except Exception:  # no allocator statistics here: not asked again
                self._memory_broken.add(fn)
                continue
            if key == "capacity_bytes":
                self._capacity = int(value[1])  # (free, total): the total, read once
            elif key:
                out[key] = int(value)
            # reset_peak_memory_stats: the next reading's peak is that of the steps between
        if self._capacity:
            out["capacity_bytes"] = self._capacity
        return out

    def step_counters(self) -> dict[str, float]:
        utils = sys.modules.get("torch._dynamo.utils")
        out: dict[str, float] = {
            "compilations": int(utils.counters.get("stats", {}).get("unique_graphs", 0)) if utils else 0}
        if utils is not None:  # torch.compile ran: its graph breaks and recompile-limit hits
            if self._reads is not None:
                self._guard_compiles()  # (again after a torch._dynamo.reset())
            out["graph_breaks"] = len(getattr(utils, "graph_break_reasons", ()))
            if self._observer is not None:
                out["compile_limit_hits"] = self._observer.limit_hit_count()
        device = self._safe_device_counters()
        if "compilations" in device:
            out["compilations"] = device["compilations"]
        if self._reads is not None:  # (ap.after_step's own reads are not counted: see the tracer)
            out["device_to_host"] = self._reads(self.device_type)
        return out

    def compile_facts(self) -> dict[str, float]:
        # torch.compile's compile time since the last call (the step tracker asks when the count moved).
        if self._observer is None:
            return {}
        total = self._observer.compile_seconds()
        seconds, self._compile_seconds_seen = total - self._compile_seconds_seen, total
        return {"compile_seconds": max(seconds, 0.0)}

    # -- distributed -------------------------------------------------------------------
    def _dist(self) -> Any:
        if "torch.distributed" not in sys.modules and self._torch is None:
            return None
        import torch.distributed as dist

        return dist if dist.is_available() and dist.is_initialized() else None

    def world_size(self) -> int:
        dist = self._dist()
        return dist.get_world_size() if dist is not None else env_int(os.environ, "WORLD_SIZE", 1)

    def rank(self) -> int:
        dist = self._dist()
        return dist.get_rank() if dist is not None else env_int(os.environ, "RANK", 0)

    def barrier(self) -> None:
        dist = self._dist()
        if dist is not None:
            with self.collectives.waiting("ap.barrier"):
                dist.barrier()

    def broadcast(self, tensors: list[Any], src: int) -> None:
        """Overwrite ``tensors`` in place with rank ``src``'s values, one collective per bucket.

        Tensors are grouped by (device, dtype) and packed like the gradients; bool
        tensors travel as uint8 (not every backend broadcasts bool).
        """
        dist = self._dist()
        if dist is None or dist.get_world_size() == 1 or not tensors:
            return
        torch = self._t()
        groups: dict[tuple[Any, Any], list[Any]] = {}
        for t in tensors:
            groups.setdefault((t.device, t.dtype), []).append(t)
        with torch.no_grad():
            pending = []
            for (_, dtype), members in groups.items():
                wire = torch.uint8 if dtype == torch.bool else dtype
                for bucket in _buckets(members, BUCKET_BYTES):
                    flat = torch.cat([t.detach().reshape(-1).to(wire) for t in bucket])
                    pending.append((dist.broadcast(flat, src, async_op=True), flat, bucket))
            for work, flat, bucket in pending:
                with self.collectives.waiting("ap.broadcast"):
                    work.wait()
                offset = 0
                for t in bucket:
                    n = t.numel()
                    t.copy_(flat[offset:offset + n].view(t.shape).to(t.dtype))
                    offset += n

    def all_reduce(self, tensor: Any, op: str = "sum") -> Any:
        # tensor and op are checked once, in ap.all_reduce, for every backend.
        dist = self._dist()
        if dist is None or dist.get_world_size() == 1:
            return tensor
        with self.collectives.waiting("ap.all_reduce"):
            if tensor.is_contiguous():
                dist.all_reduce(tensor)
            else:  # collectives need dense memory; reduce a packed copy and write it back
                packed = tensor.contiguous()
                dist.all_reduce(packed)
                tensor.copy_(packed)
        if op == "mean":
            tensor.div_(dist.get_world_size())
        return tensor


#: Where a step's time goes on the host (``cpu``) and on an accelerator (see EagerBackend.time_phases).
_HOST_PHASES: Mapping[str, str] = {
    "pre": "device+other", "body": "device", "tail": "other", "sync": "device", "read": "host_sync",
    "collective": "collective", "sync_collective": "device+collective",
}
_ACCELERATOR_PHASES: Mapping[str, str] = {
    "pre": "device+host_sync+other", "body": "device+host_sync", "tail": "other", "sync": "device+host_sync",
    "read": "device+host_sync", "collective": "collective", "sync_collective": "device+host_sync+collective",
}


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
