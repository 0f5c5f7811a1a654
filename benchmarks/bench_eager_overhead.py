"""Per-step overhead of ap.loader + ap.optimizer_step against a raw loop, on the cpu backend.

    python benchmarks/bench_eager_overhead.py [--rounds 21] [--steps 200] [--only eager|compiled] [--threads 1]
                                              [--batch 64]

The same small model (a 32-64-4 MLP, batch 64, SGD: a step of well under a millisecond,
where overhead shows most) trains in loops written two ways, eager and compiled,
interleaved round by round in one process so machine noise hits all alike:

- raw:        ``for x, y in batches:`` ... ``opt.step()`` (compiled: ``torch.compile(model)``), with torch's
              own ``torch.autograd.backward`` (accelport's process-wide wrapper of it put aside for its passes)
- accelport:  ``for x, y in ap.loader(batches):`` ... ``ap.optimizer_step(opt)`` with every
              diagnosis on, as shipped (compiled: ``ap.compile(model)``)
- accelport eager + checkpointer: the same, with ``ckpt.step()`` of an ``ap.Checkpointer``
              after each step (SIGTERM handled, the loader's position kept, no save due): what
              a step that does not save costs

A step's time is the wall time between consecutive batches arriving in the loop.
Reported: the median step time of each loop, the median over rounds of each round's
ratio (the headline figure, target <= 1.03: pairing within a round cancels slow
drifts of a shared machine), the same from each round's mean step time (work done
once every few steps shows in the mean but hardly in the median) and from each
round's CPU time (which leaves out the time other processes take the core away),
and the cost of accelport's per-step pieces timed alone.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from _rounds import interleave, per_call, raw_pass, train_pass

import accelport as ap
from accelport.runtime.state import RUNTIME


def make_model(compiled: str | None) -> tuple[Any, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if compiled == "torch":
        return torch.compile(model), opt
    if compiled == "ap":
        return ap.compile(model), opt
    return model, opt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--only", choices=("eager", "compiled"), default=None)
    parser.add_argument("--batch", type=int, default=64,
                        help="batch size: accelport's cost per step is the same at any size, the step is longer")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (1: the step's work in this thread, less noise; 0: torch's default)")
    args = parser.parse_args()

    ap.use("cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(args.batch, 32, generator=g), torch.randn(args.batch, 4, generator=g))
            for _ in range(args.steps)]
    kinds = [args.only] if args.only else ["eager", "compiled"]
    runs: dict[str, Callable[[], tuple[list[float], float]]] = {}
    for kind in kinds:
        raw_model = make_model("torch" if kind == "compiled" else None)
        ap_model = make_model("ap" if kind == "compiled" else None)
        runs[f"raw {kind}"] = lambda m=raw_model: raw_pass(data, *m, lambda opt: opt.step())
        runs[f"accelport {kind}"] = lambda m=ap_model: train_pass(ap.loader(data), *m, ap.optimizer_step)
    ckpt = None
    if "eager" in kinds:
        ckpt_model = make_model(None)
        ckpt = ap.Checkpointer(tempfile.mkdtemp(prefix="bench-ckpt-"), every_steps=10**9)
        checkpointed = ap.loader(data)
        ckpt.restore(model=ckpt_model[0], optimizer=ckpt_model[1], loader=checkpointed)

        def step_and_check(opt: torch.optim.Optimizer, ckpt: ap.Checkpointer = ckpt) -> None:
            ap.optimizer_step(opt)
            ckpt.step()

        runs["accelport eager + checkpointer"] = lambda m=ckpt_model: train_pass(checkpointed, *m, step_and_check)
    rounds = interleave(runs, args.rounds)

    engine = RUNTIME.diagnostics()
    watching = ", ".join(sorted(engine.kinds)) if engine is not None else ""
    print(f"torch {torch.__version__}, backend cpu, {torch.get_num_threads()} intra-op thread(s), batch {args.batch}; "
          f"{args.rounds} rounds x {args.steps} steps "
          f"each, interleaved; rules judging the accelport loops: {watching or 'none'}; "
          f"diagnoses during the run: {[d.kind for d in ap.diagnostics()] or 'none'}")
    headline = {}
    for kind in kinds:
        raw, ours = f"raw {kind}", f"accelport {kind}"
        by_median = rounds.ratio(rounds.median, ours, raw)
        by_mean = rounds.ratio(rounds.mean, ours, raw)
        by_cpu = rounds.ratio(rounds.cpu, ours, raw)
        headline[kind] = by_median
        for name in (raw, ours):
            print(f"{name:20s} median step {statistics.median(rounds.times[name]) * 1e6:8.1f} us, "
                  f"CPU {statistics.median(rounds.cpu[name]) * 1e6:8.1f} us")
        extra = (statistics.median(rounds.times[ours]) - statistics.median(rounds.times[raw])) * 1e6
        extra_cpu = statistics.median(
            a - b for a, b in zip(rounds.cpu[ours], rounds.cpu[raw], strict=True)) * 1e6
        print(f"{kind:9s} accelport / raw: median of per-round ratios {by_median:.3f} (of means {by_mean:.3f}, "
              f"of CPU time {by_cpu:.3f}); {extra:+.1f} us a step ({extra_cpu:+.1f} us of CPU)")

    if ckpt is not None:
        ours, base = "accelport eager + checkpointer", "accelport eager"
        print(f"{ours:20s} median step {statistics.median(rounds.times[ours]) * 1e6:8.1f} us, "
              f"CPU {statistics.median(rounds.cpu[ours]) * 1e6:8.1f} us")
        print(f"checkpointer, a step that does not save: / accelport eager: median of per-round ratios "
              f"{rounds.ratio(rounds.median, ours, base):.3f} (of means {rounds.ratio(rounds.mean, ours, base):.3f}, "
              f"of CPU time {rounds.ratio(rounds.cpu, ours, base):.3f}); {ckpt.steps} steps, no save")

    # accelport's own per-step pieces, timed alone.
    backend = ap.backend()
    tracker = RUNTIME.tracker
    model, opt = make_model(None)
    x, y = data[0]
    torch.nn.functional.mse_loss(model(x), y).backward()

    def loader_only() -> None:
        for _ in ap.loader(data):
            pass

    pieces = (
        ("ap.loader, per batch (nothing to move on cpu)", per_call(loader_only, 20) / len(data)),
        ("step bookkeeping + diagnostics (tracker.step_end)", per_call(tracker.step_end)),
        ("backend.step_counters()", per_call(backend.step_counters)),
    )
    if ckpt is not None:
        pieces += (("ckpt.step() that does not save", per_call(ckpt.step)),)
        ckpt.close()
    for name, cost in pieces:
        print(f"{name:52s} {cost:7.2f} us per call")
    for kind, ratio in headline.items():
        print(f"{kind}: accelport / raw = {ratio:.3f} (target <= 1.03: {'yes' if ratio <= 1.03 else 'NO'})")


if __name__ == "__main__":
    main()
