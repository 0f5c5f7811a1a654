"""The accelport command: output formats, exit codes, and no tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from accelport.cli import main


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "accelport", *args], capture_output=True, text=True,
                          env=full_env, timeout=120)


def test_backends_json_lists_cpu_available_and_selected() -> None:
    out = run_cli("backends", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    by_name = {b["name"]: b for b in data["backends"]}
    assert by_name["cpu"]["available"] and by_name["cpu"]["selected"]
    assert not by_name["cuda"]["selected"]
    assert data["selected"]["name"] == "cpu" and data["selected"]["reason"]
    assert data["failed_plugins"] == []


def test_backends_human_output_marks_selected() -> None:
    out = run_cli("backends")
    assert out.returncode == 0
    assert any(line.startswith("* cpu") for line in out.stdout.splitlines())
    assert "selected: cpu" in out.stdout


def test_unknown_backend_in_environment_is_reported_not_raised() -> None:
    out = run_cli("backends", "--json", env={"ACCELPORT_BACKEND": "cdua"})
    data = json.loads(out.stdout)
    assert out.returncode == 1
    assert data["selected"]["name"] is None
    assert "Did you mean 'cuda'" in data["selected"]["reason"]
    assert "Traceback" not in out.stderr


def test_usage_error_is_json_with_json_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--json", "--frobnicate"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "usage" and "--frobnicate" in data["error"]


def test_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bakends"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'bakends'" in err and "Traceback" not in err



@pytest.mark.parametrize("args,message", [
    (["backends", "--frobnicate"], "accelport: error: unrecognized arguments: --frobnicate\n"),
    (["--frobnicate"], "accelport: error: unrecognized arguments: --frobnicate\n"),
    (["ci-matrix", "--format", "yaml"], "accelport: error: ci-matrix: argument --format: invalid choice: 'yaml'"),
    (["launch"], "accelport: error: launch: the following arguments are required: script"),
])
def test_usage_error_names_accelport_once(capsys: pytest.CaptureFixture[str], args: list[str],
                                          message: str) -> None:
    # _fail() prints the "accelport: error: " prefix; the parser must not add "accelport: " again.
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("accelport: ") == 1, err


def test_console_usage_error_has_one_prefix() -> None:
    out = run_cli("backends", "--frobnicate")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == "accelport: error: unrecognized arguments: --frobnicate\n"


@pytest.mark.parametrize("command", [
    ["backends"], ["doctor"], ["matrix", "--platform", "gcp-tpu", "--torch", "2.9"],
    ["ci-matrix", "--platform", "cpu"], ["launch", "--dry-run", "examples/quickstart.py"],
])
def test_json_before_the_command_is_the_commands_json(capsys: pytest.CaptureFixture[str],
                                                     command: list[str]) -> None:
    before = main(["--json", *command])
    first = capsys.readouterr()
    after = main([*command[:1], "--json", *command[1:]])
    second = capsys.readouterr()
    assert before == after, (first, second)
    assert json.loads(first.out) == json.loads(second.out)


def test_json_before_the_command_for_errors_and_conflicts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json", "ci-matrix", "--torch", "banana"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "usage" and "invalid torch version 'banana'" in data["error"]
    # The same conflict argparse reports after the command, with the same words.
    assert main(["--json", "doctor", "--markdown"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data == {"error": "doctor: argument --markdown: not allowed with argument --json", "kind": "usage"}
    out = run_cli("--json", "backends")
    assert out.returncode == 0 and json.loads(out.stdout)["selected"]["name"] == "cpu", out.stderr

def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "backends" in capsys.readouterr().out


def test_unexpected_exception_becomes_one_line_and_valid_json(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    import accelport.cli.backends as cb

    monkeypatch.setattr(cb, "run", lambda args: 1 / 0)
    assert main(["backends", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "internal" and "ZeroDivisionError" in data["error"]
    assert main(["backends"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("accelport: error: unexpected ZeroDivisionError") and "Traceback" not in err


def test_console_script_is_installed() -> None:
    import shutil

    exe = shutil.which("accelport") or str(__import__("pathlib").Path(sys.executable).with_name("accelport"))
    out = subprocess.run([exe, "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("accelport ")


def test_a_closed_pipe_is_not_reported_as_a_bug() -> None:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")}
    out = subprocess.run(f"'{sys.executable}' -m accelport matrix | head -n 1", shell=True, capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.stdout.strip() and "BrokenPipe" not in out.stderr and "bug" not in out.stderr


def test_json_with_no_command_is_a_json_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "usage"
    assert data["error"] == ("give a command: accelport --json COMMAND (one of backends, doctor, launch, "
                             "matrix, ci-matrix, report, diagnose, compare, verify-resume)")


@pytest.mark.parametrize("as_json", [False, True])
def test_a_usage_error_quotes_what_was_typed_redacted_and_cut(capsys: pytest.CaptureFixture[str],
                                                              as_json: bool) -> None:
    # argparse quotes unrecognized arguments whole, and says so before the redacting output
    # session starts: a token typed as an argument, or 100 KB of digits, must not come back.
    token = "hf_" + "a1b2c3d4e5" * 3
    huge = "3." + "1" * 100_000
    code = main([*(["--json"] if as_json else []), "ci-matrix", token, huge])
    out, err = capsys.readouterr()
    said = json.loads(out)["error"] if as_json else err
    assert code == 2
    assert "unrecognized arguments" in said
    assert token not in out + err and "<redacted>" in said
    assert len(out + err) < 3000 and "[cut: " in said
