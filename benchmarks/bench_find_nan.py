"""What --find-nan (ACCELPORT_FIND_NAN) costs: a checked step against a plain one, and a step before the checks begin.

    python benchmarks/bench_find_nan.py [--rounds 9] [--steps 40] [--threads 1] [--width 256] [--batch 64]

The same MLP (width-width-width-10, ReLU, batch 64, Adam) trains in three loops, interleaved
round by round in one process so machine noise hits all alike:

- plain:    no search (what every run without the flag is: nothing is installed)
- waiting:  a search that begins after the run's end: only its optimizer step hook runs
            (counting steps), as in the steps before ``--find-nan-from``
- checked:  a search from the first step: every op of every step checked as it runs

Reported: the median step time of each loop, and the median over rounds of each round's
ratio to plain, from wall time and from this thread's CPU time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable

import torch
from _rounds import interleave, train_pass

from accelport.observe.nan_search import NanSearch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (1: the step's work in this thread, less noise; 0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, 10, generator=g))
            for _ in range(args.steps)]
    w = args.width
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(),
                                torch.nn.Linear(w, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    directory = tempfile.mkdtemp(prefix="bench-find-nan-")

    def searched(first_step: int) -> Callable[[], tuple[list[float], float]]:
        def run() -> tuple[list[float], float]:
            search = NanSearch(first_step, directory)
            search.attach()
            try:
                return train_pass(data, model, opt, lambda o: o.step())
            finally:
                search.finish()
                assert search.found is None, search.found
        return run

    runs: dict[str, Callable[[], tuple[list[float], float]]] = {
        "plain": lambda: train_pass(data, model, opt, lambda o: o.step()),
        "waiting": searched(10 ** 9),
        "checked": searched(1),
    }
    rounds = interleave(runs, args.rounds)
    print(f"torch {torch.__version__}, cpu, {torch.get_num_threads()} intra-op thread(s); MLP {w}-{w}-{w}-10, batch "
          f"{args.batch}, Adam; {args.rounds} rounds x {args.steps} steps, interleaved")
    for name in runs:
        step = statistics.median(rounds.median[name]) * 1e3
        line = f"{name:8s} median step {step:8.3f} ms"
        if name != "plain":
            line += (f"   ratio to plain: wall {rounds.ratio(rounds.median, name, 'plain'):.3f}, "
                     f"cpu {rounds.ratio(rounds.cpu, name, 'plain'):.3f}")
        print(line)


if __name__ == "__main__":
    main()
