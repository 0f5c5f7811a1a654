"""Selection order, reasons, and the errors for bad backend names."""

from __future__ import annotations

import os
import sys

import pytest

import accelport as ap


def test_default_on_this_machine_is_cpu_with_a_reason() -> None:
    b = ap.backend()
    assert b.name == "cpu"
    assert "cpu" in b.reason and "torch" in b.reason


def test_unknown_backend_lists_known_names_and_suggests_nearest() -> None:
    with pytest.raises(ap.UnknownBackendError) as info:
        ap.use("cdua")
    err = info.value
    assert err.suggestion == "cuda"
    assert "cpu" in err.known and "cuda" in err.known
    assert "Did you mean 'cuda'?" in str(err)
    assert "Known backends: " in str(err)


def test_unknown_backend_from_environment_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELPORT_BACKEND", "cpuu")
    with pytest.raises(ap.UnknownBackendError, match=r"ACCELPORT_BACKEND=cpuu.*Did you mean 'cpu'"):
        ap.device()


def test_unknown_name_with_nothing_close_has_no_suggestion() -> None:
    with pytest.raises(ap.UnknownBackendError) as info:
        ap.use("quantum-annealer")
    assert info.value.suggestion is None
    assert "Did you mean" not in str(info.value)


def test_a_huge_backend_name_is_quoted_cut_not_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    huge = "x" * 100_000
    cut = "'" + "x" * 40 + "... [cut: 100000 characters in all]'"
    with pytest.raises(ap.UnknownBackendError) as info:
        ap.use(huge)
    assert str(info.value).startswith(f"unknown backend {cut} (from ap.use({cut})). Known backends: ")
    assert len(str(info.value)) < 400
    monkeypatch.setenv("ACCELPORT_BACKEND", huge)
    with pytest.raises(ap.UnknownBackendError) as info:
        ap.device()
    assert f"(from ACCELPORT_BACKEND={cut[1:-1]})" in str(info.value) and len(str(info.value)) < 400


def test_a_huge_backend_name_holding_a_secret_is_quoted_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "s3cr3t-value-of-a-token"
    monkeypatch.setenv("HF_TOKEN", secret)
    monkeypatch.setenv("ACCELPORT_BACKEND", secret + "x" * 200)
    with pytest.raises(ap.UnknownBackendError) as info:
        ap.device()
    assert "ACCELPORT_BACKEND=<redacted>xxx" in str(info.value) and secret[:6] not in str(info.value)


def test_known_but_unavailable_carries_the_probe_reason() -> None:
    with pytest.raises(ap.BackendUnavailableError) as info:
        ap.use("cuda")
    assert info.value.name == "cuda"
    assert "CPU-only build" in info.value.reason or "no NVIDIA GPU" in info.value.reason
    assert info.value.reason in str(info.value)


def test_the_two_errors_are_distinct_types() -> None:
    assert not issubclass(ap.UnknownBackendError, ap.BackendUnavailableError)
    assert not issubclass(ap.BackendUnavailableError, ap.UnknownBackendError)
    assert issubclass(ap.UnknownBackendError, ap.AccelportError)


def test_explicit_use_wins_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELPORT_BACKEND", "cuda")  # unavailable here: would raise if consulted
    b = ap.use("cpu")
    assert b.name == "cpu"
    assert "ap.use('cpu')" in b.reason


def test_environment_is_case_and_space_tolerant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELPORT_BACKEND", " CPU ")
    assert ap.backend().name == "cpu"
    assert "ACCELPORT_BACKEND" in ap.backend().reason


def test_empty_name_is_an_unknown_backend() -> None:
    with pytest.raises(ap.UnknownBackendError):
        ap.use("  ")


def test_site_policy_plugin_is_asked_before_the_default(install_plugin) -> None:  # type: ignore[no-untyped-def]
    install_plugin(
        "policy",
        "site_policy",
        "import accelport as ap\n"
        "seen = {}\n"
        "@ap.hookimpl\n"
        "def accelport_select_backend(candidates, platform, recommendation):\n"
        "    seen['args'] = ([c.name for c in candidates], platform, recommendation.recommended)\n"
        "    return candidates[0], 'site policy: always the first candidate'\n",
    )
    import sys

    b = ap.backend()
    assert b.reason == "site policy: always the first candidate"
    names, platform, recommended = sys.modules["site_policy"].seen["args"]
    assert names[0] == "cpu" and platform == "cpu" and recommended == "cpu"


def test_policy_returning_none_defers_to_default(install_plugin) -> None:  # type: ignore[no-untyped-def]
    install_plugin(
        "policy", "deferring_policy",
        "import accelport as ap\n"
        "@ap.hookimpl\n"
        "def accelport_select_backend(candidates, platform, recommendation):\n"
        "    return None\n",
    )
    assert ap.backend().reason.startswith("cpu is the recommended backend")


@pytest.mark.parametrize("answer", ["(candidates[0], 'why', 'extra')", "'cpu'", "object()", "(candidates[0], 3)"])
def test_a_policy_with_a_malformed_answer_is_disabled_and_the_default_decides(install_plugin, answer: str) -> None:  # type: ignore[no-untyped-def]
    install_plugin(
        "policy", "malformed_policy",
        "import accelport as ap\n"
        "@ap.hookimpl\n"
        "def accelport_select_backend(candidates, platform, recommendation):\n"
        f"    return {answer}\n",
    )
    with pytest.warns(ap.PluginWarning, match=r"plugin 'policy' was disabled: hook accelport_select_backend "
                                              r"failed with TypeError: returned .*expected one of the candidates"):
        backend = ap.backend()
    assert backend.name == "cpu" and backend.reason.startswith("cpu is the recommended backend")


def test_disabling_the_default_policy_falls_back_to_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELPORT_DISABLED_PLUGINS", "default-selection")
    b = ap.backend()
    assert b.name == "cpu" and "no accelerator backend is available" in b.reason


def test_no_backend_at_all_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelport.plugins.host import BUILTIN_PLUGINS

    monkeypatch.setenv("ACCELPORT_DISABLED_PLUGINS", ",".join(n for n, _ in BUILTIN_PLUGINS))
    with pytest.raises(ap.AccelportError, match="no backend is registered"):
        ap.backend()


@pytest.mark.parametrize("name, known, expected", [
    ("tpu", ["gcp-tpu", "aws-neuron", "nvidia-gpu", "cpu"], "gcp-tpu"),
    ("gpu", ["gcp-tpu", "aws-neuron", "nvidia-gpu", "cpu"], "nvidia-gpu"),
    ("xl", ["cpu", "cuda", "xla", "neuron-xla"], "xla"),
    ("cdua", ["cpu", "cuda", "xla"], "cuda"),
    ("quantum", ["cpu", "cuda"], None),
])
def test_nearest_name(name: str, known: list[str], expected: str | None) -> None:
    from accelport.errors import nearest

    assert nearest(name, known) == expected


@pytest.mark.parametrize("bad", [None, 3, ["cpu"]])
def test_use_needs_a_name(bad: object) -> None:
    with pytest.raises(ap.UnknownBackendError, match="Known backends: .*cpu"):
        ap.use(bad)  # type: ignore[arg-type]


# -- the default policy on a TPU VM: the matrix's verdict decides ------------------------------


class AvailableStandIn:
    """Stands in for a backend whose hardware is not here (a TPU): available, with a reason."""

    def __init__(self, name: str, platform: str) -> None:
        self.name, self.platform = name, platform

    def probe(self) -> ap.Probe:
        return ap.Probe(True, f"{self.name} stand-in is available", 4)


def _select(names: list[str], torch_version: str) -> tuple[str, str] | None:
    from accelport.compat.verdict import recommend
    from accelport.runtime.selection import accelport_select_backend

    candidates = [AvailableStandIn(n, "cpu" if n == "cpu" else "gcp-tpu") for n in ["cpu", *names]]
    chosen = accelport_select_backend(candidates=candidates, platform="gcp-tpu",
                                      recommendation=recommend("gcp-tpu", torch_version, warn=False))
    return None if chosen is None else (chosen[0].name, chosen[1])


def test_on_a_tpu_vm_the_recommended_backend_wins_over_a_deprecated_one() -> None:
    name, reason = _select(["xla", "tpu"], "2.13.0")  # type: ignore[misc]
    assert name == "tpu"
    assert reason.startswith("tpu is the recommended backend for gcp-tpu with torch 2.13.0")


def test_on_a_tpu_vm_a_lower_ranked_backend_is_used_when_the_best_is_missing() -> None:
    name, reason = _select(["xla"], "2.13.0")  # type: ignore[misc]
    assert name == "xla"
    assert "best available backend" in reason and "tpu ranked higher but not available" in reason


def test_a_backend_the_matrix_marks_unsupported_is_never_picked_on_its_own() -> None:
    # torch 2.10 on a TPU VM: no torch_xla release pairs with it, TorchTPU needs 2.11+.
    assert _select(["xla"], "2.10.0") is None  # resolve() then falls back to cpu


def test_a_backend_the_matrix_does_not_know_can_drive_the_platform() -> None:
    name, reason = _select(["acme-tpu"], "2.13.0")  # type: ignore[misc]
    assert name == "acme-tpu"
    python = ".".join(map(str, sys.version_info[:2]))  # the verdict names the Python it judged: this one
    assert reason == f"acme-tpu is the only available backend for gcp-tpu with torch 2.13.0 on Python {python}"


def test_pjrt_device_without_a_usable_xla_backend_is_said_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    # This environment has torch 2.13 and no torch_xla: PJRT_DEVICE=CPU cannot be honoured.
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.delenv("ACCELPORT_BACKEND", raising=False)
    with pytest.warns(ap.CompatibilityWarning, match=r"PJRT_DEVICE=CPU is set, which asks for XLA, but cpu runs "
                                                     r"instead .*xla: torch_xla is not installed"):
        backend = ap.backend()
    assert backend.name == "cpu" and "PJRT_DEVICE=CPU is set" in backend.reason
    from accelport.doctor.gather import gather

    report = gather({**os.environ, "PJRT_DEVICE": "CPU"})
    assert any(f["severity"] == "warning" and f["title"].startswith("PJRT_DEVICE=CPU is set")
               for f in report["findings"])
    assert not any("PJRT_DEVICE" in f["title"] for f in gather({**os.environ, "PJRT_DEVICE": ""})["findings"])
