"""The report page's memory chart, drawn in a real headless browser, and memory-growth replayed from a file."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from accelport.diagnose.report import diagnose, write_report
from tests.diagnose.test_report import CHROME_FLAGS, CHROMIUM, step, write_jsonl

MiB = 1 << 20
STATIC = 48 * MiB


def run(growth: int) -> list[dict[str, Any]]:
    """40 steps on a cuda-like device: 60 MiB in use, ``growth`` more each step; the static part counted."""
    records = []
    for n in range(1, 41):
        memory = {"memory_bytes": 60 * MiB + growth * n, "peak_memory_bytes": 90 * MiB + growth * n,
                  "capacity_bytes": 16 << 30, "parameter_bytes": 12 * MiB, "gradient_bytes": 12 * MiB,
                  "optimizer_state_bytes": 24 * MiB, "activation_bytes": 42 * MiB}
        records.append(step(n, compilations=int(n == 1), memory=memory))
    return records


def test_growth_is_found_again_from_the_file_alone() -> None:
    found = [d for d in diagnose(run(growth=2 * MiB)) if d.kind == "memory-growth"]
    assert len(found) == 1 and found[0].evidence["growth_bytes_per_step"] == 2 * MiB
    assert "device memory grew by 2.0 MiB per step from step" in found[0].message
    assert not [d for d in diagnose(run(growth=0)) if d.kind == "memory-growth"]


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"),
                    reason="Debian's chromium is not installed (`make test` installs it where it can)")
def test_memory_chart_is_drawn_in_a_real_headless_browser(tmp_path: Path) -> None:
    assert CHROMIUM, "CI must have chromium: the Makefile's test target installs it"
    path = tmp_path / "run.jsonl"
    write_jsonl(path, run(growth=2 * MiB))
    page = write_report(str(path)).path
    text = Path(page).read_text()
    assert "Memory, per step" in text and "highest 170.0 MiB, capacity 16.0 GiB" in text
    with tempfile.TemporaryDirectory() as profile:
        dom = subprocess.run([CHROMIUM, *CHROME_FLAGS, f"--user-data-dir={profile}", "--dump-dom",
                              f"file://{page}"], capture_output=True, text=True, timeout=120).stdout
    assert re.search(r'<svg id="memory"[^>]*data-drawn="40"', dom), "the script did not draw the memory chart"
    used = re.search(r'<polyline points="([^"]+)"[^>]*class="memory-used"', dom)
    static = re.search(r'<polyline points="([^"]+)"[^>]*class="memory-static"', dom)
    assert used and static
    heights = [float(p.split(",")[1]) for p in used.group(1).split()]
    assert len(heights) == 40 and heights == sorted(heights, reverse=True)  # growing: each point higher up
    assert len({p.split(",")[1] for p in static.group(1).split()}) == 1  # the static part: flat
