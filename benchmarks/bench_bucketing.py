"""Static shapes and prefetching on XLA:CPU, side by side: the fixes the diagnostics name.

    PJRT_DEVICE=CPU python benchmarks/bench_bucketing.py [--steps 200] [--prefetch-steps 40]

1. Variable-length data (lengths 16..512, batch 8, batches of similar lengths from
   ``ap.data.LengthGroupedBatchSampler``) trained for --steps steps with the usual
   collate_fn, padding each batch to its longest sequence, against the same batches
   through ``ap.data.BucketCollate(buckets=(64, 128, 256, 512))``. Reported:
   compilations (target: at most the 4 buckets + 1), wall time and the ratio (target:
   bucketing at least 5x faster). Each loop runs in a fresh process, so neither finds
   graphs the other compiled in torch_xla's in-memory cache.

2. A dataset whose ``__getitem__`` sleeps (the data time D per batch), trained with
   ``ap.loader(..., prefetch=0)`` (each batch loaded in the loop's thread) and with
   ``ap.loader``'s default prefetching (torch_xla's ParallelLoader: a loader thread and
   an on-device queue), next to the same model on batches already in memory (the
   compute-only step time C). "Hidden" is the share of the data time that does not
   show up in the step time: 1 - (step time - C) / D. The loop's own data wait
   (``ap.metrics().data_wait_seconds``, the time it blocked for the next batch) is
   reported beside it. Target: at least 80% hidden with prefetching.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any

os.environ.setdefault("PJRT_DEVICE", "CPU")

BUCKETS = (64, 128, 256, 512)
FEATURES = 32


def sequence_batches(steps: int, batch: int = 8, seed: int = 0) -> list[list[tuple[Any, Any, Any]]]:
    """``steps`` batches of (x (length, FEATURES), mask (length,), target) samples, lengths 16..512.

    Batched by ``ap.data.LengthGroupedBatchSampler`` (similar lengths together, as the
    bucketing recipe recommends), so batch lengths spread over the whole range and
    every bucket is used; both loops get exactly these batches.
    """
    import torch

    import accelport as ap

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    lengths = [rng.randint(16, 512) for _ in range(steps * batch)]
    samples = [(torch.randn(n, FEATURES, generator=g), torch.ones(n), torch.randn((), generator=g)) for n in lengths]
    sampler = ap.data.LengthGroupedBatchSampler(lengths, batch, seed=seed)
    return [[samples[i] for i in indices] for indices in sampler]


def pad_to_longest(samples: list[tuple[Any, Any, Any]]) -> tuple[Any, Any, Any]:
    import torch
    from torch.nn.utils.rnn import pad_sequence

    return (pad_sequence([x for x, _, _ in samples], batch_first=True),
            pad_sequence([m for _, m, _ in samples], batch_first=True),
            torch.stack([y for _, _, y in samples]))


def run_sequences(variant: str, steps: int) -> dict[str, Any]:
    """One loop in this process: ``padded`` (to the batch's longest) or ``bucketed``."""
    import torch

    import accelport as ap

    ap.use("xla")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model = model.to(ap.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    collate = pad_to_longest if variant == "padded" else ap.data.BucketCollate(buckets=BUCKETS)
    batches = [collate(samples) for samples in sequence_batches(steps)]  # collated up front: not timed
    real = sum(int(mask.sum()) for _, mask, _ in batches)
    padded = sum(mask.numel() for _, mask, _ in batches)
    start = ap.metrics()
    t0 = time.perf_counter()
    for x, mask, y in ap.loader(batches):
        per_position = model(x).squeeze(-1)
        loss = torch.nn.functional.mse_loss(ap.data.masked_mean(per_position, mask > 0, dim=1), y)
        loss.backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
    ap.sync()
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()
    wall = time.perf_counter() - t0
    m = ap.metrics()
    return {"variant": variant, "steps": m.steps - start.steps, "wall_seconds": wall,
            "compilations": m.compilations - start.compilations,
            "compile_seconds": m.compile_seconds - start.compile_seconds,
            "batch_shapes": m.batch_signatures, "padding_share": 1 - real / padded,
            "diagnoses": [d.kind for d in ap.diagnostics()]}


class SleepyDataset:
    """Each sample takes ``delay`` seconds to 'load' (a stand-in for decoding or reading)."""

    def __init__(self, n: int, delay: float, features: int) -> None:
        import torch

        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, features, generator=g)
        self.y = torch.randn(n, 1, generator=g)
        self.delay = delay

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        time.sleep(self.delay)
        return self.x[i], self.y[i]


def run_prefetch(steps: int, batch: int, delay: float, width: int, n_rounds: int) -> dict[str, Any]:
    import torch
    import torch_xla.core.xla_model as xm
    from torch.utils.data import DataLoader

    import accelport as ap

    ap.use("xla")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(3) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())],
                                torch.nn.Linear(width, 1)).to(ap.device())
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    dataset = SleepyDataset(steps * batch, delay, width)

    def train(loader: Any) -> tuple[float, float]:
        """(mean wall seconds per step, mean data wait per step), from the first batch's arrival
        to the last step's end: a mean, since a queue that drains shows in a few long steps."""
        t0 = wait0 = None
        steps = 0
        for x, y in loader:
            if t0 is None:
                t0, wait0 = time.perf_counter(), ap.metrics().data_wait_seconds
            else:
                steps += 1
            torch.nn.functional.mse_loss(model(x), y).backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
            if steps == len(dataset) // batch - 1:
                break  # the last step: not the loader's end-of-data handling
        ap.sync()
        xm.wait_device_ops()
        wall = time.perf_counter() - t0
        return wall / (steps + 1), (ap.metrics().data_wait_seconds - wait0) / steps

    in_memory = [(dataset.x[i:i + batch], dataset.y[i:i + batch]) for i in range(0, len(dataset), batch)]
    train(ap.loader(in_memory))  # compile the step's graph once, outside every measurement
    data_time = []
    for _ in range(5):
        t0 = time.perf_counter()
        [dataset[i] for i in range(batch)]
        data_time.append(time.perf_counter() - t0)
    d = statistics.median(data_time)
    out: dict[str, Any] = {"data_seconds_per_batch": d}
    loops = {
        "compute only": lambda: ap.loader(in_memory),
        "prefetch=0": lambda: ap.loader(DataLoader(dataset, batch_size=batch), prefetch=0),
        "default prefetch": lambda: ap.loader(DataLoader(dataset, batch_size=batch)),
    }
    rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in loops}
    order = list(loops)
    warnings.simplefilter("ignore", ap.DiagnosticWarning)  # input-bound without prefetching: known
    for r in range(n_rounds):
        for name in order[r % 3:] + order[:r % 3]:  # interleaved, and who goes first rotates
            rounds[name].append(train(loops[name]()))
    computes = [t for t, _ in rounds["compute only"]]
    for name, got in rounds.items():
        # "hidden" per round, against that round's compute-only step: loops run back to
        # back share the machine's state, so the pairing cancels slow drifts; the median
        # of the rounds then drops the odd disturbed one.
        hidden = [1 - (t - c) / d for (t, _), c in zip(got, computes, strict=True)]
        out[name] = {"step_seconds": statistics.median(t for t, _ in got),
                     "data_wait_seconds": statistics.median(w for _, w in got),
                     "hidden": None if name == "compute only" else statistics.median(hidden)}
    return out


def sequences(steps: int) -> None:
    print(f"\n1. variable-length data (lengths 16..512, batch 8, length-grouped, {steps} steps), "
          f"per-position MLP {FEATURES}-64-1, masked mean loss")
    results = {}
    for variant in ("bucketed", "padded"):
        out = subprocess.run([sys.executable, __file__, "--variant", variant, "--steps", str(steps)],
                             capture_output=True, text=True, check=True)
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    for name, label in (("padded", "pad to the batch's longest"), ("bucketed", f"BucketCollate{BUCKETS}")):
        r = results[name]
        print(f"   {label:33s} compilations {r['compilations']:4d} ({r['compile_seconds']:6.1f} s compiling), "
              f"{r['batch_shapes']:3d} batch shapes, wall {r['wall_seconds']:6.1f} s, "
              f"padding {r['padding_share']:.0%}, diagnoses {r['diagnoses'] or 'none'}")
    ratio = results["padded"]["wall_seconds"] / results["bucketed"]["wall_seconds"]
    compiles = results["bucketed"]["compilations"]
    print(f"   bucketing: {compiles} compilations (target <= {len(BUCKETS) + 1}: "
          f"{'yes' if compiles <= len(BUCKETS) + 1 else 'NO'}), {ratio:.1f}x faster "
          f"(target >= 5x: {'yes' if ratio >= 5 else 'NO'})")


def prefetching(steps: int, n_rounds: int) -> None:
    batch, delay, width = 16, 0.0003, 1024
    print(f"\n2. a dataset whose __getitem__ sleeps {delay * 1e3:.1f} ms (batch {batch}, num_workers=0), "
          f"MLP {width}x3, {steps} steps per loop, {n_rounds} interleaved rounds (medians; hidden paired per round)")
    got = run_prefetch(steps, batch, delay, width, n_rounds)
    d = got.pop("data_seconds_per_batch")
    print(f"   data time D = {d * 1e3:.1f} ms per batch")
    for name, r in got.items():
        hidden = "" if r["hidden"] is None else f"   hidden {r['hidden']:.0%}"
        print(f"   {name:17s} step {r['step_seconds'] * 1e3:6.1f} ms   data wait {r['data_wait_seconds'] * 1e3:5.1f} ms"
              f"{hidden}")
    hidden = got["default prefetch"]["hidden"]
    print(f"   ap.loader's prefetching hides {hidden:.0%} of the data time (target >= 80%: "
          f"{'yes' if hidden >= 0.8 else 'NO'})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prefetch-steps", type=int, default=40)
    parser.add_argument("--prefetch-rounds", type=int, default=9)
    parser.add_argument("--only", choices=("sequences", "prefetch"), help="run one of the two parts")
    parser.add_argument("--variant", choices=("padded", "bucketed"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:  # a child: one loop, one JSON line
        print(json.dumps(run_sequences(args.variant, args.steps)))
        return

    import torch
    import torch_xla

    print(f"torch {torch.__version__}, torch_xla {torch_xla.__version__}, PJRT_DEVICE={os.environ['PJRT_DEVICE']}, "
          f"{os.cpu_count()} CPU cores")
    if args.only != "prefetch":
        sequences(args.steps)
    if args.only != "sequences":
        prefetching(args.prefetch_steps, args.prefetch_rounds)


if __name__ == "__main__":
    main()
