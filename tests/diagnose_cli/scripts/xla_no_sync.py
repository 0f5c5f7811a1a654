"""torch_xla with a hand-written loop that never syncs: optimizer.step() and nothing after it.

No MpDeviceLoader, no xm.mark_step(), no torch_xla.sync(): the weights are never updated on the
device while the loop runs. Never imports accelport.
"""

import torch
import torch_xla

FEATURES = 13
torch.manual_seed(0)
device = torch_xla.device()
model = torch.nn.Linear(FEATURES, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batches = [(torch.randn(16, FEATURES), torch.randn(16, 1)) for _ in range(8)]
for x, y in batches:
    x, y = x.to(device), y.to(device)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
