"""DistributedDataParallel on gloo that checkpoints itself with torch.save at every step and resumes with torch.load.

    torchrun --nproc-per-node 2 ddp_train.py [--forget rank-rng] [--epochs N]

Rank 0 writes the model and the optimizer (``ckpt.pt``), every rank its own RNG state (``rng-rank<R>.pt``: each
rank draws its own dropout); a barrier ends each step, so a rank killed after a step finds every rank's part of
it written. ``--forget rank-rng``: every rank restores rank 0's RNG state, a common slip in hand-written resumes
(one file of random states, written by rank 0, loaded by all).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--forget", default="none", choices=["none", "rank-rng"])
parser.add_argument("--epochs", type=int, default=2)
opts = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)
torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=1)
# A generator of its own: iter(loader) draws its workers' base seed from it, not from the global generator, which
# the resume restores before the pass is started again.
loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler, generator=torch.Generator().manual_seed(2))
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
torch.manual_seed(100 + rank)  # each rank its own dropout

step, first_epoch, done = 0, 0, 0
if os.path.exists("ckpt.pt"):
    saved = torch.load("ckpt.pt")
    model.module.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    step, first_epoch, done = saved["step"], saved["epoch"], saved["done"]
    torch.set_rng_state(torch.load("rng-rank0.pt" if opts.forget == "rank-rng" else f"rng-rank{rank}.pt"))

for epoch in range(first_epoch, opts.epochs):
    sampler.set_epoch(epoch)
    for i, (x, y) in enumerate(loader):
        if i < done:
            continue
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        torch.save(torch.get_rng_state(), f"rng-rank{rank}.pt")
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                        "epoch": epoch, "done": i + 1}, "ckpt.pt")
        dist.barrier()
    done = 0
dist.destroy_process_group()
print(f"rank {rank} trained {step} steps")
