"""No credential in any output: the one redaction pass, every section, every format."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from accelport.redact import REDACTED, Redactor, printable, redact_text

LEAKS = [
    ("https://AKIAEXAMPLEKEY:wJalrXUtnFEMIexample@bucket.example/cache", "wJalrXUtnFEMIexample"),
    ("https://tok3n@bucket.example/cache", "tok3n"),
    ("s3://bucket/key?sig=Zm9vYmFyc2ln&v=1", "Zm9vYmFyc2ln"),
    ("https://h.example/o?X-Amz-Signature=deadbeef1234&X-Amz-Date=20260101", "deadbeef1234"),
    ("access_token=abc123xyz", "abc123xyz"),
    ("MY_CLIENT_SECRET=hunter22", "hunter22"),
    ("the_private_key=keymaterial", "keymaterial"),
    ("--auth=pw123456", "pw123456"),
    ("--token VALUE12345 --cache_dir=/tmp/x", "VALUE12345"),
    ("Authorization: Bearer abc.def.ghi", "abc.def.ghi"),
    ('{"password": "x1y2z3"}', "x1y2z3"),
    ("hf_abcdefghijklmnopqrstuvwxyzABCDEFGH", "hf_abcdefghijklmnopqrstuvwxyzABCDEFGH"),
    ("ghp_abcdefghijklmnop1234", "ghp_abcdefghijklmnop1234"),
    ("password: hunter2", "hunter2"),
]


@pytest.mark.parametrize("text,secret", LEAKS)
def test_each_credential_form_is_redacted(text: str, secret: str) -> None:
    shown = redact_text(text)
    assert secret not in shown and REDACTED in shown


@pytest.mark.parametrize("text", [
    "PJRT_DEVICE=CPU", "--xla_force_host_platform_device_count=4", "allowed keys: platform, backend",
    "/tmp/pytest-of-root/pytest-22/test_broken_override_is_report0/bad.toml", "X-Amz-Date=20260101",
    "torch_xla==2.9.* on gcp-tpu", "the token is not set",
])
def test_ordinary_text_is_left_alone(text: str) -> None:
    assert redact_text(text) == text


def test_a_secret_variable_is_hidden_wherever_it_is_quoted() -> None:
    r = Redactor({"MY_API_TOKEN": "s3cr3t-value", "NEURON_COMPILE_CACHE_URL": "https://AKIAX:pw9@b.example/c"})
    report = {"environment": [{"value": "https://AKIAX:pw9@b.example/c"}],
              "caches": [{"path": "https://AKIAX:pw9@b.example/c"}],
              "selected": {"reason": "chosen by ACCELPORT_BACKEND=s3cr3t-value"}, "nan": float("nan")}
    text = json.dumps(r.tree(report), allow_nan=False)
    assert "pw9" not in text and "s3cr3t-value" not in text and '"nan": null' in text


def test_control_characters_and_undecodable_bytes_are_printed_escaped() -> None:
    assert printable("CPU\n[FAIL] forged\x1b[31m") == "CPU\\n[FAIL] forged\\x1b[31m"
    assert printable("CPU\udcff") == "CPU\\xff"


def _doctor(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "accelport", "doctor", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_doctor_markdown_and_json_carry_no_secret_from_the_environment() -> None:
    env = {"NEURON_COMPILE_CACHE_URL": "https://AKIAEXAMPLEKEY:wJalrXUtnFEMIexample@bucket.example/cache",
           "ACCELPORT_BACKEND": "cpu", "XLA_FLAGS": "--xla_dump_to=/tmp/d --token abc123456",
           "NEURON_CC_FLAGS": "--cache_dir=s3://b/x?sig=Zm9vYmFyc2ln"}
    for args in (("--markdown",), ("--json",), ()):
        out = _doctor(env, *args)
        assert out.returncode in (0, 1), out.stderr
        for secret in ("wJalrXUtnFEMIexample", "abc123456", "Zm9vYmFyc2ln"):
            assert secret not in out.stdout and secret not in out.stderr, (args, secret)
    json.loads(_doctor(env, "--json").stdout)


def test_doctor_output_cannot_be_forged_or_broken_by_a_value() -> None:
    env = {"ACCELPORT_NOTE": "x\n  [FAIL] forged line\x1b[2J```\n</details>", "PYTHONIOENCODING": "utf-8:strict",
           "PJRT_DEVICE": "CPU\udcff"}  # the byte 0xff, which is no UTF-8
    text = _doctor(env)
    assert text.returncode in (0, 1) and "Traceback" not in text.stderr
    assert "\n  [FAIL] forged line" not in text.stdout and "\x1b" not in text.stdout
    md = _doctor(env, "--markdown").stdout
    fence = md.splitlines()[2]
    assert set(fence) == {"`"} and len(fence) > 3 and md.rstrip().endswith(fence + "\n</details>")
    data = json.loads(_doctor(env, "--json").stdout)
    assert any(e["name"] == "ACCELPORT_NOTE" and "\\n" in e["value"] for e in data["environment"])
    assert any(e["name"] == "PJRT_DEVICE" and e["value"] == "CPU\\xff" for e in data["environment"])
