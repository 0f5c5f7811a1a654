"""``accelport compare``: real runs side by side, and every file that is not a run's refused with what to pass.

The pairs are made here, by ``accelport diagnose --output`` on scripts written as users write them
(tests/cli/scripts/compare_*.py): a compiled loop whose batch length changes each step against its
fix (one padded length), and one script on cpu against the same on XLA:CPU (marked ``xla``: it runs in
the xla session). Nothing asserts on a duration: which run is faster is asserted only where the
difference is compilations (7 in the slow run's timed steps, none in the fix's), not the machine.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from typing import Any

import pytest

from accelport.cli import main
from tests.diagnose_cli.runs import run

SCRIPTS = pathlib.Path(__file__).resolve().parent / "scripts"
SHAPES = SCRIPTS / "compare_shapes.py"
WHAT_TO_PASS = "pass the file `accelport diagnose --output FILE.json -- SCRIPT` wrote, or a metrics file"


@pytest.fixture(scope="module")
def shapes_pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """The recompiling run and its bucketed fix, each with its --output and its metrics file."""
    where = tmp_path_factory.mktemp("pair")
    for name, extra in (("before", ()), ("after", ("--bucket",))):
        out = run("--output", str(where / f"{name}.json"), "--metrics-file", str(where / f"{name}.jsonl"),
                  str(SHAPES), *extra)
        assert out.returncode == 0 and out.stdout == "done\n", out.stderr
    return {"dir": where, **{f"{n}.{ext}": where / f"{n}.{ext}" for n in ("before", "after") for ext in ("json",
                                                                                                          "jsonl")}}


def compare(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str, str]:
    code = main(["compare", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def row(comparison: dict[str, Any], key: str) -> dict[str, Any]:
    return next(r for r in comparison["rows"] if r["key"] == key)


# -- real pairs ------------------------------------------------------------------------------------


def test_the_bucketed_fix_is_faster_and_its_recompilation_is_fixed(shapes_pair: dict[str, pathlib.Path],
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = compare(capsys, shapes_pair["before.json"], shapes_pair["after.json"], "--json")
    assert code == 0, err
    result = json.loads(out)
    [against] = result["comparisons"]
    # What differs in the setup is the argument that fixed it, and nothing else (same script, torch, backend).
    assert against["setup_differences"] == [{"field": "args", "baseline": [], "run": ["--bucket"]}]
    assert list(against)[:4] == ["run", "label", "setup_differences", "rows"]  # the setup said first
    # The recompiling run hit dynamo's limit of 8 compilations; the fix compiled once.
    compilations = row(against, "compilations")
    assert compilations["baseline"] == 8 and compilations["run"] == 1
    found = against["findings"]
    assert {f["kind"] for f in found["fixed"]} == {"recompilation", "compile-limit"}
    assert found["new"] == [] and found["still"] == []
    # (Where the run found them: the optimizer step of the loop.)
    assert all(f["where"] == f"{SHAPES}:{line_of(SHAPES, 'opt.step()')}" for f in found["fixed"])
    verdict = against["verdict"]
    # (7 compilations in the slow run's timed steps, none in the fix's: the sign of the difference is the
    # compilations', whatever else the machine runs.)
    assert verdict.startswith("B is ") and " faster per step than A (" in verdict, verdict
    assert "compilations 8 -> 1, the compile-limit and recompilation are gone" in verdict, verdict
    # The compile category fell (8 compilations against 1). Which category moved most is the machine's to say:
    # the rest of a recompiling step grows with the load too.
    moved = re.search(r"(?:^|, )compile ([\d.]+) -> ([\d.]+) ms", verdict.split(": ", 1)[1])
    assert moved is not None and float(moved[1]) > float(moved[2]), verdict


def test_the_text_says_the_setup_first_then_the_table_the_findings_and_the_verdict(
        shapes_pair: dict[str, pathlib.Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = compare(capsys, shapes_pair["before.json"], shapes_pair["after.json"])
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == f"runs: A = {shapes_pair['before.json']} (the baseline), B = {shapes_pair['after.json']}"
    assert lines[1] == "setup: B differs from A: args (none) -> --bucket"
    assert lines[2].split() == ["A", "B", "B/A"]
    table = {line.split("  ")[0]: line.split() for line in lines[3:]}
    assert table["compilations"][-3:] == ["8", "1", "0.12x"]
    assert table["MFU"][-2:] == ["-", "-"]  # no efficiency in these files: shown as not measured
    assert "  fixed  recompilation at " in out and "  fixed  compile-limit at " in out
    assert lines[-1].startswith("verdict: B is ") and "faster per step than A" in lines[-1]


def test_metrics_files_compare_as_the_outputs_do(shapes_pair: dict[str, pathlib.Path],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = compare(capsys, shapes_pair["before.jsonl"], shapes_pair["after.jsonl"], "--json")
    assert code == 0, err
    [against] = json.loads(out)["comparisons"]
    assert against["setup_differences"] == []  # a metrics file records its backend only: the same
    # The same findings, replayed from the step records (which hold no location: matched by kind).
    assert {f["kind"] for f in against["findings"]["fixed"]} == {"recompilation", "compile-limit"}
    assert against["findings"]["new"] == []
    assert row(against, "compilations")["baseline"] >= 7 and row(against, "compilations")["run"] <= 1
    assert row(against, "per_step")["baseline"] > 0 and row(against, "steps")["run"] == 12


def test_each_run_after_the_first_is_compared_with_the_first(shapes_pair: dict[str, pathlib.Path],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = compare(capsys, shapes_pair["before.json"], shapes_pair["after.json"],
                             shapes_pair["before.jsonl"], "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["baseline"] == str(shapes_pair["before.json"])
    assert [c["label"] for c in result["comparisons"]] == ["B", "C"]
    second = result["comparisons"][1]
    # The baseline's own metrics file: its findings are still there, none fixed.
    assert second["findings"]["fixed"] == [] and {f["kind"] for f in second["findings"]["still"]} == {
        "recompilation", "compile-limit"}
    assert [r["label"] for r in result["runs"]] == ["A", "B", "C"]


def test_the_report_page_holds_the_comparison(shapes_pair: dict[str, pathlib.Path],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    page = shapes_pair["dir"] / "compare.html"
    code, out, err = compare(capsys, shapes_pair["before.json"], shapes_pair["after.json"], "--report", page,
                             "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["report"] == str(page)
    text = page.read_text()
    assert text.startswith("<!doctype html>") and "<title>accelport compare: 2 runs</title>" in text
    assert "setup: B differs from A: args (none) -&gt; --bucket" in text
    assert text.count("<tr class=finding>") == 2 and "class='state fixed'>fixed<" in text
    assert result["comparisons"][0]["verdict"].replace(">", "&gt;") in text


# -- the page and the output never carry what the files hold unescaped or a secret --------------------


def output_file(path: pathlib.Path, message: str = "ok", where: str = "train.py:3", *,
                efficiency: dict[str, Any] | None = None, backend: str = "cpu",
                per_step: dict[str, float] | None = None) -> pathlib.Path:
    """A file of the shape `accelport diagnose --output` writes, with one finding."""
    result: dict[str, Any] = {
        "findings": [{"kind": "host-sync", "message": message, "fix": "", "step": 3, "severity": "warning",
                      "evidence": {"where": where}, "totals": {}}],
        "metrics": {"backend": backend, "steps": 10, "compilations": 1, "compile_seconds": 0.5,
                    "device_to_host": 20, "peak_memory_bytes": 1 << 20, "data_wait_seconds": 0.1,
                    "step_seconds": 1.0,
                    "time_breakdown_per_step": per_step or {"device": 0.08, "data": 0.01, "other": 0.01}},
        "steps": 10, "backend": backend, "exit_status": 0, "verdict": {"text": ""}, "notes": [],
        "setup": {"script": "train.py", "args": [], "torch": "2.9.0", "python": "3.11.7", "accelport": "0.1.0"},
    }
    if efficiency is not None:
        result["efficiency"] = efficiency
    path.write_text(json.dumps(result))
    return path


def test_the_page_escapes_and_redacts_what_the_files_hold(tmp_path: pathlib.Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-9f8e7d")
    hostile = "<script>alert(1)</script> & wandb-secret-9f8e7d"
    a = output_file(tmp_path / "a.json", hostile, where="<b>x.py</b>:3")
    b = output_file(tmp_path / "b<i>.json", "ok", where="y.py:4")
    page = tmp_path / "page.html"
    code, out, err = compare(capsys, a, b, "--report", page)
    assert code == 0, err
    text = page.read_text()
    assert "<script>alert" not in text and "&lt;script&gt;alert(1)&lt;/script&gt; &amp; " in text
    assert "<b>x.py</b>" not in text and "&lt;b&gt;x.py&lt;/b&gt;:3" in text
    assert "b<i>.json" not in text and "b&lt;i&gt;.json" in text
    assert "wandb-secret-9f8e7d" not in text and "wandb-secret-9f8e7d" not in out


def test_the_efficiency_is_read_where_the_file_has_it(tmp_path: pathlib.Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    efficiency = {"flops_per_step": 2.0e12, "achieved_flops": 4.0e13, "mfu": 0.205, "peak_flops": 1.97e14,
                  "peak_dtype": "bfloat16", "chip": "v5e", "flops_source": "FlopCounterMode", "causes": []}
    a = output_file(tmp_path / "a.json")
    b = output_file(tmp_path / "b.json", efficiency=efficiency, backend="xla")
    code, out, _ = compare(capsys, a, b)
    assert code == 0
    lines = {line.split("  ")[0]: line.split() for line in out.splitlines()}
    assert lines["MFU"][-2:] == ["-", "20.5%"]
    assert lines["achieved FLOP/s"][-3:] == ["-", "40.0", "TFLOP/s"]
    # The backend differs: said first, and the verdict names where each ran; the same host-sync line is in B.
    assert out.splitlines()[1] == "setup: B differs from A: backend cpu -> xla"
    assert "verdict: B (xla) takes the same time per step as A (cpu) (100 -> 100 ms)" in out
    assert "  new    host-sync at y.py:4" not in out and "  fixed  host-sync at train.py:3" not in out
    assert "  still  host-sync at train.py:3" in out


def test_the_verdict_says_what_moved_and_calls_unchanged_only_what_did_not(tmp_path: pathlib.Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    a = output_file(tmp_path / "a.json", per_step={"compile": 0.9, "device": 0.05, "device+other": 0.05})
    b = output_file(tmp_path / "b.json", per_step={"device": 0.05, "device+other": 0.008})
    code, out, _ = compare(capsys, a, b)
    assert code == 0
    # device+other fell from 50 to 8 ms: less than 5% of the step, so not worth a word, and not "unchanged" either.
    assert out.splitlines()[-1] == ("verdict: B is 17.2x faster per step than A (1000 -> 58.0 ms): compile 900 -> "
                                    "0.0 ms; device unchanged")


# -- files that are not a run's -----------------------------------------------------------------------


def bad_inputs(tmp_path: pathlib.Path) -> dict[str, tuple[pathlib.Path, str]]:
    """name -> (the file, what the error says it is)."""
    (tmp_path / "not.json").write_text("step 1 took 3 ms\n")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "other.json").write_text(json.dumps({"loss": 1.5, "epoch": 3}))
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "binary.json").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    (tmp_path / "error.json").write_text(json.dumps({"error": "no such file", "kind": "usage"}))
    (tmp_path / "bad.jsonl").write_text(json.dumps({"step": 1, "seconds": 0.1}) + "\n"
                                        + json.dumps({"step": 2, "seconds": "slow"}) + "\n")
    (tmp_path / "dir").mkdir()
    return {
        "missing": (tmp_path / "missing.json", "does not exist"),
        "directory": (tmp_path / "dir", "is a directory, not a run's file"),
        "not JSON": (tmp_path / "not.json", "is not JSON (Expecting value, line 1)"),
        "JSON list": (tmp_path / "list.json", "is JSON (list), not a run's file"),
        "JSON of another shape": (tmp_path / "other.json", "is JSON of another shape (keys: epoch, loss)"),
        "empty": (tmp_path / "empty.json", "is empty"),
        "binary": (tmp_path / "binary.json", "is not a text file"),
        "an error": (tmp_path / "error.json", "holds an error accelport printed, not a run"),
        "a bad metrics line": (tmp_path / "bad.jsonl", "bad.jsonl:2: not a step record: 'seconds' must be a number"),
    }


@pytest.mark.parametrize("as_json", [False, True])
def test_a_file_that_is_not_a_runs_is_a_usage_error_saying_what_to_pass(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], as_json: bool) -> None:
    good = output_file(tmp_path / "good.json")
    for name, (path, said) in bad_inputs(tmp_path).items():
        for pair in ((path, good), (good, path)):  # as the baseline and as the run compared
            code, out, err = compare(capsys, *pair, *(["--json"] if as_json else []))
            assert code == 2, name
            if as_json:
                error = json.loads(out)  # valid JSON on the error path too, and nothing else on stdout
                assert error["kind"] == "usage" and err == "", name
                message = error["error"]
            else:
                assert out == "" and err.startswith("accelport: error: compare: ") and err.count("\n") == 1, name
                message = err
            assert str(path) in message and said in message, (name, message)
            assert "Traceback" not in out + err
            if name != "a bad metrics line":
                assert WHAT_TO_PASS in message, name


def test_a_doctor_json_file_is_said_to_be_one(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json"]) in (0, 1)
    doctor = tmp_path / "doctor.json"
    doctor.write_text(capsys.readouterr().out)
    code, out, err = compare(capsys, doctor, output_file(tmp_path / "good.json"))
    assert code == 2 and out == ""
    assert f"compare: {doctor} is the output of `accelport doctor --json` (this machine's setup, not a run)" in err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: pathlib.Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "run.json"
    os.mkfifo(fifo)
    code, out, err = compare(capsys, fifo, output_file(tmp_path / "good.json"))
    assert code == 2 and "is a FIFO" in err and WHAT_TO_PASS in err


@pytest.mark.parametrize("as_json", [False, True])
def test_one_run_or_a_report_over_a_run_is_a_usage_error(tmp_path: pathlib.Path,
                                                         capsys: pytest.CaptureFixture[str], as_json: bool) -> None:
    good = output_file(tmp_path / "good.json")
    other = output_file(tmp_path / "other.json")
    before = good.read_text()
    flag = ["--json"] if as_json else []
    cases = [
        ([good], "give two runs or more (the first is the baseline)"),
        ([good, other, "--report", other], "is the run"),
        ([good, other, "--report", tmp_path], "is a directory; give the path of an HTML file to write"),
        ([good, other, "--report", tmp_path / "nowhere" / "x.html"], "does not exist; create it first"),
    ]
    for args, said in cases:
        code, out, err = compare(capsys, *args, *flag)
        assert code == 2, args
        message = json.loads(out)["error"] if as_json else err
        assert said in message, (args, message)
    assert good.read_text() == other.read_text() == before  # the run named as --report is untouched


def line_of(script: pathlib.Path, text: str) -> int:
    return next(n for n, line in enumerate(script.read_text().splitlines(), 1) if text in line)


# -- cpu against XLA:CPU, in the xla session ------------------------------------------------------------


@pytest.mark.xla
def test_cpu_against_xla_of_one_script_says_the_backend_first(tmp_path: pathlib.Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    script = SCRIPTS / "compare_device.py"
    for name, env in (("cpu", {"PJRT_DEVICE": "CPU"}), ("xla", {"PJRT_DEVICE": "CPU", "TRAIN_ON_XLA": "1"})):
        out = run("--output", str(tmp_path / f"{name}.json"), str(script), env=env)
        assert out.returncode == 0 and out.stdout == "done\n", out.stderr
    code, out, err = compare(capsys, tmp_path / "cpu.json", tmp_path / "xla.json", "--json")
    assert code == 0, err
    [against] = json.loads(out)["comparisons"]
    # One environment, one script: the backend is the one difference, and it comes first.
    assert against["setup_differences"] == [{"field": "backend", "baseline": "cpu", "run": "xla"}]
    assert json.loads((tmp_path / "xla.json").read_text())["setup"]["torch_xla"]
    assert against["verdict"].startswith("B (xla) ") and " A (cpu) (" in against["verdict"]
    assert row(against, "compilations")["baseline"] == 0 and row(against, "compilations")["run"] >= 1
    code, text, _ = compare(capsys, tmp_path / "cpu.json", tmp_path / "xla.json")
    assert code == 0 and text.splitlines()[1] == "setup: B differs from A: backend cpu -> xla"
