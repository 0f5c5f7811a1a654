"""Real sharded jobs: 4 and 2 cpu processes over gloo, started by `accelport launch` (tests/scripts/shard_job.py).

The 4-rank job trains a small transformer sharded and replicated and writes a
checkpoint at step 3; the 2-rank job resumes it both ways and goes through the
ways a save, a load or a collective can fail; a third job runs with one rank
unable to import numpy; a fourth is killed in the middle of a 400 MB sharded
save. Kept to four launches: the CI machine has two cores.
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


def launch(nprocs: int, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`accelport launch` in a fresh process, as a user runs it; the timeout only guards a hang."""
    return subprocess.run([sys.executable, "-m", "accelport", "launch", "--backend", "cpu", "--nprocs", str(nprocs),
                           "--oversubscribe",
                           str(SCRIPT), *args], capture_output=True, text=True, env={**_env(), **(env or {})},
                          timeout=600, cwd=REPO)


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
    # Every ap.all_reduce checked across ranks: the mismatched ones (collectives()) come long after the
    # first calls, which are all that is checked by default.
    proc = launch(2, "resume", str(out), str(four[0] / "ckpt"), str(out / "single.pt"),
                  env={"ACCELPORT_CHECK_COLLECTIVES": "1"})
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
    for got in two[1]:  # FSDP2 reduce-scatters the gradients: each rank keeps its shard of them
        assert got["gradient_bytes"] == pytest.approx(got["full_gradient_bytes"] / 2, rel=0.01)


def test_bad_input_with_four_ranks_gets_specific_errors(four: tuple[Path, list[dict[str, Any]]]) -> None:
    got = four[1][0]
    assert got["shard_twice"].startswith("ShardingError: ap.shard: this FSDPTiny is already sharded")
    assert got["mixed_optimizer"].startswith("ShardingError: ap.optimizer_step: this SGD steps 27 sharded "
                                             "parameter(s) and 27 replicated one(s)")
    assert "give the replicated parameters an optimizer of their own" in got["mixed_optimizer"]
    assert "policy {GRU} matched no submodule" in got["nothing_matches"]
    assert got["foreign_directory"].startswith("CheckpointError: ap.save: ") and \
        "is a directory that is not an accelport checkpoint" in got["foreign_directory"]
    for peer in four[1][1:]:  # the same specific error on every rank
        assert peer["foreign_directory"] == got["foreign_directory"] + " (the error of rank 0, raised on every rank)"


def test_a_checkpoint_of_more_layers_is_refused_on_four_ranks(four: tuple[Path, list[dict[str, Any]]]) -> None:
    # DCP alone reads the layer both models have and ignores the saved second one.
    for got in four[1]:
        assert got["fewer_layers"] == four[1][0]["fewer_layers"]
        assert got["fewer_layers"].startswith("CheckpointError: ap.load: ") and "does not fit the objects given" in \
            got["fewer_layers"] and "12 saved value(s) that the objects given have no place for, such as " \
            "'model.enc.layers.1." in got["fewer_layers"]
        assert got["in_step_after_load"] == 4.0  # no rank was left behind in a collective


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


def test_a_save_rank_0_cannot_start_stops_every_rank_with_its_error(
        two: tuple[Path, list[dict[str, Any]], dict[str, Any]]) -> None:
    out, (first, second), _ = two
    # A parent that is a file fails for root too: rank 0's OSError used to strand rank 1 in a collective.
    assert first["parent_is_a_file"] == (f"CheckpointError: ap.save: cannot create the directory of "
                                         f"'{out}/a-file/ckpt': '{out}/a-file' is a file, not a directory; give a "
                                         "path whose every part is a directory this process can write")
    assert second["parent_is_a_file"] == first["parent_is_a_file"] + " (the error of rank 0, raised on every rank)"
    for got in (first, second):
        assert got["in_step_after_save"] == 2.0  # a script that caught it is still in step


def test_a_checkpoint_that_does_not_fit_or_is_cut_short_is_refused_on_every_rank(
        two: tuple[Path, list[dict[str, Any]], dict[str, Any]]) -> None:
    out, results, _ = two
    for got in results:
        assert "does not fit the objects given in into= (12 saved value(s) that the objects given have no place " \
            "for, such as 'model.enc.layers.1.linear1.bias')" in got["fewer_layers"]
        assert "(12 value(s) of the objects given that it lacks, such as 'model.enc.layers.2.linear1.bias')" in \
            got["more_layers"]
        # Cut to half: the parameters this load reads are whole, yet the file is not what was saved.
        assert got["cut_shard"].startswith(f"CheckpointError: ap.load: '{out}/cut' is damaged or incomplete: "
                                           "__1_0.distcp holds ")
        assert got["in_step_after_load"] == got["in_step_after_cut"] == 2.0


def test_an_empty_path_or_the_working_directory_is_never_replaced(
        two: tuple[Path, list[dict[str, Any]], dict[str, Any]]) -> None:
    out, results, _ = two
    for got in results:
        assert got["empty_path"] == ("CheckpointError: ap.save needs the path of the checkpoint to write, such as "
                                     "'ckpt.pt' or 'checkpoints/step100', not ''")
        assert got["dot_path"].startswith(f"CheckpointError: ap.save: '{out}/empty' is the directory this process "
                                          "runs in")
        assert got["empty_still_there"] and got["in_step_after_paths"] == 2.0
    assert (out / "empty").is_dir() and list((out / "empty").iterdir()) == []


def test_collectives_refuse_what_they_would_get_wrong_on_every_rank(
        two: tuple[Path, list[dict[str, Any]], dict[str, Any]]) -> None:
    for rank, got in enumerate(two[1]):
        assert got["uint8_sum"].startswith("TypeError: ap.all_reduce of a torch.uint8 tensor would wrap around")
        shape = (2 + rank,)
        assert got["shapes_differ"].startswith(f"ValueError: ap.all_reduce: the replicas passed different tensors "
                                               f"(here rank {rank}: shape {shape}, torch.float32, op='sum')")
        dtype = ("torch.float32", "torch.float64")[rank]
        assert f"(here rank {rank}: shape (2,), {dtype}, op='sum')" in got["dtypes_differ"]  # it used to hang
        assert got["in_step_after_all_reduce"] == 2.0
        assert got["broadcast_sharded"].startswith("ShardingError: ap.broadcast: this FSDPTiny is sharded") and \
            "before ap.shard" in got["broadcast_sharded"]
        assert got["broadcast_sparse"].startswith("TypeError: ap.broadcast takes dense tensors, not a "
                                                  "torch.sparse_coo one")
        assert got["in_step_after_broadcast"] == 2.0


def test_a_tied_embedding_and_head_shard_with_the_default_policy(
        two: tuple[Path, list[dict[str, Any]], dict[str, Any]]) -> None:
    import torch

    for got in two[1]:
        assert got["tied_still_tied"]
        losses = got["tied_losses"]
        assert len(losses["sharded"]) == 3 and losses["sharded"][-1] < losses["sharded"][0]
        torch.testing.assert_close(losses["sharded"], losses["replicated"], rtol=1e-5, atol=1e-6)
        assert got["tied_round_trip"]


@pytest.fixture(scope="module")
def no_numpy(four: tuple[Path, list[dict[str, Any]]],
             tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("nonumpy")
    proc = launch(2, "nonumpy", str(out), str(four[0] / "ckpt"), env={"SHARD_JOB_NO_NUMPY_RANK": "0"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, ranks(out, 2)


def test_without_numpy_sharded_checkpoints_are_refused_before_the_first_collective(
        no_numpy: tuple[Path, list[dict[str, Any]]]) -> None:
    _, (first, second) = no_numpy
    for verb in ("save", "load"):
        assert first[verb].startswith(f"CheckpointError: ap.{verb}: a sharded checkpoint on several ranks needs "
                                      "numpy, and rank 0 cannot use it (RuntimeError: Numpy is not available)")
        assert first[verb].endswith("Run `pip install numpy` in the environment of every rank")
        assert second[verb] == first[verb] + " (the error of rank 0, raised on every rank)"
    for got in (first, second):
        assert got["in_step_after_save"] == got["in_step_after_load"] == 2.0
        assert got["written"] == []  # not even a temporary directory


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


@pytest.mark.parametrize(("damage", "words"), [
    ("fewer layers", "does not fit the objects given in into= (12 saved value(s) that the objects given have no "
                     "place for, such as 'model.enc.layers.1.linear1.bias')"),
    ("no plain.pt", "is incomplete: it has no plain.pt"),
    ("no .metadata", "is damaged or incomplete: its .metadata cannot be read (FileNotFoundError"),
    ("no shard", "is damaged or incomplete: __2_0.distcp is missing, but its .metadata places data up to byte "),
    ("cut shard", "is damaged or incomplete: __1_0.distcp holds "),
])
def test_a_checkpoint_that_does_not_fit_or_is_damaged_is_refused_alone_and_nothing_is_restored(
        four: tuple[Path, list[dict[str, Any]]], tmp_path: Path, damage: str, words: str) -> None:
    import shutil

    import torch

    copy = tmp_path / "ckpt"
    shutil.copytree(four[0] / "ckpt", copy)
    if damage == "no plain.pt":
        (copy / "plain.pt").unlink()  # it used to come back as {}
    elif damage == "no .metadata":
        (copy / ".metadata").unlink()
    elif damage == "no shard":
        (copy / "__2_0.distcp").unlink()
    elif damage == "cut shard":
        os.truncate(copy / "__1_0.distcp", (copy / "__1_0.distcp").stat().st_size // 2)
    ap.use("cpu")
    model = job_module().make(seed=5, layers=1 if damage == "fewer layers" else 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ap.CheckpointError) as info:
        ap.load(copy, into={"model": model})
    assert str(info.value).startswith(f"ap.load: '{copy}' ") and words in str(info.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # refused before any read


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
