"""A tiny run whose weights start from a seed drawn from os.urandom: no two runs are alike, resumed or not."""

from __future__ import annotations

import os

import torch

torch.set_num_threads(1)
torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
start = torch.load("ckpt.pt")["step"] if os.path.exists("ckpt.pt") else 0
for step in range(start, 6):
    x = torch.ones(2, 4) * step
    optimizer.zero_grad()
    model(x).sum().backward()
    optimizer.step()
    torch.save({"step": step + 1}, "ckpt.pt")
