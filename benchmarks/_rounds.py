"""What the benchmarks share: a timed training pass, interleaved rounds, paired ratios.

Every benchmark here compares loops side by side in one run: each round runs every loop
once, in a rotating order, and the headline is the median over rounds of each round's
ratio, so slow drifts of a shared machine cancel within a round.
"""

from __future__ import annotations

import resource
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


def train_pass(batches: Iterable[Any], model: Any, opt: Any, step: Callable[[Any], Any]) -> tuple[list[float], float]:
    """Train one pass; return each step's time (batch arrival to next batch arrival) and CPU time per step.

    The CPU time is this thread's (where the step's work runs with one intra-op thread):
    unlike wall time, it leaves out the time other processes on the machine take the core away.
    """
    import torch

    times = []
    last = None
    cpu = time.thread_time()
    for x, y in batches:
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        step(opt)
        opt.zero_grad()
    return times, (time.thread_time() - cpu) / max(len(times) + 1, 1)


def raw_pass(batches: Iterable[Any], model: Any, opt: Any, step: Callable[[Any], Any]) -> tuple[list[float], float]:
    """:func:`train_pass` as a script without accelport runs it: with torch's own ``torch.autograd.backward``.

    accelport wraps that function once per process when a run is bound (its step clock watches each backward
    pass; ``loss.backward()`` goes through it). Left in place, the raw loop would pay the wrapper too, and
    every ratio to it would understate accelport's cost.
    """
    import torch.autograd as autograd

    current = autograd.backward
    original = getattr(current, "__wrapped__", None) if getattr(current, "_accelport_clock", False) else None
    if original is None:
        return train_pass(batches, model, opt, step)
    autograd.backward = original
    try:
        return train_pass(batches, model, opt, step)
    finally:
        autograd.backward = current


@dataclass
class Rounds:
    """Per loop: every step time, and per round its median step, mean step and CPU time per step."""

    times: dict[str, list[float]] = field(default_factory=dict)
    median: dict[str, list[float]] = field(default_factory=dict)
    mean: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)

    @staticmethod
    def ratios(per_round: Mapping[str, list[float]], name: str, base: str) -> list[float]:
        """Each round's ``name`` figure over ``base``'s in the same round."""
        return [a / b for a, b in zip(per_round[name], per_round[base], strict=True)]

    def ratio(self, per_round: Mapping[str, list[float]], name: str, base: str) -> float:
        """The median over rounds of ``name``'s figure over ``base``'s in the same round."""
        return statistics.median(self.ratios(per_round, name, base))

    def spread(self, per_round: Mapping[str, list[float]], name: str, base: str) -> tuple[float, float]:
        """The quartiles (25th, 75th percentile) of the per-round ratios whose median :meth:`ratio` gives: how
        far one round's ratio strays from that median on this machine."""
        ratios = self.ratios(per_round, name, base)
        if len(ratios) < 2:
            return (ratios[0], ratios[0]) if ratios else (float("nan"), float("nan"))
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        return q1, q3


def interleave(runs: Mapping[str, Callable[[], tuple[list[float], float]]], rounds: int) -> Rounds:
    """Run every loop once to warm up (compile), then ``rounds`` rounds, rotating who goes first."""
    for fn in runs.values():
        fn()
    out = Rounds(*({k: [] for k in runs} for _ in range(4)))
    order = list(runs)
    for r in range(rounds):
        shift = r % len(order)
        for name in order[shift:] + order[:shift]:
            times, cpu = runs[name]()
            out.times[name].extend(times)
            out.median[name].append(statistics.median(times))
            out.mean[name].append(statistics.fmean(times))
            out.cpu[name].append(cpu)
    return out


def call_times(targets: Iterable[tuple[str, Any, str]], run: Callable[[], Any], passes: int) -> dict[str, float]:
    """Median wall microseconds of each call of ``targets`` ((label, object, method name)) made while ``run()``
    trains, ``passes`` times: what they cost inside the loop, where the device's work beside them (and the
    caches it leaves cold) makes them several times slower than :func:`per_call` says. Each call's time
    includes the timing's own: time a call of nothing beside them to know it."""
    durations: dict[str, list[float]] = {}
    restore = []
    for label, obj, name in targets:
        original = getattr(obj, name)
        own = name in vars(obj)  # (an attribute of the instance, not its class: put back as it was)
        setattr(obj, name, _timed(original, durations.setdefault(label, [])))
        restore.append((obj, name, original if own else None))
    try:
        for _ in range(passes):
            run()
    finally:
        for obj, name, original in reversed(restore):
            if original is None:
                delattr(obj, name)
            else:
                setattr(obj, name, original)
    return {label: statistics.median(kept) * 1e6 for label, kept in durations.items() if kept}


def _timed(fn: Callable[..., Any], kept: list[float]) -> Callable[..., Any]:
    clock = time.perf_counter

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            kept.append(clock() - start)

    return timed


def per_call(fn: Callable[[], Any], n: int = 5000) -> float:
    """Microseconds per call of ``fn``, timed alone."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def slowest_rank_times(batches: Iterable[tuple[Any, Any]], step: Callable[[Any, Any], None]) -> list[float]:
    """Each step's time on the slowest rank (a barrier before each, the maximum over ranks after)."""
    import torch
    import torch.distributed as dist

    import accelport as ap

    out = []
    for x, y in batches:
        ap.barrier()
        t0 = time.perf_counter()
        step(x, y)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        out.append(float(t))
    return out


def timed(command: list[str], env: dict[str, str]) -> dict[str, float]:
    """Process wall and CPU seconds, and the loop's own wall and CPU seconds as the script printed them."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    loop = next(line.split()[1:] for line in out.stdout.splitlines() if line.startswith("loop_seconds"))
    return {"wall": wall, "cpu": cpu, "loop wall": float(loop[0]), "loop cpu": float(loop[1])}
