"""The repro ``--find-nan`` writes is plain, safe Python in a file of its own.

Whatever the run named (a module class or a script path with a newline, a token in the path)
stays inside the repro's comments, redacted; and the repro never writes over, or through, a
file that is at its name already (a user's script, a planted symlink): it takes the next name.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from accelport.observe.nan_search import REPRO_NAMES, NanSearch
from accelport.redact import REDACTED

TOKEN = "ghp_" + "a1B2c3D4e5" * 4
PAYLOAD = "\nimport os; os.system('touch {marker}')\n"


def breaking_model(class_name: str, filename: str) -> torch.nn.Module:
    """A model whose forward pass (compiled as the file ``filename``) takes the log of zeros: the op that makes an
    Inf, in a module of class ``class_name``."""
    namespace: dict[str, object] = {"torch": torch}
    code = compile("def forward(self, x):\n    return torch.log(self.fc(x) * 0.0)\n", filename, "exec")
    exec(code, namespace)

    def init(self: torch.nn.Module) -> None:
        torch.nn.Module.__init__(self)
        self.fc = torch.nn.Linear(4, 2)

    cls = type(class_name, (torch.nn.Module,), {"__init__": init, "forward": namespace["forward"]})
    return cls()


def find(model: torch.nn.Module, directory: pathlib.Path) -> tuple[str, str]:
    """Run a step of ``model`` under a search; the repro it wrote (script, tensors)."""
    search = NanSearch(1, str(directory))
    search.attach()
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    finally:
        search.finish()
    found = search.found
    assert found is not None and found.op == "aten.log.default", (found, search.notes())
    assert found.repro is not None, found.repro_problem
    return found.repro


def plain_python(script: str, cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")}
    # The timeout guards against a hang; it measures nothing.
    return subprocess.run([sys.executable, script], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def test_a_class_name_and_a_script_path_with_code_and_a_token_in_them_stay_in_redacted_comments(
        tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "injected"
    payload = PAYLOAD.format(marker=marker)
    filename = f"/work/{TOKEN}/https:/me:hunter2secret@example.com/train{payload}.py"
    model = breaking_model(f"Net{payload}#", filename)
    script, _ = find(model, tmp_path / "repro")
    source = pathlib.Path(script).read_text()
    tree = ast.parse(source)  # valid Python
    # The code is the repro's own: nothing of the names became a statement or a call.
    assert [type(node).__name__ for node in tree.body] == ["Import", "Import", "Assign", "Expr", "Assign", "For"]
    assert not any(isinstance(node, ast.Attribute) and node.attr == "system" for node in ast.walk(tree))
    assert all(line.startswith("# ") for line in source.splitlines()[:3]), source
    assert "os.system" in source.splitlines()[1] and "\\n" in source.splitlines()[1]  # said, escaped, in a comment
    assert TOKEN not in source and "hunter2secret" not in source and REDACTED in source
    done = plain_python(script, tmp_path)
    assert done.returncode == 0 and "NOT FINITE" in done.stdout, done.stderr
    assert not marker.exists()


@pytest.mark.parametrize("planted", ["symlink", "dangling symlink", "users script"])
def test_a_file_or_symlink_at_the_repros_name_is_left_as_it_was_and_the_next_name_is_taken(
        tmp_path: pathlib.Path, planted: str) -> None:
    directory = tmp_path / "repro"
    directory.mkdir()
    victim = tmp_path / "victim.py"
    taken = [directory / "accelport-nan-step1.py", directory / "accelport-nan-step1-2.pt"]
    if planted == "users script":
        for path in taken:
            path.write_text("print('my own work')\n")
    else:
        victim.write_text("print('my own work')\n")
        for path in taken:
            path.symlink_to(victim if planted == "symlink" else tmp_path / "nowhere")
    script, data = find(breaking_model("Net", "train.py"), directory)
    # Neither name that was taken is written (nor the file a link points at); the first free pair is.
    assert (script, data) == (str(directory / "accelport-nan-step1-3.py"), str(directory / "accelport-nan-step1-3.pt"))
    for path in taken:
        assert path.is_symlink() == (planted != "users script")
        if planted != "dangling symlink":
            assert path.read_text() == "print('my own work')\n"
    assert not (tmp_path / "nowhere").exists()
    if planted != "users script":
        assert victim.read_text() == "print('my own work')\n"
    # Nothing half-made is left: the repro's pair, and what was there.
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [p.name for p in taken] + ["accelport-nan-step1-3.py", "accelport-nan-step1-3.pt"])
    assert not pathlib.Path(script).is_symlink() and "torch.ops.aten.log.default" in pathlib.Path(script).read_text()


def test_a_directory_whose_every_repro_name_is_taken_gets_no_repro_and_is_told_what_to_do(
        tmp_path: pathlib.Path) -> None:
    directory = tmp_path / "repro"
    directory.mkdir()
    for n in range(1, REPRO_NAMES + 1):
        (directory / f"accelport-nan-step1{'' if n == 1 else f'-{n}'}.py").write_text("mine\n")
    search = NanSearch(1, str(directory), option="--find-nan-dir")
    search.attach()
    try:
        model = breaking_model("Net", "train.py")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    finally:
        search.finish()
    found = search.found
    assert found is not None and found.repro is None
    assert found.repro_problem == (f"no repro: {directory} already holds accelport-nan-step1.py to "
                                   f"accelport-nan-step1-{REPRO_NAMES}.py (a repro is never written over a file); "
                                   "remove those or give --find-nan-dir another directory")
    assert all(p.read_text() == "mine\n" for p in directory.iterdir())
    assert not list(directory.glob("*.pt")) and not list(directory.glob(".*"))
