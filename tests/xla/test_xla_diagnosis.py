"""The diagnostics on real XLA:CPU loops: each pathology is named, healthy loops stay silent.

Every test trains a tiny model through ``ap.loader`` + ``ap.optimizer_step`` on
the xla backend (torch_xla's real compiler and runtime on the host CPU), and
asserts the kinds ``ap.diagnostics()`` reports: exactly the expected ones, or
none at all. Runs in the xla environment: ``PJRT_DEVICE=CPU pytest -m xla``.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import pytest

import accelport as ap
from tests.conftest import REPO
from tests.diagnoses import kinds, silent

pytestmark = pytest.mark.xla


class Pooled:
    """A tiny sequence model: masked mean over the sequence, then a linear layer.

    ``features`` differs between tests so each compiles its own graphs (torch_xla's
    in-memory cache is process-wide).
    """

    def __init__(self, features: int) -> None:
        import torch

        torch.manual_seed(0)
        self.linear = torch.nn.Linear(features, 1).to(ap.device())
        self.opt = torch.optim.SGD(self.linear.parameters(), lr=0.01)

    def loss(self, x: Any, mask: Any, y: Any) -> Any:
        import torch

        pooled = (x * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        return torch.nn.functional.mse_loss(self.linear(pooled).squeeze(-1), y)

    def train(self, batches: Iterable[Any], inside: Callable[[int, Any], None] | None = None) -> None:
        for i, (x, mask, y) in enumerate(ap.loader(batches)):
            loss = self.loss(x, mask, y)
            if inside is not None:
                inside(i, loss)
            loss.backward()
            ap.optimizer_step(self.opt)
            self.opt.zero_grad()


def samples(n: int, features: int, lengths: Callable[[int], int]) -> list[tuple[Any, Any]]:
    """(sequence of shape (length, features), 0-d target) pairs."""
    import torch

    g = torch.Generator().manual_seed(1)
    return [(torch.randn(lengths(i), features, generator=g), torch.randn((), generator=g)) for i in range(n)]


def pad_to_longest(batch: list[tuple[Any, Any]]) -> tuple[Any, Any, Any]:
    """The usual collate_fn: pad to the batch's longest sequence (a new shape almost every batch)."""
    import torch

    xs = torch.nn.utils.rnn.pad_sequence([x for x, _ in batch], batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(x)) for x, _ in batch], batch_first=True)
    return xs, mask, torch.stack([y for _, y in batch])


def with_mask(collate: Callable[[list[Any]], Any]) -> Callable[[list[Any]], tuple[Any, Any, Any]]:
    """Wrap a collate_fn of (x, y) pairs so it also returns the mask of real positions."""
    import torch

    def run(batch: list[tuple[Any, Any]]) -> tuple[Any, Any, Any]:
        padded = collate([(x, torch.ones(len(x)), y) for x, y in batch])
        return padded[0], padded[1], padded[2]

    return run


def loader(data: list[Any], batch_size: int, collate: Callable[[list[Any]], Any], **kwargs: Any) -> Any:
    from torch.utils.data import DataLoader

    return DataLoader(data, batch_size=batch_size, collate_fn=collate, **kwargs)


# -- pathological loops: the right kind, with its cause ---------------------------------------


def test_padding_to_the_batch_maximum_is_a_recompilation_naming_the_changed_shape() -> None:
    ap.use("xla")
    model = Pooled(5)
    # The longest sequence of batch i is 10 + i: a new shape, so a new graph, every step.
    data = samples(30 * 4, 5, lambda i: 10 + i // 4)
    start = ap.metrics()
    with pytest.warns(ap.DiagnosticWarning, match="recompil"):
        model.train(loader(data, 4, pad_to_longest))
    assert kinds() == ["recompilation"]
    found = ap.diagnostics()[0]
    assert found.step <= 30
    m = ap.metrics()
    assert m.compilations - start.compilations >= 25 and m.batch_signatures == 30
    # The loader's batch signatures name what changed: input 0, along the sequence.
    assert "input 0 changed from (4, " in found.text and ", 5) to (4, " in found.text
    assert "BucketCollate" in found.text
    assert found.evidence["distinct_signatures"] >= 8


def test_boolean_indexing_falls_back_to_the_cpu_reads_the_host_and_recompiles() -> None:
    """What torch_xla 2.9 really does with ``x[mask]``: the mask's ``nonzero`` has no XLA
    lowering, so it runs on the host (cpu-fallback), which copies the mask to the host in
    the middle of the step (host-sync); the selected count then sets the shape of what
    follows, so every new count is a new graph (recompilation, with unchanged input shapes).
    """
    import torch

    ap.use("xla")
    torch.manual_seed(0)
    model = torch.nn.Linear(7, 1).to(ap.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # Batch i has exactly 8 + i positive targets: a different selected count every step.
    data = []
    for i in range(30):
        y = -torch.rand(48, 1)
        y[: 8 + i] *= -1
        data.append((torch.randn(48, 7), y))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.DiagnosticWarning)
        for x, y in ap.loader(data):
            keep = (y > 0).squeeze(1)
            loss = ((model(x)[keep] - y[keep]) ** 2).mean()
            loss.backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
    found = {d.kind: d for d in ap.diagnostics()}
    assert set(found) == {"cpu-fallback", "host-sync", "recompilation"}
    assert "aten::nonzero" in found["cpu-fallback"].evidence["ops"]
    assert "input shapes did not change" in found["recompilation"].text
    assert "masked_sum" in found["recompilation"].text
    assert "cpu-fallback" in found["host-sync"].text  # the host reads are the fallbacks' own
    assert ap.metrics().cpu_fallback["aten::nonzero"] >= 30


def test_item_every_step_is_a_host_sync() -> None:
    ap.use("xla")
    model = Pooled(9)
    data = samples(20 * 4, 9, lambda i: 6)
    with pytest.warns(ap.DiagnosticWarning, match="host-sync"):
        model.train(loader(data, 4, pad_to_longest), inside=lambda i, loss: loss.item())
    assert kinds() == ["host-sync"]
    found = ap.diagnostics()[0]
    assert found.evidence["transfers_per_step"] == 1.0
    assert "ap.after_step" in found.text


class SlowDataset:
    """A dataset whose __getitem__ sleeps: the loader, not the model, is the bottleneck."""

    def __init__(self, n: int, delay: float, features: int) -> None:
        self.n, self.delay, self.features = n, delay, features

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        import torch

        time.sleep(self.delay)
        return torch.randn(6, self.features), torch.randn(())


def test_a_slow_dataset_without_workers_is_input_bound() -> None:
    ap.use("xla")
    model = Pooled(11)
    # 120 ms of sleep per batch against a step of a few milliseconds: the loader stays the
    # bottleneck even when two CPU-bound processes beside the test slow the step down tenfold
    # (with 12 ms per batch, such a step caught up and the loop waited under 30% of the time).
    with pytest.warns(ap.DiagnosticWarning, match="input-bound"):
        model.train(loader(SlowDataset(16 * 4, 0.03, 11), 4, pad_to_longest, num_workers=0))
    assert kinds() == ["input-bound"]
    found = ap.diagnostics()[0]
    assert found.evidence["num_workers"] == 0 and found.evidence["data_wait_share"] >= 0.3
    assert "num_workers=0" in found.text and f"{os.cpu_count()} CPU cores" in found.text


def test_400_ops_without_a_sync_inside_a_step_is_graph_growth() -> None:
    ap.use("xla")
    model = Pooled(13)
    data = samples(16 * 4, 13, lambda i: 6)
    totals: list[Any] = []

    def accumulate(i: int, loss: Any) -> None:
        if i == 11:  # one step sums a metric over 400 slices, never syncing in between
            total = loss.detach()
            for _ in range(400):
                total = total + loss.detach()
            totals.append(total)

    with pytest.warns(ap.DiagnosticWarning, match="graph-growth"):
        model.train(loader(data, 4, pad_to_longest), inside=accumulate)
    assert kinds() == ["graph-growth"]
    found = ap.diagnostics()[0]
    usual, grown = found.evidence["usual_graph_nodes"], found.evidence["graph_nodes"]
    assert grown >= 800 and grown >= 4 * usual
    assert found.step in (12, 13)  # the grown graph compiles at the sync after its step
    assert "ap.sync()" in found.text


def test_a_large_graph_every_step_after_a_small_start_up_graph_is_silent() -> None:
    import torch

    ap.use("xla")
    model = Pooled(14)
    (torch.zeros(3, device=ap.device()) + 1).sum()
    ap.sync()  # a tiny start-up graph, compiled before the first step

    def accumulate(i: int, loss: Any) -> None:  # 400 ops in every step: large, but usual
        total = loss.detach()
        for _ in range(400):
            total = total + loss.detach()
        ap.after_step(lambda value: None, total)

    silent(lambda: model.train(loader(samples(20 * 4, 14, lambda i: 6), 4, pad_to_longest), inside=accumulate))


XLA_USE_BF16_RUN = """
import json, warnings
import accelport as ap
from tests.xla.test_xla_diagnosis import Pooled, loader, pad_to_longest, samples

warnings.simplefilter("ignore")
ap.use("xla")
model = Pooled(15)
model.train(loader(samples(8 * 4, 15, lambda i: 6), 4, pad_to_longest))
import torch
on_device = torch.ones(2).to(ap.device())
import torch_xla
print(json.dumps({"kinds": [d.to_dict() for d in ap.diagnostics()],
                  "ir": torch_xla._XLAC._get_xla_tensors_text([on_device])}))
"""


def test_xla_use_bf16_is_a_deprecated_config() -> None:
    # In its own process: torch_xla reads XLA_USE_BF16 once, when it starts.
    env = dict(os.environ, PJRT_DEVICE="CPU", XLA_USE_BF16="1")
    out = subprocess.run([sys.executable, "-c", XLA_USE_BF16_RUN], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "bf16[2]" in got["ir"]  # it really is in effect: float32 data is stored as bf16
    assert [d["kind"] for d in got["kinds"]] == ["deprecated-config"]
    (found,) = got["kinds"]
    assert found["step"] == 1 and found["evidence"]["settings"] == ["XLA_USE_BF16"]
    assert "autocast" in found["message"]


def test_cpu_fallbacks_count_from_the_backend_selection() -> None:
    """torch_xla's counters are process-wide: fallbacks of an earlier run are not this run's."""
    import torch

    ap.use("xla")
    x = torch.randn(8, device=ap.device())
    torch.nonzero(x > 0)  # a fallback before the run we diagnose
    from accelport.runtime.state import RUNTIME

    RUNTIME.reset()  # a new run in the same process: torch_xla still counts the nonzero
    ap.use("xla")
    silent(lambda: Pooled(17).train(loader(samples(12 * 4, 17, lambda i: 6), 4, pad_to_longest)))
    assert ap.metrics().cpu_fallback == {}


def test_without_ap_loader_a_recompilation_says_the_shapes_are_unknown() -> None:
    import torch

    ap.use("xla")
    torch.manual_seed(0)
    model = torch.nn.Linear(11, 1).to(ap.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.warns(ap.DiagnosticWarning, match="recompil"):
        for i in range(30):  # batches of 8 + i rows, moved by hand: accelport never sees them
            x, y = torch.randn(8 + i, 11).to(ap.device()), torch.randn(8 + i, 1).to(ap.device())
            torch.nn.functional.mse_loss(model(x), y).backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
    (found,) = ap.diagnostics()
    assert "did not come through ap.loader" in found.text and "did not change" not in found.text


TRACE_RUN = """
import json, sys, warnings
import accelport as ap
from tests.xla.test_xla_diagnosis import Pooled, loader, pad_to_longest, samples

warnings.simplefilter("ignore")
ap.use("xla")
model = Pooled(19)


def inside(i, loss):
    print(loss, file=sys.stderr)  # THE READ
    return None


model.train(loader(samples(20 * 4, 19, lambda i: 6), 4, pad_to_longest), inside=inside)
print(json.dumps([d.to_dict() for d in ap.diagnostics()]))
"""


def test_trace_mode_names_the_line_that_prints_a_device_tensor(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRACE_RUN)
    line = TRACE_RUN.splitlines().index("    print(loss, file=sys.stderr)  # THE READ") + 1
    env = dict(os.environ, PJRT_DEVICE="CPU", ACCELPORT_DIAGNOSTICS="trace", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (found,) = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["kind"] == "host-sync"
    assert found["evidence"]["sites"] == [f"{script}:{line}"]
    assert f"It happens at {script}:{line}." in found["message"]


def test_a_steps_own_compilation_is_in_its_own_record(install_plugin: Any) -> None:
    """Inside ap.loader a step's graph runs when the loop asks for the next batch; the
    record of that step is finished after it, so step 1 holds step 1's compilation."""
    install_plugin("steps_seen", "accelport_test_steps_seen",
                   "import accelport as ap\nSEEN = []\n"
                   "@ap.hookimpl\ndef accelport_step_end(record):\n"
                   "    SEEN.append((record.step, record.seconds, dict(record.delta)))\n")
    import accelport_test_steps_seen as seen

    ap.use("xla")
    silent(lambda: Pooled(23).train(loader(samples(12 * 4, 23, lambda i: 6), 4, pad_to_longest)))
    step, seconds, delta = seen.SEEN[0]
    assert step == 1 and delta["compilations"] >= 1
    assert 0 < delta["compile_seconds"] <= seconds  # the step's time includes its compile
    assert all(d["compilations"] == 0 for _, _, d in seen.SEEN[3:])  # one graph, compiled early


def test_two_optimizer_steps_per_batch_give_two_records(install_plugin: Any) -> None:
    """A GAN-style loop steps two optimizers per batch: every step gets its record."""
    install_plugin("two_steps_seen", "accelport_test_two_steps_seen",
                   "import accelport as ap\nSEEN = []\n"
                   "@ap.hookimpl\ndef accelport_step_end(record):\n"
                   "    SEEN.append(record.step)\n")
    import accelport_test_two_steps_seen as seen

    ap.use("xla")
    first, second = Pooled(27), Pooled(27)

    def run() -> None:
        for x, mask, y in ap.loader(loader(samples(10 * 4, 27, lambda i: 6), 4, pad_to_longest)):
            for model in (first, second):
                model.loss(x, mask, y).backward()
                ap.optimizer_step(model.opt)
                model.opt.zero_grad()

    silent(run)
    assert ap.metrics().steps == 20
    assert seen.SEEN == list(range(1, 21))


def test_masked_mean_instead_of_boolean_indexing_compiles_once_and_stays_on_the_device() -> None:
    import torch

    ap.use("xla")
    torch.manual_seed(0)
    model = torch.nn.Linear(13, 1).to(ap.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = []
    for i in range(30):  # the same data as the boolean-indexing test: 8 + i selected rows
        y = -torch.rand(48, 1)
        y[: 8 + i] *= -1
        data.append((torch.randn(48, 13), y))
    start = ap.metrics()

    def run() -> None:
        for x, y in ap.loader(data):
            keep = (y > 0).squeeze(1)
            loss = ap.data.masked_mean((model(x) - y).squeeze(1) ** 2, keep)
            loss.backward()
            ap.optimizer_step(opt)
            opt.zero_grad()

    silent(run)
    m = ap.metrics()
    assert m.compilations - start.compilations <= 3  # the step's graph, and optimizer start-up
    assert m.cpu_fallback == {}


# -- healthy loops: not a single diagnosis -------------------------------------------------


def test_fixed_padding_is_silent() -> None:
    ap.use("xla")
    model = Pooled(19)
    data = samples(40 * 4, 19, lambda i: 3 + i % 29)

    def pad_to_32(batch: list[Any]) -> Any:
        import torch

        xs = torch.stack([ap.data.pad_to(x, 32, dim=0) for x, _ in batch])
        mask = torch.stack([ap.data.pad_to(torch.ones(len(x)), 32) for x, _ in batch])
        return xs, mask, torch.stack([y for _, y in batch])

    start = ap.metrics()
    silent(lambda: model.train(loader(data, 4, pad_to_32)))
    assert ap.metrics().compilations - start.compilations <= 2


def test_bucketing_with_a_first_step_and_a_ragged_final_batch_is_silent() -> None:
    import random

    from torch.utils.data import DataLoader

    ap.use("xla")
    model = Pooled(21)
    rng = random.Random(3)
    lengths = [rng.randint(1, 64) for _ in range(45 * 4 + 3)]  # 3 samples left for a short last batch
    data = samples(len(lengths), 21, lambda i: lengths[i])
    # Similar lengths batched together (in order: the short last batch comes last), each
    # batch padded up to the smallest of four buckets that fits.
    batches = DataLoader(data, batch_sampler=ap.data.LengthGroupedBatchSampler(lengths, 4, shuffle=False),
                         collate_fn=with_mask(ap.data.BucketCollate(buckets=(8, 16, 32, 64))))
    start = ap.metrics()
    silent(lambda: model.train(batches))
    m = ap.metrics()
    assert m.steps == 46 and m.batch_signatures == 5  # four buckets and the short final batch
    assert m.compilations - start.compilations <= 4 + 2


def test_a_python_float_that_changes_every_step_is_silent() -> None:
    # torch_xla 2.9 uploads a Python scalar as data (0 and 1 are baked in), so a learning
    # rate or loss scale that changes every step keeps one graph.
    ap.use("xla")
    model = Pooled(23)
    start = ap.metrics()

    def rescale(i: int, loss: Any) -> None:
        for group in model.opt.param_groups:
            group["lr"] = 0.01 / (1 + i)

    silent(lambda: model.train(loader(samples(30 * 4, 23, lambda i: 6), 4, pad_to_longest), inside=rescale))
    assert ap.metrics().compilations - start.compilations <= 2


@pytest.mark.parametrize("every", [1, 5])
def test_logging_through_after_step_is_silent(every: int) -> None:
    ap.use("xla")
    model = Pooled(25 + every)
    logged: list[float] = []

    def log(i: int, loss: Any) -> None:
        if i % every == 0:
            ap.after_step(logged.append, loss)

    silent(lambda: model.train(loader(samples(30 * 4, 25 + every, lambda i: 6), 4, pad_to_longest), inside=log))
    assert len(logged) == len(range(0, 30, every))
    m = ap.metrics()
    assert m.device_to_host >= len(logged)  # the reads happened: after the step, not inside it
    # The per-step counters count those reads in Python instead of reading torch_xla's
    # transfer metric each step: the two agree.
    backend = ap.backend()
    assert backend.step_counters()["device_to_host"] == backend.counters()["device_to_host"]


def test_a_loop_that_starts_recompiling_after_a_quiet_stretch_is_flagged_soon() -> None:
    # After 40 quiet steps the counters are read once per 16 steps; the first compilation
    # seen brings back reading after every step, so the rule still sees each compiling step.
    ap.use("xla")
    model = Pooled(31)
    quiet = samples(70 * 4, 31, lambda i: 6)
    growing = samples(30 * 4, 31, lambda i: 7 + i // 4)
    start = ap.metrics()
    with pytest.warns(ap.DiagnosticWarning, match="recompil"):
        model.train(loader(quiet + growing, 4, pad_to_longest))
    assert kinds() == ["recompilation"]
    assert 70 < ap.diagnostics()[0].step <= 70 + 16 + 10
    assert ap.metrics().compilations - start.compilations >= 25
