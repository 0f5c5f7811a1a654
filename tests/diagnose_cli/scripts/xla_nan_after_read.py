"""A torch_xla loop whose 257th batch holds a NaN: the batch right after the step checks' read due at step 256.
Batches moved with .to(device), one torch_xla.sync() per step, no value ever read. Never imports accelport."""

import torch
import torch_xla

FEATURES = 17
STEPS = 260
torch.manual_seed(0)
inputs = torch.randn(16 * STEPS, FEATURES)
inputs[256 * 16 + 2, 3] = float("nan")  # in the 257th batch
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
