"""A file beside the script named like a module accelport had imported (``random.py``) is the script's
under ``accelport diagnose`` as under ``python script.py``, and accelport's own work keeps the
standard library's.

Each case runs the script plainly and under diagnose (real subprocesses, see ``runs.py``) and
compares what the script printed.
"""

from __future__ import annotations

import json
import pathlib
import textwrap

from tests.diagnose_cli.runs import run

MARKS = textwrap.dedent("""
    import os
    import random
    import statistics
    import logging
    print("random:", getattr(random, "MARKER", "the standard library's"))
    print("statistics:", getattr(statistics, "MARKER", "the standard library's"))
    print("os:", getattr(os, "MARKER", "the standard library's"))
    print("logging:", "the standard library's" if hasattr(logging, "getLogger") else logging.__path__)
""")


def said(stderr: str) -> str:
    return " ".join(stderr.split())


def test_a_module_beside_the_script_that_accelport_had_imported_is_the_scripts_as_under_python(
        tmp_path: pathlib.Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "random.py").write_text('MARKER = "random.py beside the script"\n')
    (project / "statistics.py").write_text('MARKER = "statistics.py beside the script"\n')
    # os is imported before any script (python's own start): the standard one under python too.
    (project / "os.py").write_text('MARKER = "os.py beside the script"\n')
    # A bare directory is a namespace portion: the standard logging package comes first under python.
    (project / "logging").mkdir()
    (project / "train.py").write_text(MARKS)
    plain = run("project/train.py", cwd=tmp_path, diagnose=False)
    watched = run("project/train.py", cwd=tmp_path)
    assert plain.returncode == watched.returncode == 0, watched.stderr
    assert watched.stdout == plain.stdout, (plain.stdout, watched.stdout)
    assert plain.stdout.splitlines() == ["random: random.py beside the script",
                                         "statistics: statistics.py beside the script",
                                         "os: the standard library's", "logging: the standard library's"]
    assert "beside the script" not in watched.stderr  # nothing to say: it ran as under python


def test_a_training_script_with_its_own_statistics_and_shlex_gets_them_and_accelports_findings_stay_whole(
        tmp_path: pathlib.Path) -> None:
    # accelport's rules use the standard statistics and shlex (the non-finite fix quotes the command with it).
    # (Run from the directory above: `python -m accelport` in the script's own directory would put those files
    # before the standard library for accelport's start-up, as for any -m tool.)
    project = tmp_path / "project"
    project.mkdir()
    (project / "statistics.py").write_text('MARKER = "mine"\n')
    (project / "shlex.py").write_text('MARKER = "mine"\n')
    (project / "train.py").write_text(textwrap.dedent("""
        import shlex
        import statistics

        import torch

        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(1, 7):
            loss = model(torch.randn(5, 3)).sum()
            if step == 4:
                loss = loss * torch.log(torch.zeros(()))  # the weights turn non-finite at step 4
            loss.backward()
            opt.step()
            opt.zero_grad()
        print("statistics", statistics.MARKER, "shlex", shlex.MARKER)
    """))
    plain = run("project/train.py", cwd=tmp_path, diagnose=False)
    watched = run("--output", "f.json", "--report", "r.html", "project/train.py", cwd=tmp_path)
    assert plain.returncode == watched.returncode == 0, watched.stderr
    assert watched.stdout == plain.stdout == "statistics mine shlex mine\n"
    result = json.loads((tmp_path / "f.json").read_text())
    assert result["steps"] == 6
    (found,) = [f for f in result["findings"] if f["kind"] == "non-finite"]
    assert "accelport diagnose --find-nan-from 4 -- project/train.py" in found["fix"], found["fix"]
    assert "<h1>accelport diagnose: project/train.py</h1>" in (tmp_path / "r.html").read_text()


def test_a_file_beside_the_script_named_like_accelport_itself_is_said_by_name(tmp_path: pathlib.Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "accelport.py").write_text('MARKER = "mine"\n')
    (project / "train.py").write_text('import accelport\nprint(getattr(accelport, "MARKER", "the real one"))\n')
    plain = run("project/train.py", cwd=tmp_path, diagnose=False)
    watched = run("project/train.py", cwd=tmp_path)
    assert plain.stdout == "mine\n" and watched.returncode == 0, watched.stderr
    assert watched.stdout == "the real one\n"
    assert (f"{project / 'accelport.py'} beside the script shadows accelport, which accelport itself uses: "
            "the script's `import accelport` gets accelport's") in said(watched.stderr), watched.stderr
