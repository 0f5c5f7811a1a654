"""ap.Checkpointer on XLA:CPU: a run killed mid-epoch resumes bit-identically, the XLA RNG seed restored too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DEFAULT_SIGNALS, REPO

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


def _launch(*args: str) -> list[str]:
    # The stop signals at their defaults in the launcher, whatever the test run inherited.
    return [sys.executable, "-c", DEFAULT_SIGNALS, "-m", "accelport", "launch", "--backend", "xla", "--nprocs", "1",
            *args]


def _launch_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELPORT_", "TORCHELASTIC_"))}
    return env | {"PJRT_DEVICE": "CPU", "PYTHONPATH": REPO}


def test_the_xla_launcher_restarts_a_failed_worker_and_forwards_sigterm(tmp_path: Path) -> None:
    import time

    import torch

    from accelport.launch.stop import EXIT_PREEMPTED

    full, part, stop = tmp_path / "full", tmp_path / "part", tmp_path / "stop"
    for d in (full, part, stop):
        d.mkdir()
    common = ("--steps", "30", "--every", "5")
    done = subprocess.run(_launch(JOB, str(full), str(full / "ckpt"), *common), capture_output=True, text=True,
                          env=_launch_env(), timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr
    # torch_xla's launcher has none: accelport's loop starts the worker again, which resumes.
    again = subprocess.run(_launch("--max-restarts", "1", JOB, str(part), str(part / "ckpt"), *common,
                                   "--kill-at", "17"), capture_output=True, text=True, env=_launch_env(),
                           timeout=900, cwd=REPO)
    assert again.returncode == 0, again.stderr
    assert len(list(part.glob("seen-rank0-*.json"))) == 2
    # The job's goodput, kept by the worker's checkpointer across the launcher's own restart: it had ended step 16
    # when it died after the update of step 17, past the checkpoint of step 15 the next attempt resumed from.
    assert "accelport: goodput " in again.stderr and "over 2 runs (1 restart(s))" in again.stderr, again.stderr
    assert "productive " in again.stderr and "(30 steps)" in again.stderr
    assert "recomputed 1 step(s) lost past the last checkpoint" in again.stderr
    a, b = torch.load(full / "final-rank0.pt"), torch.load(part / "final-rank0.pt")
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # A first attempt that hangs at step 12 is stopped by --timeout; the next one is watched from its own
    # start, never judged by the hung attempt's heartbeat (older than --timeout by then, which used to stop
    # it at once), and resumes from step 10. The timeout also bounds every gap between two steps that end,
    # recompilations and saves included: 60 s leaves them a wide margin on a busy machine.
    hung = tmp_path / "hung"
    hung.mkdir()
    again = subprocess.run(_launch("--max-restarts", "1", "--timeout", "60", "--startup-timeout", "300", JOB,
                                   str(hung), str(hung / "ckpt"), *common, "--hang-at", "12"), capture_output=True,
                           text=True, env=_launch_env(), timeout=900, cwd=REPO)
    assert again.returncode == 0, again.stderr
    runs = [json.loads(p.read_text()) for p in hung.glob("seen-rank0-*.json")]
    assert sorted(r["start"] for r in runs) == [0, 10] and max(r["seen"][-1][0] for r in runs) == 30, runs
    b = torch.load(hung / "final-rank0.pt")
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # SIGTERM to the launcher reaches the replica, which saves; the launch exits 75.
    proc = subprocess.Popen(_launch(JOB, str(stop), str(stop / "ckpt"), *common, "--pause-at", "12"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_launch_env(), cwd=REPO)
    deadline = time.monotonic() + 600  # only guards a hang
    while not (stop / "ready-rank0").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "every rank saved its checkpoint (step 12" in err
