"""Files a user names never hang a command or a run, and never fill memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from accelport.errors import AccelportError
from accelport.safe_io import open_append, read_regular_file


@pytest.fixture
def fifo(tmp_path: Path) -> str:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return str(path)


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # The timeout is a guard against the hang itself, not a measurement.
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env={**os.environ, **env},
                          timeout=120)


@pytest.mark.parametrize("command", [["doctor", "--json"], ["backends", "--json"], ["matrix", "--json"],
                                     ["ci-matrix", "--format", "json"]])
def test_a_fifo_as_the_matrix_override_is_an_error_not_a_hang(fifo: str, command: list[str]) -> None:
    out = _run(["-m", "accelport", *command], {"ACCELPORT_COMPAT_MATRIX": fifo})
    data = json.loads(out.stdout)
    text = json.dumps(data)
    assert "a FIFO" in text and "point it at a regular file" in text, text


def test_dev_zero_as_the_matrix_override_is_refused_without_reading_it() -> None:
    out = _run(["-m", "accelport", "matrix", "--json"], {"ACCELPORT_COMPAT_MATRIX": "/dev/zero"})
    assert out.returncode == 1 and "a device" in json.loads(out.stdout)["error"]


def test_ap_device_with_a_fifo_override_raises_a_specific_error(fifo: str) -> None:
    out = _run(["-c", "import accelport as ap\ntry:\n    ap.device()\nexcept ap.CompatMatrixError as e:\n"
                      "    print('refused:', e)\n"], {"ACCELPORT_COMPAT_MATRIX": fifo})
    assert out.returncode == 0 and "refused:" in out.stdout and "a FIFO" in out.stdout, out.stderr


def test_a_fifo_as_the_metrics_file_leaves_training_running(fifo: str, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch, accelport as ap
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in ap.loader([torch.randn(4, 2) for _ in range(3)]):
            model(x).sum().backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
        print("steps", ap.metrics().steps)
    """))
    out = _run([str(script)], {"ACCELPORT_METRICS_FILE": fifo, "ACCELPORT_BACKEND": "cpu"})
    assert out.returncode == 0, out.stderr
    assert "steps 3" in out.stdout
    assert "metrics-file" in out.stderr and "a FIFO" in out.stderr  # said once, as a PluginWarning


def test_the_reader_refuses_what_is_not_a_regular_file(tmp_path: Path, fifo: str) -> None:
    with pytest.raises(AccelportError, match="is a directory: point it at a regular file"):
        read_regular_file(str(tmp_path), what="X", limit=10)
    with pytest.raises(AccelportError, match="is a FIFO"):
        read_regular_file(fifo, what="X", limit=10)
    big = tmp_path / "big"
    big.write_bytes(b"x" * (3 << 20))
    with pytest.raises(AccelportError, match="larger than 2 MB"):
        read_regular_file(str(big), what="X", limit=2 << 20)
    assert read_regular_file(str(big), what="X", limit=4 << 20) == b"x" * (3 << 20)
    with pytest.raises(AccelportError, match="X .* is a FIFO"):
        open_append(fifo, what="X")
