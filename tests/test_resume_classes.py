"""ap.Checkpointer.restore() and an optimizer or scheduler of another class than the checkpoint's: refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import accelport as ap


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def _save(directory: Path) -> None:
    import torch

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    with ap.Checkpointer(directory, every_steps=1, stop_on=()) as ckpt:
        ckpt.restore(model=model, optimizer=opt, scheduler=sched)
        model(torch.ones(1, 3)).sum().backward()
        ap.optimizer_step(opt)
        sched.step()
        ckpt.step()


@pytest.mark.parametrize("other", ["SGD", "Adam"])
def test_another_optimizer_class_is_refused_before_anything_is_loaded(tmp_path: Path, other: str) -> None:
    import torch

    ap.use("cpu")
    _save(tmp_path)
    model = torch.nn.Linear(3, 1)
    before = [p.detach().clone() for p in model.parameters()]
    opt = getattr(torch.optim, other)(model.parameters(), lr=0.1)
    with ap.Checkpointer(tmp_path, stop_on=()) as again:
        with pytest.raises(ap.CheckpointError, match=rf"saved with optimizer AdamW \(torch.optim.adamw.AdamW\), and "
                                                     rf"restore\(\) was given {other} \(torch.optim.[a-z]+.{other}\): "
                                                     r"its state does not carry over .* Restore with optimizer "
                                                     "class AdamW, or start from another directory"):
            again.restore(model=model, optimizer=opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # left as it was
    assert not opt.state


def test_another_scheduler_class_is_refused_and_the_same_classes_restore(tmp_path: Path) -> None:
    import torch

    ap.use("cpu")
    _save(tmp_path)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with ap.Checkpointer(tmp_path, stop_on=()) as again:
        with pytest.raises(ap.CheckpointError, match=r"saved with scheduler StepLR .* was given ExponentialLR"):
            again.restore(model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.ExponentialLR(opt, 0.5))
        assert again.restore(model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 2)) == 1
    assert opt.state  # AdamW's moments came back
