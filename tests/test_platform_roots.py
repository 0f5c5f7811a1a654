"""Detection roots taken literally, a missing ACCELPORT_SYSROOT said out loud, and a forking neuron-ls
that leaves nothing behind. The trees are stand-ins for real hosts (tests/fakes.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from accelport import platform
from accelport.cli import main
from accelport.errors import AccelportError
from accelport.platform import detect
from tests import fakes


def test_a_sysroot_with_glob_characters_is_a_path_not_a_pattern(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # "tree*" as a pattern would also match the TPU VM next to it; "host[1]" would match only "host1".
    fakes.bare_cpu_host(tmp_path / "tree*")
    fakes.tpu_vm(tmp_path / "tree-tpu", "v5e", chips=4)
    monkeypatch.setenv("ACCELPORT_SYSROOT", str(tmp_path / "tree*"))
    assert detect().name == "cpu"
    fakes.neuron_host(tmp_path / "host[1]", 16, "trn1.32xlarge")
    fakes.bare_cpu_host(tmp_path / "host1")
    monkeypatch.setenv("ACCELPORT_SYSROOT", str(tmp_path / "host[1]"))
    assert (detect().name, detect().device_count) == ("aws-neuron", 16)


@pytest.mark.parametrize("kind", ["missing", "a file"])
def test_a_sysroot_that_is_no_directory_is_an_error_not_a_cpu_host(tmp_path: Path, kind: str,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "no-such-tree"
    if kind == "a file":
        root.write_text("x")
    monkeypatch.setenv("ACCELPORT_SYSROOT", str(root))
    with pytest.raises(AccelportError, match=rf"ACCELPORT_SYSROOT='{root}' is not a directory, so detection "
                                             r"would find no device there and report a CPU host: point it at"):
        detect()
    assert detect(str(tmp_path)).name == "cpu"  # an explicit root is the caller's, and wins
    # doctor reports it as a problem (exit 1), in a report that is whole otherwise.
    assert main(["doctor", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    problems = [f for f in data["findings"] if f["severity"] == "problem"]
    assert any(f["title"].startswith(f"ACCELPORT_SYSROOT='{root}' is not a directory") and
               f["fix"] == "fix or unset ACCELPORT_SYSROOT" for f in problems), problems
    assert data["platform"]["evidence"][0].startswith("ACCELPORT_SYSROOT=")


def _gone(pid: int) -> bool:
    """The process no longer runs (absent, or a zombie waiting for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc to see which processes run")
def test_a_forking_neuron_ls_leaves_no_children_after_the_timeout(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    # The fake records its two children within milliseconds; 2 s leaves that a wide margin on a busy machine.
    monkeypatch.setattr(platform, "NEURON_LS_TIMEOUT", 2.0)
    fakes.neuron_host(tmp_path, 4, "trn2.48xlarge")
    pids = tmp_path / "pids"
    fakes.neuron_ls(tmp_path, f"sleep 120 &\necho $! >> {pids}\nsleep 120 &\necho $! >> {pids}\nwait\n")
    try:
        found = detect(str(tmp_path), {})
        assert any("did not answer within 2 s" in e for e in found.evidence)
        children = [int(p) for p in pids.read_text().split()]
        assert len(children) == 2
        for _ in range(200):  # SIGKILL is delivered at once; init may take a moment to reap
            if all(_gone(p) for p in children):
                break
            time.sleep(0.05)
        assert all(_gone(p) for p in children), [p for p in children if not _gone(p)]
    finally:
        for pid in [int(p) for p in pids.read_text().split()] if pids.exists() else []:
            if not _gone(pid):
                os.kill(pid, 9)  # only the sleeps this test started
