"""accelport doctor: safe, specific, never a traceback, never a secret."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accelport.cli import main
from accelport.doctor.finding import Finding
from accelport.doctor.gather import gather
from accelport.doctor.render import exit_status, render_markdown, render_text
from accelport.redact import redact

REPORT_KEYS = {"platform", "packages", "backends", "selected", "recommendation", "environment", "caches",
               "plugins", "findings"}


def doctor_json(env: dict[str, str] | None = None) -> tuple[int, dict]:  # type: ignore[type-arg]
    full = {k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")}
    full.update(env or {})
    out = subprocess.run([sys.executable, "-m", "accelport", "doctor", "--json"], capture_output=True, text=True,
                         env=full, timeout=120)
    return out.returncode, json.loads(out.stdout)


def test_report_has_the_documented_keys_and_this_machine() -> None:
    code, report = doctor_json()
    assert code == 0
    assert REPORT_KEYS <= set(report)
    assert report["platform"]["name"] == "cpu"
    assert report["selected"]["name"] == "cpu"
    assert report["packages"]["torch"]
    assert {b["name"] for b in report["backends"]} >= {"cpu", "cuda"}
    assert any(p["name"] == "diagnostics" and "accelport_register_rules" in p["hooks"] for p in report["plugins"])


def test_doctor_imports_no_torch_and_no_vendor_runtime() -> None:
    code = (
        "import sys, io, contextlib\n"
        "from accelport.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['doctor', '--json'])\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'torch', 'torch_xla', 'torch_tpu', 'torch_neuronx', 'libneuronxla', 'jax'})\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_secrets_never_appear_in_any_output_mode(monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # type: ignore[no-untyped-def]
    secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    token = "ya29.a0AfH6SMBx3gK9vQ2pLmN8rT"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("XLA_FLAGS", f"--xla_dump_to=/tmp/x --auth_token={token}")
    monkeypatch.setenv("TPU_API_TOKEN", "plainvalue")
    for args in (["doctor"], ["doctor", "--json"], ["doctor", "--markdown"]):
        main(args)
        out = capsys.readouterr().out
        assert secret not in out and token not in out and "plainvalue" not in out
        assert "AWS_SECRET_ACCESS_KEY" not in out
        assert "--xla_dump_to=/tmp/x" in out  # the harmless part stays readable


@pytest.mark.parametrize(
    "name, value, shown",
    [
        ("XLA_FLAGS", "--xla_cpu_fast_math=false", "--xla_cpu_fast_math=false"),
        ("XLA_FLAGS", "--key=abc123", "--key=<redacted>"),
        ("NEURON_CC_FLAGS", "--cache_dir=s3://b/AKIAIOSFODNN7EXAMPLE", "--cache_dir=s3://b/<redacted>"),
        ("TPU_NAME", "my-tpu-v5e", "my-tpu-v5e"),
        ("ACCELPORT_SECRET", "anything", "<redacted>"),
        ("XLA_FLAGS", "x " + "a1" * 20, "x <redacted>"),
    ],
)
def test_redaction(name: str, value: str, shown: str) -> None:
    assert redact(name, value) == shown


def test_deprecated_setting_is_a_warning_with_a_fix() -> None:
    _, report = doctor_json({"XLA_USE_BF16": "1"})
    (found,) = [f for f in report["findings"] if "XLA_USE_BF16" in f["title"]]
    assert found["severity"] == "warning" and "autocast" in found["fix"]


def test_unusable_selection_is_a_problem_and_exit_1() -> None:
    code, report = doctor_json({"ACCELPORT_BACKEND": "cdua"})
    assert code == 1
    problems = [f for f in report["findings"] if f["severity"] == "problem"]
    assert any("Did you mean 'cuda'" in f["title"] for f in problems)
    (found,) = [f for f in problems if f["title"].startswith("no backend can be used")]
    assert "unset ACCELPORT_BACKEND (now 'cdua')" in found["fix"]


def test_the_fix_for_no_usable_backend_names_what_stands_in_the_way() -> None:
    code, report = doctor_json({"ACCELPORT_DISABLED_PLUGINS": "cpu"})
    assert code == 1
    (found,) = [f for f in report["findings"] if f["title"].startswith("no backend can be used")]
    assert "take cpu out of ACCELPORT_DISABLED_PLUGINS" in found["fix"]
    assert "install torch" not in found["fix"]  # torch is installed here: not the cause


def test_usage_error_exits_2_with_json(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["doctor", "--json", "--markdown"]) == 2
    assert json.loads(capsys.readouterr().out)["kind"] == "usage"


def test_plugins_contribute_checks_and_malformed_ones_are_reported(install_plugin) -> None:  # type: ignore[no-untyped-def]
    install_plugin(
        "sitecheck", "site_doctor_checks",
        "import accelport as ap\n"
        "from accelport.doctor.finding import Finding\n"
        "@ap.hookimpl\n"
        "def accelport_doctor_checks(context):\n"
        "    assert context.platform.name == 'cpu' and 'cpu' in context.probes\n"
        "    return [Finding('problem', 'scratch disk missing', 'mount /scratch'), {'title': 'dict form'}, 42]\n",
    )
    report = gather()
    titles = [f["title"] for f in report["findings"]]
    assert "scratch disk missing" in titles and "dict form" in titles  # good items are kept
    assert any(t.startswith("plugin sitecheck returned a malformed finding: got int") for t in titles)
    assert exit_status(report) == 1


def test_plugin_findings_carry_their_plugin_name(install_plugin) -> None:  # type: ignore[no-untyped-def]
    install_plugin(
        "sitecheck2", "site_doctor_checks2",
        "import accelport as ap\n"
        "from accelport.doctor.finding import Finding\n"
        "@ap.hookimpl\n"
        "def accelport_doctor_checks(context):\n"
        "    return [Finding('problem', 'scratch disk missing', 'mount /scratch'), {'title': 'dict form'}]\n",
    )
    report = gather()
    by_title = {f["title"]: f for f in report["findings"]}
    assert by_title["scratch disk missing"]["check"] == "sitecheck2"
    assert by_title["dict form"]["severity"] == "note"
    assert exit_status(report) == 1
    assert report["findings"][0]["severity"] == "problem"  # worst first
    text = render_text(report)
    assert "[FAIL] scratch disk missing" in text and "fix: mount /scratch" in text
    assert render_markdown(report).startswith("<details>")


def test_bad_severity_is_rejected() -> None:
    with pytest.raises(ValueError, match="severity must be one of ok, note, warning, problem"):
        Finding("fatal", "x")


env_values = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)


HOSTILE = ["PJRT_DEVICE", "XLA_USE_BF16", "XLA_FLAGS", "NEURON_CC_FLAGS", "NEURON_COMPILE_CACHE_URL",
           "CPU_NUM_DEVICES", "TPU_ACCELERATOR_TYPE", "ACCELPORT_BACKEND", "ACCELPORT_DISABLED_PLUGINS",
           "TORCHINDUCTOR_CACHE_DIR", "WORLD_SIZE", "LOCAL_RANK", "PT_XLA_DEBUG_LEVEL", "ACCELPORT_SYSROOT",
           "ACCELPORT_COMPAT_MATRIX", "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT", "NEURON_RT_VISIBLE_CORES",
           "ACCELPORT_CHECKPOINT_DIR"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(HOSTILE), env_values, max_size=6))
def test_garbage_in_every_variable_never_breaks_the_report(env: dict[str, str]) -> None:
    # In the process environment itself, so every probe and cache lookup reads it too.
    with pytest.MonkeyPatch.context() as mp:
        for name in HOSTILE:
            mp.delenv(name, raising=False)
        for name, value in env.items():
            mp.setenv(name, value)
        report = gather()
    json.dumps(report)  # always serialisable
    assert REPORT_KEYS <= set(report)
    render_text(report)
    render_markdown(report)
    assert exit_status(report) in (0, 1)


@pytest.mark.parametrize("bad", ["/etc/passwd", "/nonexistent/matrix.toml", "/tmp"])
def test_a_broken_compat_matrix_override_is_a_finding_not_a_crash(bad: str) -> None:
    code, report = doctor_json({"ACCELPORT_COMPAT_MATRIX": bad})
    assert REPORT_KEYS <= set(report)
    assert code == 1
    (found,) = [f for f in report["findings"] if f["title"].startswith("the compatibility matrix cannot be loaded")]
    assert bad in found["title"] and "ACCELPORT_COMPAT_MATRIX" in found["fix"]


def test_gather_reads_the_environment_it_is_given_not_the_process_one(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # An override that exists only in the mapping passed to gather(): the recommendation,
    # the selection and the matrix findings must all come from it.
    override = tmp_path / "rows.toml"
    override.write_text(
        '[[rows]]\nplatform = "cpu"\nbackend = "cpu"\ntorch = ["2.1", "2.30"]\nstatus = "recommended"\n'
        'message = "from the override"\nas_of = 2031-01-02\n'
        'sources = [{ title = "a test stand-in source", url = "https://example.org/" }]\n')
    monkeypatch.delenv("ACCELPORT_COMPAT_MATRIX", raising=False)
    report = gather({**os.environ, "ACCELPORT_COMPAT_MATRIX": str(override)})
    assert report["recommendation"]["as_of"] == "2031-01-02"
    assert "from the override" in report["recommendation"]["reason"]
    assert "from the override" not in json.dumps(gather(dict(os.environ))["recommendation"])


def test_a_broken_override_in_the_given_environment_is_a_finding_not_a_crash(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.toml"
    bad.write_text("[[rows]]\nplatform = 'mars'\n")
    monkeypatch.delenv("ACCELPORT_COMPAT_MATRIX", raising=False)
    report = gather({**os.environ, "ACCELPORT_COMPAT_MATRIX": str(bad)})
    titles = [f["title"] for f in report["findings"] if f["severity"] == "problem"]
    assert any("compatibility matrix cannot be loaded" in t and str(bad) in t for t in titles)


def test_missing_numpy_is_a_warning_where_ap_shard_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # Sharded checkpoints go through torch.distributed.checkpoint, which imports numpy; torch
    # does not install it. Found, never imported: the check asks the import system.
    from accelport import _packages

    found = _packages.has_module
    monkeypatch.setattr(_packages, "has_module", lambda name: name != "numpy" and found(name))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")}
    report = gather({**env, "ACCELPORT_BACKEND": "cpu"})
    (warning,) = [f for f in report["findings"] if f["title"].startswith("numpy is not installed")]
    assert warning["severity"] == "warning" and warning["fix"] == "pip install numpy"
    assert "ap.shard runs on cpu" in warning["title"] and "torch.distributed.checkpoint" in warning["title"]
    assert exit_status(report) == 0  # a warning, not a problem: an unsharded run is fine
    monkeypatch.setattr(_packages, "has_module", found)
    assert not [f for f in gather({**env, "ACCELPORT_BACKEND": "cpu"})["findings"] if "numpy" in f["title"]]



def test_doctor_says_where_the_checkpoints_are_and_how_old_the_newest_is(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch

    import accelport as ap

    ap.use("cpu")
    with ap.Checkpointer(tmp_path, every_steps=1, stop_on=()) as ckpt:
        ckpt.restore(model=torch.nn.Linear(2, 2))
        ckpt.step()
        ckpt.step()
    (tmp_path / "step-00000003").mkdir()  # a save killed before it completed
    code, report = doctor_json({"ACCELPORT_CHECKPOINT_DIR": str(tmp_path)})
    assert code == 0
    row = report["checkpoints"]
    assert row["directory"] == str(tmp_path) and [c["step"] for c in row["complete"]] == [1, 2]
    assert row["newest"]["step"] == 2 and 0 <= row["newest"]["age_s"] < 3600
    titles = [f["title"] for f in report["findings"]]
    assert any(t.startswith(f"checkpoints in {tmp_path}: 2 complete, the newest at step 2 (") and "written" in t
               and "a run with ap.Checkpointer() resumes from it" in t for t in titles), titles
    assert any("step-00000003 is incomplete: it has no checkpoint.json" in t for t in titles), titles
    (torn,) = [f for f in report["findings"] if "step-00000003 is incomplete" in f["title"]]
    assert "delete it once no run of this job is running (a background save is completed at a later step" \
        in torn["fix"]  # never advice to delete what a save may still be writing
    # The last job's goodput account, kept beside the checkpoints: one run, two steps, two saves.
    assert (row["goodput"]["runs"], row["goodput"]["productive_steps"], row["goodput"]["saves"]) == (1, 2, 2)
    assert any(t.startswith(f"the last job in {tmp_path}: goodput ") and "productive " in t and "(2 steps)" in t
               for t in titles), titles
    (tmp_path / "file").write_text("x")
    code, report = doctor_json({"ACCELPORT_CHECKPOINT_DIR": str(tmp_path / "file")})
    assert code == 1 and any("is a file, not a directory" in f["title"] for f in report["findings"])
    assert "checkpoints (ACCELPORT_CHECKPOINT_DIR):" in render_text(report)
    assert gather({k: v for k, v in os.environ.items() if k != "ACCELPORT_CHECKPOINT_DIR"})["checkpoints"] is None
