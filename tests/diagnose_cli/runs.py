"""How the tests of ``accelport diagnose`` start a run: the same conditions whatever the caller inherited.

Every run, plain ``python`` or under diagnose, gets an environment without accelport's
settings and without the interpreter's settings that change what a script prints or how
it ends (warning filters, stream encodings, ``-P``), and starts with SIGINT and SIGTERM at
their default action, unblocked: a suite started under ``nohup`` or with ``&`` from a
script (SIGINT ignored) sees the same runs as one started from a terminal.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from collections.abc import Mapping

from tests.conftest import default_signals

__all__ = ["SCRIPTS", "REPO", "child_env", "default_signals", "run", "run_bytes", "allocator_free"]

SCRIPTS = pathlib.Path(__file__).resolve().parent / "scripts"
REPO = SCRIPTS.parent.parent.parent

#: Settings of the interpreter (and of torch's logging) that change a run's output or its end.
_DROPPED = frozenset({
    "PYTHONWARNINGS", "PYTHONIOENCODING", "PYTHONSAFEPATH", "PYTHONDEVMODE", "PYTHONUTF8", "PYTHONINSPECT",
    "PYTHONOPTIMIZE", "PYTHONBREAKPOINT", "PYTHONSTARTUP", "PYTHONFAULTHANDLER", "PYTHONTRACEMALLOC",
    "PYTHONASYNCIODEBUG", "PYTHONLEGACYWINDOWSSTDIO", "TORCH_LOGS", "TORCH_COMPILE_DEBUG", "TORCHDYNAMO_VERBOSE",
})


def allocator_free(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without what changes how the C allocator grows the heap (glibc's ``MALLOC_*`` and tunables, a
    preloaded jemalloc or tcmalloc): the memory rules judge growth from resident memory, and a run judged
    silent on one allocator's settings must be the run every machine sees."""
    return {k: v for k, v in environ.items() if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES",
                                                                                          "LD_PRELOAD")}


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in allocator_free(os.environ).items() if not k.startswith("ACCELPORT_") and k not in _DROPPED}
    return {**env, **(extra or {})}


def run(*args: str, cwd: pathlib.Path | str = REPO, stdin: str | None = None, diagnose: bool = True,
        env: Mapping[str, str] | None = None, ignore: tuple[int, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``accelport diagnose ARGS`` (or, with ``diagnose=False``, ``python ARGS``) in a subprocess."""
    command = [sys.executable, "-m", "accelport", "diagnose", *args] if diagnose else [sys.executable, *args]
    # The timeout guards against a hang; it measures nothing.
    return subprocess.run(command, cwd=cwd, input=stdin, capture_output=True, text=True, timeout=600,
                          env=child_env(env), preexec_fn=lambda: default_signals(ignore))


def run_bytes(*args: str, diagnose: bool = True, env: Mapping[str, str] | None = None,
              cwd: pathlib.Path | str = REPO) -> subprocess.CompletedProcess[bytes]:
    """As :func:`run`, the output as bytes (for a script that prints what no encoding decodes)."""
    command = [sys.executable, "-m", "accelport", "diagnose", *args] if diagnose else [sys.executable, *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, timeout=600, env=child_env(env),
                          preexec_fn=default_signals)
