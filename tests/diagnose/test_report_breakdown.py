"""The report page draws each step's time breakdown, says the verdict and shows a profiled window."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile

import pytest

from accelport.diagnose.report import ReportError, load_records, render_html, write_report
from tests.diagnose.test_report import CHROME_FLAGS, CHROMIUM, step, write_jsonl


def timed(n: int, **kw):  # type: ignore[no-untyped-def]
    """A step record as a cpu run writes one: its breakdown adds up to its seconds."""
    parts = {"data": 0.02, "device": 0.025, "other": 0.005}
    base = step(n, backend="cpu", lazy=False, seconds=sum(parts.values()), compilations=0, compile_seconds=0.0,
                breakdown=parts)
    base.update(kw)
    return base


PROFILE = {"steps": [5, 7], "asked": "5:8", "complete": True, "backend": "cpu", "profiler": "torch.profiler",
           "directory": "/tmp/traces", "files": ["/tmp/traces/host_1.pt.trace.json"], "seconds": 0.15,
           "breakdown": {"data": 0.06, "device": 0.075, "other": 0.015}, "window_steps": 3,
           "top_ops": [{"name": "aten::addmm", "calls": 6, "self_seconds": 0.05, "self_device_seconds": 0.0}],
           "top_ops_note": None, "device_idle_share": 0.5, "device_idle_note": "the host is the device"}


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"),
                    reason="Debian's chromium is not installed (`make test` installs it where it can)")
def test_the_breakdown_is_drawn_per_step_in_a_real_headless_browser(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert CHROMIUM, "CI must have chromium: the Makefile's test target installs it"
    # Step 3 could not tell the device from the host's reads: its own colour, its own legend entry.
    records = [timed(n) for n in range(1, 21)]
    records[2]["breakdown"] = {"data": 0.02, "device+host_sync": 0.03}
    records[6]["profile"] = PROFILE
    path = tmp_path / "run.jsonl"
    write_jsonl(path, records)
    page = write_report(str(path)).path
    with tempfile.TemporaryDirectory() as profile:
        dom = subprocess.run([CHROMIUM, *CHROME_FLAGS, f"--user-data-dir={profile}", "--dump-dom",
                              f"file://{page}"], capture_output=True, text=True, timeout=120).stdout
    assert 'data-drawn="20"' in dom, "the script did not draw the chart"
    segments = re.findall(r'class="seg seg-([\w+]+)"', dom)
    assert segments.count("data") == 20 and segments.count("device") == 19 and segments.count("other") == 19
    assert segments.count("device+host_sync") == 1 and "wait" not in segments and "rest" not in segments
    assert re.search(r'<title>step 3: device\+host_sync 30\.00 ms</title>', dom)
    text = re.sub(r"<[^>]+>", "", dom)
    assert "device + host_sync" in text  # the legend and the totals name it
    assert re.search(r"time per step 50\.0 ms: data 20\.0 \(40%\), device 23\.8 \(48%\), device\+host_sync 1\.5 "
                     r"\(3%\), other 4\.8 \(\d+%\)", text)
    assert "device-bound: 47% of the step time after the first step is the device" in text
    assert "profile of steps 5 to 7 on cpu (torch.profiler): 1 file(s) under /tmp/traces" in text
    assert "aten::addmm" in text


def test_records_without_a_breakdown_keep_the_old_chart() -> None:
    page = render_html([step(1), step(2)], [])
    assert '"parts": ["wait", "compile", "rest"]' in page and "class=verdict" not in page


def test_a_first_step_of_no_time_keeps_the_breakdown_chart() -> None:
    # A loop without ap.loader: its first step starts where it ends (no batch to start it).
    page = render_html([timed(1, seconds=0.0, breakdown={}), timed(2), timed(3)], [])
    assert '"parts": ["data", "device", "other"]' in page and "class=verdict" in page


def test_a_breakdown_of_unknown_categories_is_an_error_naming_the_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for i, value in enumerate([{"gpu": 0.1}, {"device": -1.0}, {"device": "fast"}, ["device"]]):
        path = tmp_path / f"bad{i}.jsonl"
        path.write_text(json.dumps(timed(1, breakdown=value)) + "\n")
        with pytest.raises(ReportError, match=rf"bad{i}.jsonl:1: not a step record: 'breakdown' must map time "
                                              r"categories \(data, transfer, compile, device, host_sync, collective, "
                                              r"other, between_steps, or two joined by '\+'\) to seconds"):
            load_records(str(path))


def test_a_profile_the_page_cannot_read_is_said_not_raised() -> None:
    page = render_html([timed(1), timed(2, profile={"steps": "x"})], [])
    assert "step 2 carries a profile this page cannot read" in page
