"""ap.save / ap.load: resuming is bit-identical, a killed writer loses nothing, files stay small."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import accelport as ap
from tests.conftest import REPO

SCRIPTS = Path(REPO) / "tests" / "scripts"


def run_script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_resume_in_a_new_process_is_bit_identical_to_an_uninterrupted_run(tmp_path: Path) -> None:
    import torch

    import importlib.util

    # The uninterrupted run and the first K steps here; the rest in a new process.
    spec = importlib.util.spec_from_file_location("resume_job", SCRIPTS / "resume.py")
    job = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(job)  # type: ignore[union-attr]
    threads = torch.get_num_threads()
    try:
        job.main("full-and-part", str(tmp_path))
    finally:
        torch.set_num_threads(threads)
    second = run_script(str(SCRIPTS / "resume.py"), "resume", str(tmp_path))
    assert second.returncode == 0, second.stderr
    full = torch.load(tmp_path / "full.pt")
    resumed = torch.load(tmp_path / "resumed.pt")
    assert full.keys() == resumed.keys()
    for key in full:
        assert torch.equal(full[key], resumed[key]), key
    # The control: stopping at step K really changed something that resuming had to restore.
    ckpt = torch.load(tmp_path / "ckpt.pt")
    assert not torch.equal(ckpt["model"]["0.weight"], full["0.weight"])


def test_sigkill_in_the_middle_of_save_leaves_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    import torch

    ap.use("cpu")
    path = tmp_path / "ckpt.pt"
    previous = {"version": 1, "w": torch.arange(1000.0)}
    ap.save(previous, path)
    before = path.read_bytes()

    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")}
    child = subprocess.Popen([sys.executable, str(SCRIPTS / "big_save.py"), str(path)],
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "saving"
        # Kill it once the temporary file holds some, but not all, of the ~400 MB.
        deadline = time.monotonic() + 60
        tmp = []
        while time.monotonic() < deadline:
            tmp = [p for p in tmp_path.iterdir() if p.name.endswith(".accelport.tmp")]
            if tmp and tmp[0].stat().st_size > 8 * 2**20:
                break
            time.sleep(0.001)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert tmp, "the child never started writing its temporary file"
    size = tmp[0].stat().st_size
    assert 0 < size < 400 * 2**20, f"the kill did not land mid-write (temp file holds {size} bytes)"

    assert path.read_bytes() == before  # untouched, byte for byte
    back = ap.load(path)
    assert back["version"] == 1 and torch.equal(back["w"], previous["w"])

    # The orphan of the killed writer is removed by the next save on this host.
    ap.save({"version": 3}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
    assert ap.load(path)["version"] == 3


def test_a_temp_file_of_a_live_writer_is_left_alone(tmp_path: Path) -> None:
    import socket

    ap.use("cpu")
    live = tmp_path / f".ckpt.pt.{socket.gethostname()}.{os.getppid()}.abc.accelport.tmp"
    other = tmp_path / ".ckpt.pt.some-other-host.1.abc.accelport.tmp"
    live.write_bytes(b"partial")
    other.write_bytes(b"partial")
    ap.save({"a": 1}, tmp_path / "ckpt.pt")
    assert live.exists() and other.exists()


def test_a_view_is_saved_without_the_rest_of_its_storage(tmp_path: Path) -> None:
    import torch

    ap.use("cpu")
    big = torch.zeros(1_000_000)
    ap.save({"head": big[:10]}, tmp_path / "view.pt")
    assert (tmp_path / "view.pt").stat().st_size < 10_000
    assert torch.equal(ap.load(tmp_path / "view.pt")["head"], torch.zeros(10))


def test_state_dict_metadata_survives_the_round_trip(tmp_path: Path) -> None:
    import torch

    ap.use("cpu")
    model = torch.nn.BatchNorm1d(3)
    ap.save(model.state_dict(), tmp_path / "bn.pt")
    back = ap.load(tmp_path / "bn.pt")
    assert back._metadata == model.state_dict()._metadata  # load_state_dict reads module versions here
    torch.nn.BatchNorm1d(3).load_state_dict(back)


class Opaque:
    """Not a tensor or container: only weights_only=False may unpickle it."""

    def __init__(self, n: int) -> None:
        self.n = n


def test_load_refuses_arbitrary_objects_unless_asked(tmp_path: Path) -> None:
    import pickle

    ap.use("cpu")
    ap.save({"obj": Opaque(4)}, tmp_path / "obj.pt")
    with pytest.raises(ap.AccelportError, match="weights_only=True refuses") as info:
        ap.load(tmp_path / "obj.pt")
    assert isinstance(info.value.__cause__, pickle.UnpicklingError)
    assert ap.load(tmp_path / "obj.pt", weights_only=False)["obj"].n == 4


def test_load_of_a_missing_file_says_which(tmp_path: Path) -> None:
    ap.use("cpu")
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*missing.pt"):
        ap.load(tmp_path / "missing.pt")


def test_save_to_a_directory_and_load_of_a_non_checkpoint_say_what_is_wrong(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch

    import accelport as ap

    ap.use("cpu")
    with pytest.raises(ap.AccelportError, match="is a directory; give a file path such as"):
        ap.save({"w": torch.ones(2)}, tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing was written
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    with pytest.raises(ap.AccelportError, match="is not a checkpoint torch can read"):
        ap.load(text)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        ap.load(tmp_path / "missing.pt")
