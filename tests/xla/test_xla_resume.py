"""ap.Checkpointer on XLA:CPU: a run killed mid-epoch resumes bit-identically, the XLA RNG seed restored too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.xla

JOB = str(Path(REPO) / "tests" / "scripts" / "resume_job.py")


def job(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELPORT_", "TORCHELASTIC_"))}
    env |= {"ACCELPORT_BACKEND": "xla", "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO, **extra}
    return subprocess.run([sys.executable, JOB, *args, "--steps", "30", "--every", "5"], capture_output=True,
                          text=True, env=env, timeout=600, cwd=REPO)


def test_a_run_killed_at_step_17_resumes_bit_identical_on_xla(tmp_path: Path) -> None:
    import torch

    full, part = tmp_path / "full", tmp_path / "part"
    full.mkdir()
    part.mkdir()
    done = job(str(full), str(full / "ckpt"))
    assert done.returncode == 0, done.stderr
    killed = job(str(part), str(part / "ckpt"), "--kill-at", "17")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    saved = torch.load(part / "ckpt" / "step-00000015" / "rank-0.pt")
    assert saved["rng"]["device"][0] == "xla" and isinstance(saved["rng"]["device"][1], int)  # dropout's seed
    assert saved["data"]["kind"] == "map" and saved["data"]["consumed"] == 15  # mid-epoch: 24 batches a pass
    resumed = job(str(part), str(part / "ckpt"), TORCHELASTIC_RESTART_COUNT="1")
    assert resumed.returncode == 0, resumed.stderr
    a, b = torch.load(full / "final-rank0.pt"), torch.load(part / "final-rank0.pt")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
