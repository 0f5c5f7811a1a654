"""The xla backend for real on XLA:CPU (PJRT_DEVICE=CPU): torch_xla's real compiler and runtime.

Recompilations, host transfers and CPU fallbacks are read from torch_xla's own
counters; neuron-xla's code path runs here with only its constants swapped.
Runs in the xla environment: ``PJRT_DEVICE=CPU pytest -m xla``.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest

import accelport as ap
from tests.conftest import REPO, train_tiny

pytestmark = pytest.mark.xla


def tiny(features: int) -> tuple[Any, Any]:
    """A model whose input width no other test uses, so its graphs are new to torch_xla's cache."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(features, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return model.to(ap.device()), torch.optim.SGD(model.parameters(), lr=0.01)


def batches(features: int, sizes: list[int]) -> list[tuple[Any, Any]]:
    import torch

    return [(torch.randn(n, features), torch.randn(n, 1)) for n in sizes]


def train(model: Any, opt: Any, data: list[Any], inside: Callable[[Any, Any], None] | None = None) -> None:
    import torch

    for x, y in ap.loader(data):
        loss = torch.nn.functional.mse_loss(model(x), y)
        if inside is not None:
            inside(x, loss)
        loss.backward()
        ap.optimizer_step(opt)
        opt.zero_grad()


def fallbacks(m: ap.Metrics, op: str) -> int:
    return (m.cpu_fallback or {}).get(op, 0)


OBSERVER = """
import accelport as ap
RECORDS = []

@ap.hookimpl
def accelport_step_end(record):
    RECORDS.append(dict(record.delta))
"""


def test_fixed_shapes_compile_once_then_each_new_shape_compiles_once_more() -> None:
    ap.use("xla")
    model, opt = tiny(21)
    start = ap.metrics()
    train(model, opt, batches(21, [16] * 6))
    fixed = ap.metrics()
    assert fixed.compilations - start.compilations == 1
    assert fixed.cache_hits - start.cache_hits >= 5  # the other five steps reused the graph

    new_shapes = [3, 5, 7]
    train(model, opt, batches(21, new_shapes))
    grown = ap.metrics()
    assert grown.compilations - fixed.compilations == len(new_shapes)
    assert grown.batch_signatures == 1 + len(new_shapes)

    train(model, opt, batches(21, [5, 16, 3]))  # shapes seen before: nothing new to compile
    assert ap.metrics().compilations == grown.compilations
    assert grown.compile_seconds > 0.0


def test_item_inside_the_step_is_a_device_to_host_transfer_and_an_extra_execution(install_plugin: Any) -> None:
    install_plugin("observer", "accelport_test_observer", OBSERVER)
    import accelport_test_observer as observer

    ap.use("xla")
    model, opt = tiny(23)
    steps = 5
    train(model, opt, batches(23, [8] * steps))  # warm: both graphs compiled below are new only once
    train(model, opt, batches(23, [8] * steps), inside=lambda x, loss: loss.item())
    observer.RECORDS.clear()

    import torch_xla.core.xla_model as xm

    def settled() -> ap.Metrics:
        xm.wait_device_ops()  # executions are counted as they start, asynchronously
        return ap.metrics()

    before = settled()
    train(model, opt, batches(23, [8] * steps))
    clean = settled()
    train(model, opt, batches(23, [8] * steps), inside=lambda x, loss: loss.item())
    polled = settled()

    assert clean.device_to_host - before.device_to_host == 0
    assert polled.device_to_host - clean.device_to_host == steps
    assert fallbacks(polled, "aten::_local_scalar_dense") - fallbacks(clean, "aten::_local_scalar_dense") == steps
    assert clean.executions - before.executions == steps
    assert polled.executions - clean.executions == 2 * steps

    # Per step, as a diagnostics plugin sees it: one transfer in each polled step.
    # (.item() waits for its value, so the transfer is counted before the step ends.)
    assert [r["device_to_host"] for r in observer.RECORDS] == [0] * steps + [1] * steps
    assert all(r["compilations"] == 0 for r in observer.RECORDS)


def test_after_step_reads_values_without_an_extra_execution() -> None:
    ap.use("xla")
    model, opt = tiny(25)
    steps = 4
    train(model, opt, batches(25, [8] * steps))  # compile
    import torch_xla.core.xla_model as xm

    seen: list[float] = []
    xm.wait_device_ops()
    before = ap.metrics()
    train(model, opt, batches(25, [8] * steps), inside=lambda x, loss: ap.after_step(seen.append, loss))
    xm.wait_device_ops()
    after = ap.metrics()
    assert len(seen) == steps and all(isinstance(v, float) and math.isfinite(v) for v in seen)
    assert after.executions - before.executions == steps  # one graph per step, as without logging
    assert after.compilations == before.compilations


def test_an_op_without_an_xla_lowering_is_listed_as_a_cpu_fallback() -> None:
    import torch

    ap.use("xla")
    model, opt = tiny(27)
    before = fallbacks(ap.metrics(), "aten::nonzero")
    train(model, opt, batches(27, [8] * 3), inside=lambda x, loss: torch.nonzero(x > 0))
    assert fallbacks(ap.metrics(), "aten::nonzero") - before == 3


def test_counters_agree_with_each_other_and_with_torch_xla() -> None:
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    backend = ap.use("xla")
    train_tiny(steps=3)
    xm.wait_device_ops()
    full, cheap = backend.counters(), backend.step_counters()
    # after_step_reads: host reads made by ap.after_step callbacks (accelport's own count).
    assert set(cheap) == {"compilations", "device_to_host", "after_step_reads"}
    assert {k: full[k] for k in ("compilations", "device_to_host")} == \
        {k: cheap[k] for k in ("compilations", "device_to_host")}
    assert full["compilations"] == met.counter_value("UncachedCompile")
    assert full["executions"] == met.metric_data("ExecuteTime")[0]  # every execution finished
    assert full["host_to_device"] == met.metric_data("TransferToDeviceTime")[0]
    assert "memory_bytes" not in full  # not a counter: the memory sensor reads it (tests/xla/test_xla_memory.py)


def test_no_deprecated_torch_xla_api_is_called() -> None:
    ap.use("xla")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_tiny(steps=2)
        ap.sync()
        ap.barrier()
    deprecated = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert deprecated == []


def test_loader_prefetch_settings_and_early_exit() -> None:
    import torch

    ap.use("xla")
    data = [(torch.full((2,), float(i)), {"i": torch.tensor([i])}) for i in range(7)]
    for prefetch in (None, 0, 1, 3):
        got = [(x.device.type, int(extra["i"].cpu())) for x, extra in ap.loader(data, prefetch=prefetch)]
        assert got == [("xla", i) for i in range(7)], prefetch
    threads = threading.active_count()
    for _ in ap.loader(iter(data)):
        break  # the upload threads must stop with the loop
    assert threading.active_count() == threads
    assert ap.backend()._loading == 0


def test_a_source_that_raises_midway_raises_in_the_loop_after_the_batches_before_it(
        capfd: pytest.CaptureFixture[str]) -> None:
    # torch_xla's ParallelLoader reads the source in a thread of its own, which only prints an error and ends
    # the pass as if the source had run out: an epoch cut short without a word. The loop gets the error, as
    # on the other backends, and the next pass reads as usual.
    import torch

    ap.use("xla")

    def source(bad: int | None) -> Any:
        for i in range(5):
            if i == bad:
                raise ValueError(f"bad sample {i}")
            yield (torch.full((2,), float(i)),)

    for prefetch in (None, 0, 3):
        got: list[int] = []
        with pytest.raises(ValueError, match="bad sample 3"):
            for (x,) in ap.loader(source(3), prefetch=prefetch):
                got.append(int(x.cpu()[0]))
        assert got == [0, 1, 2], prefetch
        assert [int(x.cpu()[0]) for (x,) in ap.loader(source(None), prefetch=prefetch)] == [0, 1, 2, 3, 4]
    assert "Exception in thread" not in capfd.readouterr().err  # (said once, in the loop: not by the thread)
    assert ap.backend()._loading == 0


def test_batches_that_are_no_tuple_of_tensors_arrive_whatever_their_equality_says() -> None:
    # ap.loader reads torch_xla's device queue until it says it is done: by identity, never with the batch's own
    # ``==`` (a NumPy array's raises on a truth test, a class's own __eq__ may not take None).
    import numpy as np
    import torch

    class Pair:
        def __init__(self, i: int) -> None:
            self.x = torch.full((2,), float(i))

        def __eq__(self, other: object) -> bool:
            return bool((self.x == other.x).all())  # type: ignore[attr-defined]

    ap.use("xla")
    arrays = [np.full((2,), i, dtype=np.float32) for i in range(5)]
    assert [int(a[0]) for a in ap.loader(arrays)] == [0, 1, 2, 3, 4]
    pairs = [Pair(i) for i in range(5)]
    got = [p.x for p in ap.loader(pairs)]
    assert [x.device.type for x in got] == ["xla"] * 5 and [int(x.cpu()[0]) for x in got] == [0, 1, 2, 3, 4]


def test_a_none_batch_that_torch_xla_drops_leaves_each_later_step_its_own_shapes() -> None:
    # torch_xla's loader drops a None batch without a word (so does a raw MpDeviceLoader); the shapes the
    # diagnostics give each step stay those of its own batch.
    import torch

    from accelport.runtime.state import RUNTIME

    ap.use("xla")
    w = torch.nn.Parameter(torch.ones((), device=ap.device()))
    opt = torch.optim.SGD([w], lr=1e-3)
    data = [(torch.ones(n),) if n != 3 else None for n in range(1, 6)]
    seen = []
    for (x,) in ap.loader(data):
        (x * w).sum().backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
        seen.append(x.shape[0])
    assert seen == [1, 2, 4, 5]
    assert RUNTIME.tracker.signatures == {((torch.Size([n]), "float32"),) for n in (1, 2, 4, 5)}


def test_the_same_script_trains_on_cpu_and_on_xla() -> None:
    ap.use("cpu")
    on_cpu = train_tiny(steps=30)
    ap.use("xla")
    on_xla = train_tiny(steps=30)
    assert on_xla[-1] < 0.5 * on_xla[0]
    # Same data, same initial weights, same updates: the two runs agree closely.
    close = [math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-4) for a, b in zip(on_cpu, on_xla, strict=True)]
    assert all(close), (on_cpu, on_xla)


def test_the_unchanged_example_runs_on_xla() -> None:
    env = dict(os.environ, ACCELPORT_BACKEND="xla", PJRT_DEVICE="CPU")
    out = subprocess.run([sys.executable, "examples/quickstart.py"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("backend: xla (xla was chosen by ACCELPORT_BACKEND=xla;")


def test_compile_cache_after_the_first_computation_is_refused(tmp_path: pathlib.Path) -> None:
    ap.use("xla")
    train_tiny(steps=1)
    with pytest.raises(ap.AccelportError, match="after the first computation"):
        ap.compile_cache(tmp_path / "late")
    assert not (tmp_path / "late").exists()


COMPILE_CACHE_SCRIPT = """
import json, os, sys
import accelport as ap
from tests.conftest import train_tiny

first = ap.compile_cache(sys.argv[1])
again = ap.compile_cache(sys.argv[1])  # the same directory twice is fine
train_tiny(steps=3)
m = ap.metrics()
try:
    ap.compile_cache(sys.argv[2])
    late = None
except ap.AccelportError as exc:
    late = str(exc)
print(json.dumps({"first": first, "again": again, "reported": m.compile_cache_dir, "late": late,
                  "files": sorted(os.listdir(sys.argv[1])), "env": os.environ.get("XLA_PERSISTENT_CACHE_PATH")}))
"""


def test_compile_cache_before_the_first_computation_is_used(tmp_path: pathlib.Path) -> None:
    cache = tmp_path / "xla-cache"
    env = dict(os.environ, ACCELPORT_BACKEND="xla", PJRT_DEVICE="CPU")
    out = subprocess.run([sys.executable, "-c", COMPILE_CACHE_SCRIPT, str(cache), str(tmp_path / "other")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["first"] == got["again"] == got["reported"] == got["env"] == str(cache)
    assert got["files"], "torch_xla wrote no compiled program into the cache"
    assert "after the first computation" in got["late"]


# -- neuron-xla: the same lazy code path with only the constants swapped ---------------------

STAND_IN = """
from accelport.plugins.hookspecs import hookimpl
from accelport.lazy import Requirement
from accelport._backends.neuron_xla import NeuronXlaBackend


class NeuronXlaOnXlaCpu(NeuronXlaBackend):
    '''Stand-in: neuron-xla with only its device constants swapped, since no Trainium is here.

    PJRT device CPU instead of NEURON; no torch-neuronx / libneuronxla requirement.
    Every method is NeuronXlaBackend's own.
    '''

    name = "neuron-xla-on-xla-cpu"
    pjrt_devices = ("CPU",)
    runtime_module = None
    requires = (Requirement("torch_xla", same_minor_as_torch=True),)


@hookimpl
def accelport_register_backends(register):
    register(NeuronXlaOnXlaCpu)
"""


@pytest.fixture
def neuron_stand_in(install_plugin: Any) -> ap.Backend:
    install_plugin("neuron-xla-on-xla-cpu", "accelport_test_neuron_xla", STAND_IN)
    backend = ap.use("neuron-xla-on-xla-cpu")
    from accelport._backends.neuron_xla import NeuronXlaBackend

    assert type(backend).__mro__[1] is NeuronXlaBackend
    for attr in ("prepare", "optimizer_step", "wrap_loader", "counters", "enable_compile_cache", "save"):
        assert attr not in type(backend).__dict__  # nothing but constants was swapped
    return backend


def test_neuron_xla_code_path_trains_and_reports(neuron_stand_in: ap.Backend, tmp_path: pathlib.Path) -> None:
    import torch

    losses = train_tiny(steps=30)
    assert losses[-1] < 0.5 * losses[0]
    m = ap.metrics()
    assert m.backend == "neuron-xla-on-xla-cpu" and m.steps == 30
    assert m.compilations is not None and m.executions is not None and m.executions >= 30
    assert m.compile_cache_dir == "/var/tmp/neuron-compile-cache"
    assert ap.device().type == "xla"

    t = torch.arange(4.0, device=ap.device())
    ap.save({"t": t * 2}, tmp_path / "ckpt.pt")
    assert torch.equal(ap.load(tmp_path / "ckpt.pt", map_location="cpu")["t"], torch.arange(4.0) * 2)


def test_neuron_xla_compile_cache_follows_neuron_rules(neuron_stand_in: ap.Backend,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: pathlib.Path) -> None:
    flagged = str(tmp_path / "by-flag")
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(tmp_path / "by-url"))
    monkeypatch.setenv("NEURON_CC_FLAGS", f"--cache_dir={flagged} --retry_failed_compilation")
    assert ap.metrics().compile_cache_dir == flagged  # the flag wins over the URL
    assert ap.compile_cache(flagged) == flagged  # already where asked: nothing to change
    with pytest.raises(ap.AccelportError, match="--cache_dir=.*wins over"):
        ap.compile_cache(tmp_path / "elsewhere")

    monkeypatch.setenv("NEURON_CC_FLAGS", "--no_cache")
    assert ap.metrics().compile_cache_dir is None
    with pytest.raises(ap.AccelportError, match="--no_cache"):
        ap.compile_cache(tmp_path / "elsewhere")

    monkeypatch.delenv("NEURON_CC_FLAGS")
    train_tiny(steps=1)
    with pytest.raises(ap.AccelportError, match="after the first computation"):
        ap.compile_cache(tmp_path / "elsewhere")



def test_the_step_graph_compiles_and_runs_in_end_of_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    # ap.loader calls end_of_batch outside the data-wait clock (tests/runtime/test_loader.py), so
    # a step's compile and dispatch never read as waiting for data.
    import torch_xla.debug.metrics as met

    backend = ap.use("xla")
    real = backend.end_of_batch
    inside: list[tuple[int, int]] = []

    def lookups() -> tuple[int, int]:
        # Every launched graph is looked up in the compile cache first: a miss compiles.
        # (Its execution then runs asynchronously: ExecuteComputation counts it later.)
        miss, hit = met.counter_value("UncachedCompile") or 0, met.counter_value("CachedCompile") or 0
        return miss, miss + hit

    def spy() -> None:
        before = lookups()
        real()
        after = lookups()
        inside.append((after[0] - before[0], after[1] - before[1]))

    monkeypatch.setattr(backend, "end_of_batch", spy)
    model, opt = tiny(29)
    start = ap.metrics()
    train(model, opt, batches(29, [8] * 4))
    m = ap.metrics()
    assert len(inside) == 4  # after each of the four batches
    assert sum(c for c, _ in inside) == m.compilations - start.compilations == 1
    assert [launched for _, launched in inside] == [1, 1, 1, 1]  # each step's graph, once


TWO_REPLICAS = """
from accelport.plugins.hookspecs import hookimpl
from accelport._backends.xla import XlaBackend


class XlaAsOneOfTwoReplicas(XlaBackend):
    '''Stand-in: xla as if it were one of two replicas (multi-replica XLA:CPU cannot run here).

    Only world_size() is swapped; torch_xla itself still sees one replica, so no
    collective is issued.
    '''

    name = "xla-one-of-two-stand-in"

    def world_size(self):
        return 2


@hookimpl
def accelport_register_backends(register):
    register(XlaAsOneOfTwoReplicas)
"""


def test_with_several_replicas_the_step_runs_in_optimizer_step(install_plugin: Any) -> None:
    # A rank-0-only host read after the step (a save, a print) must never execute the
    # step's gradient all-reduce on one replica alone: the step ends on all of them at once.
    import torch_xla.debug.metrics as met

    install_plugin("two-replicas", "accelport_test_two_replicas", TWO_REPLICAS)
    ap.use("xla-one-of-two-stand-in")
    model, opt = tiny(31)
    launched: list[int] = []

    def lookups() -> int:
        return (met.counter_value("UncachedCompile") or 0) + (met.counter_value("CachedCompile") or 0)

    def step(x: Any, loss: Any) -> None:
        loss.backward()
        before = lookups()
        ap.optimizer_step(opt)
        launched.append(lookups() - before)
        opt.zero_grad()

    import torch

    for x, y in ap.loader(batches(31, [8] * 3)):
        step(x, torch.nn.functional.mse_loss(model(x), y))
    assert launched == [1, 1, 1]
