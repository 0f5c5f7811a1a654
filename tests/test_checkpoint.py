"""ap.save / ap.load: resuming is bit-identical, a killed writer loses nothing, files stay small."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import accelport as ap
from tests.conftest import REPO

SCRIPTS = Path(REPO) / "tests" / "scripts"


def run_script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_resume_in_a_new_process_is_bit_identical_to_an_uninterrupted_run(tmp_path: Path) -> None:
    import importlib.util

    import torch

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
            tmp = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.pt.") and p.name.endswith(".tmp")]
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
    live = tmp_path / f".ckpt.pt.{socket.gethostname()[:40]}.{os.getppid()}.abc.tmp"
    other = tmp_path / ".ckpt.pt.some-other-host.1.abc.tmp"
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


def test_save_keeps_the_umask_or_the_replaced_files_mode_and_writes_through_a_symlink(tmp_path: Path) -> None:
    ap.use("cpu")
    old = os.umask(0o022)
    try:
        ap.save({"a": 1}, tmp_path / "new.pt")
    finally:
        os.umask(old)
    assert (tmp_path / "new.pt").stat().st_mode & 0o777 == 0o644
    os.chmod(tmp_path / "new.pt", 0o640)
    ap.save({"a": 2}, tmp_path / "new.pt")
    assert (tmp_path / "new.pt").stat().st_mode & 0o777 == 0o640

    (tmp_path / "latest.pt").symlink_to("new.pt")
    ap.save({"a": 3}, tmp_path / "latest.pt")
    assert (tmp_path / "latest.pt").is_symlink() and ap.load(tmp_path / "new.pt")["a"] == 3


def test_a_name_near_the_file_system_limit_saves(tmp_path: Path) -> None:
    ap.use("cpu")
    path = tmp_path / ("c" * 250 + ".pt")
    ap.save({"a": 1}, path)
    assert ap.load(path)["a"] == 1 and sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_orphans_are_removed_before_a_save_so_a_save_that_fails_still_frees_them(tmp_path: Path) -> None:
    import socket

    ap.use("cpu")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()  # a pid that has exited
    orphan = tmp_path / f".ckpt.pt.{socket.gethostname()[:40]}.{dead}.abc.tmp"
    orphan.write_bytes(b"partial")
    with pytest.raises(Exception):  # noqa: B017 - torch refuses to pickle a lambda
        ap.save({"f": lambda: 1}, tmp_path / "ckpt.pt")
    assert not orphan.exists()


@pytest.fixture
def small_disk(tmp_path: Path) -> Any:
    """A real 3 MB file system (tmpfs): mounting needs root, as CI has."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_is_named_and_killed_writers_orphans_do_not_fill_it(small_disk: Path) -> None:
    import socket

    import torch

    ap.use("cpu")
    path = small_disk / "ckpt.pt"
    ap.save({"w": torch.zeros(256 * 1024)}, path)  # 1 MB
    with pytest.raises(ap.AccelportError, match=r"the disk holding .* is full .*previous checkpoint is untouched"):
        ap.save({"w": torch.zeros(1024 * 1024)}, path)  # 4 MB on a 3 MB disk
    assert ap.load(path)["w"].numel() == 256 * 1024
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    # A killed writer's 1.5 MB leftover: with it, the next 1 MB save would not fit.
    (small_disk / f".ckpt.pt.{socket.gethostname()[:40]}.{dead}.x.tmp").write_bytes(b"\0" * (3 << 19))
    ap.save({"w": torch.ones(256 * 1024)}, path)
    assert float(ap.load(path)["w"].sum()) == 256 * 1024
    assert sorted(p.name for p in small_disk.iterdir()) == ["ckpt.pt"]


def test_an_empty_path_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ap.use("cpu")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ap.CheckpointError, match="ap.save needs the path of the checkpoint to write, such as "
                                                 "'ckpt.pt' or 'checkpoints/step100', not ''"):
        ap.save({"a": 1}, "")
    assert list(tmp_path.iterdir()) == []


def test_a_dangling_symlink_is_not_followed_into_new_directories(tmp_path: Path) -> None:
    ap.use("cpu")
    link = tmp_path / "latest.pt"
    link.symlink_to(tmp_path / "gone" / "run1" / "ckpt.pt")
    with pytest.raises(ap.CheckpointError, match=r"is a symlink to .*gone/run1/ckpt\.pt', whose directory "
                                                 r".*gone/run1' does not exist; create that directory, or remove "
                                                 "the link"):
        ap.save({"a": 1}, link)
    assert not (tmp_path / "gone").exists() and link.is_symlink()
    # The same link, once its directory exists, is written through as before.
    (tmp_path / "gone" / "run1").mkdir(parents=True)
    ap.save({"a": 2}, link)
    assert ap.load(tmp_path / "gone" / "run1" / "ckpt.pt")["a"] == 2


def test_a_parent_that_is_a_file_or_a_dangling_link_is_named(tmp_path: Path) -> None:
    ap.use("cpu")
    (tmp_path / "notes").write_text("a file")
    with pytest.raises(ap.CheckpointError, match=r"cannot create the directory of .*notes/sub/ckpt\.pt': "
                                                 r".*notes' is a file, not a directory"):
        ap.save({"a": 1}, tmp_path / "notes" / "sub" / "ckpt.pt")
    (tmp_path / "runs").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ap.CheckpointError, match=r".*runs' is a symlink to .*elsewhere', which does not exist"):
        ap.save({"a": 1}, tmp_path / "runs" / "ckpt.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "runs"]
