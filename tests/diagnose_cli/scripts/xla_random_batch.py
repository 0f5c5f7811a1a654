"""A torch_xla loop in the style of torch_xla's examples whose batch sampler makes batches of random sizes (a
token budget per batch, as in speech or translation recipes): the batch dimension takes a new size at random. Never
imports accelport."""

import random

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl


class RandomBatches(torch.utils.data.Sampler):
    def __init__(self, n, steps):
        self.n, self.steps = n, steps

    def __iter__(self):
        rng = random.Random(0)
        for _ in range(self.steps):
            yield list(range(rng.randint(2, 16)))

    def __len__(self):
        return self.steps


torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(16, 12), torch.randint(0, 3, (16,)))
train_loader = torch.utils.data.DataLoader(data, batch_sampler=RandomBatches(16, 24))
device = torch_xla.device()
model = torch.nn.Linear(12, 3).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loss_fn = torch.nn.CrossEntropyLoss()
for x, y in pl.MpDeviceLoader(train_loader, device):
    optimizer.zero_grad()
    loss_fn(model(x), y).backward()
    xm.optimizer_step(optimizer)
print("done")
