"""ap.Checkpointer and the step-N directories it did not write (another tool's, a user's): left alone."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

import accelport as ap
from accelport.resume import find_checkpoints


def _train(ckpt: Any, steps: int) -> None:
    import torch

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt.restore(model=model, optimizer=opt)
    for _ in range(steps):
        model(torch.ones(1, 2)).sum().backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
        ckpt.step()


def _foreign(directory: Path) -> dict[Path, bytes]:
    """torchtitan's layout (DCP shards, no checkpoint.json) and a user's results, named as checkpoints are."""
    files = {directory / "step-1" / ".metadata": b"dcp", directory / "step-1" / "__0_0.distcp": b"shard",
             directory / "step-00000007" / "results.csv": b"step,loss\n7,0.5\n",
             directory / "step-00000002" / "notes.txt": b"mine"}
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return files


def test_directories_it_did_not_write_are_ignored_once_and_never_pruned(tmp_path: Path) -> None:
    ap.use("cpu")
    files = _foreign(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ap.Checkpointer(tmp_path, every_steps=1, keep_last=1, stop_on=()) as ckpt:
            _train(ckpt, 1)  # (step 2 is foreign: saving it is refused, below)
    said = [str(w.message) for w in caught if issubclass(w.category, ap.CheckpointWarning)]
    assert len(said) == 3 and all("accelport did not write it; it is not loaded, and never removed or saved over"
                                  in m for m in said)
    assert any("step-00000007: it has no checkpoint.json" in m for m in said)
    assert not any("skipped the checkpoint" in m for m in said)  # not called torn
    # Later saves prune (keep_last=1) and restore again: the foreign directories stay, byte for byte.
    with ap.Checkpointer(tmp_path, every_steps=3, keep_last=1, stop_on=()) as again, warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.CheckpointWarning)
        _train(again, 5)  # from step 1: saves steps 3 and 6
    assert all(path.read_bytes() == data for path, data in files.items())
    assert [f.step for f in find_checkpoints(tmp_path) if f.complete] == [6]
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.iterdir()) == [
        "goodput-progress.bin", "goodput.jsonl",  # rank 0's goodput account, beside the checkpoints
        "step-00000002", "step-00000006", "step-00000007", "step-1"]


def test_saving_onto_a_foreign_step_directory_is_refused_not_removed(tmp_path: Path) -> None:
    ap.use("cpu")
    files = _foreign(tmp_path)
    with ap.Checkpointer(tmp_path, every_steps=1, stop_on=()) as ckpt, warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.CheckpointWarning)
        with pytest.raises(ap.CheckpointError, match=r"step-00000002' is already there and accelport did not write "
                                                     r"it .* Give the checkpointer a directory of its own"):
            _train(ckpt, 2)
    assert all(path.read_bytes() == data for path, data in files.items())


def test_its_own_torn_and_empty_directories_are_still_replaced(tmp_path: Path) -> None:
    ap.use("cpu")
    (tmp_path / "step-00000001").mkdir()  # a save killed as it made its directory
    with ap.Checkpointer(tmp_path, every_steps=1, stop_on=()) as ckpt:
        with pytest.warns(ap.CheckpointWarning,
                          match="step-00000001: it has no checkpoint.json and is empty: its save did not finish"):
            _train(ckpt, 2)
    assert [(f.step, f.complete) for f in find_checkpoints(tmp_path)] == [(1, True), (2, True)]
