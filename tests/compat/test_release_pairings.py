"""Doctor against the patch-release facts: installed versions read from (fake) package metadata.

The distributions are stand-ins (``*.dist-info`` with no code): torch_xla, libtpu, torch-neuronx and
neuronx-cc cannot all be installed here, and nothing here imports them anyway.
"""

from __future__ import annotations

import pathlib

import pytest

from accelport.compat.load import build
from accelport.compat.releases import installed_findings
from accelport.doctor.gather import gather
from tests import fakes


@pytest.fixture
def site(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path / "site"


def test_a_libtpu_that_is_not_the_one_torch_xla_pins_is_a_finding_that_says_what_to_install(
        monkeypatch: pytest.MonkeyPatch, site: pathlib.Path) -> None:
    fakes.install_dist(monkeypatch, site, "torch_xla", "2.8.1", requires=['libtpu==0.0.17; extra == "tpu"'])
    fakes.install_dist(monkeypatch, site, "libtpu", "0.0.21")
    (f,) = installed_findings(build(None, {}))
    assert f.severity == "warning"
    assert f.title == "libtpu 0.0.21 does not match torch_xla 2.8.1, which pairs with libtpu==0.0.17"
    assert f.fix == "pip install libtpu==0.0.17"
    # The same through doctor, as a core finding.
    report = gather({})
    (seen,) = [x for x in report["findings"] if x["title"].startswith("libtpu 0.0.21 does not match")]
    assert seen["severity"] == "warning" and seen["fix"] == "pip install libtpu==0.0.17" and seen["check"] == "core"


def test_the_pinned_libtpu_and_a_cpu_only_torch_xla_are_quiet(monkeypatch: pytest.MonkeyPatch,
                                                               site: pathlib.Path) -> None:
    fakes.install_dist(monkeypatch, site, "torch_xla", "2.9.0")
    assert installed_findings(build(None, {})) == []  # XLA:CPU: no libtpu, nothing to pair
    fakes.install_dist(monkeypatch, site, "libtpu", "0.0.21")
    assert installed_findings(build(None, {})) == []


def test_a_known_bad_patch_release_names_the_issue_and_the_fixed_one(monkeypatch: pytest.MonkeyPatch,
                                                                    site: pathlib.Path) -> None:
    fakes.install_dist(monkeypatch, site, "torch_xla", "2.8.0")
    (f,) = installed_findings(build(None, {}))
    assert f.severity == "warning" and "torch_xla 2.8.0 has a known problem" in f.title
    assert "https://github.com/pytorch/xla/issues/9605" in f.title and f.fix == "pip install torch_xla==2.8.1"


def test_a_superseded_patch_is_a_note_with_the_libtpu_page_pip_needs(monkeypatch: pytest.MonkeyPatch,
                                                                     site: pathlib.Path) -> None:
    fakes.install_dist(monkeypatch, site, "torch_xla", "2.5.0")
    (f,) = installed_findings(build(None, {}))
    assert f.severity == "note" and "not the recommended torch 2.5 release (2.5.1)" in f.title
    assert f.fix == "pip install torch_xla==2.5.1 -f https://storage.googleapis.com/libtpu-releases/index.html"


def test_torch_neuronx_and_neuronx_cc_from_different_neuron_releases(monkeypatch: pytest.MonkeyPatch,
                                                                     site: pathlib.Path) -> None:
    fakes.install_dist(monkeypatch, site, "torch-neuronx", "2.9.0.2.13.24727")  # Neuron 2.29.0
    fakes.install_dist(monkeypatch, site, "neuronx-cc", "2.26.6360.0")  # Neuron 2.31
    findings = installed_findings(build(None, {}))
    by_severity = {f.severity: f for f in findings}
    assert set(by_severity) == {"note", "warning"}
    pair = by_severity["warning"]
    assert pair.title == ("neuronx-cc 2.26.6360.0 does not match torch-neuronx 2.9.0.2.13.24727 (Neuron 2.29.0), "
                          "which pairs with neuronx-cc==2.24.5133.0")
    assert pair.fix == "pip install neuronx-cc==2.24.5133.0 --extra-index-url https://pip.repos.neuron.amazonaws.com"
    assert "2.9.0.2.15.32035" in by_severity["note"].fix  # the last torch-neuronx 2.9 (Neuron 2.31)


def test_a_version_the_data_does_not_list_is_left_alone(monkeypatch: pytest.MonkeyPatch, site: pathlib.Path) -> None:
    fakes.install_dist(monkeypatch, site, "torch_xla", "2.9.0+git1234")  # a source build of 2.9.0: still 2.9.0
    fakes.install_dist(monkeypatch, site, "libtpu", "0.0.30")
    (f,) = installed_findings(build(None, {}))
    assert "does not match torch_xla 2.9.0+git1234" in f.title
    fakes.install_dist(monkeypatch, site / "b", "torch_xla", "2.10.0")  # no such release in the data
    assert installed_findings(build(None, {})) == []


def test_torchneuron_from_neuron_2_33_is_a_note_naming_neuron_2_34s(monkeypatch: pytest.MonkeyPatch,
                                                                    site: pathlib.Path) -> None:
    fakes.install_dist(monkeypatch, site, "torch-neuronx", "2.14.3.0.4521")  # Neuron 2.33.0
    (f,) = installed_findings(build(None, {}))
    assert f.severity == "note" and "not the recommended torch 2.14 release (2.14.3.1.*)" in f.title
    assert f.fix == "pip install 'torch-neuronx==2.14.3.1.*' --extra-index-url https://pip.repos.neuron.amazonaws.com"
    fakes.install_dist(monkeypatch, site.parent / "newer", "torch-neuronx", "2.14.3.1.777")  # Neuron 2.34.0: quiet
    assert installed_findings(build(None, {})) == []
