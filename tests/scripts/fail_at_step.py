"""Rank 1 raises at step 3 while rank 0 waits in the gradient all-reduce (tests/launch/test_launch.py)."""

import torch

import accelport as ap

model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1, 10_000):
    model(torch.randn(8, 4)).pow(2).mean().backward()
    if step == 3 and ap.rank() == 1:
        raise RuntimeError("worker error at step 3")
    ap.optimizer_step(opt)
    opt.zero_grad()
