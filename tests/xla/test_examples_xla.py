"""Every example, short form, unchanged, on XLA:CPU (torch_xla's real compiler and runtime)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.xla

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def run_example(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")}
    env.update(ACCELPORT_BACKEND="xla", PJRT_DEVICE="CPU")
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_quickstart_on_xla() -> None:
    out = run_example(str(EXAMPLES / "quickstart.py"))
    assert "backend: xla" in out.stdout
    assert "compilations" in out.stdout


def test_digits_on_xla() -> None:
    pytest.importorskip("sklearn")
    out = run_example(str(EXAMPLES / "digits.py"), "--epochs", "2", "--max-steps", "40")
    accuracy = float(out.stdout.split("test accuracy ")[1].split()[0])
    assert accuracy > 0.75
    # Fixed-size training batches: the step compiles a handful of times, not once per step.
    compilations = int(out.stdout.split("compilations ")[1].split()[0])
    assert compilations <= 8


def test_char_lm_batch_max_padding_is_diagnosed_on_xla() -> None:
    out = run_example(str(EXAMPLES / "char_lm.py"), "--padding", "batch-max", "--steps", "24")
    assert "diagnosis [recompilation]" in out.stdout
    assert "BucketCollate" in out.stdout
    assert "diagnosis [host-sync]" not in out.stdout


def test_char_lm_bucketing_compiles_once_per_bucket_on_xla() -> None:
    out = run_example(str(EXAMPLES / "char_lm.py"), "--padding", "bucket", "--steps", "24")
    assert "diagnosis" not in out.stdout
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("steps "))
    shapes = int(line.split("distinct batch shapes ")[1].split(",")[0])
    compilations = int(line.split("compilations ")[1].split(",")[0])
    assert shapes <= 4 and compilations <= shapes + 1


def test_data_parallel_example_through_the_xla_launcher() -> None:
    out = run_example("-m", "accelport", "launch", "--backend", "xla", "--nprocs", "1",
                      str(EXAMPLES / "data_parallel.py"), "--steps", "40")
    assert "1 replica(s) on xla" in out.stdout and "replicas agree" in out.stdout
