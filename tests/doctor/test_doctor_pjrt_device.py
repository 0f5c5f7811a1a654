"""accelport doctor never echoes a PJRT_DEVICE that holds a credential, in any form a reason quotes it in."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from accelport.redact import REDACTED


def _doctor(pjrt_device: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELPORT_", "PJRT_", "AWS_"))}
    env["PJRT_DEVICE"] = pjrt_device
    return subprocess.run([sys.executable, "-m", "accelport", "doctor", *args], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.mark.parametrize("secret", [
    "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",  # an AWS secret access key
    "sk-proj4Xy9abcDEF1234567890",  # an OpenAI-style key: its uppercased form ("SK-...") matches no pattern
    "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY pasted_twice",  # torch_xla's device type: the part before "_"
])
@pytest.mark.parametrize("mode", [(), ("--json",), ("--markdown",)])
def test_a_secret_pjrt_device_is_never_echoed_in_any_case(secret: str, mode: tuple[str, ...]) -> None:
    out = _doctor(secret, *mode)
    assert out.returncode in (0, 1) and "Traceback" not in out.stderr, out.stderr
    key = secret.split("_")[0]
    for form in (secret, key, key.upper(), key.lower()):
        assert form not in out.stdout and form not in out.stderr, form
    assert f"PJRT_DEVICE={REDACTED}" in out.stdout
    if mode == ("--json",):
        row = next(e for e in json.loads(out.stdout)["environment"] if e["name"] == "PJRT_DEVICE")
        assert row["value"].startswith(REDACTED)


@pytest.mark.parametrize(("value", "device"), [("TPU", "TPU"), ("cpu", "CPU"), ("CUDA", "CUDA"), ("neuron", "NEURON")])
def test_a_known_pjrt_device_stays_visible(value: str, device: str) -> None:
    report = json.loads(_doctor(value, "--json").stdout)
    row = next(e for e in report["environment"] if e["name"] == "PJRT_DEVICE")
    assert row["value"] == value
    text = json.dumps(report)
    assert f"PJRT_DEVICE={value}" in text and REDACTED not in text
    assert f"PJRT device {device}" in text or device == "CPU"  # CPU is run, not refused: no reason quotes it
