"""A plain PyTorch loop over a DataLoader whose very first batch holds a NaN (a bad row in the dataset). Never
imports accelport."""

import torch

torch.manual_seed(0)
x = torch.randn(64, 8)
x[3, 2] = float("nan")  # in the first batch
y = torch.randn(64, 1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _epoch in range(3):
    for xb, yb in loader:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
print("done")
