"""A torch_xla loop in the style of torch_xla's own MNIST example: MpDeviceLoader, xm.optimizer_step, the
loss logged through xm.add_step_closure; and an accuracy count read with .item() in every step. Never
imports accelport."""

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl

torch.manual_seed(0)
images = torch.randn(16 * 14, 1, 8, 8)
labels = torch.randint(0, 10, (16 * 14,))
train_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=16)
device = torch_xla.device()
model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                            torch.nn.Linear(4 * 6 * 6, 10)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
loss_fn = torch.nn.CrossEntropyLoss()


def _train_update(step, loss):
    print(f"step {step} loss {loss.item():.4f}")


correct = 0
for step, (data, target) in enumerate(pl.MpDeviceLoader(train_loader, device)):
    optimizer.zero_grad()
    output = model(data)
    loss = loss_fn(output, target)
    loss.backward()
    xm.optimizer_step(optimizer)
    correct += output.argmax(dim=1).eq(target).sum().item()  # the host read, every step
    if step % 5 == 0:
        xm.add_step_closure(_train_update, args=(step, loss))
print(f"accuracy {correct / len(images):.3f}")
