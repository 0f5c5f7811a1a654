"""The pytest plugin, run through pytest's own ``pytester``: option, marker, fixture, and idleness.

On this machine ``cpu`` is available and ``cuda`` is not (a CPU-only torch, no
GPU): a real unavailable backend, with its probe's real reason.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

import accelport as ap
from accelport.runtime.state import RUNTIME

pytest_plugins = ["pytester"]

STAND_IN_BACKEND = (
    "# A stand-in second backend that runs on the host CPU: this machine has only one\n"
    "# real available backend, and the fixture must be seen running once per backend.\n"
    "import accelport as ap\n"
    "from accelport._backends.cpu import CpuBackend\n"
    "class SecondCpu(CpuBackend):\n"
    "    name = 'second-cpu'\n"
    "@ap.hookimpl\n"
    "def accelport_register_backends(register):\n"
    "    register(SecondCpu)\n"
)


@pytest.fixture(scope="module", autouse=True)
def _torch_loaded_once() -> Iterator[None]:
    # pytester's in-process runs drop the modules they imported afterwards; torch cannot be
    # imported twice in one process, so it (and the backends) are loaded out here first.
    ap.use("cpu")
    ap.device()
    RUNTIME.reset()
    yield


def _reason(name: str) -> str:
    return next(b.reason for b in ap.backends() if b.name == name)


def test_the_plugin_is_registered_under_pytest11() -> None:
    (entry,) = [e for e in md.entry_points(group="pytest11") if e.name == "accelport"]
    assert entry.value == "accelport.pytest_plugin"


def test_importing_the_plugin_loads_neither_torch_nor_the_plugin_manager() -> None:
    code = ("import sys, json, accelport.pytest_plugin\n"
            "print(json.dumps(sorted(m for m in ('torch', 'accelport.plugins.host', 'accelport.runtime.selection') "
            "if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_a_suite_that_does_not_use_it_sees_no_change(pytester: pytest.Pytester) -> None:
    # A fresh process: the plugin is loaded, yet nothing is probed, selected or set.
    pytester.makepyfile(
        """
        import os, sys
        def test_untouched():
            assert "accelport.plugins.host" not in sys.modules
            assert "torch" not in sys.modules
            assert "ACCELPORT_BACKEND" not in os.environ
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert not any(line.startswith("accelport") for line in result.outlines)


def test_marker_for_an_unavailable_backend_skips_with_its_probe_reason(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        @pytest.mark.accelport(backends=["cuda"])
        def test_on_gpu():
            raise AssertionError("must not run without a GPU")
        """
    )
    result = pytester.runpytest("--strict-markers", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines([f"SKIPPED*cuda: {_reason('cuda')}*"])


def test_marker_runs_the_test_on_the_first_listed_backend_available(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import accelport as ap
        from accelport.runtime.state import RUNTIME

        @pytest.fixture
        def device():
            return ap.device()  # fixtures see the marker's backend too

        @pytest.mark.accelport(backends=["cuda", "cpu"])
        def test_marked(device):
            assert ap.backend().name == "cpu" and device.type == "cpu"

        def test_next_test_starts_from_the_previous_state():
            assert RUNTIME.explicit is None and RUNTIME._backend is None
        """
    )
    pytester.runpytest("--strict-markers").assert_outcomes(passed=2)


def test_marker_min_devices_skips_when_too_few(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        @pytest.mark.accelport(backends=["cpu"], min_devices=2)
        def test_two_devices():
            raise AssertionError("cpu has one device")
        """
    )
    result = pytester.runpytest("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED*cpu: 1 device(s) here, the test needs 2*"])


def test_a_typo_in_the_marker_is_an_error_naming_the_nearest_backend(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        @pytest.mark.accelport(backends=["cdua"])
        def test_typo():
            pass

        def test_other():
            pass
        """
    )
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.INTERRUPTED  # a collection error stops the run
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([
        "*unknown backend 'cdua' (from the accelport marker of test_a_typo_in_the_marker*::test_typo)."
        " Did you mean 'cuda'? Known backends: cpu, cuda*",
    ])
    assert "skipped" not in result.stdout.str()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ('"cpu"', "name the backends as backends=[...], not as positional arguments"),
        ('backend=["cpu"]', "unknown argument 'backend'. Did you mean 'backends'?"),
        ("backends=[]", "backends must be a non-empty list of backend names"),
        ("min_devices=1", "backends must be a non-empty list of backend names"),
        ('backends=["cpu"], min_devices=0', "min_devices must be a positive integer (got 0)"),
        ('backends=["cpu"], min_devices=True', "min_devices must be a positive integer (got True)"),
    ],
)
def test_a_malformed_marker_says_what_is_wrong(pytester: pytest.Pytester, arguments: str,
                                              message: str) -> None:
    pytester.makepyfile(f"import pytest\n@pytest.mark.accelport({arguments})\ndef test_x():\n    pass\n")
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    assert message in result.stdout.str()


def test_option_selects_cpu_for_the_session(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import os, subprocess, sys
        import accelport as ap

        def test_selected():
            assert ap.backend().name == "cpu"
            assert "ACCELPORT_BACKEND=cpu" in ap.backend().reason

        def test_subprocesses_follow():
            code = "import accelport as ap; print(ap.backend().name)"
            assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "cpu"
        """
    )
    result = pytester.runpytest("--accelport-backend", "cpu")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([f"accelport: cpu (--accelport-backend): {_reason('cpu')}"])
    assert "ACCELPORT_BACKEND" not in os.environ  # put back when the session ends


def test_option_keeps_other_backends_marked_tests_out(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        @pytest.mark.accelport(backends=["cuda"])
        def test_gpu_only():
            pass
        """
    )
    result = pytester.runpytest("--accelport-backend", "cpu", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED*cuda: this session runs on cpu (--accelport-backend cpu)*"])


def test_option_with_an_unknown_name_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest("--accelport-backend", "cpuu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        "*unknown backend 'cpuu' (from --accelport-backend). Did you mean 'cpu'? Known backends: cpu, cuda*"
    ])


def test_a_long_name_is_quoted_cut_and_redacted_as_ap_use_quotes_it(pytester: pytest.Pytester,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile('import pytest\n@pytest.mark.accelport(backends=["x" * 100_000])\ndef test_x():\n    pass\n')
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    cut = "x" * 40 + "... [cut: 100000 characters in all]"
    assert f"unknown backend '{cut}' (from the accelport marker of " in result.stdout.str()
    assert "x" * 1000 not in result.stdout.str()  # it was quoted whole
    secret = "s3cr3t-value-of-a-token"
    monkeypatch.setenv("HF_TOKEN", secret)
    result = pytester.runpytest("--accelport-backend", secret + "x" * 200)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unknown backend '<redacted>*' (from --accelport-backend).*"])
    assert secret not in result.stderr.str() + result.stdout.str()  # redacted of the patterns only, it showed


def test_option_with_an_unavailable_backend_is_a_usage_error_with_its_reason(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest("--accelport-backend", "cuda")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*backend 'cuda' (from --accelport-backend) is not available: {_reason('cuda')}*"])


def test_fixture_runs_the_test_once_per_available_backend(pytester: pytest.Pytester,
                                                          install_plugin) -> None:  # type: ignore[no-untyped-def]
    install_plugin("second-cpu", "second_cpu_backend", STAND_IN_BACKEND)
    available = [b.name for b in ap.backends() if b.available]
    assert sorted(available) == ["cpu", "second-cpu"]  # cuda is registered but unavailable
    pytester.makepyfile(
        """
        import accelport as ap

        def test_each(ap_backend):
            assert ap.backend() is ap_backend
            assert ap.device().type == "cpu"
        """
    )
    result = pytester.runpytest("-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines_random(["*test_each?cpu? PASSED*", "*test_each?second-cpu? PASSED*"])
    assert "cuda" not in result.stdout.str()


def test_fixture_with_a_marker_is_one_test_per_listed_backend(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        @pytest.mark.accelport(backends=["cpu", "cuda"])
        def test_each(ap_backend):
            assert ap_backend.name == "cpu"
        """
    )
    result = pytester.runpytest("-v", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines_random(["*test_each?cpu? PASSED*", f"SKIPPED*cuda: {_reason('cuda')}*"])


def test_fixture_puts_the_previous_runtime_state_back(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import accelport as ap
        from accelport.runtime.state import RUNTIME

        def test_uses(ap_backend):
            assert RUNTIME.explicit == "cpu"
            RUNTIME.reset()  # even a test that resets the runtime leaves nothing behind

        def test_after():
            assert RUNTIME.explicit is None and RUNTIME._backend is None
        """
    )
    pytester.runpytest().assert_outcomes(passed=2)


def test_fixture_requested_at_run_time_fails_with_what_to_do(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        def test_dynamic(request):
            request.getfixturevalue("ap_backend")
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    assert "request it as an argument of the test" in result.stdout.str()


def test_the_plugin_can_be_turned_off(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest("-p", "no:accelport", "--accelport-backend", "cpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unrecognized arguments: --accelport-backend*"])


def test_runtime_scope_restores_the_selection_and_counters() -> None:
    before = ap.backend()
    tracker = RUNTIME.tracker
    with RUNTIME.scoped():
        ap.use("cpu")
        assert RUNTIME.explicit == "cpu" and RUNTIME.tracker is not tracker
        RUNTIME.reset()
    assert RUNTIME.explicit is None
    assert ap.backend() is before and RUNTIME.tracker is tracker
