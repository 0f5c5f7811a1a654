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
    # quoted values, bare or inside another variable's value
    ("""XLA_FLAGS='password="abc123"'""", "abc123"),
    ('--api-key="x y"', "x y"),
    ('token: "abc"', '"abc"'),
    ("MY_TOKEN='two words'", "two words"),
    ('password = "spaced out"', "spaced out"),
    ('password="never closed', "never closed"),
    # short names for a password, as a whole part of a name
    ("pass=hunter22", "hunter22"),
    ("pwd=hunter22", "hunter22"),
    ("mysql --user=me DB_PASS=hunter22", "hunter22"),
    # an AWS secret access key on its own, "/" in it
    ("wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"),
    ("key material: aB3+cD4/eF5gH6iJ7kL8mN9oP0qR1sT2uV3wX4yZ", "aB3+cD4/eF5gH6iJ7kL8mN9oP0qR1sT2uV3wX4yZ"),
    # URL userinfo inside a path, also with the one slash os.path.abspath leaves of "//"
    ("/home/u/runs/https://user:pw123@host/train.py", "pw123"),
    ("/home/u/runs/https:/user:pw123@host/train.py", "pw123"),
    # a token after "_" (a file named after it)
    ("accelport run: /tmp/run_hf_abcdefghijklmnopqrstuvwxyz0123.jsonl", "hf_abcdefghijklmnopqrstuvwxyz0123"),
    ("logs/ghp_abcdefghijklmnop1234_run.txt", "ghp_abcdefghijklmnop1234"),
]


@pytest.mark.parametrize("text,secret", LEAKS)
def test_each_credential_form_is_redacted(text: str, secret: str) -> None:
    shown = redact_text(text)
    assert secret not in shown and REDACTED in shown


@pytest.mark.parametrize("text", [
    "PJRT_DEVICE=CPU", "--xla_force_host_platform_device_count=4", "allowed keys: platform, backend",
    "/tmp/pytest-of-root/pytest-22/test_broken_override_is_report0/bad.toml", "X-Amz-Date=20260101",
    "torch_xla==2.9.* on gcp-tpu", "the token is not set",
    "bypass=1", "num_passes=3", "compass=north", "task-0123456789abcdef0123",
    "/usr/lib/python3.11/site-packages/torch/distributed/checkpoint/state_dict_saver.py",
    "--token --cache_dir=/tmp/x", "C:/Users/me@example",
])
def test_ordinary_text_is_left_alone(text: str) -> None:
    assert redact_text(text) == text


@pytest.mark.parametrize(("text", "shown"), [
    ('password="a b" next', 'password="<redacted>" next'),
    ("--api-key='x y' --cache_dir=/tmp", "--api-key='<redacted>' --cache_dir=/tmp"),
    ("""XLA_FLAGS='password="abc123" --xla_dump_to=/tmp/d'""",
     """XLA_FLAGS='password="<redacted>" --xla_dump_to=/tmp/d'"""),
    ("password=<redacted>", "password=<redacted>"),  # a second pass changes nothing
])
def test_a_quoted_value_keeps_its_quotes_and_the_rest_of_the_line(text: str, shown: str) -> None:
    assert redact_text(text) == shown


def test_every_pattern_runs_in_linear_time_on_hostile_values() -> None:
    # 128 KB of each shape that made a pattern backtrack: 128 KB of dashes took hours before. In a
    # subprocess, so a regression fails at the timeout instead of hanging the suite; the margin is
    # huge (each takes well under a second here).
    code = (
        "from accelport.redact import Redactor, redact_text\n"
        "shapes = ['-', '.', 'x.', 'a-', 'http://', 'a:/', '?a', 'token', '-token', 'password=\"', 'pass_', 'x1/',\n"
        "          '\"token\": \"', 'bearer ', 'hf_', 'key=']\n"
        "for s in shapes:\n"
        "    text = (s * (128_000 // len(s) + 1))[:128_000]\n"
        "    redact_text(text)\n"
        "    Redactor({'PJRT_DEVICE': text}).text(text)\n"
        "print('done')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "done", out.stderr


def test_a_cut_string_says_how_long_it_was_and_hides_a_secret_the_cut_crosses() -> None:
    r = Redactor({"MY_TOKEN": "Z" * 3000}, limit=100)
    assert r.text("short") == "short"
    shown = r.text("x " * 48 + "password=" + "S3cr3t" * 50)
    assert shown.startswith("x x ") and "S3cr" not in shown and shown.endswith("... [cut: 405 characters in all]")
    assert shown.index("...") == 100
    # A known secret that starts before the cut and ends long after it: replaced on the whole text.
    assert "ZZZ" not in r.text("a " * 49 + "Z" * 3000)
    assert len(Redactor(limit=100).text("-" * 128_000)) < 200
    with pytest.raises(ValueError, match="limit must be a positive number of characters or None"):
        Redactor(limit=0)


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
    # A message that quoted such a value with repr() shows it the same way.
    assert printable("unknown backend " + repr("a\udcffb")) == "unknown backend 'a\\xffb'"
    assert printable("a literal \\\\udcff stays") == "a literal \\\\udcff stays"


def _doctor(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "accelport", "doctor", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_doctor_markdown_and_json_carry_no_secret_from_the_environment() -> None:
    env = {"NEURON_COMPILE_CACHE_URL": "https://AKIAEXAMPLEKEY:wJalrXUtnFEMIexample@bucket.example/cache",
           "ACCELPORT_BACKEND": "cpu", "XLA_FLAGS": "--xla_dump_to=/tmp/d --token abc123456",
           "NEURON_CC_FLAGS": "--cache_dir=s3://b/x?sig=Zm9vYmFyc2ln",
           "TPU_EXTRA_FLAGS": """password="quoted1" --api-key="two words" pwd=short9""",
           "ACCELPORT_NOTE": "token: 'quoted2' with wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"}
    for args in (("--markdown",), ("--json",), ()):
        out = _doctor(env, *args)
        assert out.returncode in (0, 1), out.stderr
        for secret in ("wJalrXUtnFEMIexample", "abc123456", "Zm9vYmFyc2ln", "quoted1", "two words", "short9",
                       "quoted2", "K7MDENG"):
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


def test_doctor_cuts_a_huge_value_and_stays_quick() -> None:
    # 128 KB of dashes in PJRT_DEVICE: it is quoted in a dozen reasons, and the flag pattern once
    # backtracked over every dash (hours). The subprocess's timeout is a huge margin, not a measurement.
    from accelport.doctor.gather import SHOWN_CHARACTERS

    value = "-" * 128_000
    out = _doctor({"PJRT_DEVICE": value}, "--json")
    assert out.returncode in (0, 1) and "Traceback" not in out.stderr
    data = json.loads(out.stdout)

    def strings(obj):  # type: ignore[no-untyped-def]
        if isinstance(obj, str):
            yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from strings(v)
        elif isinstance(obj, list):
            for v in obj:
                yield from strings(v)

    suffix = len("... [cut: 1234567 characters in all]")
    assert max(len(s) for s in strings(data)) <= SHOWN_CHARACTERS + suffix
    (row,) = [e for e in data["environment"] if e["name"] == "PJRT_DEVICE"]
    assert row["value"] == "-" * SHOWN_CHARACTERS + "... [cut: 128000 characters in all]"
    assert len(out.stdout) < 30 * SHOWN_CHARACTERS  # the whole value was in ten places


def test_undecodable_bytes_read_alike_in_every_reason() -> None:
    # ACCELPORT_BACKEND is quoted with repr() in the selection's reason and the fix; the
    # environment section shows it escaped: all three say \xff, none \udcff.
    for args in ((), ("--json",)):
        out = _doctor({"ACCELPORT_BACKEND": "a\udcffb", "PYTHONIOENCODING": "utf-8:strict"}, *args)
        assert out.returncode == 1 and "Traceback" not in out.stderr
        assert "udc" not in out.stdout and "now 'a\\xffb'" in out.stdout.replace("\\\\", "\\")
