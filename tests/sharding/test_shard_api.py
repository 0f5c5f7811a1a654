"""``ap.shard`` and the checkpoint calls in one process: alone, bad input, units, single files."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest

import accelport as ap
from accelport.checkpoint import PendingSave
from accelport.sharding import choose_units, tied_groups


def tiny(layers: int = 2) -> Any:
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(16, 32)
            layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
            self.enc = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = torch.nn.Linear(32, 16)

        def forward(self, x: Any) -> Any:
            return self.head(self.enc(self.emb(x)))

    torch.manual_seed(0)
    return Tiny()


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# -- alone ---------------------------------------------------------------------------------


def test_alone_the_model_comes_back_unchanged_and_its_bytes_are_counted() -> None:
    import torch

    ap.use("cpu")
    model = tiny()
    assert ap.metrics().parameter_bytes is None  # nothing passed to ap.shard yet: not measured
    assert ap.shard(model) is model
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert ap.metrics().parameter_bytes == nbytes(model.parameters())
    assert ap.metrics().optimizer_state_bytes == 0  # no optimizer stepped yet
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 16, (2, 5))).sum().backward()
    ap.optimizer_step(opt)
    state = [v for s in opt.state.values() for v in s.values()]
    assert ap.metrics().optimizer_state_bytes == nbytes(state) > 2 * nbytes(model.parameters())
    assert ap.metrics().to_dict()["parameter_bytes"] == nbytes(model.parameters())


def test_bf16_alone_says_it_does_nothing() -> None:
    ap.use("cpu")
    with pytest.warns(ap.CompatibilityWarning, match=r"does nothing alone.*ap\.autocast"):
        ap.shard(tiny(), mixed_precision="bf16")


# -- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"mixed_precision": "bf61"}, ValueError, r"not a mixed-precision setting accelport knows.*'bf16'"),
        ({"mixed_precision": "fp16"}, ValueError, r"use 'bf16' .* or None"),
        ({"reshard_after_forward": "yes"}, TypeError, "takes True or False"),
        ({"policy": {"TransformerEncoderLayer"}}, TypeError, "takes module classes"),
        ({"policy": set()}, TypeError, "empty set"),
        ({"policy": 3}, TypeError, "set of module classes or a callable"),
    ],
)
def test_bad_arguments_are_refused_at_every_world_size(kwargs: dict[str, Any], error: type[Exception],
                                                        message: str) -> None:
    ap.use("cpu")
    with pytest.raises(error, match=message):
        ap.shard(tiny(), **kwargs)


def test_a_policy_that_matches_nothing_says_what_would() -> None:
    import torch

    ap.use("cpu")
    with pytest.raises(ap.ShardingError, match=r"policy \{GRU\} matched no submodule of Tiny .*"
                                               r"policy=\{TransformerEncoderLayer\}"):
        ap.shard(tiny(), policy={torch.nn.GRU})
    with pytest.raises(ap.ShardingError, match="matched no submodule"):
        ap.shard(tiny(), policy=lambda module: False)
    with pytest.raises(TypeError, match="needs a torch.nn.Module"):
        ap.shard(torch.zeros(3))


def test_a_model_already_sharded_is_refused() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ap.use("cpu")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = tiny()
        fully_shard(model.enc.layers[0], mesh=init_device_mesh("cpu", (1,)))  # by hand, on one block
        with pytest.raises(ap.ShardingError, match="already sharded .* call ap.shard once"):
            ap.shard(model)
    finally:
        dist.destroy_process_group()


# -- which blocks become units -----------------------------------------------------------------


def test_default_units_are_the_layers_of_a_stack_and_sizable_submodules() -> None:
    import torch

    names = [type(m).__name__ for m in choose_units(tiny(), None)]
    assert names == ["Embedding", "TransformerEncoderLayer", "TransformerEncoderLayer", "Linear"]
    # One layer holding nearly everything is looked into.
    one = [type(m).__name__ for m in choose_units(tiny(layers=1).enc, None)]
    assert one == ["MultiheadAttention", "Linear", "Linear"]
    seq = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    assert choose_units(seq, None) == [seq[0], seq[2]]
    assert choose_units(torch.nn.Linear(3, 3), None) == []  # the root alone


def test_a_policy_picks_units_by_class_or_callable() -> None:
    import torch

    model = tiny()
    by_class = choose_units(model, ap_policy(torch.nn.TransformerEncoderLayer))
    assert by_class == list(model.enc.layers)
    by_set = choose_units(model, ap_policy({torch.nn.Linear}))
    assert model.head in by_set and all(isinstance(m, torch.nn.Linear) for m in by_set)
    everything = choose_units(model, ap_policy(lambda m: True))
    assert not any(isinstance(m, torch.nn.ModuleList) for m in everything)  # no forward: never a unit


def names_of(model: Any, groups: list[list[Any]]) -> list[list[str]]:
    path = {id(m): name for name, m in model.named_modules()}
    return [[path[id(m)] for m in group] for group in groups]


def test_tied_modules_become_one_group_and_a_tie_to_the_root_leaves_them_to_it() -> None:
    import torch

    class GPT(torch.nn.Module):  # GPT-2's layout: the head outside the body that holds the embedding
        def __init__(self) -> None:
            super().__init__()
            self.transformer = torch.nn.ModuleDict({"wte": torch.nn.Embedding(64, 32),
                                                    "h": torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in "ab")})
            self.lm_head = torch.nn.Linear(32, 64, bias=False)
            self.lm_head.weight = self.transformer["wte"].weight

    gpt = GPT()
    units = choose_units(gpt, None)
    assert names_of(gpt, [units]) == [["transformer.wte", "transformer.h.0", "transformer.h.1", "lm_head"]]
    # Two separate units for one parameter is what FSDP2 refuses at the first forward.
    assert names_of(gpt, tied_groups(gpt, units)) == [["transformer.h.1"], ["transformer.h.0"],
                                                      ["transformer.wte", "lm_head"]]

    class ToRoot(torch.nn.Module):  # a block tied to a parameter of the root itself
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in "abc")
            self.scale = torch.nn.Parameter(torch.ones(8, 8))
            self.blocks[1].weight = self.scale

    root = ToRoot()
    assert names_of(root, tied_groups(root, choose_units(root, None))) == [["blocks.2"], ["blocks.0"]]

    shared = torch.nn.Linear(8, 8)  # one module registered in two places, under two units
    twice = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(8, 8), shared),
                                torch.nn.Sequential(shared, torch.nn.Linear(8, 8)))
    outer = choose_units(twice, ap_policy(lambda m: isinstance(m, torch.nn.Sequential)))
    assert names_of(twice, tied_groups(twice, outer)) == [["0", "1"]]
    # Without ties: every unit alone, bottom-up, as before.
    model = tiny()
    assert tied_groups(model, choose_units(model, None)) == [[m] for m in reversed(choose_units(model, None))]


def test_a_tie_between_a_unit_and_its_own_ancestor_unit_is_left_to_the_ancestor() -> None:
    import torch

    inner = torch.nn.Linear(8, 8)
    outer = torch.nn.Sequential(inner, torch.nn.Linear(8, 8))
    outer.register_parameter("tied", inner.weight)
    model = torch.nn.Sequential(outer, torch.nn.Linear(8, 8))
    units = choose_units(model, ap_policy(lambda m: m is inner or m is outer))
    assert names_of(model, tied_groups(model, units)) == [["0"]]


def test_ties_that_cross_between_two_units_leave_the_inner_modules_to_them() -> None:
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(4, 4)

    class Crossed(torch.nn.Module):  # x's own parameter is y's inner weight, and y's is x's inner weight
        def __init__(self) -> None:
            super().__init__()
            self.x, self.y = Block(), Block()
            self.x.register_parameter("t", self.y.inner.weight)
            self.y.register_parameter("t", self.x.inner.weight)

    model = Crossed()
    units = [model.x, model.x.inner, model.y, model.y.inner]
    # {x, y.inner} must come after {y, x.inner} and the other way round: no order exists (it was a raw
    # graphlib.CycleError). With the inner modules left to their blocks, x and y share both ties.
    assert names_of(model, tied_groups(model, units)) == [["x", "y"]]


def ap_policy(policy: Any) -> Any:
    from accelport.sharding import check_arguments

    return check_arguments(tiny(), policy, True, None)


# -- checkpoints in one process ------------------------------------------------------------------


def test_modules_and_optimizers_in_a_single_file_restore_in_place(tmp_path: Path) -> None:
    import torch

    ap.use("cpu")
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 16, (2, 5))).sum().backward()
    ap.optimizer_step(opt)
    assert ap.save({"model": model, "opt": opt, "step": 3}, tmp_path / "ckpt.pt") is None
    raw = torch.load(tmp_path / "ckpt.pt")  # torch's own formats: readable without accelport
    assert set(raw) == {"model", "opt", "step"} and "enc.layers.0.linear1.weight" in raw["model"]

    fresh = tiny()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    plain = ap.load(tmp_path / "ckpt.pt", into={"model": fresh, "opt": fresh_opt})
    assert plain == {"step": 3}
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])

    with pytest.raises(ap.CheckpointError, match=r"has no entry 'net'; it holds 'model', 'opt', 'step'"):
        ap.load(tmp_path / "ckpt.pt", into={"net": fresh})
    with pytest.raises(TypeError, match=r"into=\.\.\.\) takes the dict"):
        ap.load(tmp_path / "ckpt.pt", into=[fresh])
    with pytest.raises(ap.CheckpointError, match="does not fit"):
        ap.load(tmp_path / "ckpt.pt", into={"model": torch.nn.Linear(2, 2)})


def test_background_without_a_sharded_model_is_written_before_it_returns(tmp_path: Path) -> None:
    import torch

    ap.use("cpu")
    pending = ap.save({"w": torch.ones(3)}, tmp_path / "a.pt", background=True)
    assert isinstance(pending, PendingSave) and pending.done()
    pending.wait()
    assert torch.equal(ap.load(tmp_path / "a.pt")["w"], torch.ones(3))
    with pytest.raises(TypeError, match=r"background=\.\.\.\) takes True or False"):
        ap.save({}, tmp_path / "b.pt", background="yes")  # type: ignore[arg-type]


def test_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    ap.use("cpu")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ap.CheckpointError, match="directory but not an accelport checkpoint"):
        ap.load(tmp_path, into={})
    with pytest.raises(ap.AccelportError, match="is a directory; give a file path"):
        ap.save({"a": 1}, tmp_path)


def test_a_save_stopped_between_its_two_renames_reads_the_previous_checkpoint(tmp_path: Path) -> None:
    ap.use("cpu")
    # What a save leaves when it stops after moving the previous checkpoint aside, before the new one lands.
    ap.save({"version": 1}, tmp_path / ".ckpt.accelport-old")
    assert not os.path.exists(tmp_path / "ckpt")
    assert ap.load(tmp_path / "ckpt") == {"version": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ap.save({"version": 2}, tmp_path / "ckpt")
    assert ap.load(tmp_path / "ckpt") == {"version": 2}


def test_a_backend_without_a_sharding_engine_runs_alone_and_refuses_replicas() -> None:
    from accelport.contract import Backend
    from accelport.eager import EagerBackend

    class NoEngine(EagerBackend):
        """A plugin backend that keeps the contract's default shard()."""

        name, platform, device_type = "noengine", "cpu", "cpu"
        replicas = 1

        def _probe(self) -> ap.Probe:
            return ap.Probe(True, "here")

        def shard(self, model: Any, **kwargs: Any) -> Any:
            return Backend.shard(self, model, **kwargs)

        def world_size(self) -> int:
            return self.replicas

    backend = NoEngine()
    model = tiny()
    assert backend.shard(model) is model
    backend.replicas = 2
    with pytest.raises(ap.ShardingError, match="backend 'noengine' has no sharding engine; with 2 replicas"):
        backend.shard(model)
