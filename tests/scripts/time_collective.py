"""Two replicas, one of which sleeps before each optimizer step: the other waits for it in the all-reduce.

Run by tests/diagnose/test_time_breakdown.py under `accelport launch --nprocs 2`; each rank writes its
``ap.metrics()`` time breakdown per step to OUT/rankN.json.
"""

import json
import sys
import time

import torch

import accelport as ap

out, sleep, steps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for x, y in ap.loader([(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(steps)]):
    torch.nn.functional.mse_loss(model(x), y).backward()
    if ap.rank() == 1:
        time.sleep(sleep)  # the slower replica's own code: the other waits for it in the gradient all-reduce
    ap.optimizer_step(opt)
    opt.zero_grad()
m = ap.metrics()
with open(f"{out}/rank{ap.rank()}.json", "w") as f:
    json.dump({"per_step": m.time_breakdown_per_step, "steps": m.steps, "verdict": m.time_verdict,
               "fix": m.time_fix}, f)
