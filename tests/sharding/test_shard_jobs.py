"""Real sharded jobs: 4 and 2 cpu processes over gloo, started by `accelport launch` (tests/scripts/shard_job.py).

The 4-rank job trains a small transformer sharded and replicated and writes a
checkpoint at step 3; the 2-rank job resumes it both ways; a third job is killed
in the middle of a 400 MB sharded save. Kept to three launches: the CI machine
has two cores.
"""

from __future__ import annotations

import importlib.util
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

SCRIPT = Path(REPO) / "tests" / "scripts" / "shard_job.py"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")}


def launch(nprocs: int, *args: str) -> subprocess.CompletedProcess[str]:
    """`accelport launch` in a fresh process, as a user runs it; the timeout only guards a hang."""
    return subprocess.run([sys.executable, "-m", "accelport", "launch", "--backend", "cpu", "--nprocs", str(nprocs),
                           "--oversubscribe",
                           str(SCRIPT), *args], capture_output=True, text=True, env=_env(), timeout=600, cwd=REPO)


def job_module() -> Any:
    spec = importlib.util.spec_from_file_location("shard_job", SCRIPT)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def ranks(out: Path, n: int) -> list[dict[str, Any]]:
    import torch

    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(n)]


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("four")
    proc = launch(4, "train", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, ranks(out, 4)


@pytest.fixture(scope="module")
def two(four: tuple[Path, list[dict[str, Any]]],
        tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]], dict[str, Any]]:
    import torch

    from accelport.runtime.state import RUNTIME

    # A single-file checkpoint written alone (one AdamW step), for the 2 ranks to load sharded.
    job = job_module()
    with RUNTIME.scoped():
        RUNTIME.reset()
        ap.use("cpu")
        model = job.make(seed=42)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x, y = job.batch(0)
        torch.nn.functional.cross_entropy(model(x).reshape(-1, job.VOCAB), y.reshape(-1)).backward()
        ap.optimizer_step(opt)
        out = tmp_path_factory.mktemp("two")
        ap.save({"model": model, "opt": opt, "step": 7}, out / "single.pt")
        single = torch.load(out / "single.pt")
    proc = launch(2, "resume", str(out), str(four[0] / "ckpt"), str(out / "single.pt"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, ranks(out, 2), single


# -- training ------------------------------------------------------------------------------


def test_sharded_training_reaches_the_replicated_losses(four: tuple[Path, list[dict[str, Any]]]) -> None:
    import torch

    _, results = four
    for got in results:
        assert got["world"] == 4 and got["types"] == ["DTensor"]  # every parameter sharded
        assert got["sharded_losses"] == results[0]["sharded_losses"]
        assert len(got["sharded_losses"]) == 6 and got["sharded_losses"][-1] < got["sharded_losses"][0]
        # FSDP2 averaged the gradients once: averaging them again would be off by a factor of 4.
        torch.testing.assert_close(got["sharded_losses"], got["replicated_losses"], rtol=1e-5, atol=1e-6)


def test_a_nan_in_sharded_gradients_is_found_on_every_rank_without_a_collective(
        four: tuple[Path, list[dict[str, Any]]]) -> None:
    # Training was silent, then one NaN loss: each rank reads its own shard of the gradients.
    _, results = four
    for got in results:
        [(kind, step, message)] = got["diagnoses"]
        assert (kind, step) == ("non-finite", got["steps"]), message
        assert "every gradient is NaN or Inf, so the loss was" in message


def test_each_rank_holds_a_quarter_then_a_half_of_parameters_and_optimizer_state(
        four: tuple[Path, list[dict[str, Any]]], two: tuple[Path, list[dict[str, Any]], dict[str, Any]]) -> None:
    for results, n in ((four[1], 4), (two[1], 2)):
        for got in results:
            assert got["parameter_bytes"] == pytest.approx(got["full_parameter_bytes"] / n, rel=0.01)
            # AdamW keeps exp_avg and exp_avg_sq sharded; its per-parameter step counts are tiny.
            assert got["optimizer_state_bytes"] == pytest.approx(got["full_optimizer_state_bytes"] / n, rel=0.01)


def test_bad_input_with_four_ranks_gets_specific_errors(four: tuple[Path, list[dict[str, Any]]]) -> None:
    got = four[1][0]
    assert got["shard_twice"].startswith("ShardingError: ap.shard: this FSDPTiny is already sharded")
    assert got["mixed_optimizer"].startswith("ShardingError: ap.optimizer_step: this SGD steps 27 sharded "
                                             "parameter(s) and 27 replicated one(s)")
    assert "give the replicated parameters an optimizer of their own" in got["mixed_optimizer"]
    assert "policy {GRU} matched no submodule" in got["nothing_matches"]
    assert got["foreign_directory"].startswith("CheckpointError: ap.save: ") and \
        "is a directory that is not an accelport checkpoint" in got["foreign_directory"]
    assert four[1][1]["foreign_directory"].startswith("CheckpointError: ap.save: rank 0 could not start")


# -- checkpoints ---------------------------------------------------------------------------


def test_four_ranks_write_one_shard_each_into_a_directory(four: tuple[Path, list[dict[str, Any]]]) -> None:
    import json

    out, results = four
    assert results[0]["ckpt_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp",
                                        "__3_0.distcp", "accelport.json", "plain.pt"]
    assert results[0]["out_files"] == ["ckpt"]  # the leftover of a killed save was cleared
    manifest = json.loads((out / "ckpt" / "accelport.json").read_text())
    assert manifest["world_size"] == 4 and manifest["modules"] == ["model"]
    assert manifest["optimizers"] == {"opt": "model"} and manifest["plain"] == ["note", "rng", "step"]


def test_a_checkpoint_of_four_ranks_resumes_on_two_bit_identically(
        four: tuple[Path, list[dict[str, Any]]], two: tuple[Path, list[dict[str, Any]], dict[str, Any]]) -> None:
    import torch

    saved = four[1][0]
    for got in two[1]:
        assert got["world"] == 2
        for name, value in saved["full_step3"].items():
            assert torch.equal(got["resumed_full"][name], value), name
        # The same continuation as a replicated 2-rank run resumed from the same checkpoint, bit for bit.
        assert got["sharded_losses"] == got["replicated_losses"]
        torch.testing.assert_close(got["sharded_losses"], saved["sharded_losses"][3:], rtol=1e-5, atol=1e-6)
        assert got["plain"] == {"step": 3, "note": "four ranks"}
        assert torch.equal(got["rng"], saved["rng_at_save"])  # rank 0's value, returned


def test_a_background_save_holds_the_state_of_the_moment_it_was_called(
        two: tuple[Path, list[dict[str, Any]], dict[str, Any]]) -> None:
    out, results, _ = two
    for got in results:
        assert got["background_done"] and got["background_equal"] and got["background_plain"] == {"step": 6}
    assert sorted(os.listdir(out / "background"))[:3] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (out / ".background.accelport-tmp").exists()


def test_a_single_file_written_alone_loads_into_a_sharded_model(
        two: tuple[Path, list[dict[str, Any]], dict[str, Any]]) -> None:
    import torch

    _, results, single = two
    names = list(single["model"])
    for got in results:
        assert got["file_plain"] == {"step": 7}
        for name in names:
            assert torch.equal(got["file_full"][name], single["model"][name]), name
        for i, name in enumerate(got["file_exp_avg"]):  # parameters in the order the optimizer numbered them
            assert torch.equal(got["file_exp_avg"][name], single["opt"]["state"][i]["exp_avg"]), name


def test_loading_a_directory_says_what_to_pass(two: tuple[Path, list[dict[str, Any]], dict[str, Any]]) -> None:
    got = two[1][0]
    assert "is a sharded checkpoint directory (written by 4 ranks): pass what to restore" in got["load_without_into"]
    assert "into={'model': model, 'opt': opt}" in got["load_without_into"]
    assert "has no module or optimizer 'net'; it holds modules ['model']" in got["load_unknown_key"]


def test_a_checkpoint_of_four_ranks_resumes_alone(four: tuple[Path, list[dict[str, Any]]],
                                                   tmp_path: Path) -> None:
    import shutil

    import torch

    out, results = four
    job = job_module()
    ap.use("cpu")
    model = job.make(seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plain = ap.load(out / "ckpt", into={"model": model, "opt": opt})
    assert plain["step"] == 3
    for name, p in model.named_parameters():
        assert torch.equal(p, results[0]["full_step3"][name]), name
    losses = job.train(model, opt, range(3, 6))  # the whole global batch in one process
    torch.testing.assert_close(losses, results[0]["sharded_losses"][3:], rtol=1e-5, atol=1e-6)

    # Saved again alone, the same path becomes a single file.
    copy = tmp_path / "ckpt"
    shutil.copytree(out / "ckpt", copy)
    ap.save({"model": model, "opt": opt, "step": 6}, copy)
    assert copy.is_file() and ap.load(copy, into={"model": job.make(), "opt": opt})["step"] == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_sigkill_during_a_sharded_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-m", "accelport", "launch", "--backend", "cpu", "--nprocs", "2",
                             str(SCRIPT), "big", str(path)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=_env(), cwd=REPO)
    pids: list[int] = []
    partial: list[int] = []
    try:
        assert proc.stdout is not None
        while len(pids) < 2:
            line = proc.stdout.readline()
            assert line, "the job ended before its second save"
            if line.startswith("saving "):
                pids.append(int(line.split()[2]))
        # Kill both ranks once their shard files hold some, but not all, of their 200 MB each.
        tmp = tmp_path / ".ckpt.accelport-tmp"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                partial = [f.stat().st_size for f in tmp.glob("*.distcp")]
            except OSError:
                partial = []
            if partial and max(partial) > 8 * 2**20:
                break
            time.sleep(0.001)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=120)
    assert proc.returncode != 0
    assert partial and max(partial) < 200 * 2**20, f"the kill did not land mid-write ({partial} bytes)"

    ap.use("cpu")
    model = job_module().Big()
    plain = ap.load(path, into={"model": model})
    assert plain == {"version": 1}
    assert all(bool((p == 1.0).all()) for p in model.parameters())  # the first save, whole
    assert (tmp_path / ".ckpt.accelport-tmp").exists()  # the killed save's leftover, cleared by the next one
