"""Deprecation warnings at selection time: which combinations, which wording, visible by default."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
import types
import warnings

import pytest

import accelport as ap
from accelport.compat.deprecations import deprecation_messages, target_platform, warn_deprecations
from tests import fakes

REPO = pathlib.Path(__file__).resolve().parents[2]


def stand_in(name: str, platform: str, lazy: bool = False, **extra: object) -> types.SimpleNamespace:
    """A stand-in for a backend object: only the attributes the warning logic reads."""
    return types.SimpleNamespace(name=name, platform=platform, lazy=lazy, **extra)


def test_neuron_xla_with_torch_2_9_names_torchneuron_and_the_source() -> None:
    (msg,) = deprecation_messages("neuron-xla", "aws-neuron", "2.9.0", {})
    assert "neuron-xla is deprecated on aws-neuron with torch 2.9.0" in msg
    assert "use the neuron backend instead" in msg
    assert "Source: AWS Neuron announcement" in msg and "https://awsdocs-neuron" in msg


def test_xla_on_a_tpu_vm_with_torch_2_11_or_later_points_to_tpu() -> None:
    for torch in ("2.11.0", "2.13.0", "2.15.0"):
        (msg,) = deprecation_messages("xla", "gcp-tpu", torch, {})
        assert "xla is deprecated on gcp-tpu" in msg and "use the tpu backend instead" in msg
        assert "pytorch/xla README" in msg


def test_xla_cuda_is_deprecated_in_2_8_and_gone_in_2_9() -> None:
    (msg,) = deprecation_messages("xla", "nvidia-gpu", "2.8.0", {})
    assert "deprecated" in msg and "use the cuda backend instead" in msg and "pytorch/xla#9597" in msg
    (msg,) = deprecation_messages("xla", "nvidia-gpu", "2.9.0", {})
    assert "xla is not supported on nvidia-gpu" in msg and "removed" in msg


def test_recommended_and_supported_paths_are_silent(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    # The selected backend's package is installed (stand-ins: no Neuron SDK or TPU here), so its
    # wheel exists for this Python whatever the data says of Python versions.
    for name, version in (("torch-neuronx", "2.14.3.0.1234"), ("torch_xla", "2.9.0"), ("torch-tpu", "0.2.0")):
        fakes.install_dist(monkeypatch, tmp_path / "site", name, version)
    assert deprecation_messages("tpu", "gcp-tpu", "2.13.0", {}) == []
    assert deprecation_messages("xla", "gcp-tpu", "2.9.0", {}) == []
    assert deprecation_messages("xla", "cpu", "2.9.0", {}) == []
    assert deprecation_messages("cpu", "cpu", "2.13.0+cpu", {}) == []
    assert deprecation_messages("cuda", "nvidia-gpu", "2.13.0", {}) == []
    assert deprecation_messages("neuron", "aws-neuron", "2.14.0", {}) == []


@pytest.mark.parametrize("var", ["XLA_USE_BF16", "XLA_DOWNCAST_BF16"])
def test_deprecated_bf16_variables_say_what_to_do(var: str) -> None:
    (msg,) = deprecation_messages("xla", "gcp-tpu", "2.9.0", {var: "1"})
    assert f"{var}=1 is set" in msg and "model.to(torch.bfloat16)" in msg and "autocast" in msg
    assert "Source: AWS Neuron announcement" in msg
    (msg,) = deprecation_messages("tpu", "gcp-tpu", "2.13.0", {var: "1"})
    assert "no effect on the tpu backend" in msg
    assert deprecation_messages("xla", "gcp-tpu", "2.9.0", {var: "0"}) == []


def test_target_platform_follows_pjrt_device_for_lazy_backends() -> None:
    xla = stand_in("xla", "gcp-tpu", lazy=True)
    assert target_platform(xla, {"PJRT_DEVICE": "CUDA"}, "nvidia-gpu") == "nvidia-gpu"
    assert target_platform(xla, {"PJRT_DEVICE": "cpu"}, "gcp-tpu") == "cpu"
    assert target_platform(xla, {}, "gcp-tpu") == "gcp-tpu"
    # torch_xla never picks CUDA by itself: unset on a GPU machine means XLA:CPU.
    assert target_platform(xla, {}, "nvidia-gpu") == "cpu"
    assert target_platform(stand_in("cuda", "nvidia-gpu"), {"PJRT_DEVICE": "TPU"}, "cpu") == "nvidia-gpu"
    own = stand_in("x", "cpu", lazy=True, target_platform=lambda: "aws-neuron")
    assert target_platform(own, {"PJRT_DEVICE": "CPU"}, "cpu") == "aws-neuron"
    broken = stand_in("x", "cpu", target_platform=lambda: 1 / 0)
    assert target_platform(broken, {}, "cpu") == "cpu"


def test_warn_deprecations_emits_the_dedicated_category(monkeypatch: pytest.MonkeyPatch) -> None:
    assert issubclass(ap.AccelportDeprecationWarning, DeprecationWarning)
    with pytest.warns(ap.AccelportDeprecationWarning, match="XLA_USE_BF16=1 is set") as record:
        messages = warn_deprecations(stand_in("cpu", "cpu"), {"XLA_USE_BF16": "1"})
    assert len(messages) == 1 and len(record) == 1
    assert record[0].filename == __file__  # attributed to the caller, not to accelport


def test_selection_warns_once_where_the_backend_is_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XLA_DOWNCAST_BF16", "true")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ap.backend()
        ap.device()
        ap.backend()
    ours = [w for w in caught if issubclass(w.category, ap.AccelportDeprecationWarning)]
    assert len(ours) == 1 and "XLA_DOWNCAST_BF16=true" in str(ours[0].message)
    assert ours[0].filename == __file__


OVERRIDE = """
[[rows]]
platform = "cpu"
backend = "cpu"
torch = ["2.1", "2.15"]
status = "deprecated"
replacement = "mychip"
message = "a test stand-in verdict: pretend the host CPU path is deprecated"
as_of = 2026-12-01
sources = [{ title = "a test stand-in source", url = "https://example.org/" }]
"""


def test_warnings_are_visible_by_default_in_a_user_script(tmp_path: pathlib.Path) -> None:
    # No warning filter is set: Python shows a DeprecationWarning only when it is
    # attributed to __main__, so this proves the stacklevel points at the script.
    (tmp_path / "override.toml").write_text(textwrap.dedent(OVERRIDE))
    script = tmp_path / "train.py"
    script.write_text("import accelport as ap\n\ndevice = ap.device()\nprint('device', device)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELPORT_", "PYTHONWARNINGS"))}
    env.update({"ACCELPORT_COMPAT_MATRIX": str(tmp_path / "override.toml"), "XLA_USE_BF16": "1",
                "ACCELPORT_BACKEND": "cpu"})  # the same on a machine with an accelerator
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "device cpu" in out.stdout
    lines = [line for line in out.stderr.splitlines() if "AccelportDeprecationWarning" in line]
    assert len(lines) == 2, out.stderr
    assert all(line.startswith(f"{script}:3: AccelportDeprecationWarning: accelport: ") for line in lines)
    assert any("cpu is deprecated on cpu" in line and "use the mychip backend instead" in line for line in lines)
    assert any("XLA_USE_BF16=1 is set" in line for line in lines)


def test_the_category_can_be_filtered_out(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import warnings, accelport as ap\n"
                      "warnings.simplefilter('ignore', ap.AccelportDeprecationWarning)\nap.device()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")}
    env["XLA_USE_BF16"] = "1"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and "AccelportDeprecationWarning" not in out.stderr
