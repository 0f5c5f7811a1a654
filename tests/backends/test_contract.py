"""The backend contract, run for every registered backend that is available on this machine.

On a CPU-only machine this is ``cpu`` (and ``xla`` in the XLA environment); the
same tests run for ``cuda``/``tpu``/``neuron`` wherever those are available.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

import accelport as ap
from tests.conftest import train_tiny


@pytest.fixture
def backend_name(ap_backend: ap.Backend) -> str:
    # accelport's pytest plugin: one run per backend available here, or only the
    # session's backend with --accelport-backend (what a cloud CI job passes).
    return ap_backend.name


def test_at_least_one_backend_is_exercised() -> None:
    available = [b.name for b in ap.backends() if b.available]
    assert available, "no backend is available: the contract suite would test nothing"


def test_device_matches_backend(backend_name: str) -> None:
    dev = ap.device()
    assert ap.backend().name == backend_name
    assert dev.type in {"cpu", "cuda", "xla", "tpu", "neuron"}
    assert ap.device() == dev  # stable


def test_small_model_trains_and_loss_falls(backend_name: str) -> None:
    losses = train_tiny(steps=40)
    assert len(losses) == 40
    assert all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.5 * first, f"loss did not fall on {backend_name}: {first:.4f} -> {last:.4f}"


def test_batches_arrive_on_the_device(backend_name: str) -> None:
    import torch

    batches = [(torch.ones(2, 3), {"mask": torch.zeros(2, dtype=torch.bool)}) for _ in range(3)]
    seen = list(ap.loader(batches))
    assert len(seen) == 3
    for x, extra in seen:
        assert x.device.type == ap.device().type
        assert extra["mask"].device.type == ap.device().type
        assert extra["mask"].dtype == torch.bool


def test_save_load_round_trip(backend_name: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch

    model = torch.nn.Linear(4, 3).to(ap.device())
    state = {"model": model.state_dict(), "step": 7, "nested": [torch.arange(5)]}
    path = tmp_path / "ckpt.pt"
    ap.save(state, path)
    back = ap.load(path)
    assert back["step"] == 7
    for key, value in model.state_dict().items():
        assert back["model"][key].device.type == ap.device().type
        assert torch.equal(back["model"][key].cpu(), value.cpu())
    assert torch.equal(back["nested"][0].cpu(), torch.arange(5))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temp file left behind
    on_host = ap.load(path, map_location="cpu")
    assert on_host["model"]["weight"].device.type == "cpu"


def test_metrics_fields_have_the_right_types(backend_name: str) -> None:
    train_tiny(steps=6)
    m = ap.metrics()
    assert m.backend == backend_name
    assert m.steps == 6
    assert m.batch_signatures == 1
    assert m.data_wait_seconds >= 0.0 and m.step_seconds > 0.0
    for f in dataclasses.fields(m):
        value = getattr(m, f.name)
        if f.name in {"compilations", "executions", "host_to_device", "device_to_host", "cache_hits",
                      "memory_bytes", "peak_memory_bytes"}:
            assert value is None or (isinstance(value, int) and value >= 0), f.name
        if f.name in {"compile_seconds", "execute_seconds"}:
            assert value is None or (isinstance(value, float) and value >= 0), f.name
        if f.name == "cpu_fallback":
            assert value is None or all(isinstance(k, str) and isinstance(n, int) for k, n in value.items())
    assert isinstance(m.to_dict(), dict)


def test_single_process_distributed_defaults(backend_name: str) -> None:
    import torch

    assert ap.world_size() == 1 and ap.rank() == 0 and ap.is_main_process()
    ap.barrier()  # no-op alone, must not hang
    t = torch.ones(3, device=ap.device())
    assert torch.equal(ap.all_reduce(t, op="mean").cpu(), torch.ones(3))
    with pytest.raises(ValueError, match="'sum' or 'mean'"):
        ap.all_reduce(t, op="max")


def test_sync_and_after_step(backend_name: str) -> None:
    import torch

    got = []
    x = torch.tensor(2.5, device=ap.device()) * 2
    ap.after_step(lambda v, w: got.append((v, w.tolist())), x, torch.arange(3, device=ap.device()))
    ap.sync()
    assert got == [(5.0, [0, 1, 2])]
    with pytest.raises(TypeError, match="callable"):
        ap.after_step("not callable", x)  # type: ignore[arg-type]


def test_cpu_eager_has_no_transfer_or_fallback_counters() -> None:
    ap.use("cpu")
    train_tiny(steps=3)
    m = ap.metrics()
    # Not measurable on an eager CPU: None, never a made-up 0.
    assert m.host_to_device is None and m.device_to_host is None and m.cpu_fallback is None
    assert m.compilations == 0  # measured: nothing was compiled


def test_compilations_count_torch_compile_on_eager() -> None:
    import torch

    ap.use("cpu")
    before = ap.metrics().compilations
    f = torch.compile(lambda x: (x * 2).sum(), backend="eager", dynamic=False)
    f(torch.ones(3))
    f(torch.ones(3))
    assert ap.metrics().compilations == before + 1
