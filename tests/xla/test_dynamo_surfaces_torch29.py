"""The dynamo surfaces the compiled-function diagnosis reads, pinned on the xla environment's torch (2.9).

The checks live in tests/diagnose/dynamo_surfaces.py; the default environment runs the
same ones on torch 2.13 (tests/diagnose/test_dynamo_surfaces.py).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.xla


class _Isolated:
    """Each check in a fresh interpreter: dynamo's counters and config are process-wide, and the
    XLA tests before these (torch_xla imported, models compiled) must not change what they see."""

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        def run() -> None:
            code = f"from tests.diagnose import dynamo_surfaces as s\ns.{name}()\n"
            out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                                 timeout=600)
            assert out.returncode == 0, f"{name} failed:\n{out.stderr[-3000:]}"

        return run


surfaces = _Isolated()


def test_this_torch_version_is_pinned() -> None:
    surfaces.check_version_is_pinned()


def test_guard_failures_and_compilation_metrics() -> None:
    surfaces.check_guard_failures_and_compilation_metrics()


def test_dynamic_default_compiles_twice() -> None:
    surfaces.check_dynamic_default_compiles_twice()


def test_recompile_limit_warning() -> None:
    surfaces.check_recompile_limit_warning()


def test_graph_break_reasons() -> None:
    surfaces.check_graph_break_reasons()


def test_hooks_the_tracer_needs() -> None:
    surfaces.check_hooks_the_tracer_needs()


def test_the_observer_reads_them_all() -> None:
    surfaces.check_the_observer_reads_them_all()


def test_torch_xla_turns_automatic_dynamic_off() -> None:
    surfaces.check_torch_xla_turns_automatic_dynamic_off()
