"""``accelport diagnose --find-nan`` and ``ACCELPORT_FIND_NAN``: the operation that made the first NaN or Inf, for real
on cpu, with its pass, module and line, and a repro that plain python runs.

The script (scripts/cpu_find_nan.py) is a small attention model that breaks in one known op per
case; unported it never imports accelport, ported (``--ported``) it runs through ap.loader and
ap.optimizer_step and prints ``ap.diagnostics()``. Every run is its own process (runs.py).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
from typing import Any

import pytest

from tests.diagnose_cli.runs import SCRIPTS, run

SCRIPT = SCRIPTS / "cpu_find_nan.py"


def said(stderr: str) -> str:
    """The summary with its lines joined (it wraps long notes)."""
    return " ".join(stderr.split())


def line_of(text: str) -> int:
    return next(n for n, line in enumerate(SCRIPT.read_text().splitlines(), 1) if text in line)


#: Each case: the step, the op, its pass, where (module, the script's line), and a word of its fix.
CASES: dict[str, dict[str, Any]] = {
    "log": {"step": 7, "op": "aten.log.default", "direction": "forward", "module": "model (Net)",
            "line": "# LOG", "made": "Inf", "fix": "Clamp before log: torch.log(x.clamp_min(1e-6))"},
    "sqrt": {"step": 5, "op": "aten.sqrt.default", "direction": "forward", "module": "model.blocks.0 (Block)",
             "line": "# SQRT", "made": "NaN", "fix": "sqrt of a negative"},
    "backward": {"step": 4, "op": "aten.div.Tensor", "direction": "backward", "module": "model.blocks.0 (Block)",
                 "line": "# NORM", "made": "NaN", "fix": "torch.linalg.vector_norm (its gradient at 0 is 0)"},
    "softmax": {"step": 3, "op": "aten._softmax.default", "direction": "forward",
                "module": "model.blocks.0.attn (Attention)", "line": "# SOFTMAX", "made": "NaN",
                "fix": "torch.finfo(scores.dtype).min instead of float('-inf')"},
    "lr": {"step": 6, "op": "aten.add_.Tensor", "direction": "optimizer", "module": None, "line": "opt.step()  # STEP",
           "made": "Inf", "fix": "The update itself overflowed: lower the learning rate"},
}


def unported(tmp_path: pathlib.Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    done = run("--output", str(out / "f.json"), *args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return done, json.loads((out / "f.json").read_text())


def ported(tmp_path: pathlib.Path, case: str, **env: str) -> tuple[subprocess.CompletedProcess[str], list[Any]]:
    done = run(str(SCRIPT), "--case", case, "--ported", diagnose=False, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    line = done.stdout.splitlines()[-1]
    assert line.startswith("findings "), done.stdout
    return done, json.loads(line[len("findings "):])


def check_origin(found: dict[str, Any], case: str, line: str | None = None) -> dict[str, Any]:
    want = CASES[case]
    assert (found["kind"], found["step"], found["severity"]) == ("non-finite", want["step"], "problem")
    origin = found["evidence"]["origin"]
    assert found["evidence"]["source"] == "op" and origin["kind"] == "op" and origin["confirmed"] is True
    assert (origin["op"], origin["direction"], origin["made"]) == (want["op"], want["direction"], want["made"])
    assert origin["where"] == f"{SCRIPT}:{line_of(line or want['line'])}", origin
    assert origin["module"] == want["module"]
    assert want["fix"] in found["fix"], found["fix"]
    if case == "backward":  # the backward op is placed at its forward op's line
        assert (origin["node"], origin["forward_op"], origin["forward_call"]) == ("SqrtBackward0", "sqrt", "torch.sqrt")
        assert "in the backward pass of sqrt (torch.sqrt, in model.blocks.0 (Block))" in found["message"]
    if case == "lr":
        assert origin["params"] == ["blocks.0.fc.weight"] and origin["optimizer"] == "SGD"
        assert "in the optimizer's update of blocks.0.fc.weight (SGD)" in found["message"]
    if case == "log":  # what the log was given: zeros, all finite
        (given,) = origin["inputs"]
        assert given["zeros"] > 0 and given["nan"] == given["posinf"] == given["neginf"] == 0
        assert given["dtype"] == "float32" and given["min"] == 0.0
    return origin


def check_repro(origin: dict[str, Any], directory: pathlib.Path, made: str) -> None:
    script, data = origin["repro"]
    assert pathlib.Path(script).parent == directory and pathlib.Path(data).parent == directory
    # As its own process, with plain python and torch: the same op on the same inputs, on cpu.
    out = run(script, diagnose=False, cwd=directory.parent)
    assert out.returncode == 0, out.stderr
    assert "inputs: 0 NaN" in out.stdout and "NOT FINITE" in out.stdout, out.stdout
    counts = [line for line in out.stdout.splitlines() if line.startswith("output 0 ")][0]
    nan, inf = (int(counts.split(f" {word}")[0].rsplit(" ", 1)[1]) for word in ("NaN", "Inf"))
    assert (nan if made == "NaN" else inf) > 0, counts


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_unported_script_is_told_the_op_its_pass_module_and_line_and_given_a_repro(
        case: str, tmp_path: pathlib.Path) -> None:
    done, result = unported(tmp_path, "--find-nan", str(SCRIPT), "--case", case)
    [found] = result["findings"]
    origin = check_origin(found, case)
    assert found["evidence"]["where"] == origin["where"]  # the summary's "at" is the op's line
    # (said once: in the message, so not again on an "at" line of its own)
    assert f"at {origin['where']}:" in said(done.stderr) and f"at {origin['where']}\n" not in done.stderr
    assert "[FAIL] non-finite at step" in done.stderr
    # The repro goes next to --output's file.
    check_repro(origin, tmp_path / "out", CASES[case]["made"])
    assert f"python {origin['repro'][0]}" in found["fix"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_ported_script_is_told_the_same_with_accelport_find_nan(case: str, tmp_path: pathlib.Path) -> None:
    repro = tmp_path / "repro"
    _, findings = ported(tmp_path, case, ACCELPORT_FIND_NAN="1", ACCELPORT_FIND_NAN_DIR=str(repro))
    [found] = findings
    origin = check_origin(found, case, line="ap.optimizer_step(opt)" if case == "lr" else None)
    check_repro(origin, repro, CASES[case]["made"])


def test_from_a_step_checks_from_that_step_and_finds_the_same_op(tmp_path: pathlib.Path) -> None:
    _, result = unported(tmp_path, "--find-nan-from", "7", str(SCRIPT), "--case", "log")
    [found] = result["findings"]
    check_origin(found, "log")
    assert found["evidence"]["checked_from"] == 7


def test_a_healthy_run_with_find_nan_has_no_finding_and_prints_what_python_prints(tmp_path: pathlib.Path) -> None:
    done, result = unported(tmp_path, "--find-nan", str(SCRIPT), "--case", "healthy")
    plain = run(str(SCRIPT), "--case", "healthy", diagnose=False, cwd=tmp_path)
    assert result["findings"] == [] and done.stdout == plain.stdout
    assert "[note] steps 1 to 10 were checked op by op: no operation made a NaN or Inf that reached the weights" \
        in said(done.stderr)
    assert not list((tmp_path / "out").glob("accelport-nan-*")), "a repro was written for nothing"


def test_a_healthy_ported_run_has_no_finding_and_says_what_was_checked_at_its_end(tmp_path: pathlib.Path) -> None:
    done, findings = ported(tmp_path, "healthy", ACCELPORT_FIND_NAN="1", ACCELPORT_FIND_NAN_DIR=str(tmp_path))
    plain = run(str(SCRIPT), "--case", "healthy", diagnose=False, cwd=tmp_path)
    assert findings == [] and done.stdout.splitlines()[:-1] == plain.stdout.splitlines()
    assert ("DiagnosticWarning: accelport ACCELPORT_FIND_NAN: steps 1 to 10 were checked op by op: no operation "
            "made a NaN or Inf that reached the weights") in done.stderr
    assert not list(tmp_path.glob("accelport-nan-*"))


def test_a_nan_already_in_the_input_batch_is_named_with_its_sample_and_no_op_is_searched(
        tmp_path: pathlib.Path) -> None:
    done, result = unported(tmp_path, "--find-nan", str(SCRIPT), "--case", "input")
    [found] = result["findings"]
    assert (found["step"], found["evidence"]["source"]) == (6, "input")
    assert "the first NaN or Inf was already in the input batch of step 6" in found["message"]
    assert "input 0, sample 3 of 16: 1 of 512 values are NaN or Inf" in found["message"]
    assert "No operation made it, so none was searched" in found["message"] and "Bad data" in found["fix"]
    assert found["evidence"]["origin"]["op"] == "" and found["evidence"]["origin"]["repro"] is None
    assert not list((tmp_path / "out").glob("accelport-nan-*"))


def test_the_default_finding_says_how_to_search_for_the_op(tmp_path: pathlib.Path) -> None:
    _, result = unported(tmp_path, str(SCRIPT), "--case", "log")
    [found] = result["findings"]
    assert found["step"] == 7 and found["evidence"]["source"] == "loss"
    assert (f"run accelport diagnose --find-nan-from 7 -- {SCRIPT} --case log: it checks every operation from "
            "step 7, about 10 times slower") in found["fix"]
    assert "A rerun may go wrong at another step" not in found["message"] + found["fix"]  # the script seeds torch
    _, findings = ported(tmp_path, "sqrt")
    [found] = findings
    assert "run the script again with ACCELPORT_FIND_NAN=5 in its environment" in found["fix"]


def test_a_run_without_a_seed_is_said_not_to_be_reproducible(tmp_path: pathlib.Path) -> None:
    _, result = unported(tmp_path, str(SCRIPT), "--case", "softmax", "--no-seed")
    [found] = result["findings"]
    assert "--find-nan-from 3" in found["fix"]
    assert ("A rerun may go wrong at another step: torch's random seed was never set (torch.manual_seed)"
            in found["fix"])


@pytest.mark.parametrize("value, says", [
    ("-3", "--find-nan-from -3: steps count from 1"),
    ("0", "--find-nan-from 0: steps count from 1"),
    ("abc", "--find-nan-from abc: not a step number"),
])
def test_a_step_that_is_no_step_is_refused_before_the_script_runs(value: str, says: str,
                                                                  tmp_path: pathlib.Path) -> None:
    done = run(f"--find-nan-from={value}", str(SCRIPT), "--case", "healthy", cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert f"accelport: error: diagnose: {says}" in done.stderr


def test_a_find_nan_setting_that_is_no_step_is_refused_and_a_dir_alone_is_refused(tmp_path: pathlib.Path) -> None:
    done = run(str(SCRIPT), "--case", "healthy", cwd=tmp_path, env={"ACCELPORT_FIND_NAN": "soon"})
    assert done.returncode == 2 and done.stdout == ""
    assert "accelport: error: diagnose: ACCELPORT_FIND_NAN=soon: not a step number" in done.stderr
    done = run("--find-nan-dir", str(tmp_path), str(SCRIPT), "--case", "healthy", cwd=tmp_path)
    assert done.returncode == 2 and "--find-nan-dir says where --find-nan writes its repro" in done.stderr


def test_a_step_past_the_end_of_the_run_checks_nothing_and_says_so(tmp_path: pathlib.Path) -> None:
    done, result = unported(tmp_path, "--find-nan-from", "1000", str(SCRIPT), "--case", "healthy")
    assert result["findings"] == []
    assert ("[note] no step was checked for the operation that made a NaN or Inf: the run ended at step 10, "
            "before step 1000, where the checks were to begin") in said(done.stderr)


def test_a_repro_directory_that_cannot_be_written_is_said_and_the_run_goes_on(tmp_path: pathlib.Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    done, result = unported(tmp_path, "--find-nan", "--find-nan-dir", str(blocker / "repro"), str(SCRIPT),
                            "--case", "sqrt")
    [found] = result["findings"]
    origin = check_origin(found, "sqrt")
    assert origin["repro"] is None and done.stdout.startswith("done sqrt [")
    problem = origin["repro_problem"]
    assert problem.startswith(f"the repro could not be written in {blocker / 'repro'} (Not a directory)"), problem
    assert "give --find-nan-dir a directory that can be written" in found["fix"]
    assert blocker.read_text() == "not a directory"
