"""Pass ends: a loop that leaves each pass early (max_steps_per_epoch) resumes bit-identically with
batches_per_pass; a run stopped at the last batch of a whole pass resumes the next pass in its order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import accelport as ap

LIMIT = 5  # batches read of each pass, of the 12 a pass holds
EPOCHS = 3


def _run(directory: Path, stop_after: int | None = None, every: int = 100) -> tuple[Any, list[list[float]]]:
    """Train EPOCHS passes of LIMIT batches each (the loop's own break too); ``stop_after``: the process stops
    there, right after that step's checkpoint (as a kill or a stop request would leave it)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.utils.data.TensorDataset(torch.linspace(-1, 1, 24).view(24, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)
    seen: list[list[float]] = []
    with ap.Checkpointer(directory, every_steps=every, stop_on=()) as ckpt:
        ckpt.restore(model=model, optimizer=opt, loader=loader, batches_per_pass=LIMIT)
        for _ in range(ckpt.epoch, EPOCHS):
            for i, (x,) in enumerate(ap.loader(loader)):
                seen.append(x.view(-1).tolist())
                model(x).pow(2).sum().backward()
                ap.optimizer_step(opt)
                opt.zero_grad()
                ckpt.step()
                if ckpt.steps == stop_after:
                    return model, seen
                if i + 1 == LIMIT:  # max_steps_per_epoch, as the loop had it
                    break
    return model, seen


@pytest.mark.parametrize("stop_at", [5, 7, 10])  # the end of pass 0, mid pass 1, the end of pass 1
def test_a_pass_left_early_resumes_bit_identical(tmp_path: Path, stop_at: int) -> None:
    import torch

    ap.use("cpu")
    full, full_seen = _run(tmp_path / "full")
    assert len(full_seen) == EPOCHS * LIMIT
    _, before = _run(tmp_path / "stopped", stop_after=stop_at, every=stop_at)
    resumed, after = _run(tmp_path / "stopped")
    assert before + after == full_seen  # the same batches at the same steps, none repeated or skipped
    for a, b in zip(full.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_batches_per_pass_is_checked(tmp_path: Path) -> None:
    with ap.Checkpointer(tmp_path, stop_on=()) as ckpt:
        with pytest.raises(ap.AccelportError, match=r"batches_per_pass=...\) takes the number of batches the loop "
                                                    "reads of each pass, 1 or more"):
            ckpt.restore(loader=[1, 2], batches_per_pass=0)
        with pytest.raises(ap.AccelportError, match="pass loader= too"):
            ckpt.restore(batches_per_pass=3)


def _whole_passes(directory: Path, loader_args: dict[str, Any], stop_after: int | None = None,
                  leave: bool = False) -> list[list[float]]:
    """Two whole passes of 6 batches, each step checkpointed; ``stop_after``: the process stops there;
    ``leave``: the loop leaves each pass at its last batch (a cap of steps per pass equal to the pass)."""
    import torch

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.arange(24.0).view(24, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, **loader_args)
    seen: list[list[float]] = []
    with ap.Checkpointer(directory, every_steps=1, stop_on=()) as ckpt:
        ckpt.restore(loader=loader)
        for _ in range(ckpt.epoch, 2):
            for i, (x,) in enumerate(ap.loader(loader)):
                seen.append(x.view(-1).tolist())
                ckpt.step()
                if ckpt.steps == stop_after:
                    return seen
                if leave and i == len(loader) - 1:
                    break
    return seen


@pytest.mark.parametrize("loader_args", [
    {"generator": "own"},  # the loader's own generator
    {},  # the global one: the sampler seeds a generator of its own from it
    {"generator": "own", "num_workers": 1, "persistent_workers": True},
    {"generator": "own", "leave": True},  # the loop leaves the pass at its last batch: it reads no further
], ids=["own-generator", "global-generator", "persistent-worker", "left-at-last-batch"])
def test_a_run_stopped_at_the_last_batch_of_a_pass_resumes_the_next_pass_in_its_order(
        tmp_path: Path, loader_args: dict[str, Any]) -> None:
    """RandomSampler draws once more as it runs out, after the pass's last batch: the state saved at that
    batch is not the one the next pass draws its order from."""
    import torch

    leave = loader_args.get("leave", False)

    def args() -> dict[str, Any]:
        return {k: torch.Generator().manual_seed(1) if v == "own" else v for k, v in loader_args.items()
                if k != "leave"}

    ap.use("cpu")
    full = _whole_passes(tmp_path / "full", args(), leave=leave)
    before = _whole_passes(tmp_path / "stopped", args(), stop_after=6, leave=leave)
    after = _whole_passes(tmp_path / "stopped", args(), leave=leave)
    assert len(before) == 6 and len(after) == 6
    assert before + after == full


def test_a_sharded_pass_whose_last_short_run_was_not_read_resumes_the_next_pass_in_its_order() -> None:
    """Two replicas of a 9-batch pass: each steps 4 times, and the 9th batch is read (and dropped) only when the
    loop asks for a 5th. Saved at the 4th, the sampler had not run out: the resume runs it out, loading nothing."""
    import torch

    from accelport.device_loader import shard_batches
    from accelport.resume import _Position

    def loader() -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(36.0)), batch_size=4,
                                           shuffle=True, generator=torch.Generator().manual_seed(1))

    def read(position: _Position, source: Any) -> list[list[float]]:
        out = []
        for (x,) in shard_batches(position.begin(source, 2), 0, 2):
            position.advance()
            out.append(x.tolist())
            if len(out) == 4:
                position.saved = position.state()  # type: ignore[attr-defined]
        return out

    first = loader()
    position = _Position(first, "map")
    full = read(position, first)
    saved = position.saved  # type: ignore[attr-defined]
    full += read(position, first)
    assert len(full) == 8 and saved["ended"] and not saved["exhausted"]
    again = loader()
    resumed = _Position(again, "map")
    assert resumed.resume_at(saved) == ""
    assert read(resumed, again) == full[4:]
