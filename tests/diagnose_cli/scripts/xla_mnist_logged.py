"""torch_xla's MNIST example (test_train_mp_mnist.py), cut small: MpDeviceLoader, xm.optimizer_step, and the loss
logged only through xm.add_step_closure every few steps: no host read of its own inside a step. Never imports
accelport."""

import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl


class MNIST(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 4, kernel_size=3)
        self.bn1 = torch.nn.BatchNorm2d(4)
        self.fc1 = torch.nn.Linear(4 * 3 * 3, 10)

    def forward(self, x):
        x = self.bn1(F.relu(F.max_pool2d(self.conv1(x), 2)))
        return F.log_softmax(self.fc1(torch.flatten(x, 1)), dim=1)


def _train_update(step, loss):
    print(f"step {step} loss {loss.item():.4f}")


torch.manual_seed(1)
images = torch.randn(8 * 12, 1, 8, 8)
labels = torch.randint(0, 10, (8 * 12,))
train_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=8,
                                           shuffle=True, drop_last=True)
device = torch_xla.device()
model = MNIST().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
loss_fn = torch.nn.NLLLoss()
model.train()
for step, (data, target) in enumerate(pl.MpDeviceLoader(train_loader, device)):
    optimizer.zero_grad()
    loss = loss_fn(model(data), target)
    loss.backward()
    xm.optimizer_step(optimizer)
    if step % 5 == 0:
        xm.add_step_closure(_train_update, args=(step, loss))
print("done")
