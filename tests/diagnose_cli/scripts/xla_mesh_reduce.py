"""A torch_xla loop that joins the other processes on the host each step: xm.mesh_reduce with a reduce
function that takes 30 ms (standing for the wait for a slower process: one process alone has no peer to
wait for). Never imports accelport."""

import time

import torch
import torch_xla
import torch_xla.core.xla_model as xm

FEATURES = 15
torch.manual_seed(0)
device = torch_xla.device()
model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batches = [(torch.randn(16, FEATURES), torch.randn(16, 1)) for _ in range(10)]


def slow_sum(values: list) -> int:
    time.sleep(0.03)
    return sum(values)


for step, (x, y) in enumerate(batches):
    loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
    loss.backward()
    xm.optimizer_step(opt)
    opt.zero_grad()
    torch_xla.sync()
    seen = xm.mesh_reduce("steps", step, slow_sum)
print("steps seen", seen)
