"""Generated documentation stays in step with the data it is generated from."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_docs_matrix_is_generated_from_the_data() -> None:
    fresh = subprocess.run([sys.executable, "-m", "accelport", "matrix", "--markdown"], capture_output=True,
                           text=True, check=True, env={"PATH": "/usr/bin:/bin"}, timeout=120).stdout
    committed = (ROOT / "docs" / "matrix.md").read_text()
    assert fresh == committed, "docs/matrix.md is stale: run `accelport matrix --markdown > docs/matrix.md`"


def test_matrix_markdown_refuses_filters() -> None:
    out = subprocess.run([sys.executable, "-m", "accelport", "matrix", "--markdown", "--torch", "2.9"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "drop --platform and --torch" in out.stderr


PRELUDE = """
import torch
train_loader = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(60)]
Net = lambda: torch.nn.Linear(4, 1)
loss_fn = torch.nn.functional.mse_loss
"""


def test_the_torch_xla_guides_after_script_runs_unchanged_on_cpu(tmp_path: pathlib.Path) -> None:
    # The guide says the ported script runs on every backend: run its code block as written.
    text = (ROOT / "docs" / "migrate-torch-xla.md").read_text()
    after = text.split("## After", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert "ap.compile_cache(" in after and "ap.save(" in after
    script = tmp_path / "train.py"
    script.write_text(PRELUDE + after)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "ACCELPORT_BACKEND": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "model.pt").is_file()
    assert "does nothing on backend 'cpu'" in out.stderr  # said once, not an error
    assert "loss" in out.stdout and "Metrics(" in out.stdout
