"""Sharding: ``ap.shard`` + ``ap.optimizer_step`` against hand-written FSDP2, and memory against replicated.

    python benchmarks/bench_shard.py                 # launches itself on 2 cpu processes (gloo)
    python benchmarks/bench_shard.py --width 2048 --rounds 8

Speed: the same model from the same weights, sharded by ``ap.shard`` and
stepped by ``ap.optimizer_step``, and sharded by hand (``fully_shard`` on every
block, then the root) and stepped by ``opt.step()``, in alternating rounds of
steps; a step's time is the slowest rank's. Printed: the median of the per-round
ratios of mean step times (accelport / hand-written) and the largest parameter
difference at the end (the same computation: it should be 0).

Memory: one fresh launch each, sharded (built on the meta device, so the whole
model never exists on one rank) and replicated, training a deeper model
(``--memory-depth``) with AdamW, each twice: with glibc's default allocator
settings and with ``MALLOC_MMAP_THRESHOLD_=1048576`` (large freed blocks go
back to the system at once). Printed per rank: parameter and optimizer-state
bytes (``ap.metrics()``; computed the same way for the replicated run) and the
growth of peak resident memory over the process before the model was built.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from _rounds import slowest_rank_times


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024, help="width of each block")
    p.add_argument("--depth", type=int, default=6, help="blocks")
    p.add_argument("--batch", type=int, default=32, help="batch per process")
    p.add_argument("--rounds", type=int, default=8, help="alternating rounds")
    p.add_argument("--steps", type=int, default=8, help="timed steps per round and method")
    p.add_argument("--memory-depth", type=int, default=24, help="blocks of the model in the memory runs")
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--worker", choices=["speed", "sharded", "replicated"], help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> object:
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(args.width, args.width)
            self.down = torch.nn.Linear(args.width, args.width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.relu(self.up(x)))

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(args.depth))
            self.head = torch.nn.Linear(args.width, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    return Net()


def worker_speed(args: argparse.Namespace) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import accelport as ap

    ours = ap.shard(build(args))
    hand = build(args)
    mesh = init_device_mesh("cpu", (ap.world_size(),))
    for block in hand.blocks:  # type: ignore[attr-defined]
        fully_shard(block, mesh=mesh)
    fully_shard(hand, mesh=mesh)  # type: ignore[arg-type]
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    opt_hand = torch.optim.AdamW(hand.parameters(), lr=1e-4)  # type: ignore[attr-defined]
    g = torch.Generator().manual_seed(100 + ap.rank())
    batches = [(torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, 1, generator=g))
               for _ in range(args.steps)]

    def step_ours(x: torch.Tensor, y: torch.Tensor) -> None:
        torch.nn.functional.mse_loss(ours(x), y).backward()
        ap.optimizer_step(opt_ours)
        opt_ours.zero_grad()

    def step_hand(x: torch.Tensor, y: torch.Tensor) -> None:
        torch.nn.functional.mse_loss(hand(x), y).backward()  # type: ignore[operator]
        opt_hand.step()
        opt_hand.zero_grad()

    def timed(step: Any) -> list[float]:
        return slowest_rank_times(batches, step)

    timed(step_ours), timed(step_hand)  # warm-up
    ratios, times = [], {"accelport": [], "hand": []}  # type: ignore[var-annotated]
    for r in range(args.rounds):
        order = [("accelport", step_ours), ("hand", step_hand)]
        means = {}
        for name, fn in order if r % 2 == 0 else order[::-1]:
            got = timed(fn)
            times[name] += got
            means[name] = statistics.fmean(got)
        ratios.append(means["accelport"] / means["hand"])
    diff = max((a.full_tensor() - b.full_tensor()).abs().max().item()
               for a, b in zip(ours.parameters(), hand.parameters(), strict=True))  # type: ignore[attr-defined]
    if ap.is_main_process():
        result = {"processes": ap.world_size(), "parameters": sum(p.numel() for p in build(args).parameters()),
                  "accelport_ms": statistics.median(times["accelport"]) * 1e3,
                  "hand_ms": statistics.median(times["hand"]) * 1e3,
                  "ratio": statistics.median(ratios), "ratios": ratios, "max_param_diff": diff}
        print("SPEED " + json.dumps(result), flush=True)


def worker_memory(args: argparse.Namespace, sharded: bool) -> None:
    import resource

    import torch

    import accelport as ap

    ap.device()
    args.depth = args.memory_depth
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if sharded:
        with torch.device("meta"):
            model = build(args)
        model = ap.shard(model)
        model.to_empty(device=ap.device())  # type: ignore[attr-defined]
        with torch.no_grad():
            for p in model.parameters():  # type: ignore[attr-defined]
                p.normal_(std=0.02)
    else:
        model = build(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # type: ignore[attr-defined]
    g = torch.Generator().manual_seed(100 + ap.rank())
    for _ in range(3):
        x, y = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, 1, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[operator]
        ap.optimizer_step(opt)
        opt.zero_grad()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    if sharded:
        m = ap.metrics()
        params, state = m.parameter_bytes, m.optimizer_state_bytes
    else:
        params = sum(p.numel() * p.element_size() for p in model.parameters())  # type: ignore[attr-defined]
        state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    row = torch.tensor([float(params), float(state), float(peak)], dtype=torch.float64)
    ap.all_reduce(row, op="mean")
    if ap.is_main_process():
        print("MEMORY " + json.dumps({"kind": "sharded" if sharded else "replicated", "parameter_bytes": row[0].item(),
                                      "optimizer_state_bytes": row[1].item(), "peak_rss_growth": row[2].item()}),
              flush=True)


def run(argv: list[str], kind: str, nprocs: int, env: dict[str, str] | None = None) -> dict[str, object]:
    cmd = [sys.executable, "-m", "accelport", "launch", "--backend", "cpu", "--nprocs", str(nprocs), "--oversubscribe",
           os.path.abspath(__file__), *argv, "--worker", kind]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(proc.returncode)
    line = next(line for line in proc.stdout.splitlines() if line.startswith(("SPEED ", "MEMORY ")))
    return json.loads(line.split(" ", 1)[1])  # type: ignore[no-any-return]


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.worker == "speed":
        worker_speed(args)
        return 0
    if args.worker:
        worker_memory(args, args.worker == "sharded")
        return 0
    speed = run(argv, "speed", args.nprocs)
    mb = 2**20
    print(f"{speed['parameters'] / 1e6:.1f} M parameters, {args.nprocs} processes, batch {args.batch} per process")
    print(f"step time ap.shard + ap.optimizer_step: {speed['accelport_ms']:.1f} ms, hand-written FSDP2: "
          f"{speed['hand_ms']:.1f} ms; median per-round ratio {speed['ratio']:.3f} "
          f"(rounds: {', '.join(f'{r:.3f}' for r in speed['ratios'])}); "  # type: ignore[attr-defined]
          f"max parameter difference {speed['max_param_diff']:.1e}", flush=True)
    memory: dict[str, dict[str, object]] = {}
    for allocator, env in (("glibc default", {}), ("MALLOC_MMAP_THRESHOLD_=1048576",
                                                   {"MALLOC_MMAP_THRESHOLD_": "1048576"})):
        s, r = (run(argv, kind, args.nprocs, env) for kind in ("sharded", "replicated"))
        memory[allocator] = {"sharded": s, "replicated": r}
        print(f"memory per rank, {args.memory_depth} blocks, allocator: {allocator}")
        print(f"  {'MB':<22}{'sharded':>10}{'replicated':>12}{'ratio':>8}")
        for key, label in (("parameter_bytes", "parameters"), ("optimizer_state_bytes", "optimizer state"),
                           ("peak_rss_growth", "peak RSS growth")):
            print(f"  {label:<22}{s[key] / mb:>10.1f}{r[key] / mb:>12.1f}"  # type: ignore[operator]
                  f"{s[key] / r[key]:>8.3f}", flush=True)  # type: ignore[operator]
    print("RESULT " + json.dumps({"speed": speed, "memory": memory}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
