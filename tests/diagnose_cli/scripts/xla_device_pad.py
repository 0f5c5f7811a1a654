"""torch_xla: the batches keep their shape, but a tensor made inside the step does not (it is cut to a length
that changes from step to step), so XLA compiles a new graph for each length. Never imports accelport."""

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl

FEATURES = 13
torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(8 * 16, 16, FEATURES), torch.randn(8 * 16, 1))
device = torch_xla.device()
model = torch.nn.Linear(FEATURES, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
lengths = [2 + step % 12 for step in range(16)]  # what the data would decide: the longest sequence, say
for step, (x, y) in enumerate(pl.MpDeviceLoader(torch.utils.data.DataLoader(data, batch_size=8), device)):
    h = x[:, : lengths[step]]  # the tensor whose shape changes
    loss = torch.nn.functional.mse_loss(model(h).mean(dim=1), y)
    loss.backward()
    xm.optimizer_step(opt)
    opt.zero_grad()
print("done")
