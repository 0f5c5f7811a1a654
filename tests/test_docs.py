"""Generated documentation stays in step with the data it is generated from."""

from __future__ import annotations

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
