"""The tpu, neuron and cuda backends' own code, run for real on the host CPU.

There is no TPU, Trainium or GPU here. Each stand-in below is the real backend
class with only the tensor placement swapped (``device_type`` and
``autocast_device_type`` become "cpu"), so training, the loader, checkpoints,
metrics, compile and distributed set-up all run through the eager family's
code exactly as on the hardware. The vendor runtime calls themselves
(``torch.accelerator.synchronize``, ``torch.tpu._get_cache_stats``,
``torch.cuda.memory_allocated`` ...) are replaced by recorders, so each test
can assert *which* runtime API the backend would call.
"""

from __future__ import annotations

import math
import threading
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

import accelport as ap
from accelport._backends.cuda import CudaBackend
from accelport._backends.neuron import NeuronBackend
from accelport._backends.tpu import TpuBackend
from accelport.contract import Probe
from accelport.eager import EagerBackend
from accelport.runtime.state import RUNTIME
from tests.conftest import train_tiny


class TpuConstantsOnCpu(TpuBackend):
    """Stand-in: the tpu backend with its tensors on the host CPU (no TPU here)."""

    device_type = "cpu"
    autocast_device_type = "cpu"

    def _probe(self) -> Probe:
        return Probe(True, "stand-in: tpu backend code, tensors on the host CPU", 1)


class NeuronConstantsOnCpu(NeuronBackend):
    """Stand-in: the neuron backend with its tensors on the host CPU (no Trainium here)."""

    device_type = "cpu"
    autocast_device_type = "cpu"

    def _probe(self) -> Probe:
        return Probe(True, "stand-in: neuron backend code, tensors on the host CPU", 1)


class CudaConstantsOnCpu(CudaBackend):
    """Stand-in: the cuda backend with its tensors on the host CPU (no GPU here)."""

    device_type = "cpu"
    autocast_device_type = "cpu"

    def _probe(self) -> Probe:
        return Probe(True, "stand-in: cuda backend code, tensors on the host CPU", 1)


STANDINS: dict[str, type[EagerBackend]] = {
    "tpu": TpuConstantsOnCpu,
    "neuron": NeuronConstantsOnCpu,
    "cuda": CudaConstantsOnCpu,
}


class Runtime:
    """Recorders in place of the device runtimes' functions; ``calls`` lists what was called."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.cache_stats = {"num_cache_hits": 3, "num_cache_reqs": 5, "num_compilations": 2}
        mp = monkeypatch
        for name, result in (("synchronize", None), ("device_count", 1), ("set_device_index", None),
                             ("memory_allocated", 1024), ("max_memory_allocated", 4096),
                             ("reset_peak_memory_stats", None), ("get_memory_info", (1000, 16 << 30))):
            mp.setattr(torch.accelerator, name, self.recorder(f"torch.accelerator.{name}", result))
        for name, result in (("synchronize", None), ("device_count", 1), ("set_device", None),
                             ("memory_allocated", 2048), ("max_memory_allocated", 8192),
                             ("reset_peak_memory_stats", None), ("mem_get_info", (1000, 40 << 30))):
            mp.setattr(torch.cuda, name, self.recorder(f"torch.cuda.{name}", result))

        # TorchTPU's torch.tpu: its device functions raise for user code (torch_tpu 0.2.0 source:
        # "... is internal to TorchTPU ... Use torch.accelerator.X instead"),
        # which this stand-in reproduces; only the private cache statistics answer.
        def internal(*args: Any) -> None:
            raise RuntimeError("torch.tpu.synchronize is internal to TorchTPU. Use torch.accelerator.synchronize")

        mp.setattr(torch, "tpu", types.SimpleNamespace(
            synchronize=internal, device_count=internal, set_device=internal, memory_allocated=internal,
            _get_cache_stats=self.recorder("torch.tpu._get_cache_stats", lambda: dict(self.cache_stats)),
        ), raising=False)
        self.neuron_module(with_synchronize=True)

        # Page-locking host memory needs a CUDA driver; record where it is asked for and
        # hand the tensor back, so the copy path after it runs for real.
        def pin_memory(tensor: torch.Tensor, *args: Any) -> torch.Tensor:
            self.calls.append(("Tensor.pin_memory", (threading.current_thread().name,)))
            return tensor

        mp.setattr(torch.Tensor, "pin_memory", pin_memory)

    def recorder(self, name: str, result: Any) -> Callable[..., Any]:
        def record(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args))
            return result() if callable(result) else result

        return record

    def neuron_module(self, *, with_synchronize: bool, with_memory: bool = False) -> None:
        """torch.neuron as TorchNeuron registers it; whether it has synchronize() is unconfirmed, and
        ``with_memory`` gives it memory functions of its own (figures unlike torch.accelerator's)."""
        module = types.SimpleNamespace(device_count=self.recorder("torch.neuron.device_count", 1),
                                       set_device=self.recorder("torch.neuron.set_device", None))
        if with_synchronize:
            module.synchronize = self.recorder("torch.neuron.synchronize", None)
        if with_memory:
            for name, result in (("memory_allocated", 512), ("max_memory_allocated", 2048),
                                 ("reset_peak_memory_stats", None), ("mem_get_info", (1, 32 << 30))):
                setattr(module, name, self.recorder(f"torch.neuron.{name}", result))
        torch.neuron = module  # type: ignore[attr-defined]  # restored by the fixture's monkeypatch

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Runtime:
    monkeypatch.setattr(torch, "neuron", None, raising=False)  # registers the attribute for restoring
    return Runtime(monkeypatch)


@pytest.fixture(params=sorted(STANDINS))
def standin(request: pytest.FixtureRequest, runtime: Runtime) -> EagerBackend:
    return select(STANDINS[request.param]())


def select(backend: EagerBackend) -> EagerBackend:
    """Register ``backend`` under its real name in place of the real one, and select it."""
    RUNTIME.host().backends[backend.name] = backend
    chosen = ap.use(backend.name)
    assert chosen is backend
    return backend


# -- the same training loop, loader, checkpoints and metrics as on the hardware ----------


def test_a_small_model_trains_through_the_backend(standin: EagerBackend) -> None:
    losses = train_tiny(steps=40)
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    assert ap.metrics().steps == 40 and ap.metrics().backend == standin.name


def test_loader_copies_batches_the_way_the_backend_says(standin: EagerBackend, runtime: Runtime,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    copies: list[tuple[str, bool]] = []
    real_to = torch.Tensor.to

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        copies.append((threading.current_thread().name, bool(kwargs.get("non_blocking"))))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    runtime.calls.clear()
    batches = [(torch.ones(2, 3), {"mask": torch.zeros(2, dtype=torch.bool)}) for _ in range(3)]
    seen = list(ap.loader(batches, prefetch=2))
    assert len(seen) == 3 and all(x.device.type == ap.device().type for x, _ in seen)
    assert seen[0][1]["mask"].dtype == torch.bool
    # Every tensor is copied in the prefetch thread; cuda pins and copies non-blocking.
    assert len(copies) == 6 and {name for name, _ in copies} == {"accelport-prefetch"}
    assert {nb for _, nb in copies} == {standin.pin_memory}
    pinned = [args[0] for name, args in runtime.calls if name == "Tensor.pin_memory"]
    assert pinned == (["accelport-prefetch"] * 6 if standin.pin_memory else [])


def test_save_and_load_round_trip(standin: EagerBackend, tmp_path: Any) -> None:
    model = torch.nn.Linear(4, 3).to(ap.device())
    ap.save({"model": model.state_dict(), "step": 3}, tmp_path / "ckpt.pt")
    back = ap.load(tmp_path / "ckpt.pt")
    assert back["step"] == 3
    assert all(torch.equal(back["model"][k], v) for k, v in model.state_dict().items())
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_sync_calls_the_api_the_backend_names(standin: EagerBackend, runtime: Runtime) -> None:
    expected = {"tpu": "torch.accelerator.synchronize", "neuron": "torch.neuron.synchronize",
                "cuda": "torch.cuda.synchronize"}[standin.name]
    assert standin.device_api("synchronize")[0] == expected  # type: ignore[index]
    runtime.calls.clear()
    ap.sync()
    assert runtime.names() == [expected]


def test_neuron_without_a_synchronize_of_its_own_uses_torch_accelerator(runtime: Runtime) -> None:
    runtime.neuron_module(with_synchronize=False)
    select(NeuronConstantsOnCpu())
    runtime.calls.clear()
    ap.sync()
    assert runtime.names() == ["torch.accelerator.synchronize"]


def test_neuron_reads_memory_through_torch_accelerator_first(runtime: Runtime) -> None:
    # Neuron 2.34's release notes: the torch.accelerator memory functions work on Neuron.
    runtime.neuron_module(with_synchronize=True, with_memory=True)
    backend = select(NeuronConstantsOnCpu())
    train_tiny(steps=3)
    m = ap.metrics()
    assert (m.memory_bytes, m.peak_memory_bytes, m.capacity_bytes) == (1024, 4096, 16 << 30)
    own = {f"torch.neuron.{n}" for n in ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats",
                                         "mem_get_info")}
    assert not own & set(runtime.names())
    # Only the memory reads changed: the device functions stay torch.neuron's.
    assert backend.device_api("synchronize")[0] == "torch.neuron.synchronize"  # type: ignore[index]
    assert "torch.neuron.device_count" in runtime.names()


def test_neuron_memory_without_torch_accelerator_functions_reads_torch_neuron(
        runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime.neuron_module(with_synchronize=True, with_memory=True)
    for name in ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats", "get_memory_info"):
        monkeypatch.delattr(torch.accelerator, name)  # an older torch
    select(NeuronConstantsOnCpu())
    train_tiny(steps=3)
    m = ap.metrics()
    assert (m.memory_bytes, m.peak_memory_bytes, m.capacity_bytes) == (512, 2048, 32 << 30)


def test_neuron_memory_falls_back_for_good_when_torch_accelerator_raises(
        runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    # A TorchNeuron before Neuron 2.34 may not back torch.accelerator's allocator statistics.
    def unbacked(*args: Any) -> int:
        runtime.calls.append(("torch.accelerator.memory_allocated", args))
        raise RuntimeError("the neuron allocator does not report statistics")

    runtime.neuron_module(with_synchronize=True, with_memory=True)
    monkeypatch.setattr(torch.accelerator, "memory_allocated", unbacked)
    select(NeuronConstantsOnCpu())
    train_tiny(steps=3)
    assert ap.metrics().memory_bytes == 512  # torch.neuron's figure, not none at all
    ap.metrics()
    names = runtime.names()
    assert names.count("torch.accelerator.memory_allocated") == 1  # asked once, then left alone
    assert names.count("torch.neuron.memory_allocated") >= 2
    assert "torch.accelerator.max_memory_allocated" in names  # the others still come from torch.accelerator


def test_tpu_never_calls_torch_tpu_device_functions(runtime: Runtime) -> None:
    # torch.tpu.synchronize and friends raise for user code; a whole run must not touch them.
    select(TpuConstantsOnCpu())
    train_tiny(steps=3)
    ap.sync()
    ap.metrics()
    assert not [n for n in runtime.names() if n.startswith("torch.tpu.") and n != "torch.tpu._get_cache_stats"]
    assert "torch.accelerator.device_count" in runtime.names()


def test_metrics_come_from_the_backends_runtime(standin: EagerBackend, runtime: Runtime) -> None:
    runtime.cache_stats.update(num_cache_hits=10, num_compilations=5)  # after the baseline at selection
    train_tiny(steps=4)
    m = ap.metrics()
    memory = {"tpu": (1024, 4096), "neuron": (1024, 4096), "cuda": (2048, 8192)}[standin.name]
    assert (m.memory_bytes, m.peak_memory_bytes) == memory
    # The peak is reset after each reading (the next is that of the steps between); the total read once.
    module = "torch.cuda" if standin.name == "cuda" else "torch.accelerator"
    total = "mem_get_info" if standin.name == "cuda" else "get_memory_info"
    assert m.capacity_bytes == (40 << 30 if standin.name == "cuda" else 16 << 30)
    assert runtime.names().count(f"{module}.{total}") == 1
    peaks = [i for i, n in enumerate(runtime.names()) if n == f"{module}.max_memory_allocated"]
    assert len(peaks) >= 5 and all(runtime.names()[i + 1] == f"{module}.reset_peak_memory_stats" for i in peaks)
    if standin.name == "tpu":
        # TorchTPU's compile cache: the change since the backend was selected (3 -> 10 hits, 2 -> 5 compiles).
        assert (m.cache_hits, m.compilations) == (7, 3)
    else:
        assert m.cache_hits is None and m.compilations == 0
    assert m.host_to_device is None and m.cpu_fallback is None  # not measurable: None, never 0


def test_a_private_stats_api_that_breaks_leaves_the_fields_empty(runtime: Runtime) -> None:
    def broken() -> Any:
        runtime.calls.append(("torch.tpu._get_cache_stats", ()))
        raise AttributeError("_get_cache_stats changed")

    torch.tpu._get_cache_stats = broken  # type: ignore[attr-defined]
    select(TpuConstantsOnCpu())
    train_tiny(steps=3)
    m = ap.metrics()
    assert m.cache_hits is None and m.compilations == 0  # dynamo's count; TorchTPU's is unavailable
    assert runtime.names().count("torch.tpu._get_cache_stats") == 1  # asked once, then left alone


def test_cache_stats_as_an_object_with_attributes(runtime: Runtime) -> None:
    stats = types.SimpleNamespace(num_cache_hits=4, num_cache_reqs=9, num_compilations=True)  # bool: not a count
    torch.tpu._get_cache_stats = lambda: stats  # type: ignore[attr-defined]
    backend = select(TpuConstantsOnCpu())
    assert backend.device_counters() == {"cache_hits": 4}


def test_step_counters_report_the_runtimes_compilations(runtime: Runtime, install_plugin: Any) -> None:
    install_plugin(
        "recorder", "step_recorder",
        "import accelport as ap\nrecords = []\n"
        "@ap.hookimpl\ndef accelport_step_end(record):\n    records.append(dict(record.delta))\n")
    import sys

    select(TpuConstantsOnCpu())
    train_tiny(steps=2)
    runtime.cache_stats["num_compilations"] = 9
    train_tiny(steps=1)
    deltas = sys.modules["step_recorder"].records
    # The 2 compilations before selection are not the first step's: steps count from the
    # backend's selection, as ap.metrics() does.
    assert [d["compilations"] for d in deltas] == [0, 0, 7]


def test_a_multi_process_job_sets_the_device_and_the_process_group(standin: EagerBackend, runtime: Runtime,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    groups: list[str] = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend: groups.append(backend))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    runtime.calls.clear()
    standin._device = None
    standin.prepare()
    assert groups == [{"tpu": "tpu", "neuron": "neuron", "cuda": "nccl"}[standin.name]]
    if standin.name == "tpu":
        # TorchTPU runs one process per chip and each sees its chip as tpu:0 (its own process
        # group code defaults to torch.device("tpu:0")): no LOCAL_RANK indexing, no set_device.
        assert not any("set_device" in name for name, _ in runtime.calls)
        assert standin.device().index in (0, None)  # the current (only) chip
        return
    set_device = {"neuron": "torch.neuron.set_device", "cuda": "torch.cuda.set_device"}[standin.name]
    assert (set_device, (3,)) in runtime.calls
    assert standin.device().index == 3  # this process's device: LOCAL_RANK


def test_a_runtime_that_sees_no_device_refuses_with_a_reason(runtime: Runtime,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 0)
    RUNTIME.host().backends["tpu"] = TpuConstantsOnCpu()
    with pytest.raises(ap.BackendUnavailableError, match=r"sees no cpu device \(torch.accelerator.device_count"):
        ap.use("tpu")


def test_the_vendor_module_is_imported_when_torch_lacks_the_device(monkeypatch: pytest.MonkeyPatch,
                                                                   runtime: Runtime) -> None:
    monkeypatch.delattr(torch, "neuron")
    RUNTIME.host().backends["neuron"] = NeuronConstantsOnCpu()
    with pytest.raises(ap.BackendUnavailableError, match=r"import torch_neuronx failed"):
        ap.use("neuron")


# -- compile and autocast ---------------------------------------------------------------


def test_compile_uses_the_backends_compiler(standin: EagerBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: seen.append(kw) or model)
    model = torch.nn.Linear(2, 2)
    assert ap.compile(model) is model
    if standin.name == "cuda":
        assert seen == [{"backend": "inductor"}]
    else:
        assert seen == [{"backend": standin.name, "dynamic": False}]
        with pytest.raises(ValueError, match=r"does not support dynamic=True.*Pad or bucket"):
            ap.compile(model, dynamic=True)
    ap.compile(model, backend="eager", fullgraph=True)
    assert seen[-1]["backend"] == "eager" and seen[-1]["fullgraph"] is True


def test_autocast_follows_the_backend(standin: EagerBackend) -> None:
    layer = torch.nn.Linear(4, 4).to(ap.device())
    with ap.autocast(torch.bfloat16):
        out = layer(torch.ones(2, 4, device=ap.device()))
    assert out.dtype == torch.bfloat16


def test_cpu_compile_and_autocast_for_real() -> None:
    ap.use("cpu")
    before = ap.metrics().compilations
    f = ap.compile(lambda x: (x * 3).sum(), backend="eager")
    assert f(torch.ones(4)).item() == 12.0
    assert ap.metrics().compilations == before + 1
    with ap.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


# -- the constants themselves (what the stand-ins keep) ------------------------------------


@pytest.mark.parametrize("cls, constants", [
    (TpuBackend, dict(device_type="tpu", device_module="tpu", vendor_module="torch_tpu", dist_backend="tpu",
                      compile_backend="tpu", compile_dynamic=False, autocast_device_type="tpu",
                      sync_api="accelerator", pin_memory=False, platform="gcp-tpu")),
    (NeuronBackend, dict(device_type="neuron", device_module="neuron", vendor_module="torch_neuronx",
                         dist_backend="neuron", compile_backend="neuron", compile_dynamic=False,
                         autocast_device_type="neuron", sync_api="module", pin_memory=False,
                         platform="aws-neuron")),
    (CudaBackend, dict(device_type="cuda", device_module="cuda", dist_backend="nccl", compile_backend="inductor",
                       compile_dynamic=True, autocast_device_type="cuda", sync_api="module", pin_memory=True,
                       platform="nvidia-gpu")),
])
def test_backend_constants(cls: type[EagerBackend], constants: dict[str, Any]) -> None:
    assert {k: getattr(cls, k) for k in constants} == constants
    standin = STANDINS[cls.name]
    swapped = {k for k in vars(standin) if not k.startswith("_")}
    assert swapped == {"device_type", "autocast_device_type"}  # nothing else differs from the real backend
