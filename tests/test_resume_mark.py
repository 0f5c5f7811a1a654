"""Completing a checkpoint on shared storage: a rank's part that rank 0's listing does not show yet (NFS caches a
directory's listing for seconds) is looked for by name until it shows, and its size is the one the file has."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

import accelport as ap
from accelport.errors import CheckpointError
from accelport.resume import MARKER


def _checkpointer(tmp_path: Path) -> ap.Checkpointer:
    import torch

    ap.use("cpu")
    ckpt = ap.Checkpointer(tmp_path / "ckpt", stop_on=())
    ckpt.restore(model=torch.nn.Linear(2, 2))
    return ckpt


def test_a_part_that_shows_late_is_waited_for_and_listed_at_its_size(tmp_path: Path) -> None:
    ckpt = _checkpointer(tmp_path)
    target = tmp_path / "ckpt" / "step-00000004"
    target.mkdir()
    (target / "rank-0.pt").write_bytes(b"0" * 10)
    late = threading.Timer(0.6, lambda: (target / "rank-1.pt").write_bytes(b"1" * 25))
    late.start()
    try:
        ckpt._mark(str(target), 4, 2)  # as rank 0 does once every rank said its part is written
    finally:
        late.join()
        ckpt.close()
    marker = json.loads((target / MARKER).read_text())
    assert marker["files"] == {"rank-0.pt": 10, "rank-1.pt": 25}


def test_a_part_that_never_shows_is_an_error_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import accelport.resume

    monkeypatch.setattr(accelport.resume, "MARK_WAIT_S", 0.5)
    ckpt = _checkpointer(tmp_path)
    target = tmp_path / "ckpt" / "step-00000004"
    target.mkdir()
    (target / "rank-0.pt").write_bytes(b"0")
    began = time.monotonic()
    with pytest.raises(CheckpointError, match=r"lacks rank-1.pt after every rank wrote its part: the directory must "
                                              r"be on storage every host shares"):
        ckpt._mark(str(target), 4, 2)
    ckpt.close()
    assert time.monotonic() - began >= 0.5  # looked again before saying so
