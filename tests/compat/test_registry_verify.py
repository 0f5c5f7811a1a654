"""`python -m accelport.compat.verify`: its parser on recorded pip output, and its checks, with no network.

registry_samples/NAME.{cmd,stdout,stderr,rc} are real runs of the command in NAME.cmd
(pip 23.2 unless the name starts with pip26_, which is pip 26.3).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
from collections.abc import Sequence

import pytest

from accelport.compat import verify
from accelport.compat.load import load_folder, shipped
from accelport.compat.schema import Parsed, parse_tables

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SAMPLES = pathlib.Path(__file__).parent / "registry_samples"


def sample(name: str) -> tuple[int, str, str]:
    return (int((SAMPLES / f"{name}.rc").read_text().strip() or 0), (SAMPLES / f"{name}.stdout").read_text(),
            (SAMPLES / f"{name}.stderr").read_text())


def parsed(name: str) -> verify.IndexResult:
    rc, out, err = sample(name)
    return verify.parse_index_versions(out, err, rc)


@pytest.mark.parametrize("name,status,versions", [
    ("idx_torch-tpu_py3.12", verify.OK, ["0.2.0"]),
    ("idx_torch-tpu_py3.15", verify.NO_MATCH, []),  # torch-tpu 0.2.0 has no cp315 wheel
    ("idx_torch_py3.15", verify.OK, ["2.15.0"]),  # torch 2.15.0 is the first with cp315
    ("idx_torch_xla_py3.13", verify.OK, ["2.9.0", "2.8.1", "2.8.0"]),
    ("pip26_json_torch-tpu_py3.15", verify.NO_MATCH, []),
    ("idx_bad_python_version", verify.USAGE, []),
    ("idx_unreachable_index_vv", verify.NETWORK, []),  # -vv tells a dead index from "no wheel"
    ("idx_nonexistent_pkg_vv", verify.NOT_FOUND, []),
])
def test_parser_reads_each_kind_of_answer(name: str, status: str, versions: list[str]) -> None:
    res = parsed(name)
    assert res.status == status
    assert res.versions == versions
    assert res.usable == (status in (verify.OK, verify.NO_MATCH, verify.NOT_FOUND))


def test_parser_reads_pip_26_json_and_the_installed_version() -> None:
    res = parsed("pip26_json_torch_xla_py3.11")
    assert res.status == verify.OK and res.name == "torch_xla" and res.latest == "2.9.0"
    assert res.versions[-1] == "2.1.0" and "2.6.1" in res.versions
    res = parsed("idx_numpy_installed")
    assert res.installed == "2.4.6" and res.latest == "2.4.6" and "1.26.4" in res.versions
    assert parsed("idx_bad_python_version").message.startswith("Usage:")
    assert "3.x" in parsed("idx_bad_python_version").message


def test_the_pip_command_asks_for_binary_wheels_of_one_python_on_linux() -> None:
    args = verify.index_versions_args("torch-tpu", "3.15")
    assert args[-1] == "torch-tpu" and "-vv" in args
    assert args[args.index("--python-version") + 1] == "3.15" and "--only-binary=:all:" in args
    assert [args[i + 1] for i, a in enumerate(args) if a == "--platform"] == list(verify.DEFAULT_PLATFORMS)
    assert "--python-version" not in verify.index_versions_args("torch", None)


class RecordedRegistry:
    """Answers `pip index versions` from the recorded samples, and counts what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str | None]] = []

    def __call__(self, args: Sequence[str]) -> tuple[int, str, str]:
        package = args[-1]
        python = args[args.index("--python-version") + 1] if "--python-version" in args else None
        self.asked.append((package, python))
        name = f"idx_{package}_py{python}" if python else f"idx_{package}_default"
        if not (SAMPLES / f"{name}.stdout").exists():
            return 1, "", f"ERROR: No matching distribution found for {package}"
        return sample(name)


def tiny(text: str) -> Parsed:
    """A one-file data set that may cite the shipped sources."""
    return parse_tables(tomllib.loads(text), "tiny.toml", shipped().sources)


TPU_ROW = """
platform = "gcp-tpu"
as_of = 2026-12-01
[[torch]]
version = "2.15"
python = ["3.11", "3.15"]
sources = ["torch-pypi-files"]
[[rows]]
backend = "tpu"
torch = "2.15"
status = "recommended"
package = "torch-tpu"
package_version = ">=0.2.0"
python = ["3.11", "PYHI"]
message = "TorchTPU"
sources = ["torch-tpu-files"]
"""


def test_a_python_the_registry_has_no_wheel_for_is_a_disagreement() -> None:
    # The old data: torch-tpu claimed Python 3.15; torch 2.15 has a cp315 wheel, torch-tpu 0.2.0 none.
    runner = RecordedRegistry()
    report = verify.check(tiny(TPU_ROW.replace("PYHI", "3.15")), verify.Registry(runner), ["3.14", "3.15"])
    (d,) = report.disagreements
    assert d.kind == "claimed-missing" and "tiny.toml rows[0] tpu torch 2.15" in d.where
    assert "claims Python 3.15" in d.text and "no torch-tpu>=0.2.0 wheel" in d.text
    assert "no torch 2.15.* wheel" not in d.text  # torch itself has one
    assert len(runner.asked) == len(set(runner.asked))  # each (package, Python) asked once
    report = verify.check(tiny(TPU_ROW.replace("PYHI", "3.14")), verify.Registry(RecordedRegistry()),
                          ["3.14", "3.15"])
    assert report.disagreements == []


def test_a_python_left_out_that_has_wheels_is_a_disagreement() -> None:
    report = verify.check(tiny(TPU_ROW.replace("PYHI", "3.12")), verify.Registry(RecordedRegistry()), ["3.14"])
    (d,) = report.disagreements
    assert d.kind == "unclaimed-present" and "leaves out Python 3.14" in d.text and "torch-tpu 0.2.0" in d.text


def test_a_pinned_runtime_without_a_wheel_is_a_disagreement() -> None:
    # torch_xla[tpu]==2.9.0 on Python 3.13: torch_xla has a cp313 wheel, the libtpu==0.0.21 it pins does not.
    data = tiny("""
platform = "gcp-tpu"
as_of = 2026-12-01
[[rows]]
backend = "xla"
torch = "2.9"
status = "recommended"
package = "torch_xla[tpu]"
package_version = "=={torch}.*"
python = ["3.13", "3.13"]
message = "XLA"
sources = ["torch-xla-pypi-files"]
[[releases]]
package = "torch_xla"
version = "2.9.0"
torch = "2.9"
status = "recommended"
pins = { libtpu = "==0.0.21" }
message = "last"
sources = ["torch-xla-metadata"]
""")

    def runner(args: Sequence[str]) -> tuple[int, str, str]:
        if args[-1] == "torch":  # torch 2.9 has a cp313 wheel (not among the recorded samples)
            return 0, "torch (2.9.1)\nAvailable versions: 2.9.1, 2.9.0\n", ""
        return RecordedRegistry()(args)

    report = verify.check(data, verify.Registry(runner), ["3.13"], only="xla")
    (d,) = report.disagreements
    assert d.kind == "pin-missing"
    assert "torch_xla==2.9.0 pins libtpu==0.0.21, which has no wheel for Python 3.13" in d.text


def test_packages_on_aws_index_are_skipped_with_a_reason() -> None:
    runner = RecordedRegistry()
    report = verify.check(shipped(), verify.Registry(runner), ["3.12"], only="neuron")
    assert report.disagreements == []
    assert "pip.repos.neuron.amazonaws.com" in report.skipped["torch-neuronx"]
    assert not any(p == "torch-neuronx" for p, _ in runner.asked)  # PyPI's torch-neuronx is a placeholder


def test_an_unreachable_registry_is_reported_not_taken_as_facts() -> None:
    def dead(args: Sequence[str]) -> tuple[int, str, str]:
        return sample("idx_unreachable_index_vv")

    report = verify.check(tiny(TPU_ROW.replace("PYHI", "3.15")), verify.Registry(dead), ["3.15"])
    assert {d.kind for d in report.disagreements} == {"registry"}
    assert all(verify.NETWORK in d.text for d in report.disagreements)


RELEASE = """
as_of = 2026-12-01
[[releases]]
package = "torch_xla"
version = "VERSION"
torch = "MINOR"
status = "recommended"
message = "listed"
sources = ["torch-xla-metadata"]
"""


def test_a_release_the_data_does_not_list_is_reported() -> None:
    def unlisted(version: str) -> list[str]:
        data = tiny(RELEASE.replace("VERSION", version).replace("MINOR", version[:3]))
        report = verify.check(data, verify.Registry(RecordedRegistry()), [], only="releases")
        assert {d.kind for d in report.disagreements} <= {"unlisted-release"}
        return [d.text for d in report.disagreements]

    # torch_xla's history goes back to 2.1.0; only the minors from the first listed one on are judged.
    assert unlisted("2.9.0") == []
    assert unlisted("2.8.1") == ["the registry has torch_xla 2.9.0, which releases.toml does not list",
                                 "the registry has torch_xla 2.8.0, which releases.toml does not list"]


def test_the_tool_reads_a_folder_as_the_package_reads_its_data() -> None:
    folder = pathlib.Path(__file__).resolve().parents[2] / "compat_matrix"
    mine, ours = load_folder(folder), shipped()
    assert [r.key for r in mine.rows] == [r.key for r in ours.rows]
    assert [(r.package, r.version) for r in mine.releases] == [(r.package, r.version) for r in ours.releases]


def test_the_tool_runs_as_a_module_and_explains_itself() -> None:
    out = subprocess.run([sys.executable, "-m", "accelport.compat.verify", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "--python" in out.stdout and "--only" in out.stdout
