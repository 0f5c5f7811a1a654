"""Test environments. nox, not tox: each environment needs its own pinned torch
(torch_xla X.Y needs torch X.Y exactly; torch-tpu needs torch 2.11 to 2.15), and
nox sessions are plain Python, so the pins, markers and environment variables
live in one readable file.

    nox                 # every suite: default (torch CPU), xla (XLA:CPU), tpu (torch-tpu import checks)
    nox -s demo         # the main job: environment check + portable example
    nox -s hardware     # the contract suite on a TPU VM or Trainium host (cloud CI jobs)
"""

from __future__ import annotations

import os

import nox

# Virtual environments outlive a fresh clone (torch_xla's is about 7 GB): reuse them.
nox.options.envdir = os.environ.get(
    "ACCELPORT_NOX_ENVDIR", os.path.join(os.path.expanduser("~"), ".cache", "accelport", "nox")
)
nox.options.reuse_venv = "yes"
nox.options.sessions = ["tests", "xla", "tpu"]
nox.options.error_on_missing_interpreters = True

TORCH = os.environ.get("ACCELPORT_TEST_TORCH", "2.13.0")  # the CPU build this machine serves
XLA_TORCH = "2.9.0"  # torch_xla's last release; it needs this exact torch
TPU_TORCH = "2.13.0"
TORCH_TPU = "0.2.0"  # the tests check our reading of this release's metadata (torch range, libtpu)


def _pytest(session: nox.Session, *args: str, env: dict[str, str] | None = None) -> None:
    # pytest exits 5 when it collects nothing; nox treats any non-zero exit as failure,
    # so an environment that silently lost its tests fails loudly.
    session.run("pytest", *args, *session.posargs, env=env or {})


#: The linters, pinned: a new release with new rules must not turn a green main red overnight.
LINT = ("ruff==0.17.6", "mypy==2.4.1")


@nox.session
def tests(session: nox.Session) -> None:
    """The whole suite on the default environment: latest torch CPU build, then ruff and mypy."""
    session.install(f"torch=={TORCH}", "numpy", "-e", ".[test]", *LINT)
    # StatefulDataLoader for the resume tests; without its deps (requests, urllib3: unused by it, and its
    # torch requirement must not move the pin above).
    session.install("--no-deps", "torchdata==0.11.0")
    # Training loops that live in a framework, for accelport diagnose's tests (tests/diagnose_cli/
    # test_real_scripts.py): releases that install beside the pinned torch without replacing it.
    session.install("transformers==5.24.0", "accelerate==1.16.0", "lightning==2.6.6")
    session.run("ruff", "check", "accelport", "backends", "tests", "benchmarks", "_build")
    session.run("mypy")  # [tool.mypy] in pyproject.toml: the package and backends/
    _pytest(session, "-m", "not xla and not tpu_pkg")


@nox.session
def xla(session: nox.Session) -> None:
    """The xla backend for real on XLA:CPU (torch 2.9.0 + torch_xla 2.9.0)."""
    session.install(f"torch=={XLA_TORCH}", f"torch_xla=={XLA_TORCH}", "numpy", "-e", ".[test]")
    _pytest(session, "-m", "xla", env={"PJRT_DEVICE": "CPU"})


@nox.session
def tpu(session: nox.Session) -> None:
    """Our assumptions about TorchTPU, checked against the real torch-tpu package (no TPU needed)."""
    session.install(f"torch=={TPU_TORCH}", f"torch-tpu=={TORCH_TPU}", "numpy", "-e", ".[test]")
    # pytest itself must not autoload TorchTPU (collection imports torch); the tests start
    # their own subprocesses with autoload on, each with a timeout.
    _pytest(session, "-m", "tpu_pkg", env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})


@nox.session
def hardware(session: nox.Session) -> None:
    """The backend contract on accelerator hardware, for one row of `accelport ci-matrix`.

    A cloud CI job sets ACCELPORT_CI_BACKEND and ACCELPORT_CI_PIP_ARGS from the row's
    `backend` and `pip_args` fields (e.g. tpu and "'torch==2.13.*' 'torch-tpu>=0.2.0'"), so the
    packages, and the index or find-links page a package needs (AWS's for torch-neuronx,
    libtpu's for torch_xla[tpu] up to 2.6), come from the compatibility matrix, not from a
    second table here. --accelport-backend makes a runner on which that backend cannot run
    fail, not skip.
    """
    import shlex

    backend = os.environ.get("ACCELPORT_CI_BACKEND", "").strip()
    pip_args = shlex.split(os.environ.get("ACCELPORT_CI_PIP_ARGS", ""))
    if not backend or not pip_args:
        session.error(
            "set ACCELPORT_CI_BACKEND and ACCELPORT_CI_PIP_ARGS to the `backend` and `pip_args` fields of a row "
            # Whether each is set, not its value: an index URL in pip_args may carry a token.
            f"of `accelport ci-matrix` (ACCELPORT_CI_BACKEND {'set' if backend else 'unset'}, "
            f"ACCELPORT_CI_PIP_ARGS {'set' if pip_args else 'unset'})"
        )
    session.install(*pip_args, "numpy", "-e", ".[test]")
    session.run("accelport", "backends")
    # -m "": pyproject's addopts deselect the xla-marked tests (the default environment
    # has no torch_xla), which here are exactly the contract tests of xla and neuron-xla.
    _pytest(session, "tests/backends/test_contract.py", f"--accelport-backend={backend}", "-m", "")


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: check the environment, then train the portable example on the best backend."""
    # What a user installs: the built package, not an editable checkout.
    session.install(f"torch=={TORCH}", "numpy", ".")
    session.run("accelport", "doctor")
    session.run("python", "examples/quickstart.py")
