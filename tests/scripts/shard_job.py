"""Sharded training jobs for tests/sharding/test_shard_jobs.py, run by `accelport launch --nprocs N`.

    shard_job.py train OUT          4 ranks: sharded against replicated, a checkpoint at step 3, bad input
    shard_job.py resume OUT CKPT FILE   2 ranks: the 4-rank checkpoint resumed sharded and replicated,
                                    a background save, a single-file checkpoint loaded into a sharded model,
                                    tied weights, failing saves and loads, mismatched collectives
    shard_job.py nonumpy OUT CKPT   2 ranks, rank SHARD_JOB_NO_NUMPY_RANK without numpy: save and load refused
    shard_job.py big PATH           2 ranks: a 400 MB sharded save that the test kills midway

Each rank writes what it saw to OUT/rank<r>.pt; the test compares.
"""

from __future__ import annotations

import os
import re
import sys

if os.environ.get("SHARD_JOB_NO_NUMPY_RANK") == os.environ.get("RANK", "0"):
    # As in an environment with torch's CPU wheel alone: numpy cannot be imported, by torch either.
    sys.modules["numpy"] = None  # type: ignore[assignment]

import torch
import torch.nn.functional as F

import accelport as ap

VOCAB, WIDTH, GLOBAL_BATCH, SEQ = 16, 32, 8, 8


class Tiny(torch.nn.Module):
    """A small transformer: embedding, two encoder layers (or ``layers``), a head."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        layer = torch.nn.TransformerEncoderLayer(WIDTH, 4, 64, dropout=0.0, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x)))


class Tied(torch.nn.Module):
    """GPT-2's layout: the output head shares the token embedding's weight, outside the body holding it."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = torch.nn.ModuleDict({
            "wte": torch.nn.Embedding(VOCAB, WIDTH),
            "wpe": torch.nn.Embedding(SEQ, WIDTH),
            "h": torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(2)),
            "ln_f": torch.nn.LayerNorm(WIDTH),
        })
        self.lm_head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.transformer["wte"].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        h = t["wte"](x) + t["wpe"](torch.arange(x.shape[1], device=x.device))
        for block in t["h"]:
            h = torch.tanh(block(h))
        return self.lm_head(t["ln_f"](h))


class Big(torch.nn.Module):
    """100 square layers of 1024: 400 MB of float32 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024, bias=False) for _ in range(100))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def make(seed: int = 0, layers: int = 2) -> Tiny:
    torch.manual_seed(seed)
    return Tiny(layers)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the step's global batch: the same global batch at every world size."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    y = torch.roll(x, 1, dims=1)
    per = GLOBAL_BATCH // ap.world_size()
    rows = slice(ap.rank() * per, (ap.rank() + 1) * per)
    return x[rows], y[rows]


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step)
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
        losses.append(ap.all_reduce(loss.detach().clone(), op="mean").item())
    return losses


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a collective on a sharded model: call it on every rank)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().clone()
    return out


def error_of(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def in_step() -> float:
    """A sum over every rank after an error: the world size if no rank was left behind in a collective."""
    return ap.all_reduce(torch.ones(1)).item()


def nbytes(tensors: object) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))  # type: ignore[attr-defined]


def job_train(out: str) -> dict[str, object]:
    result: dict[str, object] = {}
    sharded = ap.shard(make())
    opt_s = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    replicated = make()
    opt_r = torch.optim.AdamW(replicated.parameters(), lr=1e-2)
    result["types"] = sorted({type(p).__name__ for p in sharded.parameters()})
    # Left over by a save that was killed: the next save clears it.
    if ap.is_main_process():
        os.makedirs(f"{out}/.ckpt.accelport-tmp", exist_ok=True)
        open(f"{out}/.ckpt.accelport-tmp/__0_0.distcp", "w").write("partial")
    ap.barrier()

    result["sharded_losses"] = train(sharded, opt_s, range(0, 3))
    result["rng_at_save"] = torch.get_rng_state()
    ap.save({"model": sharded, "opt": opt_s, "step": 3, "note": "four ranks", "rng": torch.get_rng_state()},
            f"{out}/ckpt")
    result["full_step3"] = full_params(sharded)
    result["ckpt_files"] = sorted(os.listdir(f"{out}/ckpt"))
    result["out_files"] = sorted(os.listdir(out))
    result["sharded_losses"] += train(sharded, opt_s, range(3, 6))
    # Before the replicated model trains: from then on its parameters and state are this rank's too.
    m = ap.metrics()
    result["parameter_bytes"], result["optimizer_state_bytes"] = m.parameter_bytes, m.optimizer_state_bytes
    result["replicated_losses"] = train(replicated, opt_r, range(0, 6))
    result["full_parameter_bytes"] = nbytes(replicated.parameters())
    result["full_optimizer_state_bytes"] = nbytes(v for s in opt_r.state.values() for v in s.values())

    result["shard_twice"] = error_of(lambda: ap.shard(sharded))
    mixed = torch.optim.SGD(list(sharded.parameters()) + list(replicated.parameters()), lr=0.1)
    result["mixed_optimizer"] = error_of(lambda: ap.optimizer_step(mixed))
    result["nothing_matches"] = error_of(lambda: ap.shard(make(), policy={torch.nn.GRU}))
    result["foreign_directory"] = error_of(lambda: ap.save({"model": sharded}, out))  # holds rank*.pt files
    # The 2-layer checkpoint into a 1-layer model: DCP alone would read the layer both have and say nothing.
    result["fewer_layers"] = error_of(lambda: ap.load(f"{out}/ckpt", into={"model": ap.shard(make(layers=1))}))
    result["in_step_after_load"] = in_step()

    # A NaN loss on the sharded model: each rank finds it in its own shard of the gradients.
    x, y = batch(6)
    (F.cross_entropy(sharded(x).reshape(-1, VOCAB), y.reshape(-1)) * float("nan")).backward()
    ap.optimizer_step(opt_s)
    result["steps"] = ap.metrics().steps
    result["diagnoses"] = [(d.kind, d.step, d.message) for d in ap.diagnostics()]
    return result


def job_resume(out: str, ckpt: str, single_file: str) -> dict[str, object]:
    result: dict[str, object] = {}
    # A: sharded on 2 ranks, from the checkpoint 4 ranks wrote (other initial weights: all must come from it).
    sharded = ap.shard(make(seed=123))
    opt_s = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    plain = ap.load(ckpt, into={"model": sharded, "opt": opt_s})
    result["plain"] = {k: v for k, v in plain.items() if k != "rng"}
    result["rng"] = plain["rng"]  # a plain value: returned, for the script to restore
    result["resumed_full"] = full_params(sharded)
    result["sharded_losses"] = train(sharded, opt_s, range(3, 6))
    x, y = batch(6)  # gradients that stay (no step): this rank's shard of them
    F.cross_entropy(sharded(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
    m = ap.metrics()
    result["parameter_bytes"], result["optimizer_state_bytes"] = m.parameter_bytes, m.optimizer_state_bytes
    result["gradient_bytes"] = m.gradient_bytes
    opt_s.zero_grad()

    # B: replicated on 2 ranks from the same checkpoint.
    replicated = make(seed=999)
    opt_r = torch.optim.AdamW(replicated.parameters(), lr=1e-2)
    ap.load(ckpt, into={"model": replicated, "opt": opt_r})
    result["replicated_losses"] = train(replicated, opt_r, range(3, 6))
    result["full_parameter_bytes"] = nbytes(replicated.parameters())
    result["full_optimizer_state_bytes"] = nbytes(v for s in opt_r.state.values() for v in s.values())
    result["full_gradient_bytes"] = nbytes(p for p in replicated.parameters() if p.requires_grad)

    # C: a background save while training goes on; it holds the state of the moment it was called.
    at_save = full_params(sharded)
    pending = ap.save({"model": sharded, "opt": opt_s, "step": 6}, f"{out}/background", background=True)
    train(sharded, opt_s, range(6, 8))
    pending.wait()
    result["background_done"] = pending.done()
    again = ap.shard(make(seed=5))
    opt_again = torch.optim.AdamW(again.parameters(), lr=1e-2)
    result["background_plain"] = ap.load(f"{out}/background", into={"model": again, "opt": opt_again})
    back = full_params(again)
    result["background_equal"] = all(torch.equal(back[k], at_save[k]) for k in at_save)

    # D: a single file written alone, restored into a sharded model and its optimizer.
    from_file = ap.shard(make(seed=77))
    opt_file = torch.optim.AdamW(from_file.parameters(), lr=1e-2)
    result["file_plain"] = ap.load(single_file, into={"model": from_file, "opt": opt_file})
    result["file_full"] = full_params(from_file)
    result["file_exp_avg"] = {name: opt_file.state[p]["exp_avg"].full_tensor().clone()
                              for name, p in from_file.named_parameters()}

    result["load_without_into"] = error_of(lambda: ap.load(ckpt))
    result["load_unknown_key"] = error_of(lambda: ap.load(ckpt, into={"net": make()}))
    result.update(bad_checkpoints(out, ckpt, sharded))
    result.update(collectives(sharded))
    result.update(tied(out))
    return result


def bad_checkpoints(out: str, ckpt: str, sharded: torch.nn.Module) -> dict[str, object]:
    """Saves rank 0 cannot start and checkpoints that do not fit: every rank raises, and stays in step."""
    result: dict[str, object] = {}
    result["fewer_layers"] = error_of(lambda: ap.load(ckpt, into={"model": ap.shard(make(layers=1))}))
    result["more_layers"] = error_of(lambda: ap.load(ckpt, into={"model": ap.shard(make(layers=3))}))
    result["in_step_after_load"] = in_step()
    if ap.is_main_process():
        open(f"{out}/a-file", "w").write("not a directory")
        os.makedirs(f"{out}/empty")
        import shutil

        shutil.copytree(ckpt, f"{out}/cut")
        shard = f"{out}/cut/__1_0.distcp"
        os.truncate(shard, os.path.getsize(shard) // 2)
    ap.barrier()
    result["parent_is_a_file"] = error_of(lambda: ap.save({"model": sharded}, f"{out}/a-file/ckpt"))
    result["in_step_after_save"] = in_step()
    result["cut_shard"] = error_of(lambda: ap.load(f"{out}/cut", into={"model": ap.shard(make())}))
    result["in_step_after_cut"] = in_step()
    here = os.getcwd()
    os.chdir(f"{out}/empty")
    try:
        result["empty_path"] = error_of(lambda: ap.save({"model": sharded}, ""))
        result["dot_path"] = error_of(lambda: ap.save({"model": sharded}, "."))
    finally:
        os.chdir(here)
    result["empty_still_there"] = sorted(os.listdir(out)).count("empty") == 1 and os.listdir(f"{out}/empty") == []
    result["in_step_after_paths"] = in_step()
    return result


def collectives(sharded: torch.nn.Module) -> dict[str, object]:
    """ap.all_reduce and ap.broadcast given what they cannot reduce or copy."""
    result: dict[str, object] = {}
    result["uint8_sum"] = error_of(lambda: ap.all_reduce(torch.full((2,), 200, dtype=torch.uint8)))
    result["shapes_differ"] = error_of(lambda: ap.all_reduce(torch.ones(2 + ap.rank())))
    result["dtypes_differ"] = error_of(lambda: ap.all_reduce(torch.ones(2, dtype=(torch.float32, torch.float64)[
        ap.rank() % 2])))
    result["in_step_after_all_reduce"] = in_step()
    result["broadcast_sharded"] = error_of(lambda: ap.broadcast(sharded))
    result["broadcast_sparse"] = error_of(lambda: ap.broadcast(torch.eye(3).to_sparse()))
    result["in_step_after_broadcast"] = in_step()
    return result


def tied(out: str) -> dict[str, object]:
    """A GPT-2-style tied embedding and head sharded with the default policy: trained, saved and loaded."""
    result: dict[str, object] = {}
    torch.manual_seed(3)
    replicated = Tied()
    torch.manual_seed(3)
    sharded = ap.shard(Tied())
    result["tied_still_tied"] = sharded.lm_head.weight is sharded.transformer["wte"].weight
    losses = {}
    for name, model in (("sharded", sharded), ("replicated", replicated)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[name] = train(model, opt, range(3))
    result["tied_losses"] = losses
    ap.save({"model": sharded}, f"{out}/tied")
    torch.manual_seed(4)
    back = ap.shard(Tied())
    ap.load(f"{out}/tied", into={"model": back})
    want, got = full_params(sharded), full_params(back)
    result["tied_round_trip"] = sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)
    return result


def job_nonumpy(out: str, ckpt: str) -> dict[str, object]:
    """One rank without numpy: sharded saves and loads are refused on every rank before DCP starts."""
    result: dict[str, object] = {}
    sharded = ap.shard(make())
    result["save"] = error_of(lambda: ap.save({"model": sharded, "step": 1}, f"{out}/ckpt"))
    result["in_step_after_save"] = in_step()
    result["load"] = error_of(lambda: ap.load(ckpt, into={"model": sharded}))
    result["in_step_after_load"] = in_step()
    # (less the ranks' own result files: a peer past the last collective may have written its own)
    result["written"] = sorted(name for name in os.listdir(out) if not re.fullmatch(r"rank\d+\.pt", name))
    return result


def job_big(path: str) -> None:
    with torch.device("meta"):  # built on meta, materialised as shards only
        model = Big()
    model = ap.shard(model)
    model.to_empty(device=ap.device())
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    ap.save({"model": model, "version": 1}, path)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(2.0)
    # One write of the whole line: both ranks share the launcher's stdout, and print() writes the text and its
    # newline apart, so two ranks' lines could run together ("saving 0 2725saving 1 2731").
    sys.stdout.write(f"saving {ap.rank()} {os.getpid()}\n")
    sys.stdout.flush()
    ap.save({"model": model, "version": 2}, path)
    print("saved", flush=True)


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode == "big":
        job_big(argv[1])
        return
    out = argv[1]
    if mode == "train":
        result = job_train(out)
    elif mode == "nonumpy":
        result = job_nonumpy(out, argv[2])
    else:
        result = job_resume(out, argv[2], argv[3])
    result["rank"], result["world"] = ap.rank(), ap.world_size()
    torch.save(result, f"{out}/rank{ap.rank()}.pt")
    ap.barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
