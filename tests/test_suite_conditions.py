"""The suite's own guards: a child started through them answers stop signals as a user's process does, and
the environment a launch or a shell exported does not reach the tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.conftest import DEFAULT_SIGNALS, REPO, STOP_SIGNALS, default_signals, scrub_environment

#: Prints the child's blocked stop signals and those it ignores. (Python itself puts its own handler on a SIGINT
#: that it finds at the default action, and leaves an ignored one ignored.)
REPORT = ("import signal\n"
          f"stops = ({', '.join(f'signal.{s.name}' for s in STOP_SIGNALS)})\n"
          "blocked = sorted(s.name for s in signal.pthread_sigmask(signal.SIG_BLOCK, []) if s in stops)\n"
          "ignored = sorted(s.name for s in stops if signal.getsignal(s) == signal.SIG_IGN)\n"
          "print(blocked, ignored)\n")


def _inherit_the_worst() -> None:
    """As a test run started under nohup with a blocked mask would pass it on: every stop signal blocked
    and ignored."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def test_the_trampoline_unblocks_and_resets_every_stop_signal() -> None:
    as_is = subprocess.run([sys.executable, "-c", REPORT], capture_output=True, text=True, timeout=120,
                           preexec_fn=_inherit_the_worst)
    # The control: both states survive exec unless undone.
    assert as_is.stdout.strip() == "['SIGHUP', 'SIGINT', 'SIGQUIT', 'SIGTERM'] ['SIGHUP', 'SIGINT', 'SIGQUIT', " \
        "'SIGTERM']", as_is.stderr
    through = subprocess.run([sys.executable, "-c", f"import subprocess, sys\nsubprocess.run([sys.executable, "
                              f"'-c', {DEFAULT_SIGNALS!r}, '-c', {REPORT!r}])"],
                             capture_output=True, text=True, timeout=120, preexec_fn=_inherit_the_worst)
    assert through.stdout.strip() == "[] []", through.stderr


def test_a_preexec_reset_unblocks_and_resets_every_stop_signal() -> None:
    def both() -> None:
        _inherit_the_worst()
        default_signals(ignore=(signal.SIGINT,))

    done = subprocess.run([sys.executable, "-c", REPORT], capture_output=True, text=True, timeout=120,
                          preexec_fn=both)
    assert done.stdout.strip() == "[] ['SIGINT']", done.stderr


def test_what_a_launch_or_a_shell_exported_is_scrubbed() -> None:
    env = {"WORLD_SIZE": "8", "RANK": "3", "MASTER_ADDR": "10.0.0.1", "PET_REDIRECTS": "3",
           "TORCHELASTIC_RESTART_COUNT": "2", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1", "ACCELPORT_BACKEND": "tpu",
           "PYTHONSAFEPATH": "1", "PYTHONPATH": f"/elsewhere{os.pathsep}{REPO}", "HOME": "/root",
           "PJRT_DEVICE": "CPU"}
    scrub_environment(env)
    assert env == {"HOME": "/root", "PJRT_DEVICE": "CPU", "PYTHONPATH": f"{REPO}{os.pathsep}/elsewhere"}
    assert not any(k in os.environ for k in ("WORLD_SIZE", "PET_REDIRECTS", "PYTHONSAFEPATH"))  # done for the run
