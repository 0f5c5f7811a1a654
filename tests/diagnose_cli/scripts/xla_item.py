"""torch_xla with the loss read on the host every step (`loss.item()`). Never imports accelport."""

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl

FEATURES = 12
torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(16 * 14, FEATURES), torch.randn(16 * 14, 1))
device = torch_xla.device()
model = torch.nn.Linear(FEATURES, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
total = 0.0
for x, y in pl.MpDeviceLoader(torch.utils.data.DataLoader(data, batch_size=16), device):
    loss = torch.nn.functional.mse_loss(model(x), y)
    total += loss.item()  # the host read: the device stops here every step
    loss.backward()
    xm.optimizer_step(opt)
    opt.zero_grad()
print(f"mean loss {total / 14:.4f}")
