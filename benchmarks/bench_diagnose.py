"""The cost of `accelport diagnose`: the same unmodified script run plainly and under it, side by side.

    python benchmarks/bench_diagnose.py [--rounds 5] [--only cpu|xla]
    PJRT_DEVICE=CPU python benchmarks/bench_diagnose.py --only xla      # with torch_xla installed
    python benchmarks/bench_diagnose.py --in-process                    # the watching alone, per step

For each backend (cpu, and XLA:CPU where torch_xla is installed) one small training script,
which never imports accelport, is run as ``python train.py`` and as ``python -m accelport
diagnose train.py``, each a fresh process, in alternating rounds (who goes first swaps every
round, so a drift of the shared machine hits both alike), with ``OMP_NUM_THREADS=1`` unless set.
Reported: the median of the per-round ratios of process wall time (what a user waits for: start-up, the CLI, the
watching and the summary; the target is at most 1.05), of process CPU time (the same
cost, far less moved by other work on a shared machine), and of the loop's own wall and
CPU time, which the script measures itself.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from _rounds import timed

CPU_SCRIPT = """
import sys, time
import torch

torch.manual_seed(0)
steps = int(sys.argv[1])
data = torch.utils.data.TensorDataset(torch.randn(steps * 32, 32), torch.randn(steps * 32, 1))
loader = torch.utils.data.DataLoader(data, batch_size=32)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
start, cpu = time.perf_counter(), time.process_time()
for x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
print("loop_seconds", time.perf_counter() - start, time.process_time() - cpu)
"""

XLA_SCRIPT = """
import sys, time
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl

torch.manual_seed(0)
steps = int(sys.argv[1])
data = torch.utils.data.TensorDataset(torch.randn(steps * 16, 32), torch.randn(steps * 16, 1))
device = torch_xla.device()
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
start, cpu = time.perf_counter(), time.process_time()
for step, (x, y) in enumerate(pl.MpDeviceLoader(torch.utils.data.DataLoader(data, batch_size=16), device)):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    xm.optimizer_step(opt)
    opt.zero_grad()
    if step % 100 == 0:
        xm.add_step_closure(lambda value: None, args=(loss,))
torch_xla.sync()
print("loop_seconds", time.perf_counter() - start, time.process_time() - cpu)
"""


def compare(name: str, source: str, steps: int, rounds: int, env: dict[str, str]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "train.py")
        with open(script, "w") as f:
            f.write(source)
        plain = [sys.executable, script, str(steps)]
        watched = [sys.executable, "-m", "accelport", "diagnose", script, str(steps)]
        timed(plain, env), timed(watched, env)  # warm the page cache (and the XLA compiler's files) for both
        ratios: dict[str, list[float]] = {"wall": [], "cpu": [], "loop wall": [], "loop cpu": []}
        rows = []
        for r in range(rounds):
            first, second = (plain, watched) if r % 2 == 0 else (watched, plain)
            a, b = timed(first, env), timed(second, env)
            p, w = (a, b) if first is plain else (b, a)
            for key in ratios:
                ratios[key].append(w[key] / p[key])
            rows.append(f"{p['wall']:.2f}/{w['wall']:.2f}")
    print(f"{name}: {steps} steps; process wall seconds plain/diagnose per round: {', '.join(rows)}")
    for key, values in ratios.items():
        what = {"wall": "process wall time", "cpu": "process CPU time", "loop wall": "loop wall time",
                "loop cpu": "loop CPU time"}[key]
        target = " (target <= 1.05)" if key == "wall" else ""
        print(f"  {what} ratio, median of {rounds} rounds: {statistics.median(values):.3f}{target} "
              f"(rounds: {', '.join(f'{x:.3f}' for x in values)})")


def per_step_in_process(backend: str, steps: int, rounds: int) -> None:
    """The watching alone: one loop, in this process, alternately plain and under a fresh Watcher (CPU time).

    Each watched round pays the first step's set-up again (the plugin host, the backend), as a
    run does once; the process start and the CLI are not in it.
    """
    import torch

    from accelport.runtime.watch import Watcher

    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(steps * 16, 32), torch.randn(steps * 16, 1))
    loader: Any = torch.utils.data.DataLoader(data, batch_size=16)
    device: Any = "cpu"
    if backend == "xla":
        import torch_xla
        import torch_xla.distributed.parallel_loader as pl

        device = torch_xla.device()
        cpu_loader = loader
        loader = type("Loader", (), {"__iter__": lambda self: iter(pl.MpDeviceLoader(cpu_loader, device))})()
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def loop() -> tuple[float, float]:
        """(CPU seconds of the first step, CPU microseconds per step of the others)."""
        start = time.process_time()
        first = 0.0
        for i, (x, y) in enumerate(loader):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            if backend == "xla":
                torch_xla.sync()
            opt.zero_grad()
            if i == 0:
                first = time.process_time()
        return first - start, (time.process_time() - first) / (steps - 1) * 1e6

    loop()  # compile (XLA) and warm up
    plain: list[tuple[float, float]] = []
    watched: list[tuple[float, float]] = []
    for r in range(rounds):
        for mode in (("plain", "watched") if r % 2 == 0 else ("watched", "plain")):
            if mode == "plain":
                plain.append(loop())
                continue
            watcher = Watcher()
            watcher.install()
            try:
                watched.append(loop())
            finally:
                watcher.finish()
                watcher.uninstall()
    ratio = statistics.median(w[1] / p[1] for w, p in zip(watched, plain, strict=True))
    setup = statistics.median(w[0] - p[0] for w, p in zip(watched, plain, strict=True))
    per_plain, per_watched = statistics.median(p[1] for p in plain), statistics.median(w[1] for w in watched)
    print(f"{backend}, in this process, {steps} steps a loop: CPU time per step after the first, plain "
          f"{per_plain:.1f} us, watched {per_watched:.1f} us, "
          f"ratio {ratio:.3f} (median of {rounds} rounds); the first step's set-up (plugin host, backend) "
          f"{setup * 1000:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=("cpu", "xla"))
    parser.add_argument("--cpu-steps", type=int, default=4000)
    parser.add_argument("--xla-steps", type=int, default=2000)
    parser.add_argument("--in-process", action="store_true",
                        help="only the watching's own cost per step, in this process (less noisy)")
    args = parser.parse_args()
    if args.in_process:
        # XLA first: its device must exist before the first backward pass of the process.
        for backend in ("xla", "cpu"):
            if args.only in (None, backend) and (backend == "cpu" or importlib.util.find_spec("torch_xla")):
                per_step_in_process(backend, 500, 2 * args.rounds + 1)
        return
    # One intra-op thread for both: on a small shared machine, torch's thread pool fighting the
    # neighbours' work is most of the noise; the comparison stays like for like.
    env = {"OMP_NUM_THREADS": "1", **{k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")}}
    if args.only in (None, "cpu"):
        compare("cpu (plain PyTorch)", CPU_SCRIPT, args.cpu_steps, args.rounds, env)
    if args.only in (None, "xla"):
        if importlib.util.find_spec("torch_xla") is None:
            print("xla: skipped, torch_xla is not installed here")
        else:
            compare("XLA:CPU (torch_xla, MpDeviceLoader)", XLA_SCRIPT, args.xla_steps, args.rounds,
                    {**env, "PJRT_DEVICE": env.get("PJRT_DEVICE", "CPU")})


if __name__ == "__main__":
    main()
