"""A tiny training run that checkpoints itself with torch.save every step and resumes with torch.load.

    python train.py [--forget WHAT] [--epochs N]

WHAT is what its resume leaves out (``none``: a correct resume): ``model``, ``optimizer``, ``scheduler``,
``loader`` (sets the loader's generator to its state at the save, not at the start of the pass), ``rng``
(torch's global generator, which dropout draws from), ``skip`` (skips one batch too many) or ``repeat``
(one too few), ``scaler`` (the GradScaler's state: its growth tracker). The checkpoint is ``ckpt.pt`` in the
working directory.
"""

from __future__ import annotations

import argparse
import os

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--forget", default="none",
                    choices=["none", "model", "optimizer", "scheduler", "loader", "rng", "skip", "repeat", "scaler"])
parser.add_argument("--epochs", type=int, default=2)
opts = parser.parse_args()
forget = opts.forget

torch.set_num_threads(1)
torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randn(24, 1))
generator = torch.Generator().manual_seed(1)
loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=generator)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9 ** step)
scaler = torch.amp.GradScaler("cpu")

step, first_epoch, done = 0, 0, 0  # done: batches of the pass in progress already trained on
pass_start = generator.get_state()
if os.path.exists("ckpt.pt"):
    saved = torch.load("ckpt.pt")
    if forget != "model":
        model.load_state_dict(saved["model"])
    if forget != "optimizer":
        optimizer.load_state_dict(saved["optimizer"])
    if forget != "scheduler":
        scheduler.load_state_dict(saved["scheduler"])
    if forget != "rng":
        torch.set_rng_state(saved["rng"])
    if forget != "scaler":
        scaler.load_state_dict(saved["scaler"])
    step, first_epoch, done = saved["step"], saved["epoch"], saved["done"]
    pass_start = saved["generator_now"] if forget == "loader" else saved["pass_start"]
    done += {"skip": 1, "repeat": -1}.get(forget, 0)

for epoch in range(first_epoch, opts.epochs):
    if done:
        generator.set_state(pass_start)  # the order of the pass in progress, drawn again
    else:
        pass_start = generator.get_state()
    for i, (x, y) in enumerate(loader):
        if i < done:
            continue
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        step += 1
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "rng": torch.get_rng_state(),
                    "step": step, "epoch": epoch, "done": i + 1, "pass_start": pass_start,
                    "generator_now": generator.get_state()}, "ckpt.pt")
    done = 0
print(f"trained {step} steps")
