"""A resume whose loader cuts its batches otherwise than the checkpoint's (another batch size, another dataset
length) is refused in the middle of a pass, where the position in batches would skip or repeat samples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import accelport as ap


def _loader(samples: int, batch_size: int) -> Any:
    import torch

    return torch.utils.data.DataLoader(torch.arange(float(samples)).view(samples, 1), batch_size=batch_size)


def _run(directory: Path, loader: Any, steps: int, every: int) -> tuple[int, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ap.Checkpointer(directory, every_steps=every, stop_on=()) as ckpt:
        start = ckpt.restore(model=model, optimizer=opt, loader=loader)
        for x in ap.loader(loader):
            if ckpt.steps == steps:
                break
            model(x).sum().backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
            ckpt.step()
    return start, model


@pytest.mark.parametrize(("samples", "batch_size", "said"), [
    (24, 3, r"batch size 4 then, 3 now, batches a pass 6 then, 8 now"),
    (28, 4, r"dataset length 24 then, 28 now, batches a pass 6 then, 7 now"),
])
def test_another_batch_size_or_dataset_length_mid_pass_is_refused(tmp_path: Path, samples: int, batch_size: int,
                                                                    said: str) -> None:
    import torch

    ap.use("cpu")
    _run(tmp_path, _loader(24, 4), steps=2, every=2)  # saved 2 batches into pass 0 (of 6)
    model = torch.nn.Linear(1, 1)
    before = model.weight.detach().clone()
    with ap.Checkpointer(tmp_path, stop_on=()) as again:
        with pytest.raises(ap.CheckpointError, match=rf"step-00000002 was saved 2 batches into pass 0, and the loader "
                                                     rf"given to restore\(\) differs \({said}\): the position is kept "
                                                     "in batches, so going on with this loader would skip or repeat "
                                                     "samples of that pass. Resume with the loader as it was saved"):
            again.restore(model=model, loader=_loader(samples, batch_size))
    assert torch.equal(model.weight, before)  # refused before anything was loaded


def test_the_same_loader_resumes_and_another_one_starts_a_new_pass_after_one_ended(tmp_path: Path) -> None:
    ap.use("cpu")
    _run(tmp_path / "a", _loader(24, 4), steps=2, every=2)
    assert _run(tmp_path / "a", _loader(24, 4), steps=6, every=2)[0] == 2
    _run(tmp_path / "b", _loader(24, 4), steps=6, every=6)  # the pass had ended at the checkpoint
    assert _run(tmp_path / "b", _loader(24, 3), steps=8, every=2)[0] == 6
