"""accelport report: a self-contained page, checked in a real headless browser."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile

import pytest

from accelport.cli import main
from accelport.diagnose.report import ReportError, breakdown, diagnose, load_records, render_html, write_report


def write_jsonl(path, records) -> None:  # type: ignore[no-untyped-def]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def step(n: int, **kw):  # type: ignore[no-untyped-def]
    """A step record as the xla backend writes one (no per-step execution time)."""
    base = {"step": n, "time": 1.0 + n, "backend": "xla", "lazy": True, "seconds": 0.05,
            "data_wait_seconds": 0.01, "signature": [[[8, 100 + n], "float32"]], "compilations": 1,
            "compile_seconds": 0.02}
    base.update(kw)
    return base


def test_breakdown_never_exceeds_the_step() -> None:
    parts = breakdown({"seconds": 0.1, "data_wait_seconds": 0.03, "compile_seconds": 0.5, "execute_seconds": 0.2})
    assert parts == pytest.approx({"wait": 0.03, "compile": 0.07, "execute": 0.0, "rest": 0.0})
    assert sum(breakdown({"seconds": 0.2}).values()) == pytest.approx(0.2)


def test_recorded_run_is_diagnosed_by_the_live_rules(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "run.jsonl"
    write_jsonl(path, [step(n) for n in range(1, 31)])
    findings = diagnose(load_records(str(path)))
    assert [f.kind for f in findings] == ["recompilation"]
    assert "input 0 changed from (8, 109) to (8, 110)" in findings[0].message


def test_bad_files_give_errors_naming_the_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ReportError, match="no such file; write one by running with ACCELPORT_METRICS_FILE"):
        load_records(str(tmp_path / "missing.jsonl"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ReportError, match="no step records"):
        load_records(str(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(step(1)) + "\n{oops\n" + json.dumps(step(3)) + "\n")
    with pytest.raises(ReportError, match=r"bad.jsonl:2: not a JSON line"):
        load_records(str(bad))
    for i, (field, value, words) in enumerate([
        ("step", "one", "'step' must be an integer"),
        ("signature", 5, "'signature' must be a list of [shape, dtype] pairs"),
        ("data_wait_seconds", "x", "'data_wait_seconds' must be a number"),
        ("loader", [1], "'loader' must be an object"),
        ("counted_steps", -1, "'counted_steps' must be a non-negative integer"),
    ]):
        wrong = tmp_path / f"wrong{i}.jsonl"
        wrong.write_text(json.dumps({**step(1), field: value}) + "\n" + json.dumps(step(2)) + "\n")
        with pytest.raises(ReportError, match=rf"wrong{i}.jsonl:1: not a step record: {re.escape(words)}"):
            load_records(str(wrong))


def test_records_read_together_round_trip_through_the_file() -> None:
    from accelport.contract import StepRecord
    from accelport.diagnose.metrics_log import record_from_dict, record_to_dict

    unread = StepRecord(5, "xla", True, 0.01, 0.0, None, {}, 1.0, {}, 0)
    block = StepRecord(6, "xla", True, 0.01, 0.0, None, {"compilations": 0, "device_to_host": 4}, 1.0, {}, 16)
    single = StepRecord(7, "xla", True, 0.01, 0.0, None, {"compilations": 1}, 1.0, {})
    lines = [record_to_dict(r) for r in (unread, block, single)]
    assert [line.get("counted_steps") for line in lines] == [0, 16, None]  # 1 is not written
    back = [record_from_dict(line) for line in lines]
    assert [r.counted_steps for r in back] == [0, 16, 1]
    assert back[1].delta == {"compilations": 0, "device_to_host": 4} and back[0].delta == {}


def test_a_truncated_last_line_from_a_killed_run_is_tolerated(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "killed.jsonl"
    path.write_text(json.dumps(step(1)) + "\n" + json.dumps(step(2))[:20])
    assert [r["step"] for r in load_records(str(path))] == [1]


def test_page_is_self_contained_and_escapes_embedded_text() -> None:
    page = render_html([step(1, backend="</script><script>alert(1)</script>")], [], title="<b>t</b>")
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page
    assert "<script>alert(1)</script>" not in page
    assert "&lt;b&gt;t&lt;/b&gt;" in page
    assert "No diagnosis" in page


def test_execution_is_drawn_only_where_steps_measure_it() -> None:
    untimed = render_html([step(1), step(2)], [])
    assert "the rest (execution, Python, transfers)" in untimed and ">execution</" not in untimed
    assert '"parts": ["wait", "compile", "rest"]' in untimed
    timed = render_html([step(1, execute_seconds=0.01), step(2)], [])
    assert ">execution</" in timed and ">the rest</" in timed
    assert '"parts": ["wait", "compile", "execute", "rest"]' in timed


def test_cli_report_json_and_errors(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "run.jsonl"
    write_jsonl(path, [step(n) for n in range(1, 31)])
    assert main(["report", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["report"] == str(tmp_path / "run.html") and out["diagnoses"][0]["kind"] == "recompilation"
    assert main(["report", str(tmp_path / "nope.jsonl"), "--json"]) == 1
    err = json.loads(capsys.readouterr().out)
    assert err["kind"] == "ReportError" and "no such file" in err["error"]



@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes need a POSIX system")
def test_report_on_a_named_pipe_or_a_directory_is_an_error_not_a_hang(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import sys

    fifo = tmp_path / "run.jsonl"
    os.mkfifo(fifo)
    folder = tmp_path / "runs"
    folder.mkdir()
    good = tmp_path / "good.jsonl"
    write_jsonl(good, [step(1)])
    cases = [([str(fifo)], "is a named pipe (FIFO), not a metrics file"),
             ([str(folder)], "is a directory, not a metrics file"),
             ([str(good), "-o", str(fifo)], "it is a named pipe (FIFO)"),
             ([str(good), "-o", str(folder)], "it is a directory")]
    for args, words in cases:
        # In a subprocess with a timeout: opening a FIFO nobody writes to would block for ever.
        out = subprocess.run([sys.executable, "-m", "accelport", "report", *args],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and out.stdout == "", out.stderr
        assert out.stderr.startswith("accelport: error: ") and words in out.stderr, out.stderr
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
        out = subprocess.run([sys.executable, "-m", "accelport", "report", *args, "--json"],
                             capture_output=True, text=True, timeout=60)
        data = json.loads(out.stdout)
        assert out.returncode == 1 and data["kind"] == "ReportError" and words in data["error"]
    assert not (tmp_path / "run.html").exists()
    with pytest.raises(ReportError, match="is a directory"):
        load_records(str(folder))


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"),
                    reason="Debian's chromium is not installed (`make test` installs it where it can)")
def test_chart_is_drawn_in_a_real_headless_browser(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert CHROMIUM, "CI must have chromium: the Makefile's test target installs it"
    # Step 7 compiles for 1.55 s: the axis switches to seconds and its top label is the tallest step.
    records = [step(n, compilations=int(n in (1, 7)), compile_seconds={1: 0.02, 7: 1.55}.get(n, 0.0),
                    seconds=1.6 if n == 7 else 0.05, execute_seconds=0.01) for n in range(1, 41)]
    path = tmp_path / "run.jsonl"
    write_jsonl(path, records)
    page, _ = write_report(str(path))
    with tempfile.TemporaryDirectory() as profile:
        dom = subprocess.run([CHROMIUM, *CHROME_FLAGS, f"--user-data-dir={profile}", "--dump-dom",
                              f"file://{page}"], capture_output=True, text=True, timeout=120).stdout
    assert 'data-drawn="40"' in dom, "the script did not draw the chart"
    segments = re.findall(r'class="seg seg-(\w+)"', dom)
    assert segments.count("wait") == 40 and segments.count("execute") == 40
    assert segments.count("compile") == 2
    assert dom.count('class="compile-mark"') == 2
    labels = re.findall(r'text-anchor="end"[^>]*>([^<]+)</text>', dom)
    assert labels[:5] == ["0.00 s", "0.40 s", "0.80 s", "1.20 s", "1.60 s"], labels
