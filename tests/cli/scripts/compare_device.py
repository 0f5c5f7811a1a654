"""One small training loop, on XLA when TRAIN_ON_XLA=1 (torch_xla's device, a sync per step), else on cpu.
Never imports accelport."""

import os

import torch

if os.environ.get("TRAIN_ON_XLA") == "1":
    import torch_xla

    device = torch_xla.device()
else:
    device = torch.device("cpu")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(12):
    x, y = torch.randn(8, 16).to(device), torch.randn(8, 1).to(device)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if device.type == "xla":
        torch_xla.sync()
print("done")
