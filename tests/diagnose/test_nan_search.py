"""The search for the op that made the first NaN (accelport.observe.nan_search), on real loops on cpu: what it
blames and what it does not (an in-place op on a NaN it did not make, a -inf mask, a NaN that is masked away),
foreach updates, torch.compile, a NaN from outside the checked ops; nothing installed when it is off.
The end-to-end runs (diagnose and ported scripts, each case's repro) are in tests/diagnose_cli/test_find_nan.py.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import accelport as ap
from accelport.observe.nan_search import NanSearch, parse_first_step, reproducibility
from accelport.runtime.state import RUNTIME


@pytest.fixture
def search(tmp_path: pathlib.Path) -> Iterator[Callable[..., NanSearch]]:
    made: list[NanSearch] = []

    def start(first_step: int = 1) -> NanSearch:
        s = NanSearch(first_step, str(tmp_path / "repro"))
        made.append(s)
        s.attach()
        return s

    yield start
    for s in made:
        s.finish()


def steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int, loss_of: Callable[[int], torch.Tensor]) -> None:
    for step in range(1, n + 1):
        loss_of(step).backward()
        opt.step()
        opt.zero_grad()


def line_of(text: str) -> int:
    source = pathlib.Path(__file__).read_text().splitlines()
    return next(n for n, line in enumerate(source, 1) if text in line and "line_of" not in line)


def test_the_setting_is_a_first_step_or_off() -> None:
    assert [parse_first_step(v) for v in (None, "", "0", "off", "1", "true", "on", " 7 ")] == \
        [None, None, None, None, 1, 1, 1, 7]
    for bad, says in (("-3", "steps count from 1"), ("abc", "not a step number"), ("1.5", "not a step number")):
        with pytest.raises(ValueError, match=says):
            parse_first_step(bad)


def search_modes() -> int:
    """Dispatch modes on the stack, leaving out the FLOP count's (the first step of each batch shape)."""
    return sum(type(m).__module__ != "accelport.observe.flops" for m in _get_current_dispatch_mode_stack())


def test_off_nothing_is_installed_and_nothing_runs_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.nn.modules.module as module_hooks
    import torch.optim.optimizer as optimizer_hooks

    hooks_before = len(optimizer_hooks._global_optimizer_post_hooks)
    modes: list[int] = []
    ap.use("cpu")
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model.register_forward_hook(lambda *_: modes.append(search_modes()))
    for x in ap.loader([torch.randn(8, 4) for _ in range(3)]):
        model(x).sum().backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
    assert RUNTIME.tracker.nan_search is None and modes == [0, 0, 0]
    assert len(optimizer_hooks._global_optimizer_post_hooks) == hooks_before
    assert not module_hooks._global_forward_hooks and not module_hooks._global_forward_pre_hooks


def test_a_ported_run_finds_the_op_and_takes_every_hook_out_after_it(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: pathlib.Path) -> None:
    import torch.nn.modules.module as module_hooks

    monkeypatch.setenv("ACCELPORT_FIND_NAN", "2")
    monkeypatch.setenv("ACCELPORT_FIND_NAN_DIR", str(tmp_path))
    ap.use("cpu")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    modes: list[int] = []
    model.register_forward_hook(lambda *_: modes.append(search_modes()))
    with pytest.warns(ap.DiagnosticWarning, match=r"aten::sqrt made the first NaN or Inf at step 4"):
        for step, x in enumerate(ap.loader([torch.randn(8, 4) for _ in range(6)]), 1):
            h = model(x)
            loss = torch.sqrt(h - (50 if step == 4 else -50)).sum()  # SQRT OF A NEGATIVE AT STEP 4
            loss.backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
    (found,) = ap.diagnostics()
    assert found.evidence["checked_from"] == 2 and found.step == 4
    assert found.evidence["origin"]["where"] == f"{__file__}:{line_of('SQRT OF A NEGATIVE AT STEP 4')}"
    # Checked from step 2 (the mode is on for steps 2 to 4), off again from step 5.
    assert modes == [0, 1, 1, 1, 0, 0]
    assert not module_hooks._global_forward_hooks and not module_hooks._global_forward_pre_hooks
    assert sorted(p.name for p in tmp_path.iterdir()) == ["accelport-nan-step4.pt", "accelport-nan-step4.py"]


def test_an_in_place_op_on_weights_that_were_nan_before_is_not_blamed(search: Callable[..., NanSearch]) -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")  # before the checks begin: no checked op made it
    s = search(1)
    steps(model, opt, 2, lambda _: model(torch.randn(8, 4)).sum())
    found = s.found
    assert found is not None and found.kind == "entered" and found.step == 1
    assert found.params == ("weight",) and "held NaN when step 1 began" in found.detail
    # The optimizer's add_ wrote NaN into the weight, but it was NaN before it ran: never the origin.
    assert found.op != "aten.add_.Tensor"


def test_a_nan_that_no_checked_op_made_is_said_to_come_from_outside(search: Callable[..., NanSearch]) -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(32, 4)
    data[13, 2] = float("nan")  # the loop reads its data itself, no DataLoader
    s = search(1)
    steps(model, opt, 4, lambda step: model(data[(step - 1) * 8:step * 8]).sum())  # READS ITS OWN DATA
    found = s.found
    assert found is not None and (found.kind, found.step) == ("entered", 2)
    assert "a tensor of shape (32, 4) that no checked operation made held NaN" in found.detail
    assert found.site == (__file__, line_of("READS ITS OWN DATA"))


def test_a_minus_inf_mask_and_a_nan_that_is_masked_away_are_not_findings(search: Callable[..., NanSearch]) -> None:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = search(1)

    def loss(step: int) -> torch.Tensor:
        h = model(torch.randn(8, 4))
        mask = torch.zeros(8, 4, dtype=torch.bool)
        mask[:, 0] = True  # one key of each row masked: meant, and every row keeps three
        attn = torch.softmax(h.masked_fill(mask, float("-inf")), -1)
        junk = torch.nan_to_num(torch.log(torch.zeros(3)), neginf=0.0)  # MADE AND MASKED: -inf, then 0
        return (attn * h).sum() + junk.sum()

    steps(model, opt, 3, loss)
    assert s.found is None
    (masked,) = s.transient[:1]
    assert (masked.op, masked.made, masked.step) == ("aten.log.default", "Inf", 1)
    assert "did not reach the weights" in " ".join(s.notes())


def test_a_foreach_update_that_overflows_is_named_and_its_repro_holds_one_tensor(
        search: Callable[..., NanSearch], tmp_path: pathlib.Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, foreach=True)
    s = search(1)

    def loss(step: int) -> torch.Tensor:
        if step == 3:
            opt.param_groups[0]["lr"] = 3e38
        return model(torch.randn(8, 4)).sum() * 100

    steps(model, opt, 3, loss)
    found = s.found
    assert found is not None and found.direction == "optimizer" and found.step == 3
    assert found.op.startswith("aten._foreach_add") and found.params and found.optimizer == "SGD"
    assert found.repro is not None
    script, data = found.repro
    assert len(torch.load(data, weights_only=True)) == 2  # the one parameter and its gradient, not every one
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")})
    assert out.returncode == 0 and "NOT FINITE" in out.stdout, out.stderr


def test_a_compiled_model_runs_eagerly_in_checked_steps_and_its_op_is_found(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: pathlib.Path) -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(torch.relu(self.fc(x)))  # LOG OF RELU, COMPILED

    monkeypatch.setenv("ACCELPORT_FIND_NAN", "1")
    monkeypatch.setenv("ACCELPORT_FIND_NAN_DIR", str(tmp_path))
    net = Net()
    model = torch.compile(net)
    ap.use("cpu")
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    batches = [torch.randn(8, 4) for _ in range(2)]
    batches[0][3] = -net.fc.weight.detach()[0] * 100  # fc(x) < 0 there: relu 0, log -inf
    with pytest.warns(ap.DiagnosticWarning, match="aten::log made the first NaN or Inf at step 1"):
        for x in ap.loader(batches):
            model(x).mean().backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
    origin = ap.diagnostics()[0].evidence["origin"]
    assert origin["where"] == f"{__file__}:{line_of('LOG OF RELU, COMPILED')}"
    assert origin["module"] == "Net" and origin["direction"] == "forward"  # the model, not the compiled wrapper


def test_a_rerun_is_said_unreliable_without_a_seed_or_with_nondeterministic_kernels() -> None:
    torch.manual_seed(3)
    assert reproducibility("cpu") == ()
    torch.seed()  # a random 64-bit seed, as a process that never seeds has
    (reason,) = reproducibility("cpu")
    assert "torch's random seed was never set" in reason and "shuffled DataLoader" in reason
    torch.manual_seed(3)
    (reason,) = reproducibility("cuda", ["index_add_"])
    assert "on cuda some kernels (index_add_)" in reason and "torch.use_deterministic_algorithms(True)" in reason


def test_a_ported_script_with_a_setting_that_is_no_step_is_warned_once_and_not_searched(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELPORT_FIND_NAN", "later")
    with pytest.warns(ap.DiagnosticWarning, match="ACCELPORT_FIND_NAN=later: not a step number") as caught:
        ap.use("cpu")
    assert len([w for w in caught if "ACCELPORT_FIND_NAN" in str(w.message)]) == 1
    assert RUNTIME.tracker.nan_search is None
