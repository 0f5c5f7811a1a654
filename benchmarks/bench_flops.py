"""What counting a step's FLOPs costs: the sampled step, and a run that counts one step per batch shape.

    python benchmarks/bench_flops.py [--rounds 11] [--steps 50] [--threads 1]

Three models train on the host CPU (an MLP, a conv net, a transformer block with
scaled_dot_product_attention), each step timed three ways side by side, in a rotating order
within each round so machine noise hits all alike:

- plain:     the step as it is;
- counted:   the same step under the count of an eager backend (cpu, cuda, tpu, neuron: one step
             per batch shape);
- traced:    under the count of a lazy backend (XLA). Both are the one pass-through mode with
             torch.utils.flop_counter's formulas, so the two columns differ by noise alone;

and a run of ``--steps`` steps with one of them counted against the same run without. Reported per
model: the median step times, the median over rounds of each round's ratio to plain (the sampled
step's cost), and the run's ratio (what counting once per shape adds to a run of that length).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any


def models() -> dict[str, tuple[Any, Any]]:
    import torch

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(32, 32, 3),
                               torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(32, 10))
    block = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True, dropout=0.0)
    return {"mlp": (mlp, torch.randn(256, 512)), "conv": (conv, torch.randn(16, 3, 32, 32)),
            "transformer": (block, torch.randn(8, 128, 256))}


def step_of(model: Any, x: Any) -> Callable[[], None]:
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    return step


def timed(step: Callable[[], None], how: str) -> float:
    from accelport.observe.flops import FlopWatch

    watch = FlopWatch(lazy=how == "traced") if how != "plain" else None
    start = time.perf_counter()
    if watch is not None:
        watch.batch(("s",))
    step()
    if watch is not None:
        watch.step_end(("s",))
        assert watch.counts[("s",)].flops > 0
    return time.perf_counter() - start


def run(step: Callable[[], None], steps: int, count: bool) -> float:
    from accelport.observe.flops import FlopWatch

    watch = FlopWatch(lazy=False) if count else None
    start = time.perf_counter()
    for _ in range(steps):
        if watch is not None:
            watch.batch(("s",))  # (counted on the first step only: the same shape after it)
        step()
        if watch is not None:
            watch.step_end(("s",))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    ways = ("plain", "counted", "traced")
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} rounds, runs of {args.steps} steps")
    print(f"{'model':<12} {'plain ms':>9} {'counted ms':>11} {'traced ms':>10} {'counted/plain':>14} "
          f"{'traced/plain':>13} {'run with/without':>17}")
    for name, (model, x) in models().items():
        step = step_of(model, x)
        for _ in range(3):
            step()  # warm up
        times: dict[str, list[float]] = {w: [] for w in ways}
        ratios: dict[str, list[float]] = {w: [] for w in ways[1:]}
        runs: list[float] = []
        for r in range(args.rounds):
            order = ways[r % 3:] + ways[:r % 3]
            got = {w: timed(step, w) for w in order}
            for w in ways:
                times[w].append(got[w])
            for w in ways[1:]:
                ratios[w].append(got[w] / got["plain"])
            pair = [(c, run(step, args.steps, c)) for c in ((True, False) if r % 2 else (False, True))]
            seconds = dict(pair)
            runs.append(seconds[True] / seconds[False])
        med = {w: statistics.median(v) * 1e3 for w, v in times.items()}
        print(f"{name:<12} {med['plain']:>9.2f} {med['counted']:>11.2f} {med['traced']:>10.2f} "
              f"{statistics.median(ratios['counted']):>14.2f} {statistics.median(ratios['traced']):>13.2f} "
              f"{statistics.median(runs):>17.3f}")


if __name__ == "__main__":
    main()
