"""Two jobs sharing one checkpoint directory: found, and said, at the first save after the other job's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import accelport as ap
from accelport.resume import find_checkpoints


def _objects() -> dict[str, Any]:
    import torch

    model = torch.nn.Linear(2, 1)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def test_a_second_job_in_the_same_directory_is_named_before_it_replaces_the_first_ones(tmp_path: Path) -> None:
    ap.use("cpu")
    first = ap.Checkpointer(tmp_path, every_steps=1, stop_on=())
    second = ap.Checkpointer(tmp_path, every_steps=1, stop_on=())  # another job, started on the same directory
    try:
        first.restore(**_objects())
        second.restore(**_objects())
        first.step()
        first.step()
        with pytest.raises(ap.CheckpointError, match=r"another job writes checkpoints in .* too: .*step-00000001 was "
                                                     r"written by run [0-9a-f]{12} \(host .*, pid \d+\) after this one "
                                                     r"\(run [0-9a-f]{12}\) began; .* Give each job a directory of its "
                                                     "own"):
            second.step()  # its step 1 would replace the first job's
        assert [(f.step, f.complete) for f in find_checkpoints(tmp_path)] == [(1, True), (2, True)]
        first.step()  # the first job goes on: what was there when it restored, and its own, are no one else's
    finally:
        first.close()
        second.close()


def test_a_run_resumed_after_another_job_ended_saves_as_usual(tmp_path: Path) -> None:
    ap.use("cpu")
    with ap.Checkpointer(tmp_path, every_steps=1, stop_on=()) as before:
        before.restore(**_objects())
        before.step()
    with ap.Checkpointer(tmp_path, every_steps=1, stop_on=()) as after:
        assert after.restore(**_objects()) == 1
        after.step()
    assert [f.step for f in find_checkpoints(tmp_path) if f.complete] == [1, 2]
