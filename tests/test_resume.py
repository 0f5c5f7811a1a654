"""ap.Checkpointer in one process: bit-identical resumes (a crash, a stop request, a torn checkpoint, three kinds
of loader), the deadline, and a specific error for each kind of bad input."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

import accelport as ap
from accelport.launch.stop import EXIT_PREEMPTED
from accelport.resume import find_checkpoints
from tests.conftest import DEFAULT_SIGNALS, REPO

JOB = Path(REPO) / "tests" / "scripts" / "resume_job.py"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELPORT_", "TORCHELASTIC_"))}
    return env | extra


def job(*args: str, timeout: float = 300, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", DEFAULT_SIGNALS, str(JOB), *args], capture_output=True, text=True,
                          env=_env(**extra), timeout=timeout, cwd=REPO)


def start_job(*args: str, **extra: str) -> subprocess.Popen[str]:
    """The job in a process group of its own (with its DataLoader workers), as torchrun starts a worker."""
    return subprocess.Popen([sys.executable, "-c", DEFAULT_SIGNALS, str(JOB), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(**extra), cwd=REPO, start_new_session=True)


def wait_for(path: Path, proc: subprocess.Popen[str], limit: float = 300) -> None:
    """Until ``path`` exists (the job reached the point the test waits for); the limit only guards a hang."""
    deadline = time.monotonic() + limit
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def final(out: Path, rank: int = 0) -> dict[str, Any]:
    import torch

    return torch.load(out / f"final-rank{rank}.pt")


def assert_identical(a: dict[str, Any], b: dict[str, Any]) -> None:
    import torch

    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def seen(out: Path, rank: int = 0) -> dict[int, list[int]]:
    """Step -> the sample indices of its batch, over every process of the job (a later process wins)."""
    steps: dict[int, list[int]] = {}
    for path in sorted(out.glob(f"seen-rank{rank}-*.json"), key=lambda p: p.stat().st_mtime):
        for step, *indices in json.loads(path.read_text())["seen"]:
            steps[step] = indices
    return steps


#: The loaders a resumed run is tested with: a DataLoader (read in the loop's thread; with 2 workers and read
#: ahead by a prefetch thread) and torchdata's StatefulDataLoader (the same two ways).
LOADERS = {"plain": (), "workers": ("--workers", "2", "--prefetch", "2"), "stateful": ("--stateful",),
           "stateful-prefetch": ("--stateful", "--prefetch", "2"),
           # persistent_workers: the passes after the first reuse the iterator, which draws no workers' seed
           "persistent": ("--workers", "2", "--persistent"),
           "persistent-generator": ("--workers", "2", "--persistent", "--generator"),
           # a sampler that shuffles with numpy's global generator
           "numpy-sampler": ("--numpy-sampler",)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The uninterrupted runs each resumed run must equal, one per kind of loader."""
    out = {}
    for kind, args in LOADERS.items():
        where = tmp_path_factory.mktemp(f"full-{kind}")
        done = job(str(where), str(where / "ckpt"), *args)
        assert done.returncode == 0, done.stderr
        out[kind] = where
    return out




@pytest.mark.parametrize("kind", list(LOADERS))
def test_a_run_killed_at_step_23_resumes_bit_identical(reference: dict[str, Path], tmp_path: Path, kind: str) -> None:
    args = LOADERS[kind]
    ckpt = tmp_path / "ckpt"
    killed = job(str(tmp_path), str(ckpt), "--kill-at", "23", *args)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert [f.step for f in find_checkpoints(ckpt) if f.complete] == [10, 20]
    resumed = job(str(tmp_path), str(ckpt), *args, TORCHELASTIC_RESTART_COUNT="1")
    assert resumed.returncode == 0, resumed.stderr
    assert_identical(final(reference[kind]), final(tmp_path))
    # The data position: from step 21 on (mid-epoch: 24 batches a pass), the same batches at the same steps.
    full, part = seen(reference[kind]), seen(tmp_path)
    assert [part[s] for s in range(21, 61)] == [full[s] for s in range(21, 61)]
    assert part[21] != part[1]  # (the control: not the start of a pass)


@pytest.mark.parametrize("kind", ["persistent", "persistent-generator", "plain"])
def test_a_run_killed_in_its_second_pass_resumes_the_same_order(reference: dict[str, Path], tmp_path: Path,
                                                                kind: str) -> None:
    # Step 35 is in the second pass (24 batches a pass), which a persistent loader drew without a new iterator.
    ckpt = tmp_path / "ckpt"
    killed = job(str(tmp_path), str(ckpt), "--kill-at", "35", *LOADERS[kind])
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert [f.step for f in find_checkpoints(ckpt) if f.complete] == [10, 20, 30]
    resumed = job(str(tmp_path), str(ckpt), *LOADERS[kind], TORCHELASTIC_RESTART_COUNT="1")
    assert resumed.returncode == 0, resumed.stderr
    full, part = seen(reference[kind]), seen(tmp_path)
    assert [part[s] for s in range(31, 61)] == [full[s] for s in range(31, 61)]
    assert part[31] != full[7]  # (the control: pass 2's order is not pass 1's)
    assert_identical(final(reference[kind]), final(tmp_path))


#: Loader workers started otherwise than by fork (spawn: macOS's default; forkserver: Python 3.14's on Linux). The
#: dataset draws nothing, so their run is the "workers" one.
START_METHODS = {"workers-spawn": ("--start-method", "spawn"), "workers-forkserver": ("--start-method", "forkserver")}


@pytest.mark.parametrize("kind", ["plain", "workers", *START_METHODS])
def test_sigterm_saves_at_the_next_step_and_exits_75_then_the_rerun_matches(reference: dict[str, Path],
                                                                            tmp_path: Path, kind: str) -> None:
    ckpt = tmp_path / "ckpt"
    args = (*LOADERS["workers"], *START_METHODS[kind]) if kind in START_METHODS else LOADERS[kind]
    # Step 26: the second batch of pass 2, from its second loader worker, so both of that pass's fresh workers
    # have run their worker_init_fn (which shields them from the group's SIGTERM) before the signal.
    proc = start_job(str(tmp_path), str(ckpt), "--pause-at", "26", *args)
    wait_for(tmp_path / "ready-rank0", proc)
    if kind != "plain":
        # As torchrun stops a worker: the signal to its whole process group, its DataLoader workers too.
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "SIGTERM: saved the checkpoint of step 26" in err and "exit status 75" in err
    assert [f.step for f in find_checkpoints(ckpt) if f.complete] == [10, 20, 26]
    resumed = job(str(tmp_path), str(ckpt), *args)
    assert resumed.returncode == 0, resumed.stderr
    assert_identical(final(reference["workers" if kind in START_METHODS else kind]), final(tmp_path))


def test_a_checkpoint_torn_by_sigkill_during_its_save_is_skipped(reference: dict[str, Path], tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    # SIGKILL right after this rank's part of step 20 is on disk, before the checkpoint is complete.
    killed = job(str(tmp_path), str(ckpt), "--kill-in-save", "20")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    torn = find_checkpoints(ckpt)
    assert [(f.step, f.complete) for f in torn] == [(10, True), (20, False)]
    assert (ckpt / "step-00000020" / "state").exists()
    assert "checkpoint.json says its save did not finish" in torn[1].problem
    resumed = job(str(tmp_path), str(ckpt), TORCHELASTIC_RESTART_COUNT="1")
    assert resumed.returncode == 0, resumed.stderr
    assert "skipped the checkpoint at" in resumed.stderr and "step-00000020" in resumed.stderr
    assert "resuming from step 10" in resumed.stderr
    assert_identical(final(reference["plain"]), final(tmp_path))
    assert [f.step for f in find_checkpoints(ckpt)] == [40, 50, 60]  # keep_last=3; the torn one replaced, pruned


def test_a_handler_the_script_installs_afterwards_answers_the_signal_with_no_deadline(tmp_path: Path) -> None:
    script = tmp_path / "own_handler.py"
    script.write_text(
        "import os, signal, time, torch\nimport accelport as ap\n"
        f"ckpt = ap.Checkpointer({str(tmp_path / 'ckpt')!r}, every_steps=5)\n"
        "ckpt.restore(model=torch.nn.Linear(2, 2))\n"
        "seen = []\nsignal.signal(signal.SIGTERM, lambda *a: seen.append(1))  # the script's own, after accelport's\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(6)  # three times the deadline: still running\n"
        "print('handled', seen, ckpt.stop_requested, flush=True)\n")
    done = subprocess.run([sys.executable, "-c", DEFAULT_SIGNALS, str(script)], capture_output=True, text=True,
                          env=_env(ACCELPORT_STOP_DEADLINE_S="2"), timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "handled [1] False\n" and "deadline passed" not in done.stderr


def test_the_deadline_ends_a_process_that_never_reaches_a_step_boundary(tmp_path: Path) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(
        "import sys, time, torch\nimport accelport as ap\n"
        f"ckpt = ap.Checkpointer({str(tmp_path / 'ckpt')!r}, every_steps=5)\n"
        "ckpt.restore(model=torch.nn.Linear(2, 2))\n"
        "print('ready', flush=True)\n"
        "while True:\n    time.sleep(0.2)  # a step that never ends\n")
    proc = subprocess.Popen([sys.executable, "-c", DEFAULT_SIGNALS, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(ACCELPORT_STOP_DEADLINE_S="2"))
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "2 s deadline passed; exiting without a checkpoint" in err


def test_sigint_stops_only_when_asked(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(
        "import sys, torch\nimport accelport as ap\n"
        f"ckpt = ap.Checkpointer({str(tmp_path / 'ckpt')!r}, stop_on=('SIGTERM', 'SIGINT'))\n"
        "model = torch.nn.Linear(2, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "ckpt.restore(model=model, optimizer=opt)\n"
        "print('ready', flush=True)\n"
        "while True:\n"
        "    model(torch.ones(1, 2)).sum().backward()\n"
        "    ap.optimizer_step(opt)\n    opt.zero_grad()\n    ckpt.step()\n")
    proc = subprocess.Popen([sys.executable, "-c", DEFAULT_SIGNALS, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "SIGINT: saved the checkpoint of step" in err
    assert len([f for f in find_checkpoints(tmp_path / "ckpt") if f.complete]) == 1


# -- in this process ---------------------------------------------------------------------------------------


def _model(width: int = 4) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, 3), torch.nn.Linear(3, 1))


def test_no_checkpoint_starts_at_zero_and_a_file_cut_short_is_skipped(tmp_path: Path) -> None:
    import torch

    ap.use("cpu")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ap.Checkpointer(tmp_path, every_steps=2, stop_on=()) as ckpt:
        assert ckpt.restore(model=model, optimizer=opt) == 0 and ckpt.epoch == 0
        for _ in range(4):
            model(torch.ones(2, 4)).sum().backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
            ckpt.step()
    assert [f.step for f in find_checkpoints(tmp_path)] == [2, 4]
    state = tmp_path / "step-00000004" / "state"
    state.write_bytes(state.read_bytes()[:100])  # a copy cut short
    with ap.Checkpointer(tmp_path, every_steps=2, stop_on=()) as again:
        with pytest.warns(ap.CheckpointWarning, match=r"skipped the checkpoint at .*step-00000004: state holds 100 "
                                                      r"bytes, not the \d+ it was saved with; resuming from step 2"):
            assert again.restore(model=_model(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) == 2


def test_an_iterable_dataset_says_once_that_it_restarts_its_pass(tmp_path: Path) -> None:
    import torch

    class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter(torch.arange(12.0).view(12, 1))

    ap.use("cpu")
    loader = torch.utils.data.DataLoader(Stream(), batch_size=2)
    model = _model(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ap.Checkpointer(tmp_path, every_steps=4, stop_on=()) as ckpt:
        ckpt.restore(model=model, optimizer=opt, loader=loader)
        for x in ap.loader(loader):
            model(x).sum().backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
            ckpt.step()
            if ckpt.steps == 4:
                break
    with ap.Checkpointer(tmp_path, stop_on=()) as again:
        with pytest.warns(ap.CheckpointWarning, match="over an iterable dataset keeps no position: the pass in "
                                                      r"progress at the checkpoint \(epoch 0, 4 batches in\) starts "
                                                      "again from its first batch") as caught:
            assert again.restore(model=model, optimizer=opt, loader=loader) == 4
        assert len(caught) == 1 and again.epoch == 0
        assert [float(x[0, 0]) for x in ap.loader(loader)][:2] == [0.0, 2.0]


def test_a_loader_read_directly_is_said_once_not_to_keep_its_position(tmp_path: Path) -> None:
    import warnings

    import torch

    ap.use("cpu")
    loader = torch.utils.data.DataLoader(torch.arange(16.0).view(16, 1), batch_size=2)
    model = _model(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ap.Checkpointer(tmp_path, every_steps=2, stop_on=()) as ckpt, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt.restore(model=model, optimizer=opt, loader=loader)
        for x in loader:  # not through ap.loader
            model(x).sum().backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
            ckpt.step()
    said = [str(w.message) for w in caught if issubclass(w.category, ap.CheckpointWarning)]
    assert said == ["ap.Checkpointer: the loader given to restore() was not read through ap.loader by step 2: its "
                    "position is not saved, so a resumed run starts its data at the first batch of a new pass; "
                    "iterate ap.loader(loader) in the training loop"]
    assert [f.step for f in find_checkpoints(tmp_path)][-1] == 8  # saved all the same


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"every_steps": 0}, "every_steps must be a whole number of steps, 1 or more"),
    ({"every_steps": 2.5}, "every_steps must be a whole number"),
    ({"every_seconds": 0}, "every_seconds must be a number of seconds above 0"),
    ({"keep_last": 0}, "keep_last must be 1 or more"),
    ({"stop_on": ("SIGKILL",)}, "SIGKILL cannot be caught"),
    ({"stop_on": None}, r"takes signal names such as \('SIGTERM', 'SIGINT'\), or \(\) for none, not None"),
    ({"stop_on": ("SIGFOO",)}, "takes signal names such as 'SIGTERM'"),
])
def test_bad_arguments_are_refused(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ap.AccelportError, match=message):
        ap.Checkpointer(tmp_path, **kwargs)


def test_bad_directories_and_settings_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "notes").write_text("a file")
    with pytest.raises(ap.CheckpointError, match=r"notes' is a file, not a directory"):
        ap.Checkpointer(tmp_path / "notes")
    monkeypatch.delenv("ACCELPORT_CHECKPOINT_DIR", raising=False)
    with pytest.raises(ap.AccelportError, match="needs a directory: pass one .* or set ACCELPORT_CHECKPOINT_DIR"):
        ap.Checkpointer()
    monkeypatch.setenv("ACCELPORT_STOP_DEADLINE_S", "soon")
    with pytest.raises(ap.AccelportError, match="ACCELPORT_STOP_DEADLINE_S must be a number of seconds above 0"):
        ap.Checkpointer(tmp_path / "a")
    monkeypatch.setenv("ACCELPORT_STOP_DEADLINE_S", "5")
    monkeypatch.setenv("ACCELPORT_CHECKPOINT_DIR", str(tmp_path / "from-env"))
    with ap.Checkpointer() as ckpt:
        assert ckpt.directory == str(tmp_path / "from-env") and (tmp_path / "from-env").is_dir()
        with pytest.raises(ap.CheckpointError, match=r"step\(\) before restore\(\)"):
            ckpt.step()


def _mount(where: Path, options: str) -> Any:
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    return where


@pytest.fixture
def read_only(tmp_path: Path) -> Any:
    """A read-only file system (tmpfs): refused even to root, as CI runs."""
    mount = _mount(tmp_path / "ro", "ro,size=1m")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Any:
    """A real 3 MB file system (tmpfs), as tests/test_checkpoint.py fills one."""
    mount = _mount(tmp_path / "small", "size=3m")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_an_unwritable_directory_is_refused(read_only: Path) -> None:
    with pytest.raises(ap.CheckpointError, match=r"cannot write in .*ro/ckpt': Read-only file system"):
        ap.Checkpointer(read_only / "ckpt")


def test_a_full_disk_is_named_and_the_previous_checkpoint_stays_whole(small_disk: Path) -> None:
    import torch

    ap.use("cpu")
    model = torch.nn.Linear(300_000 // 4, 4, bias=False)  # 1.2 MB of weights
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ap.Checkpointer(small_disk, every_steps=1, stop_on=()) as ckpt:
        ckpt.restore(model=model, optimizer=opt)
        ckpt.step()
        ckpt.step()
        with pytest.raises(ap.CheckpointError, match=r"the disk holding .* is full .*Free space there"):
            ckpt.step()  # a third 1.2 MB on a 3 MB disk
    assert [(f.step, f.complete) for f in find_checkpoints(small_disk)] == [(1, True), (2, True)]  # none torn left
    with ap.Checkpointer(small_disk, stop_on=()) as again:
        assert again.restore(model=model, optimizer=opt) == 2


def test_a_checkpoint_of_another_model_names_the_missing_and_unexpected_keys(tmp_path: Path) -> None:
    import torch

    ap.use("cpu")
    with ap.Checkpointer(tmp_path, every_steps=1, stop_on=()) as ckpt:
        ckpt.restore(model=_model())
        ckpt.step()
    other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))  # the head is now '2'
    with ap.Checkpointer(tmp_path, stop_on=()) as again:
        with pytest.raises(ap.CheckpointError, match=r"does not fit the objects given in into= \('model': 2 missing "
                                                     r"key\(s\): '2.bias', '2.weight'; 2 unexpected key\(s\): "
                                                     r"'1.bias', '1.weight'\)"):
            again.restore(model=other)


def test_restore_warns_about_saved_state_it_was_not_given(tmp_path: Path) -> None:
    import torch

    ap.use("cpu")
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    with ap.Checkpointer(tmp_path, every_steps=1, stop_on=()) as ckpt:
        ckpt.restore(model=model, optimizer=opt, scheduler=sched)
        ckpt.step()
    with ap.Checkpointer(tmp_path, stop_on=()) as again:
        with pytest.warns(ap.CheckpointWarning, match="holds optimizer, scheduler state that restore"):
            assert again.restore(model=model) == 1


def test_signal_handlers_are_given_back_on_close(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    ckpt = ap.Checkpointer(tmp_path)
    assert signal.getsignal(signal.SIGTERM) is not before
    ckpt.close()
    assert signal.getsignal(signal.SIGTERM) is before


# -- a StatefulDataLoader read ahead by a prefetch thread: the position a save records ---------------------------
# In process, with the real StatefulDataLoader, prefetch thread and sharding that ap.loader composes (the
# position is accelport's internal piece between them; a 2-rank job would only add its start-up).


def _stateful(dataset: Any) -> Any:
    pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata (StatefulDataLoader) is not installed")
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(dataset, batch_size=1)


def _yielded(position: Any) -> int:
    return int(position.state()["state"]["_num_yielded"])


def test_a_sharded_replica_read_ahead_saves_the_position_of_every_source_batch_it_passed() -> None:
    from accelport.device_loader import prefetch_iter, shard_batches
    from accelport.resume import _Position

    loader = _stateful(list(range(24)))
    position = _Position(loader, "stateful")
    seen = []
    # Rank 0 of 2: each batch it takes is the first of a run of two source batches; the run's second is rank 1's.
    for batch in prefetch_iter(shard_batches(position.begin(loader, 2), 0, 2), depth=3):
        position.advance()
        seen.append((int(batch), _yielded(position)))
        if len(seen) == 5:
            break
    assert seen == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]  # it used to say one source batch per batch


def test_a_pass_left_early_cannot_move_the_next_pass_position() -> None:
    import threading

    from accelport.device_loader import prefetch_iter
    from accelport.resume import _Position

    gate, held = threading.Event(), threading.Event()

    class Gated(list):  # type: ignore[type-arg]
        def __getitem__(self, i: Any) -> Any:
            if i == 5 and not held.is_set():  # the first pass's read-ahead stops inside batch 5 until told
                held.set()
                assert gate.wait(60)
            return super().__getitem__(i)

    loader = _stateful(Gated(range(12)))
    position = _Position(loader, "stateful")
    first = prefetch_iter(position.begin(loader, 1), depth=2)
    taken = [next(first) for _ in range(3)]
    assert held.wait(60)  # the first pass's thread is inside the loader now
    # The loop leaves the pass (a break) and starts the next one. A break waits for the batch being read
    # (up to a limit): left in another thread here, it stands for a batch that outlasts that limit.
    leaving = threading.Thread(target=first.close)
    leaving.start()
    try:
        second = prefetch_iter(position.begin(loader, 1), depth=2)
        states = []
        for i, batch in enumerate(second):
            position.advance()
            states.append((int(batch), _yielded(position)))
            if i == 3:
                gate.set()  # the first pass's thread ends its batch now, amid the second pass
                leaving.join()
    finally:
        gate.set()
        leaving.join()
    assert [int(b) for b in taken] == [0, 1, 2]
    # Each batch's saved position is its own: the first pass's late batch used to add its snapshot to this
    # pass's, and every later save recorded the batch before (a batch repeated on resume).
    assert states == [(i, i + 1) for i in range(12)]


class _NumpyState:
    """A dataset whose own state (a StatefulDataLoader saves it) holds numpy arrays, a scalar and a generator."""

    def __init__(self) -> None:
        import numpy as np

        self.rng = np.random.default_rng(0)
        self.seen = np.zeros((2, 3), dtype=np.float32)
        self.count = np.int64(0)
        self.loaded: dict[str, Any] | None = None

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> Any:
        import torch

        return torch.tensor([float(i)])

    def state_dict(self) -> dict[str, Any]:
        import numpy as np

        return {"rng": self.rng.bit_generator.state, "seen": self.seen + 1, "count": self.count + 7,
                "order": np.arange(4, dtype=np.int16), "names": np.array(["a", "bc"]), "none": np.zeros((0, 3)),
                "by_name": collections.OrderedDict(x=np.float64(0.5))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


def test_a_loader_state_holding_numpy_arrays_resumes_under_weights_only(tmp_path: Path) -> None:
    import numpy as np
    import torch

    def run(stop_after: int | None) -> tuple[list[float], _NumpyState]:
        dataset = _NumpyState()
        loader = _stateful(dataset)
        model = torch.nn.Linear(1, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        seen = []
        with ap.Checkpointer(tmp_path / "ckpt", every_steps=1, stop_on=()) as ckpt:
            ckpt.restore(model=model, optimizer=opt, loader=loader)
            for (x,) in ap.loader(loader):
                seen.append(float(x))
                model(x).sum().backward()
                ap.optimizer_step(opt)
                opt.zero_grad()
                ckpt.step()
                if ckpt.steps == stop_after:
                    break
        return seen, dataset

    ap.use("cpu")
    before, _ = run(stop_after=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ap.CheckpointWarning)  # no checkpoint may be called damaged
        after, dataset = run(stop_after=None)
    assert before + after == [float(i) for i in range(12)]
    state = dataset.loaded
    assert state is not None
    assert state["seen"].dtype == np.float32 and state["seen"].tolist() == [[1.0] * 3] * 2
    assert type(state["count"]) is np.int64 and state["count"] == 7
    assert state["order"].dtype == np.int16 and state["order"].tolist() == [0, 1, 2, 3]
    assert state["names"].tolist() == ["a", "bc"] and state["rng"] == np.random.default_rng(0).bit_generator.state
    assert state["none"].shape == (0, 3) and state["by_name"] == collections.OrderedDict(x=0.5)
    assert type(state["by_name"]) is collections.OrderedDict
