"""The wheel ships backends/ and compat_matrix/ inside accelport, never as top-level modules."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    (whl,) = out.glob("accelport-*.whl")
    return zipfile.ZipFile(whl)


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
