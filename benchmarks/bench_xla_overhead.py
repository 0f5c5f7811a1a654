"""Per-step overhead of ap.loader + ap.optimizer_step against raw torch_xla, on XLA:CPU.

    PJRT_DEVICE=CPU python benchmarks/bench_xla_overhead.py [--rounds 15] [--steps 100]

The same tiny model (where overhead shows most) trains in loops written three ways,
interleaved round by round in one process so machine noise hits all alike:

- raw:       MpDeviceLoader(batches, device) + xm.optimizer_step(opt), torch_xla's defaults
- accelport: ap.loader(batches) + ap.optimizer_step(opt)
- observed:  the accelport loop with an accelport_step_end observer installed, so the
             per-step counters (Backend.step_counters) are read and a StepRecord is built

A step's time is the wall time between consecutive batches arriving in the loop.
Reported: the median step time of each, its ratio to raw, the median over rounds of
each round's ratio (the headline figure, target <= 1.03: pairing within a round cancels
slow drifts of a shared machine), and the cost of one Backend.step_counters() /
counters() call after the run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
from torch_xla.distributed.parallel_loader import MpDeviceLoader  # noqa: E402

import accelport as ap  # noqa: E402
from accelport._runtime import RUNTIME  # noqa: E402


def make_model(device: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def epoch(batches: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, step: Any) -> list[float]:
    """Train one pass; return the time of each step (batch arrival to next batch arrival)."""
    times = []
    last = None
    for x, y in batches:
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        step(opt)
        opt.zero_grad()
    return times


class Observer:
    """A minimal accelport_step_end plugin: what a diagnostics plugin costs at the least."""

    def __init__(self) -> None:
        self.records = 0

    @ap.hookimpl
    def accelport_step_end(self, record: Any) -> None:
        self.records += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()

    ap.use("xla")
    device = ap.device()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)) for _ in range(args.steps)]
    raw_model, raw_opt = make_model(device)
    ap_model, ap_opt = make_model(device)
    obs_model, obs_opt = make_model(device)
    host = RUNTIME.host()
    observer = Observer()

    def raw() -> list[float]:
        return epoch(MpDeviceLoader(data, device), raw_model, raw_opt, xm.optimizer_step)

    def accel() -> list[float]:
        return epoch(ap.loader(data), ap_model, ap_opt, ap.optimizer_step)

    def observed() -> list[float]:
        host.pm.register(observer, name="bench-observer")
        host._step_end = None  # rebuild the hot-path list with the observer in it
        try:
            return epoch(ap.loader(data), obs_model, obs_opt, ap.optimizer_step)
        finally:
            host.pm.unregister(observer)
            host._step_end = None

    runs = {"raw": raw, "accelport": accel, "observed": observed}
    for fn in runs.values():  # compile and warm up every loop
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    per_round: dict[str, list[float]] = {k: [] for k in runs}
    order = list(runs)
    for r in range(args.rounds):
        for name in order[r % 3:] + order[:r % 3]:  # rotate who goes first
            got = runs[name]()
            times[name].extend(got)
            per_round[name].append(statistics.median(got))
    torch_xla.sync()
    med = {k: statistics.median(v) for k, v in times.items()}
    # Each round's loops ran back to back: their ratio cancels slow drifts of a shared machine.
    paired = {k: statistics.median(a / b for a, b in zip(per_round[k], per_round["raw"])) for k in runs}
    print(f"torch {torch.__version__}, torch_xla {torch_xla.__version__}, PJRT_DEVICE={os.environ['PJRT_DEVICE']}; "
          f"{args.rounds} rounds x {args.steps} steps each, interleaved")
    for k in runs:
        print(f"{k:10s} median step {med[k] * 1e6:8.1f} us   ratio to raw {med[k] / med['raw']:.3f}   "
              f"median of per-round ratios {paired[k]:.3f}")
    print(f"observer saw {observer.records} steps")
    # accelport's own per-step work, timed alone (no device work, so no noise from it).
    from accelport._loader import signature

    backend = ap.backend()
    tracker = RUNTIME.tracker

    def observed_step_end() -> None:
        tracker.step_end(backend, host)

    def per_call(fn: Any, n: int = 5000) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6

    host.pm.register(observer, name="bench-observer")
    host._step_end = None
    with_observer = per_call(observed_step_end)
    host.pm.unregister(observer)
    host._step_end = None
    for name, cost in (("signature(batch)", per_call(lambda: signature(data[0]))),
                       ("step bookkeeping", per_call(lambda: tracker.step_end(backend, host))),
                       ("same + observer", with_observer),
                       ("step_counters()", per_call(backend.step_counters)),
                       ("counters()", per_call(backend.counters, 500))):
        print(f"{name:17s} {cost:7.2f} us per call")
    ratio = paired["accelport"]
    print(f"accelport / raw = {ratio:.3f}, median of per-round ratios (target <= 1.03: "
          f"{'yes' if ratio <= 1.03 else 'NO'})")


if __name__ == "__main__":
    main()
