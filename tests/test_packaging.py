"""What a user installs: the wheel holds every file of the tree's packages, installs into a fresh environment,
and its commands run from outside the checkout; backends/ and compat_matrix/ ship inside accelport."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile

import pytest

from tests.conftest import default_signals

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: Where each source folder lands in the wheel.
SHIPPED = {"accelport": "accelport", "backends": "accelport/_backends", "compat_matrix": "accelport/compat_matrix"}


def _copy_of_checkout(dest: pathlib.Path) -> pathlib.Path:
    """The tracked and untracked-but-not-ignored files of the checkout, as a fresh clone has them."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True, timeout=60).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, pathlib.Path]:
    """(the wheel, the checkout it was built from): ``pip wheel`` of a copy of this checkout."""
    checkout = _copy_of_checkout(tmp_path_factory.mktemp("checkout"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(checkout)],
        check=True, capture_output=True, text=True, timeout=600,
    )
    (whl,) = out.glob("accelport-*.whl")
    return whl, checkout


@pytest.fixture(scope="module")
def wheel(built: tuple[pathlib.Path, pathlib.Path]) -> zipfile.ZipFile:
    return zipfile.ZipFile(built[0])


@pytest.fixture(scope="module")
def wheel_names(wheel: zipfile.ZipFile) -> list[str]:
    return wheel.namelist()


@pytest.fixture(scope="module")
def wheel_metadata(wheel: zipfile.ZipFile) -> str:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return wheel.read(name).decode()


def test_no_top_level_backends_module(wheel_names: list[str]) -> None:
    top = {n.split("/")[0] for n in wheel_names}
    assert "backends" not in top and "compat_matrix" not in top
    assert {t for t in top if not t.endswith(".dist-info")} == {"accelport"}


def test_builtin_backends_and_matrix_ship_inside_accelport(wheel_names: list[str]) -> None:
    for name in ("accelport/_backends/cpu.py", "accelport/_backends/cuda.py", "accelport/py.typed",
                 "accelport/compat_matrix/__init__.py"):
        assert name in wheel_names, name
    for src in (ROOT / "backends").glob("*.py"):
        assert f"accelport/_backends/{src.name}" in wheel_names
    for src in (ROOT / "compat_matrix").glob("*.toml"):
        assert f"accelport/compat_matrix/{src.name}" in wheel_names


def test_torch_is_an_extra_not_a_requirement(wheel_metadata: str) -> None:
    requires = [line.split(":", 1)[1].strip() for line in wheel_metadata.splitlines()
                if line.startswith("Requires-Dist:")]
    hard = [r for r in requires if "extra ==" not in r]
    assert not any(r.startswith("torch") for r in hard), hard
    assert any(r.startswith("torch") and 'extra == "torch"' in r for r in requires)


def test_every_file_of_the_trees_packages_is_in_the_wheel(wheel_names: list[str]) -> None:
    """A package left out of pyproject's list (accelport.observe was) fails here, named, not at a user's import."""
    missing = []
    for folder, shipped in SHIPPED.items():
        for src in (ROOT / folder).rglob("*"):
            if src.is_file() and "__pycache__" not in src.parts and src.suffix in (".py", ".toml", ".typed"):
                name = f"{shipped}/{src.relative_to(ROOT / folder).as_posix()}"
                if name not in wheel_names:
                    missing.append(name)
    assert not missing, f"not in the wheel (add the package to [tool.setuptools] packages): {missing}"


def test_building_leaves_nothing_in_the_checkout(built: tuple[pathlib.Path, pathlib.Path]) -> None:
    left = [p.name for p in built[1].iterdir() if p.name == "build" or p.name.endswith(".egg-info")]
    assert left == []


TINY = textwrap.dedent("""\
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    for _ in range(3):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    print("trained", round(float(loss), 3))
""")


@pytest.mark.slow
def test_the_wheel_installs_into_a_fresh_environment_and_runs_from_outside_the_checkout(
        built: tuple[pathlib.Path, pathlib.Path], tmp_path: pathlib.Path) -> None:
    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    work = tmp_path / "work"  # the user's own folder: no accelport/ beside the script
    work.mkdir()
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "ACCELPORT_", "PIP_REQUIRE"))}
    environ.pop("VIRTUAL_ENV", None)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        # The timeout guards against a hang; it measures nothing.
        return subprocess.run(list(args), cwd=work, capture_output=True, text=True, timeout=600, env=environ,
                              preexec_fn=default_signals)

    # Its requirements (pluggy, packaging) come from the package index, as a user's do.
    installed = run(str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(built[0]))
    assert installed.returncode == 0, installed.stderr
    # torch is the user's own (accelport never installs it): this environment's, put on the new one's path
    # after the new one's own packages, rather than a second 700 MB copy per test run.
    import torch

    site = env_dir / pathlib.Path(sysconfig.get_path("purelib", vars={"base": str(env_dir)})).relative_to(env_dir)
    (site / "zz_user_torch.pth").write_text(str(pathlib.Path(torch.__file__).parent.parent) + "\n")

    where = run(str(python), "-c", "import accelport, sys; print(accelport.__file__); print('torch' in sys.modules)")
    assert where.returncode == 0, where.stderr
    location, torch_loaded = where.stdout.split()
    assert pathlib.Path(location).is_relative_to(env_dir) and torch_loaded == "False", where.stdout

    accelport = str(env_dir / "bin" / "accelport")
    helped = run(accelport, "--help")
    assert helped.returncode == 0 and "doctor" in helped.stdout, helped.stderr
    doctor = run(accelport, "doctor", "--json")
    assert doctor.returncode in (0, 1), doctor.stderr
    report = json.loads(doctor.stdout)
    cpu = [b for b in report["backends"] if b["name"] == "cpu"]
    assert report["selected"]["name"] == "cpu" and cpu[0]["available"], report

    (work / "tiny.py").write_text(TINY)
    out = work / "run.json"
    diagnosed = run(accelport, "diagnose", "--output", str(out), "tiny.py")
    assert diagnosed.returncode == 0, diagnosed.stderr
    assert "trained" in diagnosed.stdout
    assert "3 optimizer step(s) on cpu" in diagnosed.stderr, diagnosed.stderr
    result = json.loads(out.read_text())
    assert (result["backend"], result["steps"], result["exit_status"]) == ("cpu", 3, 0), result
