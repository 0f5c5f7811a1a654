"""The tiny run of train.py, checkpointed and resumed by ap.Checkpointer (in ``ckpt/`` under the working directory)."""

from __future__ import annotations

import torch

import accelport as ap

torch.set_num_threads(1)
torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randn(24, 1))
loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9 ** step)

ckpt = ap.Checkpointer("ckpt", every_steps=1, keep_last=1)
ckpt.restore(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)
for _epoch in range(ckpt.epoch, 2):
    for x, y in ap.loader(loader):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        ckpt.step()
