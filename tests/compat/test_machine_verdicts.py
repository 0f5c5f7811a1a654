"""Verdicts for the exact machine: the chip, the Python version, patch releases and runtime pairings."""

from __future__ import annotations

import pathlib
import warnings

import pytest

import accelport as ap
from accelport.compat import verdict as verdict_mod
from accelport.compat.machine import CHIPS, chip_name, parse_chip, parse_python
from accelport.compat.verdict import recommend
from accelport.errors import CompatMatrixError, InvalidPythonVersionError, UnknownChipError
from tests import fakes


def verdict(platform: str | None, torch: str, **kw: object) -> ap.compat.Verdict:  # type: ignore[name-defined]
    kw.setdefault("python", "3.12")  # a stated Python, not whatever runs the tests
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.CompatibilityWarning)
        return recommend(platform, torch, **kw)  # type: ignore[arg-type]


# -- chips -----------------------------------------------------------------------------------


def test_the_data_knows_the_chips_of_both_clouds() -> None:
    assert list(CHIPS) == ["v2/v3", "v4", "v5e", "v5p", "v6e", "7x", "trn1", "trn2", "trn3", "inf2"]
    # What platform detection reports maps onto them (accelport.platform: TPU_DEVICE_IDS, NEURON_FAMILIES).
    from accelport.platform import NEURON_FAMILIES, TPU_DEVICE_IDS

    assert {chip_name(g) for g in TPU_DEVICE_IDS.values()} == {"v2/v3", "v4", "v5e", "v5p", "v6e", "7x"}
    assert chip_name(NEURON_FAMILIES["trn1n"]) == "trn1" and chip_name(NEURON_FAMILIES["trn2u"]) == "trn2"
    assert chip_name(NEURON_FAMILIES["inf2"]) == "inf2" and chip_name(NEURON_FAMILIES["trn3"]) == "trn3"
    assert chip_name("Inferentia") is None  # inf1: no torch-neuronx at all


@pytest.mark.parametrize("torch", ["2.9", "2.14"])
def test_trn1_has_no_torchneuron_and_keeps_the_xla_path_for_torch_2_9(torch: str) -> None:
    v = verdict(None, torch, chip="trn1")
    assert v.platform == "aws-neuron" and v.chip == "trn1"  # the chip implies its platform
    assert v.recommended is None and v.status("neuron") == "unsupported"
    if torch == "2.9":
        assert v.ranked == ("neuron-xla",) and v.status("neuron-xla") == "deprecated"
        assert "Neuron 2.30" in v.backends["neuron-xla"].message
    else:
        message = v.backends["neuron"].message
        assert "does not run on trn1 (only on trn2, trn3)" in message
        assert "torch-neuronx 2.9 on PyTorch/XLA" in message and "inference only since Neuron 2.30" in message
        assert [(a.torch, a.backend, a.status) for a in v.alternatives] == [("2.9", "neuron-xla", "deprecated")]
        assert "nearest working: torch 2.9 with neuron-xla" in v.reason


@pytest.mark.parametrize("torch", ["2.9", "2.14"])
def test_trn2_gets_torchneuron_from_torch_2_13(torch: str) -> None:
    v = verdict("aws-neuron", torch, chip="trn2")
    if torch == "2.9":
        assert v.recommended is None and v.ranked == ("neuron-xla",)
        assert ("2.13", "neuron") in {(a.torch, a.backend) for a in v.alternatives}
    else:
        assert v.recommended == "neuron" and v.status("neuron-xla") == "unsupported"
        assert v.reason.startswith("neuron is recommended for aws-neuron (trn2) with torch 2.14 on Python 3.12")


def test_inferentia2_runs_only_the_xla_path() -> None:
    assert verdict(None, "2.14", chip="inf2").status("neuron") == "unsupported"
    assert verdict(None, "2.9", chip="inf2").ranked == ("neuron-xla",)


@pytest.mark.parametrize("chip", ["v4", "v6e", "v5p", "7x"])
def test_torchtpu_runs_on_v4_to_7x_with_torch_2_13(chip: str) -> None:
    v = verdict(None, "2.13", chip=chip)
    assert v.platform == "gcp-tpu" and v.recommended == "tpu" and v.ranked == ("tpu", "xla")


def test_tpu_v2_v3_has_no_torchtpu_and_is_sent_back_to_torch_xla_2_9() -> None:
    v = verdict("gcp-tpu", "2.13", chip="v3")  # an alias
    assert v.chip == "v2/v3" and v.status("tpu") == "unsupported" and v.recommended is None
    assert "does not run on v2/v3" in v.backends["tpu"].message
    assert v.alternatives[0].torch == "2.9" and v.alternatives[0].backend == "xla"


@pytest.mark.parametrize("chip,torch,status", [
    ("7x", "2.8", "unsupported"), ("7x", "2.9", "recommended"),  # torch_xla 2.9 added 7x's PCI id
    ("v6e", "2.4", "unsupported"), ("v6e", "2.5", "recommended"),
    ("v5p", "2.1", "unsupported"), ("v5p", "2.2", "recommended"), ("v5e", "2.1", "recommended"),
])
def test_torch_xla_runs_on_the_chips_its_release_recognises(chip: str, torch: str, status: str) -> None:
    v = verdict(None, torch, chip=chip, python="3.10")
    assert v.status("xla") == status
    if status == "unsupported":
        assert "does not recognise the chip's PCI id" in v.backends["xla"].message


def test_a_chip_of_another_platform_or_an_unknown_one_is_refused() -> None:
    with pytest.raises(UnknownChipError, match=r"unknown chip 'trn1' for gcp-tpu.*Valid chips for gcp-tpu: v2/v3"):
        recommend("gcp-tpu", "2.13", chip="trn1")
    with pytest.raises(UnknownChipError, match=r"'trn9'.*Did you mean 'trn3'\?.*Valid chips: v2/v3, v4, .*inf2"):
        parse_chip("trn9")
    with pytest.raises(ValueError, match="Valid chips"):
        ap.recommend("aws-neuron", "2.14", chip="trn9")


def test_a_detected_chip_the_data_does_not_name_changes_nothing_but_listed_chips() -> None:
    gpu = verdict("nvidia-gpu", "2.13", chip="NVIDIA H100 80GB HBM3")
    assert gpu.recommended == "cuda" and gpu.chip == "NVIDIA H100 80GB HBM3"
    inf1 = verdict("aws-neuron", "2.14", chip="Inferentia")
    assert inf1.status("neuron") == "unsupported"


# -- Python ----------------------------------------------------------------------------------


def test_python_3_15_with_torch_2_15_on_a_tpu_vm_has_no_torch_tpu() -> None:
    v = verdict("gcp-tpu", "2.15", python="3.15")
    assert v.python == "3.15" and v.python_given
    assert v.status("tpu") == "unsupported" and v.recommended is None
    message = v.backends["tpu"].message
    assert "torch-tpu for torch 2.15 has no wheel for Python 3.15 (only 3.11 to 3.14)" in message
    assert "use Python 3.14, where tpu is recommended" in message
    assert "on Python 3.15" in v.reason and "use Python 3.14" in v.reason
    assert verdict("gcp-tpu", "2.15", python="3.14").recommended == "tpu"


def test_torch_xla_tpu_2_9_stops_at_python_3_12_for_its_libtpu() -> None:
    v = verdict("gcp-tpu", "2.9", python="3.13")
    assert v.status("xla") == "unsupported" and "use Python 3.12" in v.backends["xla"].message
    assert verdict("cpu", "2.9", python="3.13").status("xla") == "supported"  # XLA:CPU needs no libtpu


def test_a_torch_without_wheels_for_the_python_makes_every_backend_unsupported() -> None:
    v = verdict("cpu", "2.13", python="3.15")
    assert v.status("cpu") == "unsupported"
    assert "torch 2.13 has no wheels for Python 3.15 (only 3.10 to 3.14)" in v.backends["cpu"].message
    assert [(a.torch, a.backend) for a in v.alternatives] == [("2.15", "cpu")]


def test_the_default_python_is_this_one_and_an_installed_package_proves_its_wheel(
        monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    import sys

    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    v = verdict("gcp-tpu", "2.13", python=None)
    assert v.python == here and not v.python_given
    # As if on Python 3.15: torch-tpu has no wheel there, unless it is installed (then it evidently has one).
    monkeypatch.setattr(verdict_mod, "this_python", lambda: "3.15")
    assert verdict("gcp-tpu", "2.15", python=None).status("tpu") == "unsupported"
    fakes.install_dist(monkeypatch, tmp_path / "site", "torch-tpu", "0.2.0")
    assert verdict("gcp-tpu", "2.15", python=None).status("tpu") == "recommended"
    assert verdict("gcp-tpu", "2.15", python="3.15").status("tpu") == "unsupported"  # a stated Python is a question


@pytest.mark.parametrize("bad", ["3", "abc", "3.12.1", "2.7", "3.99", ""])
def test_a_bad_python_names_the_valid_ones(bad: str) -> None:
    with pytest.raises(InvalidPythonVersionError, match=r"expected major.minor, one of 3\.8, 3\.9, .*3\.15"):
        recommend("cpu", "2.13", python=bad)
    with pytest.raises(ValueError, match="3.15"):
        ap.recommend("cpu", "2.13", python=bad)
    assert parse_python("3.09", ["3.9"]) == "3.9"


def test_the_selection_reason_names_the_chip_and_the_python() -> None:
    from accelport.runtime.selection import accelport_select_backend

    class StandIn:  # a backend whose hardware is not here (Trainium2), available
        name, platform = "neuron", "aws-neuron"

        def probe(self) -> ap.Probe:
            return ap.Probe(True, "neuron stand-in is available", 1)

    chosen = accelport_select_backend(candidates=[StandIn()], platform="aws-neuron",
                                      recommendation=verdict(None, "2.14", chip="Trainium2"))
    assert chosen is not None
    assert chosen[1].startswith("neuron is the recommended backend for aws-neuron (trn2) with torch 2.14 on "
                                "Python 3.12")


# -- patch releases ----------------------------------------------------------------------------


def test_the_recommended_patch_release_and_the_known_bad_one() -> None:
    st = verdict("gcp-tpu", "2.8").backends["xla"]
    assert st.requires == "torch_xla[tpu]==2.8.*" and st.install == "torch_xla[tpu]==2.8.1"
    assert st.release is not None and st.release.version == "2.8.1"
    assert dict(st.release.pins) == {"libtpu": "==0.0.17"}
    (bad,) = st.known_bad
    assert bad.version == "2.8.0" and bad.issue == "https://github.com/pytorch/xla/issues/9605"
    assert "10-15% slower" in bad.message
    assert verdict("gcp-tpu", "2.5").backends["xla"].install == "torch_xla[tpu]==2.5.1"
    assert verdict("gcp-tpu", "2.6").backends["xla"].pip_options == (
        "-f", "https://storage.googleapis.com/libtpu-releases/index.html")


def test_torch_neuronx_2_9_names_its_last_release_and_neuron_sdk() -> None:
    st = verdict("aws-neuron", "2.9").backends["neuron-xla"]
    assert st.release is not None and st.release.version == "2.9.0.2.15.32035"
    assert st.release.neuron_sdk == ("2.31.0", "2.31.1") and dict(st.release.pins) == {"neuronx-cc": "==2.26.6360.0"}
    assert st.pip_options == ("--extra-index-url", "https://pip.repos.neuron.amazonaws.com")
    d = st.to_dict()
    assert d["install"] == "torch-neuronx==2.9.0.2.15.32035" and d["release"]["neuron_sdk"] == ["2.31.0", "2.31.1"]


def test_the_matrix_finds_the_release_an_installed_version_is() -> None:
    mx = verdict_mod.default_matrix({})
    assert mx.release("torch_xla", "2.8.0+cpu").status == "bad"  # type: ignore[union-attr]
    assert mx.release("torch-neuronx", "2.14.3.0.4521").version == "2.14.3.0.*"  # type: ignore[union-attr]
    assert mx.release("torch_xla", "2.10.0") is None


@pytest.mark.parametrize("entry,key,words", [
    ('status = "bad"', "releases[0].issue", "must link the issue"),
    ('status = "great"', "releases[0].status", "recommended, superseded, bad"),
    ('version = "2.8"\nstatus = "recommended"\npins = { libtpu = "=!0.0.17" }', "releases[0].pins.libtpu",
     "not a valid pip requirement"),
])
def test_release_entries_are_validated(tmp_path: pathlib.Path, entry: str, key: str, words: str) -> None:
    from accelport.compat.load import load_file

    body = entry if entry.startswith("version") else f'version = "2.8.0"\n{entry}'
    f = tmp_path / "r.toml"
    f.write_text(f'as_of = 2026-12-01\n[[releases]]\npackage = "torch_xla"\ntorch = "2.8"\n{body}\n'
                 'message = "m"\nsources = ["torch-xla-metadata"]\n')
    with pytest.raises(CompatMatrixError, match=key.replace("[", r"\[").replace("]", r"\]")) as info:
        load_file(f)
    assert words in str(info.value)


def test_a_row_may_only_list_chips_its_platform_has(tmp_path: pathlib.Path) -> None:
    from accelport.compat.load import load_file

    f = tmp_path / "r.toml"
    f.write_text('as_of = 2026-12-01\n[[rows]]\nplatform = "gcp-tpu"\nbackend = "acme"\ntorch = "2.13"\n'
                 'status = "supported"\nchips = ["v6", "trn2"]\nmessage = "m"\nsources = ["torch-tpu-files"]\n')
    with pytest.raises(CompatMatrixError, match=r"rows\[0\]\.chips\[1\].*unknown gcp-tpu chip 'trn2'"):
        load_file(f)
