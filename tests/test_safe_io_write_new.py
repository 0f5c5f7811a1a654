"""``safe_io.write_new``: a new file, whole, or nothing; never over a file, never through a symlink."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from accelport.errors import AccelportError
from accelport.safe_io import write_new


def no_hard_links(src: str, dst: str, *args: object, **kwargs: object) -> None:
    raise OSError(errno.EPERM, "Operation not permitted")  # as a file system without hard links says


@pytest.mark.parametrize("links", ["hard links", "no hard links"])
def test_a_new_name_is_written_whole_and_a_taken_one_is_left_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, links: str) -> None:
    if links == "no hard links":
        monkeypatch.setattr(os, "link", no_hard_links)
    victim = tmp_path / "victim"
    victim.write_bytes(b"mine")
    (tmp_path / "link").symlink_to(victim)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "file").write_bytes(b"mine")
    assert write_new(str(tmp_path / "new"), b"data", what="the repro") is True
    for taken in ("link", "dangling", "file"):
        assert write_new(str(tmp_path / taken), b"data", what="the repro") is False
    assert (tmp_path / "new").read_bytes() == b"data"
    assert victim.read_bytes() == b"mine" and (tmp_path / "file").read_bytes() == b"mine"
    assert not (tmp_path / "nowhere").exists()
    # No temporary file is left beside them.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "file", "link", "new", "victim"]


def test_a_directory_that_cannot_be_written_is_a_specific_error(tmp_path: Path) -> None:
    with pytest.raises(AccelportError, match=r"^the repro '.*/missing/new' cannot be written \(No such file"):
        write_new(str(tmp_path / "missing" / "new"), b"data", what="the repro")
