"""torchrun's grace period after a stop signal: a torch whose torchrun kills the workers 30 s after it, whatever
ACCELPORT_STOP_DEADLINE_S says, is found on disk and said before the launch starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from accelport._packages import torchrun_takes_shutdown_timeout
from accelport.launch.stop import torchrun_grace_note


def _torch_tree(root: Path, source: str) -> Path:
    api = root / "torch" / "distributed" / "launcher" / "api.py"
    api.parent.mkdir(parents=True)
    api.write_text(source)
    return root / "torch"


def test_the_setting_is_found_in_torchrun_source_not_by_importing(tmp_path: Path) -> None:
    newer = _torch_tree(tmp_path / "a", 'timeout = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))\n')
    older = _torch_tree(tmp_path / "b", "shutdown_timeout = 30\n")
    assert torchrun_takes_shutdown_timeout(str(newer)) is True
    assert torchrun_takes_shutdown_timeout(str(older)) is False
    assert torchrun_takes_shutdown_timeout(str(tmp_path / "none")) is None
    assert torchrun_takes_shutdown_timeout() is True  # this machine's torch 2.13 reads it


@pytest.mark.parametrize(("deadline", "takes", "said"), [
    (60.0, False, True), (30.0, False, False), (60.0, True, False), (60.0, None, False)])
def test_the_note_is_said_only_where_torchrun_would_cut_the_deadline_short(deadline: float, takes: bool | None,
                                                                           said: bool) -> None:
    note = torchrun_grace_note(deadline, takes)
    assert (note is not None) == said
    if note:
        assert "kills the workers 30 s after a stop signal" in note and "60 s of ACCELPORT_STOP_DEADLINE_S" in note
        assert "set ACCELPORT_STOP_DEADLINE_S to at most 30" in note
