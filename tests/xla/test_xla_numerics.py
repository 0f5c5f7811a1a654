"""Lazy cases on real XLA:CPU loops: non-finite gradients and bf16 updates that round away (read
through step closures, no extra graph, no transfer the user sees), and graph growth without steps.
Runs in the xla environment: ``PJRT_DEVICE=CPU pytest -m xla``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import accelport as ap
from accelport.observe.numerics import CHECK_EVERY_LAZY, PRECISION_EVERY, PRECISION_FIRST
from tests.diagnoses import kinds, silent

pytestmark = pytest.mark.xla


def data(steps: int, features: int, *, scale: float = 1.0, nan_at: int | None = None, bf16: bool = False) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    w = torch.randn(features, 1, generator=g)
    out = []
    for i in range(steps):
        x = torch.randn(16, features, generator=g) * scale
        y = x @ w
        if i + 1 == nan_at:
            x[2, 1] = float("nan")
        out.append((x.bfloat16(), y.bfloat16()) if bf16 else (x, y))
    return out


def train(features: int, batches: list[Any], lr: float = 0.01, bf16: bool = False) -> None:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(features, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    if bf16:
        model = model.bfloat16()
    model = model.to(ap.device())
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in ap.loader(batches):
        torch.nn.functional.mse_loss(model(x), y).backward()
        ap.optimizer_step(opt)
        opt.zero_grad()


def test_a_nan_input_batch_is_named_exactly_without_an_extra_graph_or_transfer() -> None:
    ap.use("xla")
    start = ap.metrics()
    with pytest.warns(ap.DiagnosticWarning, match=r"\[non-finite\] PROBLEM"):
        train(11, data(CHECK_EVERY_LAZY + 8, 11, nan_at=6))  # found by the read in the loop
    assert kinds() == ["non-finite"]
    (found,) = ap.diagnostics()
    assert found.evidence["first_step"] == 6 and found.evidence["source"] == "input"
    assert "input 0: 1 of 176 values are NaN or Inf" in found.text
    m = ap.metrics()
    # The step's graph and the optimizer's start-up, as without the check; the parameters'
    # values were read after the loop's syncs, and those reads are not the user's.
    assert m.compilations - start.compilations <= 2
    assert m.device_to_host - start.device_to_host == 0


def test_a_diverging_loss_is_reported_from_the_parameters_it_made_nan() -> None:
    ap.use("xla")
    with pytest.warns(ap.DiagnosticWarning, match="non-finite"):
        train(12, data(20, 12, scale=30.0), lr=10.0)  # found by the read at the loop's end
    (found,) = ap.diagnostics()
    # Read at the loop's end: the canary's values (no gradient is kept on XLA), the step it was found by,
    # and the last one known finite.
    assert found.evidence["source"] == "gradients" and found.evidence["found_by_step"] == 20
    assert found.evidence["names"] == ["2.bias"] and found.text.startswith("the weights became NaN or Inf")
    assert found.evidence["first_step"] is None and found.evidence["finite_at_step"] == 0
    assert "after step 0 and by step 20 (on xla they are read every few hundred steps" in found.text
    assert "The inputs were finite" in found.text and "clip_grad_norm_" in found.text


@pytest.mark.parametrize("every_pass", [False, True])
def test_a_short_pass_that_ends_soon_after_a_read_leaves_its_read_to_the_next_one(
        every_pass: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # On XLA a read at a pass's end is a sync of its own: the first pass's end reads, and then a pass's end
    # reads only PASS_END_READ_SECONDS after the last read. What it left is read by ap.diagnostics().
    import warnings

    from accelport.observe import numerics

    monkeypatch.setattr(numerics, "PASS_END_READ_SECONDS", 0.0 if every_pass else 3600.0)
    ap.use("xla")
    train(12, data(5, 12))  # read at its end: the first pass's
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        train(12, data(20, 12, scale=30.0), lr=10.0)  # diverges
    at_pass_end = [str(w.message) for w in said if "[non-finite]" in str(w.message)]
    assert bool(at_pass_end) == every_pass, at_pass_end
    (found,) = ap.diagnostics()
    assert found.kind == "non-finite" and found.evidence["found_by_step"] == 25
    assert found.evidence["finite_at_step"] == 5  # (the first pass's end read its values: finite)


def test_what_a_pass_left_unread_is_read_when_its_scoped_run_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    # The pytest plugin runs each test in a scoped runtime, whose tracker goes with it: its end reads.
    from accelport.observe import numerics
    from accelport.runtime.state import RUNTIME

    monkeypatch.setattr(numerics, "PASS_END_READ_SECONDS", 3600.0)
    with pytest.warns(ap.DiagnosticWarning, match=r"\[non-finite\] PROBLEM: the weights became NaN or Inf after "
                                                  r"step 5 and by step 25"):
        with RUNTIME.scoped():
            ap.use("xla")
            train(12, data(5, 12))
            train(12, data(20, 12, scale=30.0), lr=10.0)


_TWO_LOOPS = """
import sys
import accelport as ap
import torch
ap.use("xla")
import torch_xla
teardown = torch_xla._XLAC._prepare_to_exit  # (what torch_xla's own exit hook calls)
def said_then_teardown():
    print("torch_xla tears its runtime down", file=sys.stderr, flush=True)
    teardown()
torch_xla._XLAC._prepare_to_exit = said_then_teardown
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
w = torch.randn(12, 1, generator=g)
def data(n, scale):
    out = []
    for _ in range(n):
        x = torch.randn(16, 12, generator=g) * scale
        out.append((x, x @ w))
    return out
model = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(ap.device())
for batches, lr in ((data(5, 1.0), 0.01), (data(20, 30.0), 10.0)):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in ap.loader(batches):
        torch.nn.functional.mse_loss(model(x), y).backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
print("trained", flush=True)
"""


def test_a_script_whose_last_short_pass_diverges_is_told_as_it_exits(tmp_path: Any) -> None:
    # Its last pass's end came within PASS_END_READ_SECONDS of the first's read: the read at the process's exit
    # finds it, before torch_xla's own exit hook tears its runtime down (though accelport was imported first).
    from tests.diagnose_cli.runs import run

    script = tmp_path / "two_loops.py"
    script.write_text(_TWO_LOOPS)
    out = run(str(script), cwd=tmp_path, diagnose=False, env={"PJRT_DEVICE": "CPU", "PYTHONWARNINGS": "default"})
    assert out.returncode == 0 and out.stdout.strip() == "trained", out.stdout + out.stderr
    said = "[non-finite] PROBLEM: the weights became NaN or Inf after step 5 and by step 25"
    assert said in out.stderr, out.stderr
    assert out.stderr.index(said) < out.stderr.index("torch_xla tears its runtime down"), out.stderr


_RAISES_AT_THE_END = """
backend = ap.backend()
backend._sync = lambda sync=backend._sync: (print("synced", file=sys.stderr, flush=True), sync())
# Stand-ins: several XLA processes cannot run on XLA:CPU here.
if PEERS == "replicas":
    backend.world_size = lambda: 2
    backend._world = 2
elif PEERS == "hosts":  # an SPMD slice of two hosts: a world of 1, two processes
    backend._xr.process_count = lambda: 2
print("trained", flush=True)
raise RuntimeError("the script failed")
"""


@pytest.mark.parametrize("peers", ["alone", "replicas", "hosts"])
def test_an_exception_that_ends_a_job_of_several_replicas_runs_no_device_work_at_exit(
        tmp_path: Any, peers: str) -> None:
    # The pending graph of a replica that failed may hold a collective the others never join: at exit neither the
    # checks' read nor the pending closures' sync runs it (a hang in place of the error). Alone, both run.
    from tests.diagnose_cli.runs import run

    script = tmp_path / "fails.py"
    script.write_text(_TWO_LOOPS.replace('print("trained", flush=True)', "")
                      + _RAISES_AT_THE_END.replace("PEERS", repr(peers)))
    out = run(str(script), cwd=tmp_path, diagnose=False, env={"PJRT_DEVICE": "CPU", "PYTHONWARNINGS": "default"})
    assert out.returncode == 1 and out.stdout.strip() == "trained", out.stdout + out.stderr
    assert "RuntimeError: the script failed" in out.stderr, out.stderr
    said = "[non-finite] PROBLEM: the weights became NaN or Inf after step 5 and by step 25"
    if peers != "alone":
        assert "synced" not in out.stderr and said not in out.stderr, out.stderr
    else:
        assert "synced" in out.stderr and said in out.stderr, out.stderr


def test_a_replica_whose_error_accelport_diagnose_caught_runs_no_device_work_at_its_end(tmp_path: Any) -> None:
    # accelport diagnose catches the script's error (its exit status says it): its last hand-over of the steps and
    # the process's exit hooks take it for the error it is.
    from tests.diagnose_cli.runs import run

    script = tmp_path / "fails.py"
    script.write_text(_TWO_LOOPS.replace('print("trained", flush=True)', "")
                      + _RAISES_AT_THE_END.replace("PEERS", repr("replicas")))
    out = run(str(script), cwd=tmp_path, env={"PJRT_DEVICE": "CPU"})
    assert out.returncode == 1 and "trained" in out.stdout, out.stdout + out.stderr
    assert "RuntimeError: the script failed" in out.stderr, out.stderr
    assert "synced" not in out.stderr, out.stderr


def stand_in_peers(monkeypatch: pytest.MonkeyPatch, backend: Any, peers: str) -> None:
    """Other processes that join this one's graphs, stood in for (several XLA processes cannot run on XLA:CPU here):
    "replicas" (a world of 2), "hosts" (an SPMD slice of two hosts: a world of 1, two processes), or "alone"."""
    if peers == "replicas":
        monkeypatch.setattr(backend, "world_size", lambda: 2)
        monkeypatch.setattr(backend, "_world", 2)
    elif peers == "hosts":
        monkeypatch.setattr(backend._xr, "process_count", lambda: 2)


@pytest.mark.parametrize("peers", ["alone", "replicas", "hosts"])
@pytest.mark.parametrize("left_by", ["an error", "a break", "its end"])
def test_a_pass_left_early_on_several_replicas_runs_no_device_work_as_its_loader_closes(
        monkeypatch: pytest.MonkeyPatch, peers: str, left_by: str) -> None:
    # The loader's pass is closed when nothing holds it any more (its error handled, or at a break): the graph
    # pending on this replica may hold a collective the others never join, so with several replicas the pass's
    # end runs neither the checks' read nor a sync (a hang in place of the error). Alone, the first pass's end
    # reads, as it always did, and so does a pass that runs to its end on several replicas (after the loop's own
    # sync). The same holds for the hosts of a multi-host SPMD slice (a world size of 1, several processes).
    import torch
    import torch_xla.core.xla_model as xm

    ap.use("xla")
    backend = ap.backend()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(ap.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    synced: list[int] = []
    batches = iter(ap.loader(data(6, 7)))
    try:
        for i, (x, y) in enumerate(batches):
            torch.nn.functional.mse_loss(model(x), y).backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
            if i == (5 if left_by == "its end" else 3):
                model(x).sum()  # (a forward pending on this replica, as when a step fails midway)
                monkeypatch.setattr(backend, "_sync", lambda sync=backend._sync: (synced.append(1), sync()))
                stand_in_peers(monkeypatch, backend, peers)
                if left_by == "a break":
                    break
                if left_by == "an error":
                    raise RuntimeError("the step failed")
    except RuntimeError:
        pass
    if left_by == "its end":  # the loop's own sync, then the checks' read at the pass's end: on any number of replicas
        assert synced == [1, 1]
        return
    xm.wait_device_ops()  # (executions are counted as they start)
    before = ap.metrics().executions
    batches.close()  # what happens when nothing holds the pass any more
    ran = ap.metrics().executions - before
    if peers != "alone":
        assert synced == [] and ran == 0
    else:
        assert synced and ran > 0


@pytest.mark.parametrize("peers", ["alone", "replicas", "hosts"])
def test_findings_asked_while_an_error_is_handled_on_several_replicas_run_no_device_work(
        monkeypatch: pytest.MonkeyPatch, peers: str) -> None:
    # A handler that logs ap.diagnostics() before it re-raises: with several replicas the checks' read (a sync on
    # XLA) waits, since the graph pending here may hold a collective the others never join. Asked again once the
    # error is handled, the read runs. Alone, it runs at once.
    import torch

    from accelport.observe import numerics

    monkeypatch.setattr(numerics, "PASS_END_READ_SECONDS", 1e9)  # only the first pass's end reads
    ap.use("xla")
    backend = ap.backend()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(ap.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for batches in (data(3, 7), data(3, 7)):  # the second pass's steps are not read at its end
        for x, y in ap.loader(batches):
            torch.nn.functional.mse_loss(model(x), y).backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
    model(x).sum()  # (a forward pending on this replica, as when a step fails midway)
    synced: list[int] = []
    monkeypatch.setattr(backend, "_sync", lambda sync=backend._sync: (synced.append(1), sync()))
    stand_in_peers(monkeypatch, backend, peers)
    try:
        raise RuntimeError("the step failed")
    except RuntimeError:
        assert ap.diagnostics() == []
        assert len(synced) == (0 if peers != "alone" else 1)
    assert ap.diagnostics() == [] and len(synced) == 1


def test_no_gradient_outlives_its_step_so_no_step_graph_outputs_one() -> None:
    # A tensor live at the loop's sync is an output of the step's graph, made and let go each step: the
    # checks keep no gradient on XLA (they read the canary's values), so those the script let go of are gone.
    import weakref

    import torch

    ap.use("xla")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(9, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(ap.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    alive = []
    for x, y in ap.loader(data(5, 9)):
        torch.nn.functional.mse_loss(model(x), y).backward()
        ap.optimizer_step(opt)
        gradient = weakref.ref(model[2].bias.grad)  # the canary's
        opt.zero_grad()  # (set_to_none: the script lets go of them, before the loop's sync)
        alive.append(gradient() is not None)
    assert ap.diagnostics() == [] and alive == [False] * 5


def test_a_read_run_by_a_later_steps_sync_is_said_of_that_step() -> None:
    # Outside ap.loader, ap.optimizer_step syncs before the step ends: the read due at step 256 runs at step
    # 257's sync, after its update, and reads the parameters as they are then. A NaN that step 257 made is
    # found by step 257, not by step 256 (which was finite).
    import torch

    ap.use("xla")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(9, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(ap.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.warns(ap.DiagnosticWarning, match="non-finite"):
        for x, y in data(CHECK_EVERY_LAZY + 3, 9, nan_at=CHECK_EVERY_LAZY + 1):
            torch.nn.functional.mse_loss(model(x.to(ap.device())), y.to(ap.device())).backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
        (found,) = ap.diagnostics()
    assert found.evidence["found_by_step"] == CHECK_EVERY_LAZY + 1 and found.evidence["finite_at_step"] == 0
    assert found.evidence["names"] == ["2.bias"] and "(the values of 2.bias" in found.text


def test_bf16_weights_with_a_tiny_learning_rate_stall() -> None:
    ap.use("xla")
    start = ap.metrics()
    with pytest.warns(ap.DiagnosticWarning, match=r"\[precision\]"):
        train(13, data(PRECISION_FIRST + PRECISION_EVERY + 3, 13, bf16=True), lr=1e-5, bf16=True)
    assert kinds() == ["precision"]
    (found,) = ap.diagnostics()
    assert found.step == PRECISION_FIRST + PRECISION_EVERY + 1
    assert "0.weight" in found.evidence["params"]
    assert ap.metrics().compilations - start.compilations <= 2  # whole parameters read: no slice graph


def test_healthy_fp32_training_stays_silent_with_one_graph_and_no_transfers() -> None:
    ap.use("xla")
    start = ap.metrics()
    silent(lambda: train(14, data(2 * CHECK_EVERY_LAZY + 5, 14), lr=1e-4))
    m = ap.metrics()
    assert m.compilations - start.compilations <= 2 and m.device_to_host - start.device_to_host == 0


def _steps_then(loop: Callable[[Any, list[Any]], None]) -> None:
    import torch

    ap.use("xla")
    torch.manual_seed(0)
    model = torch.nn.Linear(15, 1).to(ap.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in ap.loader(data(6, 15)):
        torch.nn.functional.mse_loss(model(x), y).backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
    xs = [x.to(ap.device()) for x, _ in data(50, 15)]
    ap.sync()  # the uploads
    loop(model, xs)


def test_a_loop_that_accumulates_without_a_sync_is_flagged_at_its_sync() -> None:
    def accumulate(model: Any, xs: list[Any]) -> None:
        import torch

        total = torch.zeros((), device=ap.device())
        for x in xs:  # 50 iterations, one graph
            total = total + model(x).pow(2).mean()
        ap.sync()

    with pytest.warns(ap.DiagnosticWarning, match=r"\[graph-growth\] a graph of \d+ nodes ran at ap.sync\(\)"):
        _steps_then(accumulate)
    assert kinds() == ["graph-growth"]
    (found,) = ap.diagnostics()
    assert found.evidence["where"] == "ap.sync()"
    assert found.evidence["graph_nodes"] >= 4 * found.evidence["usual_graph_nodes"]
    assert "with no training step since the previous sync" in found.text
    assert "ap.sync() once per iteration" in found.text


def test_a_loop_that_syncs_each_iteration_is_silent() -> None:
    def evaluate(model: Any, xs: list[Any]) -> None:
        import torch

        with torch.no_grad():
            for x in xs:
                model(x).pow(2).mean()
                ap.sync()

    silent(lambda: _steps_then(evaluate))
