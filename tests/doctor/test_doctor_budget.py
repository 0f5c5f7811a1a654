"""What one doctor run costs: /sys read once however many times the platform is asked for, and the
cache-size walk bounded on trees of empty directories. Counts, never seconds."""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

import pytest

from accelport.doctor.gather import _dir_size, gather
from tests import fakes


def test_one_doctor_run_reads_the_pci_devices_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fakes.tpu_vm(tmp_path, "v5e", chips=4)
    monkeypatch.setenv("ACCELPORT_SYSROOT", str(tmp_path))
    scans: list[str] = []
    real = glob.glob

    def spy(pattern: str, *args: Any, **kwargs: Any) -> list[str]:  # counts, then globs for real
        if pattern.endswith("sys/bus/pci/devices/*/vendor"):
            scans.append(pattern)
        return real(pattern, *args, **kwargs)

    monkeypatch.setattr(glob, "glob", spy)
    report = gather()
    assert report["platform"]["name"] == "gcp-tpu" and report["platform"]["device_count"] == 4
    tpu = next(b for b in report["backends"] if b["name"] == "xla")
    assert "libtpu is not installed" in tpu["reason"]  # said only where the probe saw the TPU tree
    assert len(scans) == 1, scans
    gather()
    assert len(scans) == 2  # a new run reads /sys again: nothing is kept between runs
    from accelport.platform import detect

    detect()
    detect()
    assert len(scans) == 4  # outside a doctor run every detection reads afresh


def test_the_cache_size_walk_is_bounded_on_a_tree_of_empty_directories(tmp_path: Path) -> None:
    tree = tmp_path / "cache"
    for i in range(30):
        (tree / f"d{i}" / "e" / "f").mkdir(parents=True)
    assert _dir_size(str(tree), budget=float("inf")) == 0  # (the counts are judged here, not the clock)
    assert _dir_size(str(tree), max_files=50) is None  # 91 directories, no file: counted all the same
    assert _dir_size(str(tree), budget=-1.0) is None  # a budget already spent stops the walk at once
    (tree / "d0" / "data.bin").write_bytes(b"x" * 1000)
    assert _dir_size(str(tree), budget=float("inf")) == 1000
