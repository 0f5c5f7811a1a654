"""A torch_xla loop in the style of torch_xla's MNIST example whose step 4 makes a tensor far larger than any device
(torch_xla's own case: 4 PiB, refused while its graph is prepared). The graph runs at the sync MpDeviceLoader makes
before handing out the next batch, where the logged loss is read: that sync fails. Never imports accelport."""

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl

torch.manual_seed(0)
images = torch.randn(16 * 8, 1, 8, 8)
labels = torch.randint(0, 10, (16 * 8,))
train_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=16)
device = torch_xla.device()
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loss_fn = torch.nn.CrossEntropyLoss()
for step, (data, target) in enumerate(pl.MpDeviceLoader(train_loader, device), 1):
    optimizer.zero_grad()
    loss = loss_fn(model(data), target)
    if step == 4:
        loss = loss + torch.rand(1024, 1024, 1024, 1024, 1024, device=device).sum() * 0  # HUGE
    loss.backward()
    xm.optimizer_step(optimizer)
    xm.add_step_closure(lambda step, loss: print(f"step {step} loss {loss.item():.4f}"), args=(step, loss))
print("done")
