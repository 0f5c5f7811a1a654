"""``accelport diagnose`` on unmodified plain-PyTorch scripts (cpu): run as ``python`` would, judged by the rules.

The scripts under ``scripts/`` never import accelport. Most runs are real subprocesses of
the CLI, compared with the same script run by plain ``python``; the in-process ones check
what a subprocess cannot see (every hook taken out again).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from typing import Any

import pytest

from accelport.cli import main
from accelport.contract import StepRecord
from tests.diagnose_cli.runs import SCRIPTS, run


def line_of(script: pathlib.Path, text: str) -> int:
    """The number of the first line of ``script`` that contains ``text``."""
    return next(n for n, line in enumerate(script.read_text().splitlines(), 1) if text in line)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """cpu_healthy.py run plainly and under diagnose (with every output), from a directory of its own."""
    where = tmp_path_factory.mktemp("healthy")
    script = str(SCRIPTS / "cpu_healthy.py")
    (where / "out").mkdir()
    plain = run(script, "--steps", "30", "--read-stdin", cwd=where, stdin="hello\n", diagnose=False)
    watched = run("--output", "out/findings.json", "--report", "out/run.html", "--metrics-file", "out/steps.jsonl",
                  script, "--steps", "30", "--read-stdin", cwd=where, stdin="hello\n")
    return {"dir": where, "plain": plain, "watched": watched}


def test_a_healthy_script_runs_as_under_python_and_has_no_finding(healthy: dict[str, Any]) -> None:
    plain, watched = healthy["plain"], healthy["watched"]
    assert plain.returncode == 0 and watched.returncode == 0, watched.stderr
    # The script's stdout is the script's: argv, working directory, __name__, stdin, and the
    # trained weights, to the last digit (diagnose changes nothing it computes).
    assert watched.stdout == plain.stdout
    assert f"argv ['{SCRIPTS / 'cpu_healthy.py'}', '--steps', '30', '--read-stdin']" in watched.stdout
    assert f"cwd {healthy['dir']}" in watched.stdout and "name __main__" in watched.stdout
    assert "stdin hello" in watched.stdout
    assert "torch imported before the script False" in watched.stdout  # diagnose imports no torch of its own
    summary = watched.stderr
    assert summary.startswith(f"accelport diagnose: {SCRIPTS / 'cpu_healthy.py'} took 30 optimizer step(s) on cpu "
                              "and exited with status 0\n"), summary
    assert "[ok  ] no finding after 30 step(s) with every check running" in summary
    result = json.loads((healthy["dir"] / "out" / "findings.json").read_text())
    assert set(result) == {"findings", "metrics", "steps", "backend", "exit_status", "verdict", "notes", "setup",
                           "efficiency"}
    assert result["setup"]["script"] == str(SCRIPTS / "cpu_healthy.py")
    assert result["setup"]["args"] == ["--steps", "30", "--read-stdin"] and result["setup"]["torch"]
    assert result["verdict"] == {"judged_every_step": True, "steps_judged": 30, "not_judged": {},
                                 "text": "no finding after 30 step(s) with every check running"}
    assert result["findings"] == [] and result["steps"] == 30 and result["backend"] == "cpu"
    assert result["exit_status"] == 0 and result["metrics"]["steps"] == 30
    assert result["metrics"]["batch_signatures"] == 1
    lines = (healthy["dir"] / "out" / "steps.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 31))
    assert json.loads(lines[0])["loader"] == {"type": "DataLoader", "num_workers": 0, "batch_size": 16,
                                              "drop_last": False}


def test_input_bound_is_found_and_shown_where_the_batches_are_built(capfd: pytest.CaptureFixture[str],
                                                    tmp_path: pathlib.Path) -> None:
    import torch.optim.optimizer as optimizer_module
    import torch.utils.data.dataloader as dataloader_module

    script = SCRIPTS / "cpu_slow_data.py"
    hooks_before = dict(optimizer_module._global_optimizer_post_hooks)
    meta_path_before = list(sys.meta_path)
    showwarning_before = warnings.showwarning
    out = tmp_path / "findings.json"
    assert main(["diagnose", "--output", str(out), str(script), "--steps", "16"]) == 0
    result = json.loads(out.read_text())
    assert [f["kind"] for f in result["findings"]] == ["input-bound"]
    finding = result["findings"][0]
    assert set(finding) == {"kind", "message", "fix", "step", "evidence", "totals", "severity"}
    assert "num_workers=0" in finding["message"] and "Set num_workers to" in finding["fix"]
    assert finding["totals"]["data_wait_share"] > 0.3 and finding["totals"]["data_wait_seconds"] > 0
    assert finding["evidence"]["num_workers"] == 0 and finding["evidence"]["data_wait_share"] > 0.3
    # The user's dataset is where the time goes: shown at its __getitem__, said to be that.
    data = f"{script}:{line_of(script, 'def __getitem__')}"
    assert finding["evidence"]["where"] == data
    assert finding["evidence"]["where_is"] == "the dataset's __getitem__, where the batches are built"
    err = capfd.readouterr().err
    assert re.search(r"\[WARN\] input-bound at step \d+: the training loop waited for data", err), err
    assert f"at {data} (the dataset's __getitem__" in err
    # Everything the watcher put in is taken out again.
    assert optimizer_module._global_optimizer_post_hooks == hooks_before
    assert sys.meta_path == meta_path_before and warnings.showwarning is showwarning_before
    assert not hasattr(dataloader_module.DataLoader.__iter__, "__wrapped__")
    assert not hasattr(dataloader_module._SingleProcessDataLoaderIter._next_data, "__wrapped__")


def test_a_limit_hit_earlier_in_the_process_is_not_the_diagnosed_scripts(tmp_path: pathlib.Path) -> None:
    """dynamo's records are process-wide: a diagnose run in process judges what came after it started."""
    import torch
    import torch._dynamo

    import accelport as ap

    ap.use("cpu")  # a run before, which watches dynamo's records from then on
    compiled = torch.compile(torch.nn.Linear(4, 1), backend="eager", dynamic=False)
    try:
        with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for n in range(2, 6):  # the limit is hit before the diagnosed run starts
                compiled(torch.randn(n, 4))
        out = tmp_path / "findings.json"
        assert main(["diagnose", "--output", str(out), str(SCRIPTS / "cpu_slow_data.py"), "--steps", "16"]) == 0
        assert [f["kind"] for f in json.loads(out.read_text())["findings"]] == ["input-bound"]
    finally:
        torch._dynamo.reset()


def test_exit_status_3_is_kept_and_the_findings_still_written(tmp_path: pathlib.Path) -> None:
    script = SCRIPTS / "cpu_slow_data.py"
    out = run("--output", str(tmp_path / "f.json"), str(script), "--exit", "3")
    assert out.returncode == 3, out.stderr
    result = json.loads((tmp_path / "f.json").read_text())
    assert result["exit_status"] == 3 and result["steps"] == 16
    assert [f["kind"] for f in result["findings"]] == ["input-bound"]
    # Said once, in the summary (with the run's totals), at the script's own line where the batches are
    # built: never as a warning during the run as well.
    data = line_of(script, "def __getitem__")
    assert out.stderr.count("input-bound at step") == 1 and "InputBoundWarning" not in out.stderr
    # (and named as the verdict of where the steps' time went)
    assert re.search(r"\[time\] time per step [\d.]+ ms: data ", out.stderr)
    said = " ".join(out.stderr.split())  # (the summary wraps its lines)
    assert f"at {script}:{data} (the dataset's __getitem__, where the batches are built)" in said
    assert "exited with status 3: 1 finding(s)" in said
    # Not "ok": the script failed, and the summary says how much of it was judged.
    assert "[note] the script ended with status 3 after 16 step(s): the findings above are from them" in said
    assert "[ok ]" not in said


def test_a_script_that_raises_prints_its_own_traceback(tmp_path: pathlib.Path) -> None:
    script = str(SCRIPTS / "ends.py")
    plain = run(script, "raise", diagnose=False)
    watched = run("--output", str(tmp_path / "f.json"), script, "raise")
    assert plain.returncode == watched.returncode == 1
    assert watched.stdout == plain.stdout == "started ['raise']\n"
    # The same traceback, frame for frame: none of accelport's or runpy's.
    assert plain.stderr.startswith("Traceback (most recent call last):\n")
    assert watched.stderr.startswith(plain.stderr), watched.stderr
    assert "accelport" not in watched.stderr[:len(plain.stderr)] and "runpy" not in watched.stderr
    assert watched.stderr[len(plain.stderr):].startswith("accelport diagnose: ")
    assert "[note] no optimizer step ran in this process" in watched.stderr
    result = json.loads((tmp_path / "f.json").read_text())
    assert {k: v for k, v in result.items() if k not in ("verdict", "notes", "setup")} == {
        "findings": [], "metrics": {}, "steps": 0, "backend": None, "exit_status": 1, "efficiency": None}
    assert result["setup"]["args"] == ["raise"]
    assert result["verdict"]["judged_every_step"] is False and result["verdict"]["steps_judged"] == 0


@pytest.mark.parametrize("args,status,stderr_start", [
    (["exit", "0"], 0, "accelport diagnose: "),
    (["exit", "4"], 4, "accelport diagnose: "),
    (["exit-text", "stopped: bad config"], 1, "stopped: bad config\naccelport diagnose: "),
    # What the shell sees: the low 8 bits of the code; True is 1.
    (["exit", "256"], 0, "accelport diagnose: "),
    (["exit", "-1"], 255, "accelport diagnose: "),
    (["exit-true"], 1, "accelport diagnose: "),
])
def test_system_exit_gives_the_status_python_gives(capfd: pytest.CaptureFixture[str], tmp_path: pathlib.Path,
                                                  args: list[str], status: int, stderr_start: str) -> None:
    out = tmp_path / "f.json"
    assert main(["diagnose", "--output", str(out), str(SCRIPTS / "ends.py"), *args]) == status
    captured = capfd.readouterr()
    assert captured.out == f"started {args!r}\n" and captured.err.startswith(stderr_start), captured.err
    assert f"exited with status {status}" in captured.err
    assert json.loads(out.read_text())["exit_status"] == status


def test_a_double_dash_after_the_script_is_the_scripts_own(capfd: pytest.CaptureFixture[str]) -> None:
    ends = str(SCRIPTS / "ends.py")
    assert main(["diagnose", ends, "--", "-m", "x"]) == 0
    assert capfd.readouterr().out == "started ['--', '-m', 'x']\n"
    # One before the script separates it from diagnose's options; the script's own stay.
    assert main(["diagnose", "--", ends, "exit", "0", "--"]) == 0
    assert capfd.readouterr().out == "started ['exit', '0', '--']\n"


def test_ctrl_c_ends_it_as_it_would_have(tmp_path: pathlib.Path) -> None:
    # (run() starts both with SIGINT at its default action: one inherited as ignored would make
    # both python and diagnose ignore it, and the script sleep on)
    script = str(SCRIPTS / "ends.py")
    plain = run(script, "interrupt", diagnose=False)
    watched = run("--output", str(tmp_path / "f.json"), script, "interrupt")
    # Killed by SIGINT, as Python ends after an unhandled KeyboardInterrupt (a calling shell stops too).
    assert plain.returncode == watched.returncode == -signal.SIGINT, watched.stderr
    assert plain.stderr.startswith("Traceback") and plain.stderr.rstrip().endswith("KeyboardInterrupt")
    assert watched.stderr.startswith(plain.stderr), watched.stderr
    assert json.loads((tmp_path / "f.json").read_text())["exit_status"] == 130


def test_a_module_runs_as_with_python_m(tmp_path: pathlib.Path) -> None:
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(
        "import os, sys\nprint(__name__, sys.argv, sys.path[0] == os.getcwd(), __spec__.name)\nsys.exit(5)\n")
    plain = run("-m", "mypkg.train", "--epochs", "1", cwd=tmp_path, diagnose=False)
    watched = run("-m", "mypkg.train", "--epochs", "1", cwd=tmp_path)
    assert plain.returncode == watched.returncode == 5, watched.stderr
    assert watched.stdout == plain.stdout == f"__main__ ['{package / 'train.py'}', '--epochs', '1'] True mypkg.train\n"
    assert watched.stderr.startswith("accelport diagnose: -m mypkg.train took 0 optimizer step(s) and exited with "
                                     "status 5")


@pytest.mark.parametrize("case", ["missing script", "a directory", "missing module", "package without __main__",
                                  "output directory missing", "report directory missing", "no script",
                                  "unknown backend"])
def test_bad_input_is_a_specific_error_with_exit_2(tmp_path: pathlib.Path, case: str) -> None:
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "trainpkg").mkdir()
    (tmp_path / "trainpkg" / "__init__.py").write_text("")
    args, words = {
        "missing script": (["nope.py"], "diagnose: nope.py: no such file; give the path of the training script"),
        "a directory": (["data"], "diagnose: data is a directory, not a Python script"),
        "missing module": (["-m", "no_such_pkg.train"], "diagnose: -m no_such_pkg.train: no module of that name"),
        # As python -m says it, not "no such module".
        "package without __main__": (["-m", "trainpkg"], "diagnose: -m trainpkg: 'trainpkg' is a package and "
                                                         "cannot be executed directly (it has no __main__ module)"),
        "output directory missing": (["--output", "missing/f.json", "train.py"],
                                     "diagnose: --output missing/f.json: the directory"),
        "report directory missing": (["--report", "missing/r.html", "train.py"],
                                     "diagnose: --report missing/r.html: the directory"),
        "no script": ([], "diagnose: give the script to run"),
        "unknown backend": (["--backend", "tpuu", "train.py"], "unknown backend 'tpuu' (from --backend)."),
    }[case]
    out = run(*args, cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == "", out.stderr
    assert out.stderr.startswith("accelport: error: ") and words in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert not marker.exists()  # refused before the script ran
    if case == "output directory missing":
        assert "does not exist; create it first or write somewhere else" in out.stderr


def test_json_asked_for_is_a_json_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json", "diagnose", str(SCRIPTS / "ends.py"), "exit", "0"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "usage" and "--output FILE.json" in data["error"]
    # After the script, --json is the script's own argument.
    assert main(["diagnose", str(SCRIPTS / "ends.py"), "exit", "0", "--json"]) == 0


# -- the graph-growth rule for loops that never sync, on step records -------------------------


def lazy_step(n: int, syncs: int, counted: int = 1) -> StepRecord:
    """A step record as the watcher makes one on XLA: ``syncs`` the script made during it."""
    return StepRecord(n, "xla", True, 0.01, 0.0, None, {"compilations": 0, "syncs": syncs} if counted else {},
                      float(n), {}, counted)


def test_steps_without_a_sync_are_graph_growth_and_steps_with_one_are_not() -> None:
    from tests.diagnoses import engine

    never = engine({})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(1, 9):
            never.step_end(lazy_step(n, 0))
    assert [(f.kind, f.step) for f in never.findings] == [("graph-growth", 5)]
    assert "the loop never syncs" in never.findings[0].text and "torch_xla.sync()" in never.findings[0].text
    assert never.findings[0].evidence["steps_without_sync"] == 5
    assert [str(w.message)[:14] for w in caught] == ["[graph-growth]"]

    # Two optimizers and one sync per batch (a GAN), a quiet stretch read 16 steps at a time,
    # and a ported loop (its records carry no sync count): silent.
    two_optimizers = [lazy_step(n, n % 2) for n in range(1, 41)]
    quiet = [lazy_step(n, 1) for n in range(1, 41)] + [
        lazy_step(n, 16, 16) if n % 16 == 0 else lazy_step(n, 0, 0) for n in range(41, 97)]
    ported = [StepRecord(n, "xla", True, 0.01, 0.0, None, {"compilations": 0}, float(n), {}) for n in range(1, 41)]
    for records in (two_optimizers, quiet, ported):
        rules = engine({})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for record in records:
                rules.step_end(record)
        assert rules.findings == []


def test_a_recorded_run_that_never_synced_is_diagnosed_by_accelport_report(tmp_path: pathlib.Path) -> None:
    from accelport.diagnose.metrics_log import record_to_dict
    from accelport.diagnose.report import diagnose, load_records

    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(record_to_dict(lazy_step(n, 0))) + "\n" for n in range(1, 9)))
    assert [f.kind for f in diagnose(load_records(str(path)))] == ["graph-growth"]


# -- the native path: torch.compile and the step checks (real inductor on cpu) -----------------

NATIVE = SCRIPTS / "cpu_native.py"


def native(tmp_path: pathlib.Path, case: str, steps: int) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = run("--output", str(tmp_path / f"{case}.json"), str(NATIVE), "--case", case, "--steps", str(steps))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"done {case} [")
    return out, json.loads((tmp_path / f"{case}.json").read_text())


def test_a_compiled_function_past_its_recompile_limit_is_a_problem_shown_at_its_def(tmp_path: pathlib.Path) -> None:
    out, result = native(tmp_path, "shapes", 12)
    by_kind = {f["kind"]: f for f in result["findings"]}
    assert set(by_kind) == {"compile-limit", "recompilation"}, result["findings"]
    limit = by_kind["compile-limit"]
    assert limit["severity"] == "problem" and limit["evidence"]["limit"] == 8
    forward = f"{NATIVE}:{line_of(NATIVE, 'def forward')}"
    assert f"Net.forward ({forward})" in limit["message"] and "runs it eagerly" in limit["message"]
    # The batch dimension takes a new size batch after batch: padding to one size is the fix, not sequence buckets
    # (drop_last, which only drops a last short batch, is said as such).
    assert "changed size along dim 0" in limit["message"] and "pad every batch up to one size" in limit["fix"]
    assert "drop_last=True" in limit["fix"] and "LengthGroupedBatchSampler" not in limit["fix"]
    # The function's line is in the message: said once, not again as an "at" line.
    said = " ".join(out.stderr.split())
    assert "[FAIL] compile-limit at step 9" in said and said.count(f"({forward}) reached") == 1
    assert f"at {forward}" not in said
    assert by_kind["recompilation"]["severity"] == "warning"


def test_a_graph_break_on_every_call_is_shown_at_the_line_that_breaks(tmp_path: pathlib.Path) -> None:
    out, result = native(tmp_path, "breaks", 6)
    [found] = result["findings"]
    breaks = f"{NATIVE}:{line_of(NATIVE, 'h.sum().item()')}"
    assert found["kind"] == "graph-break" and found["evidence"]["sites"][0].startswith(breaks + ": ")
    assert "Tensor.item()" in found["message"] and "torch.where(cond, a, b)" in found["fix"]
    # Where it breaks is in the message ("at file:line in forward"): said once, no second "at" line.
    said = " ".join(out.stderr.split())
    assert said.count(f"at {breaks} in forward") == 1 and said.count(breaks) == 1


def test_a_nan_in_a_batch_is_traced_to_that_batch(tmp_path: pathlib.Path) -> None:
    out, result = native(tmp_path, "nan", 12)
    [found] = result["findings"]
    assert (found["kind"], found["step"], found["severity"]) == ("non-finite", 6, "problem")
    assert "it came from the input batch (input 0: 1 of 128 values are NaN or Inf)" in found["message"]
    assert "[FAIL] non-finite at step 6" in out.stderr


def test_bf16_weights_whose_updates_round_away_are_named(tmp_path: pathlib.Path) -> None:
    out, result = native(tmp_path, "bf16", 64)
    [found] = result["findings"]
    assert (found["kind"], found["severity"]) == ("precision", "problem")
    assert "100% of fc.weight (bfloat16) did not change" in found["message"]
    # A plain PyTorch script: the fix in plain PyTorch's terms.
    assert "torch.autocast(device_type, dtype=torch.bfloat16)" in found["fix"] and "ap." not in found["fix"]


def test_a_healthy_compiled_loop_is_silent_and_computes_what_python_does(tmp_path: pathlib.Path) -> None:
    out, result = native(tmp_path, "healthy", 64)
    assert result["findings"] == [] and result["steps"] == 64
    assert out.stdout == run(str(NATIVE), "--case", "healthy", "--steps", "64", diagnose=False).stdout
    assert "[ok  ] no finding" in out.stderr


def test_a_finding_is_shown_at_the_scripts_line_never_at_a_librarys() -> None:
    import torch

    from accelport.runtime.watch import Site, where

    sites = {"step": Site("train.py", 30), "loop": Site("train.py", 20)}

    def at(kind: str, **evidence: Any) -> tuple[str, int] | None:
        site = where(type("Finding", (), {"kind": kind, "evidence": evidence})(), sites)
        return (site.file, site.line) if site is not None else None

    assert at("graph-break", sites=["/w/model.py:12: Unsupported Tensor.item() call"]) == ("/w/model.py", 12)
    assert at("host-sync", sites=["C:\\w\\train.py:7"]) == ("C:\\w\\train.py", 7)
    # A break without a frame, whose reason holds a path: no file is made up from it.
    assert at("graph-break", sites=["?: Unsupported call at /x/misc.py:123: foo"]) == ("train.py", 30)
    assert at("compile-limit", function="forward (/w/model.py:5)") == ("/w/model.py", 5)
    # torch's own Sequential.forward says nothing of the script: the loop's line instead.
    container = torch.nn.modules.container.__file__
    assert at("recompilation", function=f"Sequential.forward ({container}:240)") == ("train.py", 20)


# -- the report page, in a real browser --------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"),
                    reason="Debian's chromium is not installed (`make test` installs it where it can)")
def test_the_report_page_renders_in_a_headless_browser(healthy: dict[str, Any]) -> None:
    assert CHROMIUM, "CI must have chromium: the Makefile's test target installs it"
    page = healthy["dir"] / "out" / "run.html"
    assert f"wrote {healthy['dir'] / 'out' / 'findings.json'}, {page}" in healthy["watched"].stderr
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    with tempfile.TemporaryDirectory() as profile:
        dom = subprocess.run([CHROMIUM, *flags, f"--user-data-dir={profile}", "--dump-dom", f"file://{page}"],
                             capture_output=True, text=True, timeout=120).stdout
    assert 'data-drawn="30"' in dom, "the script did not draw the chart"
    # Each step's own time breakdown (on cpu the forward, backward and optimizer are the device's work).
    segments = re.findall(r'class="seg seg-([\w+]+)"', dom)
    assert segments.count("device") == 30 and "rest" not in segments
    assert "accelport diagnose: " in dom and "No diagnosis: nothing in this run looks slow or wrong" in dom
