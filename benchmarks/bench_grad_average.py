"""Gradient averaging: ``ap.optimizer_step`` against DistributedDataParallel, side by side.

    python benchmarks/bench_grad_average.py            # launches itself on 2 cpu processes (gloo)
    python benchmarks/bench_grad_average.py --width 2048 --rounds 8

Both train the same model from the same initial weights on the same batches, in
alternating rounds of steps so machine noise hits both alike. A step is
zero_grad + forward + backward + (average gradients) + optimizer step; the time
of a step is the slowest rank's. Printed: median step time of each and their
ratio (accelport / DDP), and the largest parameter difference after training
(both compute the same average, so it should be ~0).
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
    p.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    p.add_argument("--depth", type=int, default=4, help="hidden layers")
    p.add_argument("--batch", type=int, default=64, help="batch per process")
    p.add_argument("--rounds", type=int, default=6, help="alternating rounds")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round and method")
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import accelport as ap

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = [torch.nn.Linear(64, args.width), torch.nn.ReLU()]
        for _ in range(args.depth - 1):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 1))

    rank = ap.rank()
    ours = model()
    ddp = DistributedDataParallel(model())
    opt_ours = torch.optim.SGD(ours.parameters(), lr=1e-3)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(100 + rank)
    batches = [(torch.randn(args.batch, 64, generator=g), torch.randn(args.batch, 1, generator=g))
               for _ in range(args.steps)]

    def step_ours(x: torch.Tensor, y: torch.Tensor) -> None:
        opt_ours.zero_grad()
        torch.nn.functional.mse_loss(ours(x), y).backward()
        ap.optimizer_step(opt_ours)

    def step_ddp(x: torch.Tensor, y: torch.Tensor) -> None:
        opt_ddp.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt_ddp.step()

    def timed(step: Any) -> list[float]:
        return slowest_rank_times(batches, step)

    timed(step_ours), timed(step_ddp)  # warm-up (DDP builds its buckets on the first step)
    times: dict[str, list[float]] = {"accelport": [], "ddp": []}
    for r in range(args.rounds):
        order = [("accelport", step_ours), ("ddp", step_ddp)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            times[name] += timed(fn)

    diff = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), ddp.module.parameters(), strict=True))
    if ap.is_main_process():
        params = sum(p.numel() for p in ours.parameters())
        a, d = statistics.median(times["accelport"]), statistics.median(times["ddp"])
        result = {"processes": ap.world_size(), "parameters": params, "gradient_mb": params * 4 / 2**20,
                  "batch_per_process": args.batch, "steps_each": len(times["ddp"]),
                  "accelport_ms": a * 1e3, "ddp_ms": d * 1e3, "ratio": a / d, "max_param_diff": diff}
        print(f"{'method':<28}{'median step (ms)':>18}")
        print(f"{'ap.optimizer_step':<28}{a * 1e3:>18.2f}")
        print(f"{'DistributedDataParallel':<28}{d * 1e3:>18.2f}")
        print(f"ratio accelport/DDP: {a / d:.3f}   ({params / 1e6:.2f} M parameters, "
              f"{result['gradient_mb']:.1f} MB of gradients, {ap.world_size()} processes, "
              f"max parameter difference {diff:.1e})")
        print("RESULT " + json.dumps(result))


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    cmd = [sys.executable, "-m", "accelport", "launch", "--backend", "cpu", "--nprocs", str(args.nprocs),
           os.path.abspath(__file__), *argv, "--worker"]
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
