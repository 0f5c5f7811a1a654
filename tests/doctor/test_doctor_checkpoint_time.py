"""accelport doctor on a checkpoint.json whose time is out of range or later than now: said as such."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from accelport.resume import FORMAT, MARKER


def _checkpoint(directory: Path, when: str) -> None:
    """A complete checkpoint (it lists no files) whose checkpoint.json says it was written at ``when``
    (JSON text: ``-Infinity`` is what Python's json module reads and writes for -inf)."""
    step = directory / "step-00000007"
    step.mkdir(parents=True)
    (step / MARKER).write_text(f'{{"format": "{FORMAT}", "version": 1, "step": 7, "files": {{}}, "time": {when}}}')


def _doctor(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")}
    env["ACCELPORT_CHECKPOINT_DIR"] = str(directory)
    return subprocess.run([sys.executable, "-m", "accelport", "doctor", *args], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.mark.parametrize(("when", "said"), [
    ("-1e308", "at a time not valid"),
    ("-Infinity", "at a time not valid"),
    ("NaN", "at a time not valid"),
    ("1e308", "at a time in the future"),
    (repr(time.time() + 10 * 86400), "at a time in the future"),
])
def test_a_time_out_of_range_or_in_the_future_is_said_as_such(tmp_path: Path, when: str, said: str) -> None:
    _checkpoint(tmp_path, when)
    out = _doctor(tmp_path, "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    newest = report["checkpoints"]["newest"]
    assert newest["step"] == 7 and newest["age_s"] is None
    assert newest["time_problem"] == said.removeprefix("at a time ")
    title = next(f["title"] for f in report["findings"] if f["title"].startswith(f"checkpoints in {tmp_path}"))
    assert f"written {said}" in title and "ago" not in title, title
    text = _doctor(tmp_path)
    assert text.returncode == 0 and "Traceback" not in text.stderr, text.stderr
    assert f"written {said}" in text.stdout and " ago" not in text.stdout


def test_a_time_in_the_past_still_says_how_long_ago(tmp_path: Path) -> None:
    _checkpoint(tmp_path, repr(time.time() - 3 * 86400 - 60))
    report = json.loads(_doctor(tmp_path, "--json").stdout)
    newest = report["checkpoints"]["newest"]
    assert newest["time_problem"] is None and newest["age_s"] > 3 * 86400
    assert any("written 3 days ago" in f["title"] for f in report["findings"])
