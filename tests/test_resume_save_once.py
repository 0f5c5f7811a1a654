"""One save per step: a stop asked for during a due save stops on that checkpoint, and a step already saved is never
written again (which would first remove a complete checkpoint)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

import accelport as ap
from accelport.resume import find_checkpoints


def _objects() -> tuple[object, object]:
    import torch

    model = torch.nn.Linear(3, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model: object, opt: object) -> None:
    import torch

    model(torch.ones(1, 3)).sum().backward()  # type: ignore[operator]
    ap.optimizer_step(opt)


def test_a_stop_asked_during_a_due_save_stops_on_that_checkpoint(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import accelport.checkpoint

    ap.use("cpu")
    write = accelport.checkpoint.atomic_torch_save

    def write_and_get_a_stop(torch_module: object, obj: object, path: str) -> None:
        write(torch_module, obj, path)
        if "step-00000002" in path:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while the save of step 2 is being written

    monkeypatch.setattr(accelport.checkpoint, "atomic_torch_save", write_and_get_a_stop)
    model, opt = _objects()
    ckpt = ap.Checkpointer(tmp_path, every_steps=2)
    try:
        ckpt.restore(model=model, optimizer=opt)
        with pytest.raises(SystemExit) as stopped:
            for _ in range(5):
                _step(model, opt)
                ckpt.step()
    finally:
        ckpt.close()
    assert stopped.value.code == ap.Checkpointer.EXIT_PREEMPTED
    assert ckpt.steps == 2  # not one step later, after a second save
    assert [(f.step, f.complete) for f in find_checkpoints(tmp_path)] == [(2, True)]


def test_a_step_already_saved_is_not_written_again(tmp_path: Path) -> None:
    ap.use("cpu")
    model, opt = _objects()
    with ap.Checkpointer(tmp_path, every_steps=2, stop_on=()) as ckpt:
        ckpt.restore(model=model, optimizer=opt)
        for _ in range(2):
            _step(model, opt)
            ckpt.step()
    saved = Path(ckpt.last_saved or "")
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in saved.iterdir()}
    model, opt = _objects()
    with ap.Checkpointer(tmp_path, every_steps=2, stop_on=()) as again:
        assert again.restore(model=model, optimizer=opt) == 2
        assert again.save() == str(saved)  # resumed from it: the same state, left as it is
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in saved.iterdir()} == before
    with ap.Checkpointer(tmp_path, every_steps=2, stop_on=()) as third:
        third.restore(model=model, optimizer=opt)
        _step(model, opt)
        third.step()
        assert third.save().endswith("step-00000003")  # a step not saved yet is written
    assert [f.step for f in find_checkpoints(tmp_path) if f.complete] == [2, 3]
