"""``accelport diagnose``'s outputs never harm the user's files, and what it says shows no secret.

The refusals run in this process (the script never starts, so there is nothing to isolate);
the redaction of a real run's summary is one subprocess.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from accelport import safe_io
from accelport.cli import main
from tests.diagnose_cli.runs import SCRIPTS, run

ENDS = SCRIPTS / "ends.py"
SCRIPT = "train.py"
SCRIPT_TEXT = "open('ran', 'w').close()\n"


@pytest.fixture
def workdir(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[pathlib.Path]:
    """A directory holding the script (and a package), the working directory for the test."""
    (tmp_path / SCRIPT).write_text(SCRIPT_TEXT)
    (tmp_path / "link.py").symlink_to(SCRIPT)
    os.link(tmp_path / SCRIPT, tmp_path / "hard.py")
    os.mkfifo(tmp_path / "pipe")
    # A reader on the FIFO: where it were not refused, writing to it would not hang the test, only fail it.
    reader = os.open(tmp_path / "pipe", os.O_RDONLY | os.O_NONBLOCK)
    package = tmp_path / "victim_pkg_of_diagnose"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(SCRIPT_TEXT)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    os.close(reader)
    sys.modules.pop("victim_pkg_of_diagnose", None)


@pytest.mark.parametrize("args,words", [
    (["--metrics-file", SCRIPT, SCRIPT], "--metrics-file train.py is the script"),
    (["--output", SCRIPT, SCRIPT], "--output train.py is the script"),
    (["--report", SCRIPT, SCRIPT], "--report train.py is the script"),
    (["--report", "link.py", SCRIPT], "--report link.py is the script"),  # through a symlink
    (["--output", "hard.py", SCRIPT], "--output hard.py is the script"),  # and a hard link
    (["--output", "f.json", "--report", "./f.json", SCRIPT],
     "--output f.json and --report ./f.json are the same file"),
    (["--output", "f.json", "--metrics-file", "f.json", SCRIPT],
     "--output f.json and --metrics-file f.json are the same file"),
    (["--output", "victim_pkg_of_diagnose/__main__.py", "-m", "victim_pkg_of_diagnose"],
     "--output victim_pkg_of_diagnose/__main__.py is the file of module victim_pkg_of_diagnose"),
    (["--output", "pipe", SCRIPT], "--output 'pipe' is a FIFO: point it at a regular file"),
])
def test_an_output_that_is_an_input_another_output_or_a_fifo_is_refused_before_the_script_runs(
        workdir: pathlib.Path, capsys: pytest.CaptureFixture[str], args: list[str], words: str) -> None:
    assert main(["diagnose", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("accelport: error: diagnose: ") and words in err, err
    assert err.count("\n") == 1
    # Nothing ran, nothing was written or removed.
    assert not (workdir / "ran").exists()
    assert (workdir / SCRIPT).read_text() == SCRIPT_TEXT
    assert (workdir / "victim_pkg_of_diagnose" / "__main__.py").read_text() == SCRIPT_TEXT
    assert sorted(p.name for p in workdir.iterdir()) == [
        "hard.py", "link.py", "pipe", SCRIPT, "victim_pkg_of_diagnose"]


class _FullDisk:
    """``os`` as safe_io sees it, on a disk that is full: every write fails with ENOSPC."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def write(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_leaves_the_earlier_output_whole_and_says_why(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "f.json"
    out.write_text('{"an earlier run": true}\n')
    monkeypatch.setattr(safe_io, "os", _FullDisk())
    # The script ends with status 0; the output that could not be written makes it 1.
    assert main(["diagnose", "--output", str(out), str(ENDS), "exit", "0"]) == 1
    err = capfd.readouterr().err
    assert f"accelport: error: --output '{out}' cannot be written (the disk is full; the file that was there " \
           "is unchanged)" in err, err
    assert out.read_text() == '{"an earlier run": true}\n'  # not a 0-byte file
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]  # and no temporary file left beside it


def test_usage_errors_are_redacted_and_escaped(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / SCRIPT).write_text(SCRIPT_TEXT)
    for args in (["--backend", "https://bob:hunter2pw@example.com", SCRIPT],
                 ["--output", "https://bob:hunter2pw@example.com/f.json", SCRIPT],  # (no split on "/")
                 ["--output", "no-such-dir\nforged line/f.json", SCRIPT],
                 ["run\x1b[31m.py"]):
        assert main(["diagnose", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "\x1b" not in err, err
        assert "hunter2pw" not in err, err
        assert "<redacted>" in err or "\\n" in err or "\\x1b" in err, err


def test_a_long_backend_name_is_quoted_cut_as_ap_use_quotes_it(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / SCRIPT).write_text(SCRIPT_TEXT)
    assert main(["diagnose", "--backend", "x" * 100_000, SCRIPT]) == 2
    err = capsys.readouterr().err
    cut = "x" * 40 + "... [cut: 100000 characters in all]"
    assert err.startswith(f"accelport: error: diagnose: --backend: unknown backend '{cut}' (from --backend).")
    assert len(err) < 400, len(err)  # it was quoted whole, up to the line's limit


def test_the_summary_and_the_json_show_no_secret_and_no_control_character(tmp_path: pathlib.Path) -> None:
    where = tmp_path / "run\x1b[31m"
    where.mkdir()
    script = where / "train.py"
    script.write_text((SCRIPTS / "cpu_healthy.py").read_text())
    out = "out\nforged: line.json"
    sysroot = "https://bob:hunter2pw@example.com/root\x1b[2J"
    watched = run("--output", out, str(script), "--steps", "3", cwd=tmp_path, env={"ACCELPORT_SYSROOT": sysroot})
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout.startswith("argv")
    summary = watched.stderr
    assert summary.startswith("accelport diagnose: ") and "took 3 optimizer step(s)" in summary, summary
    assert "\x1b" not in summary and "hunter2pw" not in summary, summary
    assert all(line.startswith(("accelport diagnose: ", "  ")) for line in summary.splitlines()), summary
    assert "run\\x1b[31m/train.py" in summary.splitlines()[0]
    assert "ACCELPORT_SYSROOT='https://<redacted>@example.com/root" in " ".join(summary.split())
    assert f"wrote {tmp_path}/out\\nforged: line.json" in summary
    result = json.loads((tmp_path / out).read_text())
    assert result["steps"] == 3 and "hunter2pw" not in json.dumps(result)


def test_a_diagnosis_shown_while_the_script_runs_goes_through_the_same_pass() -> None:
    import warnings

    from accelport.errors import DiagnosticWarning
    from accelport.redact import Redactor
    from accelport.runtime.watch import Watcher

    watcher = Watcher(redactor=Redactor({}))
    with warnings.catch_warnings(record=True) as shown:
        watcher.install()
        try:  # (the warning a rule raises inside the script's optimizer.step(), as the watcher shows it)
            warnings.showwarning(DiagnosticWarning("[input-bound] from https://bob:hunter2pw@example.com\x1b[2J"),
                                 DiagnosticWarning, "train.py", 1)
        finally:
            watcher.finish()
            watcher.uninstall()
    [warning] = shown
    assert str(warning.message) == "[input-bound] from https://<redacted>@example.com\\x1b[2J"
    assert isinstance(warning.message, DiagnosticWarning)
