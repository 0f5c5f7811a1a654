"""`accelport matrix` and `accelport ci-matrix`: readable at 80 columns, valid JSON, specific errors."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

from accelport.cli import main
from accelport.compat.verdict import recommend

WIDTH = 80


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_fits(text: str) -> None:
    """Every line fits 80 columns, except a source URL alone on its line (a broken URL is useless)."""
    for line in text.splitlines():
        if line.strip().startswith("https://") and " " not in line.strip():
            continue
        assert len(line) <= WIDTH, f"{len(line)} columns: {line!r}"


def test_whole_table_is_readable_at_80_columns(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "matrix")
    assert code == 0 and err == ""
    assert_fits(out)
    for platform in ("cpu", "nvidia-gpu", "gcp-tpu", "aws-neuron"):
        assert f"\n{platform}\n" in out
    assert "  2.11-2.15   deprecated    recommended" in out  # gcp-tpu: xla, tpu
    assert "  2.13-2.14   -             recommended" in out  # aws-neuron: neuron-xla, neuron
    assert "This machine: " in out
    assert "*: not confirmed" in out


@pytest.mark.parametrize("platform,torch", [
    ("aws-neuron", "2.9"), ("aws-neuron", "2.14"), ("gcp-tpu", "2.10"), ("gcp-tpu", "2.13"),
    ("nvidia-gpu", "2.8"), ("cpu", "2.13.0+cpu"), ("aws-neuron", "2.16"),
])
def test_verdicts_are_readable_at_80_columns(capsys: pytest.CaptureFixture[str], platform: str,
                                             torch: str) -> None:
    code, out, _ = run(capsys, "matrix", "--platform", platform, "--torch", torch)
    assert code == 0
    assert_fits(out)
    assert out.startswith(f"{platform}, torch {torch}")
    assert "sources:" in out and "https://" in out


def test_verdict_text_leads_with_the_answer(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, "matrix", "--platform", "aws-neuron", "--torch", "2.14", "--python", "3.12")
    assert ("recommended: neuron (pip: torch==2.14.* torch-neuronx==2.14.3.1.*\n"
            "--extra-index-url https://pip.repos.neuron.amazonaws.com)") in out
    assert "chips: trn2, trn3" in out
    _, out, _ = run(capsys, "matrix", "--platform", "gcp-tpu", "--torch", "2.10")
    assert "recommended: none" in out and "nearest working combinations:" in out
    assert "torch 2.11 with tpu (recommended; torch-tpu>=0.2.0)" in out
    _, out, _ = run(capsys, "matrix", "--platform", "aws-neuron", "--torch", "2.16")
    assert "judged by the torch 2.15 rows" in out and "Unverified" in out


def test_platform_alone_uses_the_installed_torch(capsys: pytest.CaptureFixture[str]) -> None:
    from accelport import _packages

    code, out, _ = run(capsys, "matrix", "--platform", "gcp-tpu", "--json")
    data = json.loads(out)
    assert code == 0 and data["torch_version"] == _packages.version("torch")
    assert data["recommended"] == recommend("gcp-tpu", warn=False).recommended


def test_torch_alone_uses_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    from accelport.platform import detect

    code, out, _ = run(capsys, "matrix", "--torch", "2.9", "--json")
    data = json.loads(out)
    assert data["platform"] == detect().name and data["torch_version"] == "2.9"
    assert data["recommended"] == recommend(detect().name, "2.9", chip=detect().chip).recommended


def test_whole_matrix_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "matrix", "--json")
    data = json.loads(out)
    assert code == 0 and data["as_of"] == "2026-12-05"
    assert {r["backend"] for r in data["rows"]} >= {"cpu", "cuda", "xla", "tpu", "neuron", "neuron-xla"}
    assert all(r["sources"] for r in data["rows"])
    assert {e["name"] for e in data["env"]} == {"XLA_USE_BF16", "XLA_DOWNCAST_BF16"}


@pytest.mark.parametrize("args,words", [
    (("--platform", "mars"), ["unknown platform 'mars'", "gcp-tpu, aws-neuron, nvidia-gpu, cpu"]),
    (("--torch", "banana"), ["invalid torch version 'banana'", "2.9.0+cu128"]),
])
def test_bad_input_is_a_usage_error_naming_valid_values(capsys: pytest.CaptureFixture[str],
                                                        args: tuple[str, ...], words: list[str]) -> None:
    code, out, err = run(capsys, "matrix", *args)
    assert code == 2 and out == "" and "Traceback" not in err
    assert all(w in err for w in words)
    code, out, _ = run(capsys, "matrix", *args, "--json")
    data = json.loads(out)
    assert code == 2 and data["kind"] == "usage" and all(w in data["error"] for w in words)


@pytest.mark.parametrize("args,words", [
    (("--chip", "trn9"), ["--chip: unknown chip 'trn9'", "Did you mean 'trn3'?",
                          "Valid chips: v2/v3, v4, v5e, v5p, v6e, 7x, trn1, trn2, trn3, inf2."]),
    (("--python", "3"), ["--python: invalid Python version '3'", "major.minor",
                         "3.8, 3.9, 3.10, 3.11, 3.12, 3.13, 3.14, 3.15"]),
    (("--python", "abc"), ["--python: invalid Python version 'abc'", "3.8, 3.9, 3.10, 3.11, 3.12, 3.13, 3.14, 3.15"]),
    (("--chip", "v6e", "--platform", "aws-neuron"), ["unknown chip 'v6e' for aws-neuron",
                                                     "Valid chips for aws-neuron: trn1, trn2, trn3, inf2."]),
    (("--markdown", "--chip", "trn1"), ["drop --platform and --torch (and any --chip or --python)"]),
])
def test_a_bad_chip_or_python_names_the_valid_ones(capsys: pytest.CaptureFixture[str], args: tuple[str, ...],
                                                   words: list[str]) -> None:
    code, out, err = run(capsys, "matrix", *args)
    assert code == 2 and out == "" and "Traceback" not in err
    assert all(w in err for w in words), err
    if "--markdown" in args:
        return
    code, out, _ = run(capsys, "matrix", *args, "--json")
    data = json.loads(out)
    assert code == 2 and data["kind"] == "usage" and all(w in data["error"] for w in words)


@pytest.mark.parametrize("flag,value,expected", [
    ("--python", "3." + "1" * 5000, "give a Python major.minor such as 3.12"),  # int() refuses 4300+ digits
    ("--platform", "x" * 100_000, "give one of gcp-tpu, aws-neuron, nvidia-gpu, cpu"),
    ("--chip", "y" * 100_000, "give one of v2/v3, v4, v5e"),
    ("--torch", "2." + "9" * 100_000, "give a torch version such as 2.9"),
])
def test_a_huge_value_is_a_usage_error_that_quotes_it_cut(capsys: pytest.CaptureFixture[str], flag: str,
                                                           value: str, expected: str) -> None:
    code, out, err = run(capsys, "matrix", flag, value)
    assert code == 2 and out == "" and "Traceback" not in err and "unexpected" not in err
    assert err.startswith(f"accelport: error: {flag}: '{value[:40]}... [cut: {len(value)} characters in all]' "
                          "is too long to be a value here: ") and expected in err
    assert len(err) < 400
    code, out, _ = run(capsys, "matrix", flag, value, "--json")
    data = json.loads(out)
    assert code == 2 and data["kind"] == "usage" and expected in data["error"] and len(data["error"]) < 400


def test_a_huge_value_that_holds_a_secret_is_quoted_redacted(capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "s3cr3t-value-of-a-token"
    monkeypatch.setenv("HF_TOKEN", secret)
    code, out, err = run(capsys, "matrix", "--platform", secret + "x" * 200)
    assert code == 2 and "'<redacted>xxxx" in err and secret[:6] not in err


@pytest.mark.parametrize("args", [
    ("--chip", "trn1", "--torch", "2.14"), ("--chip", "trn2", "--torch", "2.9"), ("--chip", "v2/v3", "--torch", "2.13"),
    ("--platform", "gcp-tpu", "--torch", "2.15", "--python", "3.15"), ("--chip", "v6e", "--torch", "2.8"),
])
def test_chip_and_python_verdicts_are_readable_at_80_columns(capsys: pytest.CaptureFixture[str],
                                                             args: tuple[str, ...]) -> None:
    code, out, _ = run(capsys, "matrix", *args)
    assert code == 0
    assert_fits(out)
    assert "sources:" in out


def test_chip_and_python_in_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, "matrix", "--chip", "trn1", "--torch", "2.14", "--python", "3.12")
    assert out.startswith("aws-neuron (trn1), torch 2.14, Python 3.12\n(as of 2026-12-05)\n")
    assert "neuron       unsupported" in out and "does not run on trn1" in out
    assert "torch 2.9 with neuron-xla (deprecated; torch-neuronx==2.9.0.2.15.32035)" in out
    code, out, _ = run(capsys, "matrix", "--chip", "trn1", "--torch", "2.14", "--python", "3.12", "--json")
    data = json.loads(out)
    assert code == 0 and data["platform"] == "aws-neuron" and data["chip"] == "trn1"
    assert data["python"] == "3.12" and data["python_from"] == "given" and data["recommended"] is None
    by = {b["backend"]: b for b in data["backends"]}
    assert by["neuron"]["status"] == "unsupported" and by["neuron"]["chips"] == ["trn2", "trn3"]
    assert data["alternatives"] == [{"torch": "2.9", "backend": "neuron-xla", "status": "deprecated",
                                     "requires": "torch-neuronx==2.9.0.2.15.32035"}]
    # The Python defaults to this machine's, and says so.
    _, out, _ = run(capsys, "matrix", "--platform", "cpu", "--torch", "2.13", "--json")
    data = json.loads(out)
    assert data["python_from"] == "this machine" and data["python"] == ".".join(map(str, sys.version_info[:2]))


def test_the_verdict_names_the_patch_release_and_the_one_to_avoid(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, "matrix", "--platform", "gcp-tpu", "--torch", "2.8", "--python", "3.12")
    assert "recommended: xla (pip: torch==2.8.* torch_xla[tpu]==2.8.1)" in out
    assert "release: torch_xla 2.8.1 (pairs with libtpu==0.0.17)" in out
    assert "avoid: torch_xla 2.8.0: 10-15% slower training" in out and "pytorch/xla/issues/9605" in out
    code, out, _ = run(capsys, "matrix", "--platform", "gcp-tpu", "--torch", "2.8", "--python", "3.12", "--json")
    xla = {b["backend"]: b for b in json.loads(out)["backends"]}["xla"]
    assert xla["install"] == "torch_xla[tpu]==2.8.1" and xla["release"]["pins"] == {"libtpu": "==0.0.17"}
    assert [b["version"] for b in xla["known_bad"]] == ["2.8.0"]
    _, out, _ = run(capsys, "matrix", "--json")
    assert {(r["package"], r["version"]) for r in json.loads(out)["releases"]} >= {("torch_xla", "2.8.1")}


def test_broken_override_is_reported_in_one_line(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[rows]]\nplatform = "cpu"\nbackend = "x"\ntorch = "2.9"\nstatus = "great"\n')
    monkeypatch.setenv("ACCELPORT_COMPAT_MATRIX", str(bad))
    code, out, _ = run(capsys, "matrix", "--json")
    data = json.loads(out)
    assert code == 1 and data["kind"] == "CompatMatrixError"
    assert str(bad) in data["error"] and "rows[0].status" in data["error"]


# -- ci-matrix ------------------------------------------------------------------------------


def ci(capsys: pytest.CaptureFixture[str], *args: str) -> list[dict[str, object]]:
    code, out, err = run(capsys, "ci-matrix", *args)
    assert code == 0, err
    assert len(out.strip().splitlines()) == 1  # the github format is one line for $GITHUB_OUTPUT
    return json.loads(out)["include"]


def test_ci_matrix_lists_the_working_combinations(capsys: pytest.CaptureFixture[str]) -> None:
    entries = ci(capsys)
    keys = {(e["platform"], e["torch"], e["backend"]) for e in entries}
    assert ("gcp-tpu", "2.9", "xla") in keys and ("gcp-tpu", "2.13", "tpu") in keys
    assert ("aws-neuron", "2.14", "neuron") in keys and ("nvidia-gpu", "2.13", "cuda") in keys
    assert ("gcp-tpu", "2.13", "xla") not in keys  # deprecated: not by default
    assert ("aws-neuron", "2.9", "neuron-xla") not in keys
    assert ("gcp-tpu", "2.10", "xla") not in keys  # unsupported
    for e in entries:
        assert set(e) == {"platform", "torch", "backend", "python", "runner", "status", "install", "pip_args"}
        assert e["status"] in ("recommended", "supported", "experimental")
        assert str(e["install"]).startswith(f"torch=={e['torch']}.*")
    assert len(entries) < 256  # GitHub's limit on jobs per matrix


def test_ci_matrix_python_fits_torch_package_and_accelport(capsys: pytest.CaptureFixture[str]) -> None:
    by = {(e["platform"], e["torch"], e["backend"]): e for e in ci(capsys)}
    assert by[("gcp-tpu", "2.1", "xla")]["python"] == "3.11"  # torch_xla 2.1: up to 3.11
    # torch 2.9 has 3.14 and torch_xla 2.9.0 3.13, but the libtpu its tpu extra pins stops at 3.12.
    assert by[("gcp-tpu", "2.9", "xla")]["python"] == "3.12"
    assert by[("cpu", "2.9", "xla")]["python"] == "3.13"  # no tpu extra, no libtpu
    assert by[("aws-neuron", "2.14", "neuron")]["python"] == "3.14"
    assert by[("cpu", "2.13", "cpu")]["python"] == "3.14"  # torch 2.13 has no 3.15 wheel
    assert by[("cpu", "2.15", "cpu")]["python"] == "3.15"
    assert by[("gcp-tpu", "2.9", "xla")]["install"] == "torch==2.9.* torch_xla[tpu]==2.9.*"
    # torch_xla[tpu] 2.1 to 2.6 pins a libtpu-nightly only Google's page serves.
    assert by[("gcp-tpu", "2.6", "xla")]["pip_args"].endswith(
        " -f https://storage.googleapis.com/libtpu-releases/index.html")
    assert "-f" not in by[("gcp-tpu", "2.7", "xla")]["pip_args"]


def _through_bash(words: str) -> list[str]:
    """The arguments a command gets when ``words`` are pasted into a bash command line."""
    import subprocess

    out = subprocess.run(["bash", "-c", 'printf "%s\\n" ' + words], capture_output=True, text=True,
                         timeout=30, check=True)
    return out.stdout.splitlines()


def test_ci_matrix_pip_args_are_safe_in_a_shell(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import shlex
    import subprocess

    monkeypatch.chdir(tmp_path)  # a redirection would write here
    entries = ci(capsys, "--status", "recommended,supported,experimental,deprecated")
    neuron = "https://pip.repos.neuron.amazonaws.com"
    by = {(e["platform"], e["torch"], e["backend"]): e for e in entries}
    assert by[("gcp-tpu", "2.13", "tpu")]["install"] == "torch==2.13.* torch-tpu>=0.2.0"  # unchanged
    assert _through_bash(by[("gcp-tpu", "2.13", "tpu")]["pip_args"]) == ["torch==2.13.*", "torch-tpu>=0.2.0"]
    assert _through_bash(by[("aws-neuron", "2.14", "neuron")]["pip_args"]) == [
        "torch==2.14.*", "torch-neuronx==2.14.3.*", "--extra-index-url", neuron]
    assert _through_bash(by[("cpu", "2.13", "cpu")]["pip_args"]) == ["torch==2.13.*"]
    for e in entries:
        args = _through_bash(str(e["pip_args"]))
        # The same requirements as `install` (what the noxfile splits), plus the index pip needs.
        requirements = shlex.split(str(e["install"]))
        needs_index = any(r.startswith("torch-neuronx") for r in requirements)
        # torch_xla[tpu] 2.1 to 2.6 pins a libtpu-nightly that only Google's page serves.
        links = ["-f", "https://storage.googleapis.com/libtpu-releases/index.html"] if (
            e["platform"] == "gcp-tpu" and e["backend"] == "xla"
            and tuple(map(int, str(e["torch"]).split("."))) <= (2, 6)) else []
        assert args == requirements + (["--extra-index-url", neuron] if needs_index else []) + links, e
        assert shlex.split(str(e["pip_args"])) == args
        assert needs_index == (e["platform"] == "aws-neuron"), e
        # As a GitHub `run:` line: no word is taken as a redirection, a glob or a variable.
        subprocess.run(["bash", "-ec", f"printf '%s\\n' {e['pip_args']} > argv"], check=True, timeout=30)
        assert (tmp_path / "argv").read_text().splitlines() == args
        assert sorted(p.name for p in tmp_path.iterdir()) == ["argv"]
    # Why pip_args exists: pasted unquoted, `install` loses the pin to a redirection.
    (tmp_path / "argv").unlink()
    assert _through_bash("torch==2.13.* torch-tpu>=0.2.0") == []
    assert (tmp_path / "=0.2.0").read_text().splitlines() == ["torch==2.13.*", "torch-tpu"]


def test_ci_matrix_default_and_custom_runners(capsys: pytest.CaptureFixture[str]) -> None:
    runners = {e["platform"]: e["runner"] for e in ci(capsys)}
    assert runners == {"cpu": "ubuntu-latest", "nvidia-gpu": ["self-hosted", "gpu"],
                       "gcp-tpu": ["self-hosted", "tpu"], "aws-neuron": ["self-hosted", "trainium"]}
    entries = ci(capsys, "--platform", "gcp-tpu", "--runner", "gcp-tpu=self-hosted,tpu-v5e",
                 "--runner", "cpu=ubuntu-24.04")
    assert {json.dumps(e["runner"]) for e in entries} == {'["self-hosted", "tpu-v5e"]'}
    entries = ci(capsys, "--platform", "cpu", "--runner", "cpu=ubuntu-24.04")
    assert {e["runner"] for e in entries} == {"ubuntu-24.04"}


def test_ci_matrix_filters(capsys: pytest.CaptureFixture[str]) -> None:
    entries = ci(capsys, "--platform", "gcp-tpu,aws-neuron", "--torch", "2.9", "--torch", "2.14.0+cpu",
                 "--status", "recommended,deprecated")
    assert sorted((e["platform"], e["torch"], e["backend"], e["status"]) for e in entries) == [
        ("aws-neuron", "2.14", "neuron", "recommended"),
        ("aws-neuron", "2.9", "neuron-xla", "deprecated"),
        ("gcp-tpu", "2.14", "tpu", "recommended"),
        ("gcp-tpu", "2.14", "xla", "deprecated"),
        ("gcp-tpu", "2.9", "xla", "recommended"),
    ]


def test_ci_matrix_json_format_is_indented(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "ci-matrix", "--platform", "cpu", "--format", "json")
    assert code == 0 and len(out.splitlines()) > 5 and json.loads(out)["include"]


@pytest.mark.parametrize("args,code,words", [
    (("--platform", "mars"), 2, ["unknown platform 'mars'", "aws-neuron"]),
    (("--torch", "banana"), 2, ["invalid torch version 'banana'"]),
    (("--status", "stable"), 2, ["unknown status 'stable'", "recommended, supported"]),
    (("--runner", "gcp-tpu"), 2, ["PLATFORM=LABEL"]),
    (("--runner", "moon=x"), 2, ["unknown platform 'moon'"]),
    # A torch version the matrix has no row for is a mistake, not an empty answer.
    (("--torch", "1.0"), 2, ["--torch 1.0: the compatibility matrix has no row for torch 1.0",
                             "it covers torch 2.1 to"]),
    (("--platform", "cpu", "--torch", "2.9,3.0"), 2, ["--torch 3.0:", "on cpu (it covers torch 2.1 to"]),
])
def test_ci_matrix_errors(capsys: pytest.CaptureFixture[str], args: tuple[str, ...], code: int,
                          words: list[str]) -> None:
    got, out, err = run(capsys, "ci-matrix", *args)
    assert got == code and out == "" and all(w in err for w in words), err
    for flag in (("--json",), ("--format", "json")):
        got, out, _ = run(capsys, "ci-matrix", *args, *flag)
        data = json.loads(out)
        assert got == code and all(w in data["error"] for w in words)


def test_ci_matrix_with_no_match(capsys: pytest.CaptureFixture[str]) -> None:
    # For a workflow (the default format) an empty list is an answer: the workflow skips the cloud
    # jobs on count == 0. As JSON for a person or a script it is an error saying what to do.
    # (torch 2.10 has rows on gcp-tpu, none that works: unlike 1.0, it is not a usage error.)
    got, out, err = run(capsys, "ci-matrix", "--platform", "gcp-tpu", "--torch", "2.10")
    assert got == 0 and json.loads(out) == {"include": []} and "no combination matches" in err
    for flag in (("--json",), ("--format", "json")):
        got, out, _ = run(capsys, "ci-matrix", "--platform", "gcp-tpu", "--torch", "2.10", *flag)
        data = json.loads(out)
        assert got == 1 and "no combination matches" in data["error"] and "empty matrix" in data["error"]


def test_matrix_commands_import_no_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, contextlib, io\nfrom accelport.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    main(['matrix']); main(['matrix', '--platform', 'gcp-tpu', '--json']); main(['ci-matrix'])\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torch_xla', 'torch_tpu')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
