"""``accelport diagnose`` runs a script as ``python`` does, however it is packed and however it ends.

Each case runs the script plainly and under diagnose (real subprocesses, see ``runs.py``)
and compares what the script saw and did; the torch ones are few and short.
"""

from __future__ import annotations

import json
import pathlib
import py_compile
import signal
import textwrap
import zipapp
import zipfile

import pytest

from tests.diagnose_cli.runs import SCRIPTS, run, run_bytes

ENDS = str(SCRIPTS / "ends.py")
SHOWS = textwrap.dedent("""
    import sys
    print("argv", sys.argv, "name", __name__, "file", __file__, "path0", sys.path[0])
    print("spec", __spec__.name if __spec__ else None, "loader", type(__loader__).__name__)
""")


def summary_of(stderr: str) -> str:
    """diagnose's own part of stderr: from its first line on."""
    return stderr[stderr.index("accelport diagnose: "):]


@pytest.mark.parametrize("packed", ["pyc", "zipapp", "directory"])
def test_a_pyc_a_zipapp_and_a_directory_run_as_under_python(tmp_path: pathlib.Path, packed: str) -> None:
    app = tmp_path / "app"
    app.mkdir()
    (app / "__main__.py").write_text(SHOWS)
    if packed == "pyc":
        (tmp_path / "shows.py").write_text(SHOWS)
        py_compile.compile(str(tmp_path / "shows.py"), cfile=str(tmp_path / "shows.pyc"), doraise=True)
        target = "shows.pyc"
    elif packed == "zipapp":
        zipapp.create_archive(app, tmp_path / "app.pyz")
        target = "app.pyz"
    else:
        target = "app"
    plain = run(target, "--flag", cwd=tmp_path, diagnose=False)
    watched = run(target, "--flag", cwd=tmp_path)
    assert plain.returncode == watched.returncode == 0, watched.stderr
    # argv[0] as typed, __file__ and sys.path[0] as python sets them, the loader python uses.
    assert watched.stdout == plain.stdout, (plain.stdout, watched.stdout)
    assert f"argv ['{target}', '--flag']" in watched.stdout
    assert watched.stderr.startswith(f"accelport diagnose: {target} took 0 optimizer step(s)")


def test_a_zip_without_main_is_refused_before_anything_runs(tmp_path: pathlib.Path) -> None:
    with zipfile.ZipFile(tmp_path / "bare.zip", "w") as z:
        z.writestr("helper.py", "print('ran')\n")
    out = run("bare.zip", cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert "diagnose: bare.zip is a zip archive without a __main__ module" in out.stderr, out.stderr


def test_the_scripts_hooks_and_files_beside_it_are_its_own(tmp_path: pathlib.Path) -> None:
    # A delegating import hook (it asks every other finder, accelport's too), and files that
    # shadow the standard library for the script: accelport's own imports are done before the
    # script's directory goes on sys.path, so its report page still gets the real html module.
    # (Run from the directory above: `python -m accelport` in the script's own directory would
    # put those files before the standard library for accelport's start-up, as for any -m tool.)
    project = tmp_path / "project"
    project.mkdir()
    (project / "shutil.py").write_text('"""the script\'s own shutil: nothing in it"""\n')
    (project / "html.py").write_text('"""the script\'s own html: nothing in it"""\n')
    (project / "train.py").write_text(textwrap.dedent("""
        import importlib.abc
        import sys


        class Delegating(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                for finder in sys.meta_path:
                    if finder is not self and hasattr(finder, "find_spec"):
                        spec = finder.find_spec(name, path, target)
                        if spec is not None:
                            return spec
                return None


        sys.meta_path.insert(0, Delegating())
        import torch

        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(4):
            model(torch.randn(5, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
        print("weights", [round(v, 5) for v in model.weight.flatten().tolist()])
    """))
    plain = run("project/train.py", cwd=tmp_path, diagnose=False)
    watched = run("--output", "f.json", "--report", "r.html", "project/train.py", cwd=tmp_path)
    assert plain.returncode == watched.returncode == 0, watched.stderr
    assert watched.stdout == plain.stdout
    assert "RecursionError" not in watched.stderr and "bug in accelport" not in watched.stderr
    assert json.loads((tmp_path / "f.json").read_text())["steps"] == 4
    assert "<h1>accelport diagnose: project/train.py</h1>" in (tmp_path / "r.html").read_text()


def test_a_thread_that_trains_after_the_last_line_is_waited_for_as_python_does() -> None:
    script = str(SCRIPTS / "cpu_thread.py")
    plain = run(script, diagnose=False)
    watched = run(script)  # (a thread pool left open must not keep it waiting: Python stops its threads)
    assert plain.returncode == watched.returncode == 0, watched.stderr
    assert watched.stdout == plain.stdout and "trained in a thread" in watched.stdout
    assert summary_of(watched.stderr).startswith(f"accelport diagnose: {script} took 12 optimizer step(s) on cpu")


def test_a_forked_child_ends_as_its_own_process_and_the_parent_reports(tmp_path: pathlib.Path) -> None:
    watched = run("--output", str(tmp_path / "f.json"), ENDS, "fork")
    assert watched.returncode == 0, watched.stderr
    assert "the child ends\n" in watched.stdout and "the child ended with status 3\n" in watched.stdout
    assert watched.stderr.count("accelport diagnose: ") == 1, watched.stderr  # one summary: the parent's
    assert "exited with status 0" in watched.stderr
    assert json.loads((tmp_path / "f.json").read_text())["exit_status"] == 0


@pytest.mark.parametrize("how", ["close-streams", "patch-builtins"])
def test_a_script_that_closes_its_streams_or_replaces_builtins_still_gets_its_findings(
        tmp_path: pathlib.Path, how: str) -> None:
    plain = run(ENDS, how, diagnose=False)
    watched = run("--output", str(tmp_path / "f.json"), ENDS, how)
    assert plain.returncode == watched.returncode == 0, watched.stderr
    assert watched.stdout == plain.stdout == f"started [{how!r}]\n"
    # Said on the stderr it started with (file descriptor 2 where the script closed sys.stderr).
    assert "Traceback" not in watched.stderr and "exited with status 0" in watched.stderr, watched.stderr
    assert f"wrote {tmp_path / 'f.json'}" in watched.stderr
    assert json.loads((tmp_path / "f.json").read_text())["exit_status"] == 0


def test_stdout_keeps_the_error_handler_python_gave_it() -> None:
    # A strict stdout cannot print a lone surrogate: the script fails under python, and so here.
    strict = {"PYTHONIOENCODING": "utf-8:strict"}
    plain = run_bytes(ENDS, "surrogate", diagnose=False, env=strict)
    watched = run_bytes(ENDS, "surrogate", env=strict)
    assert plain.returncode == watched.returncode == 1
    assert plain.stderr.rstrip().endswith(b"surrogates not allowed")
    assert watched.stderr.startswith(plain.stderr), watched.stderr
    assert watched.stdout == plain.stdout
    # And one that escapes them writes the byte, as under python.
    escape = {"PYTHONIOENCODING": "utf-8:surrogateescape"}
    plain = run_bytes(ENDS, "surrogate", diagnose=False, env=escape)
    watched = run_bytes(ENDS, "surrogate", env=escape)
    assert plain.returncode == watched.returncode == 0
    assert watched.stdout == plain.stdout == b"started ['surrogate']\n\xff\n"


# -- SIGTERM, the usual scheduler kill ---------------------------------------------------------


def test_sigterm_writes_the_findings_so_far_then_ends_the_run_as_sigterm_would(tmp_path: pathlib.Path) -> None:
    script = SCRIPTS / "cpu_slow_data.py"
    (tmp_path / "steps.jsonl").write_text('{"an earlier run": true}\n')
    watched = run("--output", "f.json", "--report", "r.html", "--metrics-file", "steps.jsonl", str(script),
                  "--terminate", cwd=tmp_path)
    assert watched.returncode == -signal.SIGTERM, watched.stderr
    assert watched.stdout == "trained; now killed\n"
    result = json.loads((tmp_path / "f.json").read_text())
    assert result["exit_status"] == 128 + signal.SIGTERM and result["steps"] == 16
    assert [f["kind"] for f in result["findings"]] == ["input-bound"]
    steps = [json.loads(line)["step"] for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 17))  # this run's, replacing the earlier run's
    assert "input-bound" in (tmp_path / "r.html").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json", "r.html", "steps.jsonl"]  # nothing left over
    summary = summary_of(watched.stderr)
    assert summary.startswith(f"accelport diagnose: {script} took 16 optimizer step(s) on cpu and was ended by "
                              "SIGTERM (status 143): 1 finding(s)"), summary


def test_a_scripts_own_sigterm_handler_or_an_ignored_sigterm_is_respected(tmp_path: pathlib.Path) -> None:
    plain = run(ENDS, "terminate-handled", diagnose=False)
    watched = run("--output", str(tmp_path / "f.json"), ENDS, "terminate-handled")
    assert plain.returncode == watched.returncode == 7, watched.stderr
    assert watched.stdout == plain.stdout == "started ['terminate-handled']\nthe script's own SIGTERM handler ran\n"
    assert json.loads((tmp_path / "f.json").read_text())["exit_status"] == 7
    # Started with SIGTERM ignored (as a launcher may), python lives on, and so does the script here.
    plain = run(ENDS, "terminate", diagnose=False, ignore=(signal.SIGTERM,))
    watched = run(ENDS, "terminate", ignore=(signal.SIGTERM,))
    assert plain.returncode == watched.returncode == 0, watched.stderr
    assert watched.stdout == plain.stdout == "started ['terminate']\nsurvived SIGTERM\n"
