"""A complete-looking newest checkpoint that is damaged (a byte changed, a part of another step, garbage, a
hand-edited checkpoint.json) gives way, with a warning naming what is wrong, to the complete one before it."""

from __future__ import annotations

import json
import os
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest

import accelport as ap


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Linear(64, 1)


def _save(directory: Path) -> dict[str, Any]:
    """Checkpoints at steps 2 and 4; the model's state at step 2."""
    import torch

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    at: dict[str, Any] = {}
    with ap.Checkpointer(directory, every_steps=2, stop_on=()) as ckpt:
        ckpt.restore(model=model, optimizer=opt)
        for _ in range(4):
            model(torch.ones(1, 64)).sum().backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
            ckpt.step()
            if ckpt.steps == 2:
                at = {k: v.clone() for k, v in model.state_dict().items()}
    return at


def _flip_a_data_byte(path: Path) -> None:
    """Change one byte inside the largest stored member of torch's zip archive (its size stays)."""
    with zipfile.ZipFile(path) as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    name_length, extra_length = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    start = info.header_offset + 30 + name_length + extra_length
    data[start + info.file_size // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _marker(step_dir: Path) -> dict[str, Any]:
    return json.loads((step_dir / "checkpoint.json").read_text())  # type: ignore[no-any-return]


def _other_step_rank_file(directory: Path) -> None:
    newest = directory / "step-00000004"
    (newest / "rank-0.pt").write_bytes((directory / "step-00000002" / "rank-0.pt").read_bytes())
    marker = _marker(newest)
    marker["files"]["rank-0.pt"] = os.path.getsize(newest / "rank-0.pt")
    (newest / "checkpoint.json").write_text(json.dumps(marker))


def _garbage_state(directory: Path) -> None:
    state = directory / "step-00000004" / "state"
    state.write_bytes(os.urandom(state.stat().st_size))


def _unlisted_missing_file(directory: Path) -> None:
    newest = directory / "step-00000004"
    marker = _marker(newest)
    del marker["files"]["rank-0.pt"]
    (newest / "checkpoint.json").write_text(json.dumps(marker))
    (newest / "rank-0.pt").unlink()


def _bad_json(directory: Path) -> None:
    (directory / "step-00000004" / "checkpoint.json").write_text('{"format": "accelport.run", ')


@pytest.mark.parametrize(("damage", "said"), [
    (lambda d: _flip_a_data_byte(d / "step-00000004" / "state"),
     r"it is damaged: state does not hold the bytes it was saved with \(.* fails its CRC32 check\)"),
    (lambda d: _flip_a_data_byte(d / "step-00000004" / "rank-0.pt"),
     r"it is damaged: rank-0.pt does not hold the bytes it was saved with"),
    (_other_step_rank_file, r"it is damaged: rank-0.pt is of step 2, not of the step 4 the checkpoint is"),
    (_garbage_state, r"it is damaged: state is not the archive torch wrote"),
    (_unlisted_missing_file, r"it is damaged: its checkpoint.json does not list rank-0.pt, which every checkpoint"),
    (_bad_json, r"ignored .*step-00000004: its checkpoint.json cannot be read \(JSONDecodeError"),
], ids=["state-byte", "rank-byte", "rank-of-step-2", "garbage", "unlisted-missing", "bad-json"])
def test_a_damaged_newest_checkpoint_gives_way_to_the_one_before(tmp_path: Path, damage: Any, said: str) -> None:
    import torch

    ap.use("cpu")
    at_2 = _save(tmp_path)
    damage(tmp_path)
    model = _model()
    with ap.Checkpointer(tmp_path, stop_on=()) as again:
        with pytest.warns(ap.CheckpointWarning, match=said):
            assert again.restore(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) == 2
    assert all(torch.equal(v, at_2[k]) for k, v in model.state_dict().items())
