"""Sharded training jobs for tests/sharding/test_shard_jobs.py, run by `accelport launch --nprocs N`.

    shard_job.py train OUT          4 ranks: sharded against replicated, a checkpoint at step 3, bad input
    shard_job.py resume OUT CKPT FILE   2 ranks: the 4-rank checkpoint resumed sharded and replicated,
                                    a background save, a single-file checkpoint loaded into a sharded model
    shard_job.py big PATH           2 ranks: a 400 MB sharded save that the test kills midway

Each rank writes what it saw to OUT/rank<r>.pt; the test compares.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

import accelport as ap

VOCAB, WIDTH, GLOBAL_BATCH, SEQ = 16, 32, 8, 8


class Tiny(torch.nn.Module):
    """A small transformer: embedding, two encoder layers, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        layer = torch.nn.TransformerEncoderLayer(WIDTH, 4, 64, dropout=0.0, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x)))


class Big(torch.nn.Module):
    """100 square layers of 1024: 400 MB of float32 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024, bias=False) for _ in range(100))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def make(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


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
    result["replicated_losses"] = train(replicated, opt_r, range(0, 6))

    m = ap.metrics()
    result["parameter_bytes"], result["optimizer_state_bytes"] = m.parameter_bytes, m.optimizer_state_bytes
    result["full_parameter_bytes"] = nbytes(replicated.parameters())
    result["full_optimizer_state_bytes"] = nbytes(v for s in opt_r.state.values() for v in s.values())

    result["shard_twice"] = error_of(lambda: ap.shard(sharded))
    mixed = torch.optim.SGD(list(sharded.parameters()) + list(replicated.parameters()), lr=0.1)
    result["mixed_optimizer"] = error_of(lambda: ap.optimizer_step(mixed))
    result["nothing_matches"] = error_of(lambda: ap.shard(make(), policy={torch.nn.GRU}))
    result["foreign_directory"] = error_of(lambda: ap.save({"model": sharded}, out))  # holds rank*.pt files

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
    m = ap.metrics()
    result["parameter_bytes"], result["optimizer_state_bytes"] = m.parameter_bytes, m.optimizer_state_bytes

    # B: replicated on 2 ranks from the same checkpoint.
    replicated = make(seed=999)
    opt_r = torch.optim.AdamW(replicated.parameters(), lr=1e-2)
    ap.load(ckpt, into={"model": replicated, "opt": opt_r})
    result["replicated_losses"] = train(replicated, opt_r, range(3, 6))
    result["full_parameter_bytes"] = nbytes(replicated.parameters())
    result["full_optimizer_state_bytes"] = nbytes(v for s in opt_r.state.values() for v in s.values())

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
    print(f"saving {ap.rank()} {os.getpid()}", flush=True)
    ap.save({"model": model, "version": 2}, path)
    print("saved", flush=True)


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode == "big":
        job_big(argv[1])
        return
    out = argv[1]
    result = job_train(out) if mode == "train" else job_resume(out, argv[2], argv[3])
    result["rank"], result["world"] = ap.rank(), ap.world_size()
    torch.save(result, f"{out}/rank{ap.rank()}.pt")
    ap.barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
