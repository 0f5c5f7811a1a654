"""A torch_xla loop whose seventh batch holds a NaN: batches moved with .to(device), one
torch_xla.sync() per step, no value ever read. Never imports accelport."""

import torch
import torch_xla

FEATURES = 13
torch.manual_seed(0)
inputs = torch.randn(16 * 20, FEATURES)
inputs[6 * 16 + 2, 5] = float("nan")  # in the seventh batch
data = torch.utils.data.TensorDataset(inputs, torch.randn(16 * 20, 1))
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
