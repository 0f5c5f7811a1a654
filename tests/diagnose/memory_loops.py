"""Training loops for the memory-growth tests, each run in a fresh process (``python memory_loops.py LOOP``).

The process's resident memory is what grows on cpu, and memory that an earlier test freed would be
reused first, hiding growth for a while: each loop gets a process of its own. Each step keeps (or not) a
monitoring loss whose autograd graph holds a 4 MiB activation. Prints the diagnoses as JSON.
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import torch

import accelport as ap

HIDDEN = 4096  # a (256, 4096) float32 activation: 4 MiB in each kept graph
BATCH = 256
STEPS = 60


def main(loop: str) -> None:
    ap.use("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 8))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = [(torch.randn(BATCH, 64), torch.randn(BATCH, 8)) for _ in range(4)]
    losses: list[Any] = []
    total: Any = torch.zeros(())
    cache: list[torch.Tensor] = []
    for step in range(1, STEPS + 1):
        x, y = data[step % 4]
        torch.nn.functional.mse_loss(model(x), y).backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
        monitored = torch.nn.functional.mse_loss(model(x), y)  # a second forward: its graph is never freed
        if loop == "list":
            losses.append(monitored)
        elif loop == "sum":
            total = total + monitored
        elif loop == "sum-in-place":
            total += monitored
        elif loop == "item":
            losses.append(monitored.item())
        elif loop == "detach":
            losses.append(monitored.detach())
        elif loop.startswith("once-at-"):
            if step == int(loop.rpartition("-")[2]):
                cache.append(torch.ones(64 << 20))  # 256 MiB once, written
        else:
            assert loop == "healthy", loop
    print(json.dumps({"steps": ap.metrics().steps, "diagnoses": [
        {"kind": d.kind, "step": d.step, "message": d.message, "fix": d.fix, "evidence": d.evidence}
        for d in ap.diagnostics()]}))


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    main(sys.argv[1])
