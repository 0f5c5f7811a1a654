"""Per-step overhead of ap.loader + ap.optimizer_step against raw torch_xla, on XLA:CPU.

    PJRT_DEVICE=CPU python benchmarks/bench_xla_overhead.py [--rounds 21] [--steps 100]

The same tiny model (where overhead shows most) trains in loops written three ways (the
first twice), interleaved round by round in one process so machine noise hits all alike:

- raw:        MpDeviceLoader(batches, device) + xm.optimizer_step(opt), torch_xla's defaults, with torch's own
              torch.autograd.backward (accelport's process-wide wrapper of it put aside for its passes)
- raw again:  the same raw loop a second time, with a model of its own: a control. Its ratio to
              raw is what this machine's noise alone makes of two equal loops, the yardstick
              for the figures of the others
- accelport:  ap.loader(batches) + ap.optimizer_step(opt), as shipped: the built-in
              rules judge every step's record
- no-observer: the same loop with the rules off, so no step record is built and no
              per-step counters are read (the step checks the rules asked for stay)

With ``--ablate``, two more loops split what is left by switching one part off (each a loop of
the shipped build with that part patched out for its passes only, so not a product setting):

- no bookkeeping: the step tracker's per-step calls off (a batch's arrival, the optimizer
              step's start and end, the loop's sync): no record, no time breakdown, no step
              checks. What it saves is the bookkeeping's cost, by elimination
- no loader look: the loader thread's look at each host batch for NaN and Inf off

A step's time is the wall time between consecutive batches arriving in the loop.
Reported: the median step time of each, its ratio to raw, the median over rounds of
each round's ratio (the headline figure, target <= 1.03: pairing within a round cancels
slow drifts of a shared machine) with the quartiles of those ratios beside it (how far
one round strays), the same from the loop thread's CPU time per step (it
leaves out the time other processes take the core away: the steadier figure on a busy
machine), the same from each round's mean step time (work done
once every few steps, such as the diagnostics reading torch_xla's counters once per 16
quiet steps, shows in the mean but hardly in the median), the cost of accelport's
per-step pieces timed alone, and the same pieces timed inside the loop (median per call).
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
from _rounds import call_times, interleave, per_call, raw_pass, train_pass  # noqa: E402
from torch_xla.distributed.parallel_loader import MpDeviceLoader  # noqa: E402

import accelport as ap  # noqa: E402
from accelport.device_loader import signature  # noqa: E402
from accelport.runtime.state import RUNTIME  # noqa: E402


def make_model(device: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--ablate", action="store_true", help="also run the loops with one part switched off")
    args = parser.parse_args()

    ap.use("xla")
    device = ap.device()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)) for _ in range(args.steps)]
    names = ["raw", "raw again", "accelport", "no-observer"]
    if args.ablate:
        names += ["no bookkeeping", "no loader look"]
    models = {name: make_model(device) for name in names}
    host = RUNTIME.host()
    engine = RUNTIME.diagnostics()

    class observers_off:
        """The rules off (the tracker then builds no records); the step checks stay, as the rules asked for them."""

        def __enter__(self) -> None:
            RUNTIME.tracker.bind(ap.backend(), host, None, RUNTIME.tracker.numerics)

        def __exit__(self, *exc: Any) -> None:
            RUNTIME.tracker.bind(ap.backend(), host, engine, RUNTIME.tracker.numerics)

    def raw(name: str = "raw") -> tuple[list[float], float]:
        return raw_pass(MpDeviceLoader(data, device), *models[name], xm.optimizer_step)

    watching: list[str] = []  # the observers the "accelport" loop ran with

    def accel() -> tuple[list[float], float]:
        got = train_pass(ap.loader(data), *models["accelport"], ap.optimizer_step)
        watching[:] = sorted(engine.kinds) if engine is not None else []
        return got

    def quiet() -> tuple[list[float], float]:
        with observers_off():
            return train_pass(ap.loader(data), *models["no-observer"], ap.optimizer_step)

    runs = {"raw": raw, "raw again": lambda: raw("raw again"), "accelport": accel, "no-observer": quiet}
    if args.ablate:
        tracker = RUNTIME.tracker

        def without(name: str, off: dict[str, Any]) -> tuple[list[float], float]:
            """A pass of the shipped loop with the tracker's methods in ``off`` replaced for its duration."""
            vars(tracker).update(off)
            try:
                return train_pass(ap.loader(data), *models[name], ap.optimizer_step)
            finally:
                for key in off:
                    del vars(tracker)[key]

        def nothing(*args: Any, **kwargs: Any) -> None:
            return None

        bookkeeping = dict.fromkeys(("batch_arrived", "optimizer_started", "step_end", "synced"), nothing)
        runs["no bookkeeping"] = lambda: without("no bookkeeping", bookkeeping)
        runs["no loader look"] = lambda: without("no loader look", {"inspector": lambda: None})
    rounds = interleave(runs, args.rounds)
    torch_xla.sync()
    med = {k: statistics.median(v) for k, v in rounds.times.items()}
    by_median = {k: rounds.ratio(rounds.median, k, "raw") for k in runs}
    by_mean = {k: rounds.ratio(rounds.mean, k, "raw") for k in runs}
    by_cpu = {k: rounds.ratio(rounds.cpu, k, "raw") for k in runs}
    spread = {k: rounds.spread(rounds.median, k, "raw") for k in runs}
    print(f"torch {torch.__version__}, torch_xla {torch_xla.__version__}, PJRT_DEVICE={os.environ['PJRT_DEVICE']}; "
          f"{args.rounds} rounds x {args.steps} steps each, interleaved; "
          f"rules judging the accelport loop: {', '.join(watching) or 'none'}")
    for k in runs:
        # CPU time: the loop thread's, which leaves out the time other processes take the core away
        # (XLA:CPU computes in threads of its own: this is the host's tracing and accelport's work).
        extra_cpu = statistics.median(a - b for a, b in zip(rounds.cpu[k], rounds.cpu["raw"], strict=True)) * 1e6
        print(f"{k:14s} median step {med[k] * 1e6:8.1f} us   ratio to raw {med[k] / med['raw']:.3f}   "
              f"median of per-round ratios {by_median[k]:.3f} [quartiles {spread[k][0]:.3f} to {spread[k][1]:.3f}] "
              f"(of means {by_mean[k]:.3f}, "
              f"of CPU time {by_cpu[k]:.3f}; {extra_cpu:+.1f} us of CPU a step)")

    # accelport's own per-step pieces, timed alone (no device work running beside them;
    # inside the loop, XLA:CPU computing on the same cores slows them several times).
    backend = ap.backend()
    tracker = RUNTIME.tracker
    with_observers = per_call(tracker.step_end)
    with observers_off():
        bare = per_call(tracker.step_end)
    for name, cost in (("signature(batch), in the loader's thread", per_call(lambda: signature(data[0]))),
                       ("step bookkeeping", bare),
                       ("same + diagnostics, averaged over quiet steps", with_observers),
                       ("step_counters(), once per 16 quiet steps", per_call(backend.step_counters)),
                       ("counters(), behind ap.metrics()", per_call(backend.counters, 500))):
        print(f"{name:46s} {cost:7.2f} us per call")

    # The same pieces inside the loop, where they cost several times as much: the median of each call
    # while the accelport loop trains, less the timing's own cost (a timed call of nothing, made once a
    # step); and the loop's sync against raw torch_xla's, with the step marker inside each (the same graph
    # traced and launched: the same time, where the loops' own Python differs).
    class Nothing:
        def call(self) -> None:
            return None

    nothing = Nothing()

    def stepped(opt: torch.optim.Optimizer) -> Any:
        nothing.call()
        return ap.optimizer_step(opt)

    pieces = [("(a timed call of nothing)", nothing, "call"),
              ("tracker.batch_arrived", tracker, "batch_arrived"),
              ("tracker.optimizer_started", tracker, "optimizer_started"),
              ("tracker.step_end", tracker, "step_end")]
    pieces += [(f"  of which {name}.step_end", watch, "step_end") for name, watch in
               (("numerics", tracker.numerics), ("flops", tracker.flops), ("memory", tracker.memory)) if watch]
    marker = torch_xla._XLAC  # (the step marker: tracing the step's graph and launching it, inside either sync)
    pieces += [("tracker.synced (the median: a quiet step's)", tracker, "synced"),
               ("backend.end_of_batch: the loop's sync", backend, "end_of_batch"),
               ("  of which torch_xla's step marker", marker, "_xla_step_marker")]
    inside = call_times(pieces, lambda: train_pass(ap.loader(data), *models["accelport"], stepped), 5)
    inside.update(call_times([("raw torch_xla: its loader's sync", torch_xla, "sync"),
                              ("  of which torch_xla's step marker (raw)", marker, "_xla_step_marker")], raw, 5))
    own = inside.pop("(a timed call of nothing)")
    print(f"inside the loop (median per call, less {own:.2f} us of timing):")
    for name, cost in inside.items():
        print(f"  {name:46s} {cost - own:7.2f} us per call")
    ratio = by_median["accelport"]
    low, high = spread["accelport"]
    print(f"accelport / raw = {ratio:.3f}, median of per-round ratios (target <= 1.03: "
          f"{'yes' if ratio <= 1.03 else 'NO'}; quartiles {low:.3f} to {high:.3f}); from each round's mean step: "
          f"{by_mean['accelport']:.3f}. The control, raw again / raw: {by_median['raw again']:.3f} "
          f"(quartiles {spread['raw again'][0]:.3f} to {spread['raw again'][1]:.3f}), what noise alone gives here")


if __name__ == "__main__":
    main()
