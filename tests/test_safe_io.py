"""Files a user names never hang a command or a run, never fill memory, and are never half written."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from accelport.errors import AccelportError
from accelport.safe_io import (
    open_append,
    read_regular_file,
    remove_orphans,
    replace_with,
    same_file,
    temp_beside,
    write_atomic,
)


@pytest.fixture
def fifo(tmp_path: Path) -> str:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return str(path)


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # The timeout is a guard against the hang itself, not a measurement.
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env={**os.environ, **env},
                          timeout=120)


@pytest.mark.parametrize("command", [["doctor", "--json"], ["backends", "--json"], ["matrix", "--json"],
                                     ["ci-matrix", "--format", "json"]])
def test_a_fifo_as_the_matrix_override_is_an_error_not_a_hang(fifo: str, command: list[str]) -> None:
    out = _run(["-m", "accelport", *command], {"ACCELPORT_COMPAT_MATRIX": fifo})
    data = json.loads(out.stdout)
    text = json.dumps(data)
    assert "a FIFO" in text and "point it at a regular file" in text, text


def test_dev_zero_as_the_matrix_override_is_refused_without_reading_it() -> None:
    out = _run(["-m", "accelport", "matrix", "--json"], {"ACCELPORT_COMPAT_MATRIX": "/dev/zero"})
    assert out.returncode == 1 and "a device" in json.loads(out.stdout)["error"]


def test_ap_device_with_a_fifo_override_raises_a_specific_error(fifo: str) -> None:
    out = _run(["-c", "import accelport as ap\ntry:\n    ap.device()\nexcept ap.CompatMatrixError as e:\n"
                      "    print('refused:', e)\n"], {"ACCELPORT_COMPAT_MATRIX": fifo})
    assert out.returncode == 0 and "refused:" in out.stdout and "a FIFO" in out.stdout, out.stderr


def test_a_fifo_as_the_metrics_file_leaves_training_running(fifo: str, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch, accelport as ap
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in ap.loader([torch.randn(4, 2) for _ in range(3)]):
            model(x).sum().backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
        print("steps", ap.metrics().steps)
    """))
    out = _run([str(script)], {"ACCELPORT_METRICS_FILE": fifo, "ACCELPORT_BACKEND": "cpu"})
    assert out.returncode == 0, out.stderr
    assert "steps 3" in out.stdout
    assert "metrics-file" in out.stderr and "a FIFO" in out.stderr  # said once, as a PluginWarning


def test_the_reader_refuses_what_is_not_a_regular_file(tmp_path: Path, fifo: str) -> None:
    with pytest.raises(AccelportError, match="is a directory: point it at a regular file"):
        read_regular_file(str(tmp_path), what="X", limit=10)
    with pytest.raises(AccelportError, match="is a FIFO"):
        read_regular_file(fifo, what="X", limit=10)
    big = tmp_path / "big"
    big.write_bytes(b"x" * (3 << 20))
    with pytest.raises(AccelportError, match="larger than 2 MB"):
        read_regular_file(str(big), what="X", limit=2 << 20)
    assert read_regular_file(str(big), what="X", limit=4 << 20) == b"x" * (3 << 20)
    with pytest.raises(AccelportError, match="X .* is a FIFO"):
        open_append(fifo, what="X")


def test_same_file_sees_through_links_and_compares_paths_not_yet_there(tmp_path: Path) -> None:
    a = tmp_path / "a.py"
    a.write_text("x")
    (tmp_path / "sym.py").symlink_to(a)
    os.link(a, tmp_path / "hard.py")
    (tmp_path / "b.py").write_text("x")
    assert same_file(str(a), str(tmp_path / "sym.py")) and same_file(str(a), str(tmp_path / "hard.py"))
    assert not same_file(str(a), str(tmp_path / "b.py"))  # equal content is not the same file
    assert same_file(str(tmp_path / "new.json"), str(tmp_path / "." / "new.json"))
    assert not same_file(str(tmp_path / "new.json"), str(a))


def test_write_atomic_replaces_whole_keeps_the_mode_and_writes_through_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "f.json"
    target.write_text("earlier")
    target.chmod(0o640)
    (tmp_path / "link.json").symlink_to(target)
    assert write_atomic(str(tmp_path / "link.json"), b"new", what="--output") == str(target)
    assert target.read_bytes() == b"new" and stat.S_IMODE(target.stat().st_mode) == 0o640
    assert (tmp_path / "link.json").is_symlink()
    umask = os.umask(0o022)
    try:
        write_atomic(str(tmp_path / "fresh.json"), b"", what="--output")  # an empty one too
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "fresh.json").stat().st_mode) == 0o644  # as open(path, "w") gives it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json", "fresh.json", "link.json"]


def test_write_atomic_refuses_a_fifo_without_waiting_and_leaves_it(fifo: str) -> None:
    with pytest.raises(AccelportError, match=r"--report .* is a FIFO: point it at a regular file"):
        write_atomic(fifo, b"page", what="--report")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_temporary_file_beside_a_long_name_fits_the_file_system(tmp_path: Path) -> None:
    target = tmp_path / ("é" * 120 + ".jsonl")  # 245 bytes: with a suffix of its own it would not fit
    tmp = temp_beside(str(target))
    assert os.path.dirname(tmp) == str(tmp_path) and os.path.basename(tmp).startswith(".")
    with open(tmp, "a") as f:
        f.write("line\n")
    replace_with(tmp, str(target))
    assert target.read_text() == "line\n" and not os.path.exists(tmp)



def test_temporary_files_of_writers_that_no_longer_run_on_this_host_are_removed(tmp_path: Path) -> None:
    import socket

    target = tmp_path / "ckpt.pt"
    mine = temp_beside(str(target))  # this process's: in use
    host = socket.gethostname()[:40]
    assert os.path.basename(mine).startswith(f".ckpt.pt.{host}.{os.getpid()}.") and mine.endswith(".tmp")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()  # a pid that has exited
    orphan = tmp_path / f".ckpt.pt.{host}.{dead}.0a1b2c3d.tmp"
    live = tmp_path / f".ckpt.pt.{host}.{os.getppid()}.0a1b2c3d.tmp"  # a writer that still runs
    elsewhere = tmp_path / f".ckpt.pt.another-host.{dead}.0a1b2c3d.tmp"  # its host's to judge (shared disk)
    other = tmp_path / f".other.pt.{host}.{dead}.0a1b2c3d.tmp"  # another target's
    for path in (orphan, live, elsewhere, other):
        path.write_bytes(b"partial")
    remove_orphans(str(target))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        os.path.basename(p) for p in (mine, str(live), str(elsewhere), str(other)))


def test_a_read_that_fails_after_the_open_is_a_specific_error() -> None:
    # /proc/self/mem opens as a regular file, and its first read fails with an I/O error.
    with pytest.raises(AccelportError, match=r"the setting '/proc/self/mem' cannot be read \("):
        read_regular_file("/proc/self/mem", what="the setting", limit=1 << 20)
