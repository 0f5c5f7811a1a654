"""The cost of diagnosing a whole job: a 2-rank DDP script under torchrun, plainly and under `accelport diagnose`.

    python benchmarks/bench_job.py [--rounds 5] [--steps 400]

The same unmodified script (gloo on cpu, a 32-64-1 MLP in DDP, batches of 32 from a DataLoader) is
run four ways, each a fresh set of processes, in rounds whose order rotates: a job of two ranks
(`python -m torch.distributed.run --nproc-per-node 2 train.py`) plainly and as
`python -m accelport diagnose -m torch.distributed.run --nproc-per-node 2 train.py`, and one
process plainly and under `accelport diagnose`. Each rank measures its own loop (wall and CPU
time); reported: the median over rounds of each round's ratio, diagnosed / plain, of the loop's CPU
time (rank 0's; the figure other work on a shared machine moves least), of its wall time, and of the
whole command's wall time, for the job and for one process side by side: the job mode adds no
collective to any step, so its loop's ratio should be the one-process ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

from _rounds import timed

SCRIPT = """
import os, sys, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

steps = int(sys.argv[1])
job = "RANK" in os.environ
if job:
    dist.init_process_group("gloo")
torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(steps * 32, 32), torch.randn(steps * 32, 1))
loader = torch.utils.data.DataLoader(data, batch_size=32)
net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
model = DDP(net) if job else net
opt = torch.optim.SGD(model.parameters(), lr=0.01)
start, cpu = time.perf_counter(), time.process_time()
for x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
if not job or dist.get_rank() == 0:
    print("loop_seconds", time.perf_counter() - start, time.process_time() - cpu, flush=True)
if job:
    dist.destroy_process_group()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "train.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        py, steps = sys.executable, str(args.steps)
        job = ["-m", "torch.distributed.run", "--nproc-per-node", "2", script, steps]
        commands = {
            "job plain": [py, *job],
            "job diagnosed": [py, "-m", "accelport", "diagnose", *job],
            "one plain": [py, script, steps],
            "one diagnosed": [py, "-m", "accelport", "diagnose", script, steps],
        }
        env = {k: v for k, v in os.environ.items() if k != "RANK"} | {"OMP_NUM_THREADS": "1"}
        results: dict[str, list[dict[str, float]]] = {k: [] for k in commands}
        order = list(commands)
        for r in range(args.rounds):
            for name in order[r % len(order):] + order[:r % len(order)]:
                results[name].append(timed(commands[name], env))

    def ratio(a: str, b: str, key: str) -> float:
        return statistics.median(x[key] / y[key] for x, y in zip(results[a], results[b], strict=True))

    print(f"{args.rounds} rounds, {args.steps} steps, OMP_NUM_THREADS=1; median of per-round ratios, diagnosed / plain")
    print(f"{'':24}{'loop CPU':>10}{'loop wall':>11}{'command wall':>14}")
    for what in ("job", "one"):
        figures = [ratio(f"{what} diagnosed", f"{what} plain", key) for key in ("loop cpu", "loop wall", "wall")]
        label = "2 ranks (rank 0's loop)" if what == "job" else "one process"
        print(f"{label:24}" + "".join(f"{v:>{w}.3f}" for v, w in zip(figures, (10, 11, 14), strict=True)))
    plain = statistics.median(x["loop cpu"] for x in results["job plain"]) / args.steps * 1e6
    print(f"rank 0's loop CPU time per step, plain: {plain:.0f} us")


if __name__ == "__main__":
    main()
