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
from accelport.diagnose.report import (
    ReportError,
    breakdown,
    diagnose,
    load_records,
    load_runs,
    render_html,
    write_report,
)


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


def test_a_recorded_diagnosis_gets_the_severity_of_todays_rules(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A file from an older build recorded precision as a warning: it is a problem now.
    recorded = {"kind": "precision", "message": "updates round away", "step": 3, "evidence": {},
                "severity": "warning"}
    path = tmp_path / "run.jsonl"
    write_jsonl(path, [step(1, compilations=1), step(2, compilations=0), step(3, compilations=0, diagnoses=[recorded])])
    [found] = diagnose(load_records(str(path)))
    assert (found.kind, found.severity, found.step) == ("precision", "problem", 3)


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



def test_a_jobs_page_takes_its_findings_and_ranks_from_the_jobs_output(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "run.jsonl"
    write_jsonl(path, [step(1, signature=[[[8, 100], "float32"]]) for _ in range(1)])
    job = tmp_path / "job.json"
    straggler = {"kind": "straggler", "message": "rank 1 (host h) holds the job back", "fix": "more workers",
                 "step": 2, "evidence": {"rank": 1}, "severity": "warning"}
    ranks = [{"rank": r, "host": "h", "pid": 10 + r, "steps": 1, "exit_status": 0, "straggler": r == 1,
              "time_breakdown": {"data": 0.01 + 0.2 * r, "collective": 0.2 * (1 - r)}, "findings": []} for r in (0, 1)]
    job.write_text(json.dumps({"findings": [straggler], "ranks": ranks, "verdict": {}}, indent=1))
    assert main(["report", str(path), "--job", str(job), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [d["kind"] for d in out["diagnoses"]] == ["straggler"]
    html = (tmp_path / "run.html").read_text()
    assert html.count("<tr class=rank>") == 2 and "rank 1 (host h) holds the job back" in html
    # Not a job's --output: one specific error each, as JSON with --json.
    (tmp_path / "one.json").write_text(json.dumps({"findings": [], "verdict": {}}))  # one process's --output
    (tmp_path / "torn.json").write_text('{"findings": [')
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "many.json").write_text(json.dumps({"findings": 5, "ranks": ranks}))
    for value in ("x", None, [1], float("nan")):
        broken = [{**ranks[0], "time_breakdown": {"data": value}}]
        (tmp_path / f"parts-{value}.json").write_text(json.dumps({"findings": [], "ranks": broken}))
    (tmp_path / "list.json").write_text(json.dumps({"findings": [], "ranks": [{**ranks[0], "time_breakdown": [1]}]}))
    os.mkfifo(tmp_path / "pipe.json")
    parts = "'time_breakdown' is not seconds by category"
    for bad, said in ((tmp_path / "nope.json", "no such file"), (path, "not a job's --output (it has no 'ranks'"),
                      (tmp_path / "one.json", "not a job's --output (it has no 'ranks'"),
                      (tmp_path / "torn.json", "not the --output of accelport diagnose"),
                      (tmp_path / "deep.json", "nested too deeply"),
                      (tmp_path / "many.json", "'findings' is not a list"),
                      (tmp_path / "parts-x.json", parts), (tmp_path / "parts-None.json", parts),
                      (tmp_path / "parts-[1].json", parts), (tmp_path / "parts-nan.json", parts),
                      (tmp_path / "list.json", parts), (tmp_path / "pipe.json", "is a named pipe (FIFO), not a file")):
        assert main(["report", str(path), "--job", str(bad), "--json"]) == 1
        err = json.loads(capsys.readouterr().out)
        assert err["kind"] == "ReportError" and said in err["error"], err
    # The --output where the metrics file goes; the page written over the --job file.
    assert main(["report", str(job), "--json"]) == 1
    assert "is the --output of accelport diagnose, not a metrics file" in json.loads(capsys.readouterr().out)["error"]
    before = job.read_text()
    assert main(["report", str(path), "--job", str(job), "-o", str(job), "--json"]) == 1
    assert "it is the --job file" in json.loads(capsys.readouterr().out)["error"] and job.read_text() == before


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
    page = write_report(str(path)).path
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


def test_the_report_never_writes_over_its_input(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "run.jsonl"
    write_jsonl(run, [step(n) for n in range(1, 4)])
    before = run.read_bytes()
    assert main(["report", str(run), "-o", str(run), "--json"]) == 1
    err = json.loads(capsys.readouterr().out)
    assert err["kind"] == "ReportError"
    assert err["error"] == (f"cannot write {run}: -o names the metrics file itself, and the page would replace "
                            "the run's record; give -o another path, e.g. -o report.html")
    os.symlink(run, tmp_path / "alias.jsonl")  # the same file by another name
    with pytest.raises(ReportError, match="-o names the metrics file itself"):
        write_report(str(run), str(tmp_path / "alias.jsonl"))
    named_html = tmp_path / "run.html"
    write_jsonl(named_html, [step(1)])
    with pytest.raises(ReportError, match=r"the default output \(the input's name with .html\) is the metrics file"):
        write_report(str(named_html))
    assert run.read_bytes() == before and json.loads(named_html.read_text())["step"] == 1
    assert write_report(str(named_html), str(tmp_path / "page.html")).path == str(tmp_path / "page.html")


@pytest.mark.parametrize(("line", "words"), [
    (json.dumps(step(2, compilations="abc")), "not a step record: 'compilations' must be a non-negative number, "
                                              "not 'abc'"),
    (json.dumps(step(2, compilations=[1])), "'compilations' must be a non-negative number"),
    (json.dumps(step(2, execute_seconds="x")), "'execute_seconds' must be a number of seconds, not 'x'"),
    ('{"step": 2, "seconds": 0.1, "loader": ' + "[" * 100_000 + "]" * 100_000 + "}",
     "nested too deeply to be a step record"),
    ('{"step": 2, "seconds": ' + "9" * 5000 + "}", "not a step record: a number of more than 4300 digits"),
    (json.dumps(step(2, seconds=10**400)), "'seconds' is an integer of 401 digits, too large for a step record"),
    (json.dumps(step(10**30)), "'step' is an integer of 31 digits"),
])
def test_hostile_values_are_an_error_naming_the_line(tmp_path, line: str, words: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "hostile.jsonl"
    path.write_text(json.dumps(step(1)) + "\n" + line + "\n" + json.dumps(step(3)) + "\n")
    with pytest.raises(ReportError) as caught:
        write_report(str(path))
    assert str(caught.value).startswith(f"{path}:2: ") and words in str(caught.value), str(caught.value)
    assert main(["report", str(path)]) == 1  # the CLI's error path, not "unexpected ... (this is a bug)"


def test_nan_seconds_keep_the_embedded_data_valid_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "nan.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [
        step(1, seconds=float("nan")), step(2, compile_seconds=float("inf")), step(3, data_wait_seconds=float("-inf")),
        step(4)]))
    assert "NaN" in path.read_text()  # json.dumps writes NaN, which JSON.parse rejects
    page = open(write_report(str(path)).path).read()
    embedded = re.search(r'<script type="application/json" id="run-data">(.*?)</script>', page, re.S)
    assert embedded is not None
    data = json.loads(embedded.group(1), parse_constant=lambda c: pytest.fail(f"{c} in the embedded data"))
    assert [s["total"] for s in data["steps"]][0] == 0.0 and data["steps"][1]["compile"] == 0.0
    assert "3 step(s) recorded a time that is not a number (step 1, 2, 3): counted as 0 s." in page


def test_a_crashed_run_followed_by_an_appended_run_is_read_as_two_runs(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "appended.jsonl"
    first = "".join(json.dumps(step(n, backend="cpu")) + "\n" for n in range(1, 6))
    killed = json.dumps(step(6, backend="cpu"))[:25]  # the writer died mid-line, without its newline
    second = "".join(json.dumps(step(n, signature=[[[8, 16], "float32"]])) + "\n" for n in range(1, 31))
    path.write_text(first + killed + second)  # the next run's first record continues the partial line
    runs = load_runs(str(path))
    assert [[r["step"] for r in run.records] for run in runs] == [[1, 2, 3, 4, 5], list(range(1, 31))]
    assert (runs[0].first_line, runs[0].last_line, runs[1].first_line, runs[1].last_line) == (1, 5, 6, 35)
    assert main(["report", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["runs"] == 2 and out["lines"] == [6, 35]
    page = (tmp_path / "appended.html").read_text()
    assert "holds 2 runs, one after the other; this page is about the last one (lines 6 to 35)" in page
    assert "backend xla · 30 steps" in page
    # Appended without a crash: the step count starting again at 1 starts the next run.
    clean = tmp_path / "clean.jsonl"
    clean.write_text(first + second)
    assert [len(run.records) for run in load_runs(str(clean))] == [5, 30]
    assert main(["report", str(clean)]) == 0
    assert "clean.jsonl holds 2 runs; the page is about the last one (lines 6 to 35)" in capsys.readouterr().out


def test_a_torn_line_on_its_own_before_an_appended_run_is_read_past(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "torn.jsonl"
    first = "".join(json.dumps(step(n, backend="cpu")) + "\n" for n in range(1, 6))
    torn = json.dumps(step(6, backend="cpu"))[:40] + "\n"  # a partial record that did end its line
    second = "".join(json.dumps(step(n)) + "\n" for n in range(1, 31))
    path.write_text(first + torn + second + "\n")
    runs = load_runs(str(path))
    assert [len(run.records) for run in runs] == [5, 30] and (runs[1].first_line, runs[1].last_line) == (7, 36)
    assert main(["report", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["runs"] == 2 and out["skipped_lines"] == [6] and out["lines"] == [7, 36]
    note = "torn.jsonl: line 6 holds a partial record left by a run stopped while writing it; skipped"
    assert note in (tmp_path / "torn.html").read_text()
    assert main(["report", str(path)]) == 0
    assert note in capsys.readouterr().out
    # The same torn line inside a run (no step 1 after it) is still an error naming it.
    inside = tmp_path / "inside.jsonl"
    inside.write_text(first + torn + json.dumps(step(7)) + "\n")
    with pytest.raises(ReportError, match=r"inside.jsonl:6: not a JSON line"):
        load_runs(str(inside))


def test_every_text_the_page_shows_from_the_run_is_redacted_then_escaped(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from accelport.diagnose.rules import Diagnosis
    from accelport.redact import Redactor

    token = "hf_" + "abcdefghijklmnopqrstuvwxyz0123"
    records = [step(1, backend="xla password=hunter22", signature=[[[8, 16], "float32 token=abc123xyz"]]),
               step(2, backend="xla password=hunter22")]
    found = [Diagnosis("recompilation", "from MY_TOKEN=plainvalue9 <b>x</b> and plainvalue9 again", 2)]
    page = render_html(records, found, title=f"accelport diagnose: /home/u/run_{token}/https:/me:pw77@h/t.py",
                       notes=["Authorization: Bearer abc.def.ghi"], redactor=Redactor({"MY_TOKEN": "plainvalue9"}))
    for secret in (token, "pw77", "hunter22", "abc123xyz", "plainvalue9", "abc.def.ghi"):
        assert secret not in page, secret
    assert "<title>accelport diagnose: /home/u/run_&lt;redacted&gt;/https:/&lt;redacted&gt;@h/t.py</title>" in page
    assert "&lt;b&gt;x&lt;/b&gt;" in page  # escaped after redaction: the page's own markup is untouched
    # `accelport report` knows this environment's secrets: a value recorded in the run is hidden.
    monkeypatch.setenv("MY_API_TOKEN", "plainvalue9")
    path = tmp_path / f"run_{token}.jsonl"
    recorded = {"kind": "precision", "message": "seen with plainvalue9", "step": 1, "evidence": {}}
    write_jsonl(path, [step(1, diagnoses=[recorded])])
    assert main(["report", str(path), "-o", str(tmp_path / "page.html")]) == 0
    written = (tmp_path / "page.html").read_text()
    assert "plainvalue9" not in written and token not in written and "seen with &lt;redacted&gt;" in written
