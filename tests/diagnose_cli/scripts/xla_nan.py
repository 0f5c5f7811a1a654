"""A torch_xla loop one of whose batches holds a NaN (the seventh of 20, or as ``xla_nan.py STEPS BATCH
FEATURES`` says): batches moved with .to(device), one torch_xla.sync() per step, no value ever read. Never
imports accelport."""

import sys

import torch
import torch_xla

STEPS, NAN_BATCH, FEATURES = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 1 else (20, 7, 13)
torch.manual_seed(0)
inputs = torch.randn(16 * STEPS, FEATURES)
inputs[(NAN_BATCH - 1) * 16 + 2, 5] = float("nan")
data = torch.utils.data.TensorDataset(inputs, torch.randn(16 * STEPS, 1))
device = torch_xla.device()
model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for x, y in torch.utils.data.DataLoader(data, batch_size=16):
    x, y = x.to(device), y.to(device)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    torch_xla.sync()
    opt.zero_grad()
print("trained")
