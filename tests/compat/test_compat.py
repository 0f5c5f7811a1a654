"""The compatibility verdict: pinned verdicts from the vendors' facts, version parsing, range lookup."""

from __future__ import annotations

import datetime as dt
import functools
import itertools
import json
import subprocess
import sys
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import accelport as ap
from accelport.compat import load
from accelport.compat.load import Matrix
from accelport.compat.schema import STATUSES, Row, Source, parse_torch_version
from accelport.compat.verdict import recommend
from accelport.errors import InvalidVersionError, UnknownPlatformError

FAST = settings(max_examples=150, deadline=None)


def verdict(platform: str, torch: str, **kw: object) -> ap.compat.Verdict:  # type: ignore[name-defined]
    """The verdict on a stated Python (3.11 unless given), not on whatever runs the tests."""
    kw.setdefault("python", "3.11")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.CompatibilityWarning)
        return recommend(platform, torch, **kw)  # type: ignore[arg-type]


# -- pinned verdicts: what the platform facts imply ------------------------------------------


@pytest.mark.parametrize("torch", ["2.5", "2.5.1", "2.9", "2.9.0+cu128"])
def test_tpu_with_torch_up_to_2_9_uses_torch_xla(torch: str) -> None:
    v = verdict("gcp-tpu", torch)
    assert v.recommended == "xla"
    assert v.status("tpu") == "unsupported"  # torch-tpu needs torch >= 2.11
    minor = torch[:3]
    assert v.backends["xla"].requires == f"torch_xla[tpu]=={minor}.*"


def test_tpu_torch_2_9_says_it_is_the_last_torch_xla() -> None:
    v = verdict("gcp-tpu", "2.9")
    assert "last" in v.backends["xla"].message and "torch-tpu" in v.backends["xla"].message


def test_tpu_with_torch_2_10_has_no_path_and_points_both_ways() -> None:
    v = verdict("gcp-tpu", "2.10.0a0+git1234")
    assert v.recommended is None and v.ranked == ()
    assert v.status("xla") == "unsupported" and v.status("tpu") == "unsupported"
    alts = {(a.torch, a.backend) for a in v.alternatives}
    assert ("2.9", "xla") in alts and ("2.11", "tpu") in alts
    assert "no backend is recommended" in v.reason and "torch 2.11 with tpu" in v.reason


def test_tpu_with_torch_2_13_recommends_torchtpu_and_deprecates_xla() -> None:
    v = verdict("gcp-tpu", "2.13")
    assert v.recommended == "tpu"
    assert v.ranked == ("tpu", "xla")
    assert v.status("xla") == "deprecated"
    assert v.backends["xla"].replacement == "tpu"
    assert v.backends["tpu"].requires == "torch-tpu>=0.2.0"
    assert v.backends["tpu"].python == ("3.11", "3.14")  # torch-tpu 0.2.0 has no 3.15 wheel


def test_neuron_with_torch_2_8_is_end_of_life() -> None:
    v = verdict("aws-neuron", "2.8", python="3.12")
    assert v.recommended is None and v.ranked == ()
    assert v.status("neuron-xla") == "unsupported" and "end of life" in v.backends["neuron-xla"].message
    assert [(a.torch, a.backend, a.status) for a in v.alternatives] == [
        ("2.13", "neuron", "recommended"), ("2.9", "neuron-xla", "deprecated")]


def test_neuron_with_torch_2_9_is_the_deprecated_xla_path() -> None:
    v = verdict("aws-neuron", "2.9.0")
    assert v.recommended is None
    assert v.ranked == ("neuron-xla",)  # still selectable, with a deprecation warning
    st_ = v.backends["neuron-xla"]
    assert st_.status == "deprecated" and st_.replacement == "neuron"
    assert st_.requires == "torch-neuronx==2.9.0.2.*"
    assert "Neuron 2.30" in st_.message


def test_neuron_with_torch_2_11_has_only_a_private_beta() -> None:
    v = verdict("aws-neuron", "2.11", python="3.12")
    assert v.recommended is None and v.ranked == ()
    assert "private beta" in v.backends["neuron"].message
    assert v.alternatives[0].backend == "neuron" and v.alternatives[0].torch == "2.13"


def test_neuron_with_torch_2_14_recommends_torchneuron_on_trn2_and_trn3() -> None:
    v = verdict("aws-neuron", "2.14", python="3.12")
    assert v.recommended == "neuron"
    st_ = v.backends["neuron"]
    assert st_.requires == "torch-neuronx==2.14.3.*"
    assert st_.chips == ("trn2", "trn3")
    assert v.status("neuron-xla") == "unsupported"


@pytest.mark.parametrize("torch", ["2.13", "2.14"])
def test_torchneuron_rows_follow_neuron_2_34(torch: str) -> None:
    # Neuron 2.34.0 ships torch-neuronx 2.13.3.1 and 2.14.3.1; 2.13.3.0 / 2.14.3.0 (Neuron 2.33) stay usable.
    from packaging.specifiers import SpecifierSet

    st_ = verdict("aws-neuron", torch, python="3.12").backends["neuron"]
    assert "Neuron 2.34" in st_.message and "Neuron 2.33" not in st_.message
    wanted = SpecifierSet(st_.requires.removeprefix("torch-neuronx"))  # type: ignore[union-attr]
    assert f"{torch}.3.1.4242" in wanted and f"{torch}.3.1" in wanted and f"{torch}.3.0.4521" in wanted
    assert "2.9.0.2.15.32035" not in wanted
    assert st_.install == f"torch-neuronx=={torch}.3.1.*"  # the patch to install: Neuron 2.34's
    assert st_.release is not None and st_.release.neuron_sdk == ("2.34.0",)
    assert not st_.release.confirmed and "index" in (st_.release.note or "")  # the mirror is unconfirmed
    assert any("2.34.0" in s.url for s in st_.release.sources)


def test_torch_2_15_on_neuron_names_neuron_2_34() -> None:
    st_ = verdict("aws-neuron", "2.15", python="3.12").backends["neuron"]
    assert st_.status == "unsupported" and "Neuron 2.34 ships 2.13 and 2.14" in st_.message


def test_neuron_xla_says_pytorch_xla_inference_ended_on_trn2_and_trn3() -> None:
    st_ = verdict("aws-neuron", "2.9").backends["neuron-xla"]
    assert "nor for inference on Trn2/Trn3 since Neuron 2.34" in st_.message
    assert any(s.url.endswith("announce-no-support-torch-xla-inference-trn.html") for s in st_.sources)
    assert st_.release is not None and "not on Trn2/Trn3 since Neuron 2.34" in st_.release.message


def test_torchneuron_on_a_trn1_is_unsupported_for_the_chip() -> None:
    v = verdict("aws-neuron", "2.14", chip="Trainium", python="3.12")  # as detection reports a trn1
    assert v.recommended is None and v.chip == "trn1"
    assert v.status("neuron") == "unsupported"
    assert "does not run on trn1" in v.backends["neuron"].message
    assert verdict("aws-neuron", "2.14", chip="trainium2", python="3.12").recommended == "neuron"


def test_neuron_with_torch_2_16_uses_the_2_15_row_and_warns_unverified() -> None:
    with pytest.warns(ap.CompatibilityWarning, match=r"torch 2\.16 is newer than every row .*aws-neuron"):
        v = recommend("aws-neuron", "2.16", python="3.12")
    assert v.unverified and v.row_torch == "2.15"
    assert v.recommended is None and v.status("neuron") == "unsupported"
    assert v.alternatives[0].torch == "2.14" and v.alternatives[0].backend == "neuron"
    assert "unverified" in v.reason


def test_newer_torch_with_a_recommendation_still_gets_it_unverified() -> None:
    with pytest.warns(ap.CompatibilityWarning):
        v = recommend("gcp-tpu", "2.17.0.dev20270101")
    assert v.recommended == "tpu" and v.unverified and v.row_torch == "2.15"


def test_gpu_torch_2_8_xla_cuda_is_deprecated() -> None:
    v = verdict("nvidia-gpu", "2.8.0+cu128")
    assert v.recommended == "cuda"
    assert v.status("xla") == "deprecated" and v.backends["xla"].replacement == "cuda"
    assert v.ranked == ("cuda", "xla")


def test_gpu_torch_2_9_xla_cuda_is_removed() -> None:
    v = verdict("nvidia-gpu", "2.9.0+cu128")
    assert v.recommended == "cuda"
    assert v.status("xla") == "unsupported" and "removed" in v.backends["xla"].message
    assert v.ranked == ("cuda",)


@pytest.mark.parametrize("torch", ["2.1", "2.9", "2.13.0+cpu", "2.15.0.dev20261001"])
def test_cpu_always_recommends_cpu(torch: str) -> None:
    assert verdict("cpu", torch).recommended == "cpu"


def test_cpu_xla_cpu_exists_only_up_to_torch_2_9() -> None:
    assert verdict("cpu", "2.9").status("xla") == "supported"
    assert verdict("cpu", "2.10").status("xla") == "unsupported"


def test_torch_older_than_the_matrix_gets_no_verdict_but_a_way_forward() -> None:
    v = verdict("cpu", "2.0.1")
    assert v.recommended is None and v.backends == {}
    assert "older than the matrix" in v.reason and v.alternatives[0].torch == "2.1"


def test_every_status_carries_message_sources_and_date() -> None:
    v = verdict("gcp-tpu", "2.13")
    for st_ in v.backends.values():
        assert st_.message and st_.sources and isinstance(st_.as_of, dt.date)
        assert all(s.url.startswith("https://") for s in st_.sources)
    assert v.sources and v.as_of == dt.date(2026, 12, 5)  # the newest check in the data (Neuron 2.34)
    json.dumps(v.to_dict())  # serialisable as it stands


# -- defaults and input errors --------------------------------------------------------------


def test_defaults_are_the_detected_platform_and_installed_torch() -> None:
    v = ap.recommend()
    from accelport import _packages
    from accelport.platform import detect

    assert v.platform == detect().name
    assert v.torch_version == _packages.version("torch")
    assert v == recommend(detect().name, _packages.version("torch"), chip=detect().chip)


def _stand_in_version(value: str | None):  # type: ignore[no-untyped-def]
    """A stand-in for _packages.version answering ``value`` for every distribution (keeps cache_clear)."""
    return functools.lru_cache(maxsize=None)(lambda name: value)


def test_missing_torch_gives_a_verdict_saying_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelport import _packages

    monkeypatch.setattr(_packages, "version", _stand_in_version(None))
    v = recommend("cpu")
    assert v.torch_version is None and v.ranked == () and "torch is not installed" in v.reason


def test_unparseable_installed_torch_does_not_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelport import _packages

    monkeypatch.setattr(_packages, "version", _stand_in_version("custom-build"))
    assert "not a PEP 440 version" in recommend("cpu").reason


def test_unknown_platform_names_the_valid_ones() -> None:
    with pytest.raises(UnknownPlatformError, match=r"unknown platform 'mars'.*Valid platforms: .*gcp-tpu"):
        recommend("mars", "2.9")
    with pytest.raises(UnknownPlatformError, match="Did you mean 'gcp-tpu'"):
        recommend("gcp_tpu", "2.9")


def test_banana_is_not_a_torch_version() -> None:
    with pytest.raises(InvalidVersionError, match=r"'banana'.*2\.9\.0\+cu128.*covers torch 2\.1 to 2\.15"):
        recommend("cpu", "banana")


def test_recommend_imports_no_torch() -> None:
    code = ("import sys, accelport as ap; ap.recommend(); ap.recommend('gcp-tpu', '2.13');"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torch_xla', 'torch_tpu')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- the version parser (property-based) ------------------------------------------------------

suffixes = st.sampled_from(["", "+cpu", "+cu128", "a0", "a0+git1234", "rc1", ".dev20261001", ".post1",
                            "+rocm6.4", "b2.dev3+gabc"])


@FAST
@given(major=st.integers(0, 9), minor=st.integers(0, 99), patch=st.integers(0, 99), suffix=suffixes)
def test_parser_maps_every_pep440_form_to_its_minor(major: int, minor: int, patch: int, suffix: str) -> None:
    assert parse_torch_version(f"{major}.{minor}.{patch}{suffix}") == (major, minor)
    assert parse_torch_version(f"  {major}.{minor}{suffix} ") == (major, minor)


@FAST
@given(st.text(max_size=30))
def test_parser_never_fails_with_anything_but_a_clear_error(text: str) -> None:
    try:
        result = parse_torch_version(text)
    except InvalidVersionError as exc:
        assert repr(text) in str(exc)
    else:
        assert isinstance(result, tuple) and len(result) == 2


@pytest.mark.parametrize("text,expected", [
    ("2.9.0+cu128", (2, 9)), ("2.10.0a0+git1234", (2, 10)), ("2.15.0.dev20261001", (2, 15)),
    ("2", (2, 0)), ("v2.4.1", (2, 4)), ("2.13.0+cpu", (2, 13)),
])
def test_parser_examples(text: str, expected: tuple[int, int]) -> None:
    assert parse_torch_version(text) == expected


# -- range lookup (property-based) ---------------------------------------------------------

SRC = (Source("a test stand-in source", "https://example.org/"),)


def _rows(cuts: list[int], statuses: list[str], backend: str = "b") -> list[Row]:
    """Contiguous rows for ``backend`` on cpu covering 2.{cuts[i]} .. 2.{cuts[i+1]-1}."""
    rows = []
    for i, (lo, hi) in enumerate(itertools.pairwise(cuts)):
        status = statuses[i % len(statuses)]
        rows.append(Row("cpu", backend, (2, lo), (2, hi - 1), status, f"{backend} {status}",
                        dt.date(2026, 12, 1), SRC, replacement="x" if status == "deprecated" else None,
                        key=f"rows[{i}]"))
    return rows


@FAST
@given(cuts=st.lists(st.integers(0, 30), min_size=2, max_size=8, unique=True).map(sorted),
       statuses=st.lists(st.sampled_from(STATUSES), min_size=1, max_size=5),
       query=st.integers(0, 40))
def test_lookup_agrees_with_brute_force(cuts: list[int], statuses: list[str], query: int) -> None:
    rows = _rows(cuts, statuses)
    mx = Matrix(rows)
    expected = next((r for r in rows if r.torch_min <= (2, query) <= r.torch_max), None)
    assert mx.lookup("cpu", "b", (2, query)) == expected
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.CompatibilityWarning)
        v = recommend("cpu", f"2.{query}.0", matrix=mx)
    last = rows[-1]
    if query > last.torch_max[1]:
        assert v.unverified and v.row_torch == f"2.{last.torch_max[1]}"
        assert v.status("b") == last.status
    elif query < rows[0].torch_min[1]:
        assert v.backends == {} and not v.unverified
    else:
        assert not v.unverified and expected is not None and v.status("b") == expected.status
        assert ("b" in v.ranked) == (expected.status != "unsupported")


@FAST
@given(base=st.lists(st.integers(0, 20), min_size=2, max_size=6, unique=True).map(sorted),
       over=st.tuples(st.integers(0, 20), st.integers(0, 5)), query=st.integers(0, 20))
def test_an_override_layer_wins_only_over_its_own_range(base: list[int], over: tuple[int, int],
                                                        query: int) -> None:
    rows = _rows(base, ["supported"])
    lo, span = over
    top = Row("cpu", "b", (2, lo), (2, lo + span), "experimental", "override", dt.date(2026, 12, 1), SRC)
    mx = Matrix(rows, [[top]])
    found = mx.lookup("cpu", "b", (2, query))
    if lo <= query <= lo + span:
        assert found is top
    else:
        assert found == next((r for r in rows if r.covers((2, query))), None)


def test_ranking_is_by_status_then_matrix_order() -> None:
    d = dt.date(2026, 12, 1)
    mx = Matrix([
        Row("cpu", "old", (2, 1), (2, 5), "deprecated", "m", d, SRC, replacement="new"),
        Row("cpu", "beta", (2, 1), (2, 5), "experimental", "m", d, SRC),
        Row("cpu", "new", (2, 1), (2, 5), "supported", "m", d, SRC),
        Row("cpu", "gone", (2, 1), (2, 5), "unsupported", "m", d, SRC),
    ])
    v = recommend("cpu", "2.3", matrix=mx)
    assert v.ranked == ("new", "beta", "old") and v.recommended is None
    assert "new is supported" in v.reason


def test_shipped_matrix_is_parsed_once() -> None:
    assert load.shipped() is load.shipped()
