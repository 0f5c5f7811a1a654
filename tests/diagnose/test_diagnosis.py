"""The diagnosis rules, on synthetic step records and on real eager (cpu) loops.

The lazy-backend rules are exercised for real on XLA:CPU in tests/xla/.
"""

from __future__ import annotations

import json
import time
import warnings

import pytest

import accelport as ap
from accelport.contract import StepRecord
from accelport.diagnose.engine import Diagnostics
from accelport.diagnose.rules import BUILTIN_RULES, describe_shape_change
from accelport.diagnose.rules.cpu_fallback import CpuFallbackRule
from tests.diagnoses import engine


def rec(step: int, *, compiles: int = 0, d2h: int | None = None, sig: tuple | None = None,  # type: ignore[type-arg]
        seconds: float = 0.01, wait: float = 0.0, lazy: bool = True, graph: int | None = None,
        loader: dict | None = None, counted: int = 1, backend: str = "xla") -> StepRecord:  # type: ignore[type-arg]
    """A step record; ``counted=0`` is one whose counters were read with a later step's."""
    delta: dict[str, float] = {"compilations": compiles}
    if d2h is not None:
        delta["device_to_host"] = d2h
    if graph is not None:
        delta["graph_nodes"] = graph
    return StepRecord(step, backend, lazy, seconds, wait, sig, delta if counted else {}, time.time(),
                      loader or {}, counted)


def feed(records: list[StepRecord]) -> Diagnostics:
    d = engine({})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for r in records:
            d.step_end(r)
    return d


def sig(n: int) -> tuple:  # type: ignore[type-arg]
    return (((8, n, 16), "float32"), ((8,), "int64"))


def kinds(d: Diagnostics) -> list[str]:
    return [f.kind for f in d.findings]


def test_shape_change_is_described() -> None:
    assert describe_shape_change(sig(128), sig(131)) == (
        "input 0 changed from (8, 128, 16) to (8, 131, 16) along dim 1 (a sequence or image dimension)")
    assert describe_shape_change(sig(4), (((5, 4, 16), "float32"), ((8,), "int64"))) == (
        "input 0 changed from (8, 4, 16) to (5, 4, 16) along the batch dimension (dim 0)")
    assert describe_shape_change(sig(4), sig(4)) is None
    assert describe_shape_change(None, sig(4)) is None


def test_growing_compilations_flagged_within_30_steps_naming_the_shape_change() -> None:
    records = [rec(s, compiles=1, sig=sig(100 + s)) for s in range(1, 31)]
    d = feed(records)
    assert kinds(d) == ["recompilation"]
    found = d.findings[0]
    assert found.step <= 30
    assert "input 0 changed from (8, 109, 16) to (8, 110, 16)" in found.text
    assert "BucketCollate" in found.text


def test_bucketing_plus_first_step_and_final_batch_is_silent() -> None:
    buckets = [128, 256, 512, 1024]
    records, seen = [], set()
    for s in range(1, 201):
        b = buckets[(s * 7) % 4]
        records.append(rec(s, compiles=3 if s == 1 else int(b not in seen), sig=sig(b)))
        seen.add(b)
    records.append(rec(201, compiles=2, sig=(((5, 128, 16), "float32"),)))  # ragged final batch
    assert feed(records).findings == []


def test_six_buckets_and_an_optimizer_start_up_compile_are_silent() -> None:
    # Each bucket's first batch compiles (a new shape); step 2 recompiles as the optimizer
    # creates its state. Seven compilations in 21 steps, all explained: no finding.
    buckets = [64, 128, 192, 256, 384, 512]
    records = [rec(1, compiles=1, sig=sig(64)), rec(2, compiles=1, sig=sig(64))]
    seen = {64}
    for s in range(3, 200):
        b = buckets[(s * 5) % 6]
        records.append(rec(s, compiles=int(b not in seen), sig=sig(b)))
        seen.add(b)
    assert feed(records).findings == []


def test_a_loop_recompiling_every_third_step_is_flagged_within_30_steps() -> None:
    # On repeated shapes (the graph itself changes) ...
    d = feed([rec(s, compiles=int(s % 3 == 0), sig=sig(64)) for s in range(1, 100)])
    assert kinds(d) == ["recompilation"]
    assert d.findings[0].step <= 30
    assert "recompiled in 6 of the last" in d.findings[0].text
    # ... and on a new shape each time.
    d = feed([rec(s, compiles=int(s % 3 == 0), sig=sig(64 + s // 3)) for s in range(1, 100)])
    assert kinds(d) == ["recompilation"] and d.findings[0].step <= 30
    assert "changed from (8, 73, 16) to (8, 74, 16)" in d.findings[0].text


def test_an_old_shape_change_is_not_blamed_for_later_recompilation() -> None:
    # 128 -> 256 early (one compile), then steady shapes; the graph recompiles from step 40.
    records = [rec(s, compiles=int(s in (1, 3)), sig=sig(128 if s < 3 else 256)) for s in range(1, 40)]
    records += [rec(s, compiles=1, sig=sig(256)) for s in range(40, 70)]
    d = feed(records)
    assert kinds(d) == ["recompilation"]
    assert "changed from" not in d.findings[0].text
    assert "input shapes did not change" in d.findings[0].text


def test_without_ap_loader_the_shapes_are_unknown_not_unchanged() -> None:
    d = feed([rec(s, compiles=1, sig=None) for s in range(1, 30)])
    assert kinds(d) == ["recompilation"]
    message = d.findings[0].text
    assert "did not come through ap.loader" in message and "did not change" not in message
    assert "BucketCollate" in message and "masked_sum" in message


def test_recompiling_with_unchanged_shapes_points_at_data_dependent_ops() -> None:
    d = feed([rec(s, compiles=1, sig=sig(64)) for s in range(1, 25)])
    assert kinds(d) == ["recompilation"]
    assert "input shapes did not change" in d.findings[0].text
    assert "masked_sum" in d.findings[0].text


def test_host_sync_needs_transfers_in_most_steps() -> None:
    d = feed([rec(s, d2h=1, sig=sig(8)) for s in range(1, 15)])
    assert kinds(d) == ["host-sync"]
    assert "ap.after_step" in d.findings[0].text and d.findings[0].evidence["transfers_per_step"] == 1.0
    # Logging every 10 steps (through after_step or not) is fine.
    assert feed([rec(s, d2h=int(s % 10 == 0), sig=sig(8)) for s in range(1, 60)]).findings == []
    # An eager backend cannot count transfers: no key, no finding.
    assert feed([rec(s, lazy=False, sig=sig(8)) for s in range(1, 30)]).findings == []


def test_host_reads_counted_for_many_steps_at_once_are_not_overstated() -> None:
    # Steps 1-40 read one by one, 41-56 read together (reads began at step 53: 4 of
    # them), then one by one again: one .item() per step is 1.0 per step, not more.
    records = [rec(s, d2h=0, sig=sig(8)) for s in range(1, 41)]
    records += [rec(s, sig=sig(8), counted=0) for s in range(41, 56)]
    records.append(rec(56, d2h=4, sig=sig(8), counted=16))
    records += [rec(s, d2h=1, sig=sig(8)) for s in range(57, 80)]
    d = feed(records)
    assert kinds(d) == ["host-sync"]
    assert d.findings[0].evidence["transfers_per_step"] == 1.0
    assert "1.0 device-to-host transfers per step in 10 of the last 10 steps" in d.findings[0].text
    # Many reads in a block may all be one step's (a checkpoint, an eval): alone, silent.
    block = [rec(s, d2h=0, sig=sig(8)) for s in range(1, 41)]
    block += [rec(s, sig=sig(8), counted=0) for s in range(41, 56)] + [rec(56, d2h=300, sig=sig(8), counted=16)]
    quiet_after = [rec(s, d2h=0, sig=sig(8)) for s in range(57, 90)]
    assert feed(block + quiet_after).findings == []
    # A loop that keeps reading is then read step by step, and flagged at its true rate.
    reading = [rec(s, d2h=2, sig=sig(8)) for s in range(57, 90)]
    d = feed(block[:-1] + [rec(56, d2h=32, sig=sig(8), counted=16)] + reading)
    assert kinds(d) == ["host-sync"] and d.findings[0].step == 66
    assert d.findings[0].evidence["transfers_per_step"] == 2.0


def test_cpu_fallbacks_are_looked_for_early_and_then_every_1000_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    looked: list[int] = []
    monkeypatch.setattr(CpuFallbackRule, "_judge", lambda self, record: looked.append(record.step))
    feed([rec(s, sig=sig(8)) for s in range(1, 3001)])
    assert looked == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 3000]


def test_input_bound_reports_share_workers_and_cores() -> None:
    d = feed([rec(s, seconds=0.1, wait=0.06, loader={"num_workers": 0}) for s in range(1, 15)])
    assert kinds(d) == ["input-bound"]
    msg = d.findings[0].text
    assert "60%" in msg and "num_workers=0" in msg and "CPU cores" in msg
    assert feed([rec(s, seconds=0.1, wait=0.01) for s in range(1, 40)]).findings == []


def test_graph_growth_against_the_usual_step() -> None:
    records = [rec(s, graph=120, sig=sig(8)) for s in range(1, 10)]
    records.append(rec(10, graph=120 + 800, sig=sig(8)))
    d = feed(records)
    assert kinds(d) == ["graph-growth"]
    assert "920 nodes (usually 120)" in d.findings[0].text and "ap.sync()" in d.findings[0].text
    # Normal jitter in graph size is not growth.
    assert feed([rec(s, graph=120 + (s % 3) * 10, sig=sig(8)) for s in range(1, 40)]).findings == []


def test_each_kind_is_reported_once_as_its_own_warning_category() -> None:
    d = engine({})
    with pytest.warns(ap.DiagnosticWarning) as caught:
        for s in range(1, 40):
            d.step_end(rec(s, compiles=1, sig=sig(s)))
    relevant = [w for w in caught if issubclass(w.category, ap.DiagnosticWarning)]
    assert len(relevant) == 1
    assert relevant[0].category.__name__ == "RecompilationWarning"
    assert len(d.findings) == 1


def test_deprecated_config_is_reported_on_the_first_step() -> None:
    d = engine({"XLA_USE_BF16": "1"})
    with pytest.warns(ap.DiagnosticWarning, match="XLA_USE_BF16 is deprecated"):
        d.step_end(rec(1))
    assert kinds(d) == ["deprecated-config"] and "autocast" in d.findings[0].text
    quiet = engine({"XLA_USE_BF16": "0"})
    quiet.step_end(rec(1))
    assert quiet.findings == []
    # On cpu torch_xla's switch does nothing: not "in effect" (selection already said so).
    on_cpu = engine({"XLA_USE_BF16": "1"})
    on_cpu.step_end(rec(1, backend="cpu", lazy=False))
    assert on_cpu.findings == []


# -- real loops on the cpu backend ------------------------------------------------------


class SlowDataset:
    """A dataset whose __getitem__ sleeps: the loader, not the model, is the bottleneck."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        import torch

        time.sleep(self.delay)
        return torch.randn(8), torch.randn(1)


def _train(loader, steps: int | None = None) -> None:  # type: ignore[no-untyped-def]
    import torch

    model = torch.nn.Linear(8, 1).to(ap.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i, (x, y) in enumerate(ap.loader(loader, prefetch=0)):
        torch.nn.functional.mse_loss(model(x), y).backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
        if steps is not None and i + 1 >= steps:
            break


def test_input_bound_on_cpu_with_a_slow_dataset() -> None:
    from torch.utils.data import DataLoader

    ap.use("cpu")
    with pytest.warns(ap.DiagnosticWarning, match="input-bound"):
        _train(DataLoader(SlowDataset(15 * 4, 0.004), batch_size=4, num_workers=0))
    (found,) = ap.diagnostics()
    assert found.kind == "input-bound"
    assert found.evidence["num_workers"] == 0 and found.evidence["data_wait_share"] > 0.3
    assert "Set num_workers to " in found.text and "in parallel" in found.text


def test_healthy_cpu_loop_is_silent_and_nothing_lazy_fires() -> None:
    import torch

    ap.use("cpu")
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(40)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ap.DiagnosticWarning)
        _train(data)
    assert ap.diagnostics() == []
    assert ap.metrics().steps == 40


def test_on_cpu_what_only_hurts_a_compiled_device_is_not_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    # .item() every step, a new sequence length every step, torch.nonzero and an
    # XLA-only setting: each is a finding on XLA (tests/xla/), none costs anything here.
    import torch

    monkeypatch.setenv("XLA_USE_BF16", "1")
    with pytest.warns(ap.AccelportDeprecationWarning, match="no effect on the cpu backend"):
        ap.use("cpu")  # selection says once that the setting does nothing here
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(4, 10 + i, 8), torch.randn(4, 1)) for i in range(40)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ap.DiagnosticWarning)
        for x, y in ap.loader(data, prefetch=0):
            loss = torch.nn.functional.mse_loss(model(x).mean(1), y)
            loss.backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
            torch.nonzero(x[0, :, 0] > 0)
            assert isinstance(loss.item(), float)
    assert ap.diagnostics() == []
    assert ap.metrics().batch_signatures == 40


def test_diagnostics_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils.data import DataLoader

    monkeypatch.setenv("ACCELPORT_DIAGNOSTICS", "0")
    ap.use("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ap.DiagnosticWarning)
        _train(DataLoader(SlowDataset(15 * 4, 0.004), batch_size=4))
    assert ap.diagnostics() == []


def test_metrics_file_gets_one_json_line_per_step(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch

    path = tmp_path / "logs" / "run.jsonl"
    monkeypatch.setenv("ACCELPORT_METRICS_FILE", str(path))
    ap.use("cpu")
    _train([(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(7)])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 8))
    first = lines[0]
    assert first["backend"] == "cpu" and first["signature"] == [[[4, 8], "float32"], [[4, 1], "float32"]]
    assert {"time", "seconds", "data_wait_seconds", "compilations"} <= set(first)
    assert all(line["seconds"] >= 0 for line in lines)


def test_observers_get_every_step_in_order_even_when_counters_are_read_in_blocks(
        install_plugin) -> None:  # type: ignore[no-untyped-def]
    import torch

    from accelport.runtime.state import RUNTIME, StepTracker

    install_plugin("arrivals", "accelport_test_arrivals",
                   "import accelport as ap\nfrom accelport.runtime.state import RUNTIME\nSEEN = []\n"
                   "@ap.hookimpl\ndef accelport_step_end(record):\n"
                   "    SEEN.append((record.step, RUNTIME.tracker.steps, dict(record.delta), record.counted_steps))\n")
    import accelport_test_arrivals as arrivals

    ap.use("cpu")
    steps = StepTracker.CLOSE_STEPS + 3 * StepTracker.QUIET_EVERY + 5
    _train([(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(steps)])
    assert [step for step, *_ in arrivals.SEEN] == list(range(1, steps + 1))  # all, in order
    lag = [seen_at - step for step, seen_at, *_ in arrivals.SEEN]
    assert all(n == 0 for n in lag[:StepTracker.CLOSE_STEPS])  # the first steps: read one by one
    assert max(lag) == StepTracker.QUIET_EVERY - 1  # then once per 16 quiet steps
    # A record whose counters were read says how many steps they cover; the others say
    # theirs were not read, and carry no made-up zeros. Together they cover every step.
    counted = [n for *_, n in arrivals.SEEN]
    assert counted[:StepTracker.CLOSE_STEPS] == [1] * StepTracker.CLOSE_STEPS
    assert StepTracker.QUIET_EVERY in counted and sum(counted) == steps
    assert all(("compilations" in delta) == (n > 0) for _, _, delta, n in arrivals.SEEN)
    assert RUNTIME.tracker._pending == []  # the end of the ap.loader loop handed over the rest


def test_diagnostics_hands_over_the_steps_not_read_yet() -> None:
    import torch

    from accelport.runtime.state import RUNTIME, StepTracker

    ap.use("cpu")
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(StepTracker.CLOSE_STEPS + 5):  # a loop without ap.loader
        torch.nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1)).backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
    assert RUNTIME.tracker._pending  # quiet steps wait for the next read
    assert ap.diagnostics() == []
    assert RUNTIME.tracker._pending == []


def test_host_read_traces_are_per_listener_and_a_new_one_clears_nothing() -> None:
    # Run apart: the trace wraps torch.Tensor methods for the rest of the process.
    # A "meta" tensor stands in for a device tensor: its repr is a host read of a non-CPU tensor.
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from accelport.observe.tracer import HostSyncSites\n"
        "first = HostSyncSites(); first.listen()\n"
        "x = torch.empty(2, device='meta')\n"
        "repr(x)\n"  # line 5
        "second = HostSyncSites(); second.listen()\n"  # a second plugin host starts tracing
        "repr(x)\n"  # line 7
        "print(dict(first.sites), dict(second.sites))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.strip().rsplit("} {", 1)
    assert "'<string>:5': 1" in first and "'<string>:7': 1" in first  # the first listener kept its count
    assert "'<string>:7': 1" in second and "<string>:5" not in second


def test_a_finding_carries_the_runs_totals_and_buckets_for_every_length_seen() -> None:
    # Recompiling on a new length every step: found by step 10, when the longest length so far is 110;
    # the run goes on to 140. What is read at the end says the run, next to the moment it fired.
    d = feed([rec(s, compiles=1, sig=sig(100 + s), seconds=0.5) for s in range(1, 41)])
    [found] = d.current()
    assert found.kind == "recompilation" and found.step <= 10
    assert max(found.evidence["buckets"]) < 140  # the moment it fired
    buckets = [int(b) for b in found.fix.split("buckets=(")[1].split(")")[0].split(",")]
    assert max(buckets) >= 140  # the fix: from every length the run saw
    assert found.totals["compilations"] == 40 and found.totals["compiling_steps"] == 40  # every step compiled
    assert found.totals["steps"] == 40 and found.totals["distinct_batch_shapes"] == 40
    assert "compilations 40" in found.totals_text and "compile share" not in found.totals_text


def test_the_fix_is_in_the_scripts_own_terms() -> None:
    from accelport.diagnose.rule import RunView

    records = [rec(s, d2h=1, sig=sig(8)) for s in range(1, 20)]
    fixes = {}
    for style in ("accelport", "torch", "torch_xla", "transformers", "lightning"):
        d = Diagnostics([("diagnostics", r) for r in BUILTIN_RULES], RunView(style=style))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for r in records:
                d.step_end(r)
        [found] = d.findings
        fixes[style] = found.fix
    assert fixes["accelport"].startswith("Log with ap.after_step(fn, loss)")
    assert fixes["torch_xla"].startswith("Read them in a step closure instead: xm.add_step_closure(")
    assert "logging_steps" in fixes["transformers"] and "self.log(" in fixes["lightning"]
    assert "loss.detach()" in fixes["torch"]
