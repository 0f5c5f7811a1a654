"""A healthy torch_xla loop: fixed shapes, MpDeviceLoader, xm.optimizer_step, the loss logged
from xm.add_step_closure (after the step ran, every step). Never imports accelport."""

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl

FEATURES = 14
torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(16 * 30, FEATURES), torch.randn(16 * 30, 1))
device = torch_xla.device()
model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
losses = []
for _step, (x, y) in enumerate(pl.MpDeviceLoader(torch.utils.data.DataLoader(data, batch_size=16), device)):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    xm.optimizer_step(opt)
    opt.zero_grad()
    xm.add_step_closure(lambda value: losses.append(value.item()), args=(loss,))
xm.mark_step()
print(f"{len(losses)} losses logged, last {losses[-1]:.4f}")
