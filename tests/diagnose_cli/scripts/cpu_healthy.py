"""A healthy plain-PyTorch loop on the CPU: fixed shapes, data in memory. Never imports accelport.

Prints what it was run with (argv, working directory, __name__, a line of stdin, whether
torch was imported before it), then the final weights, so a test can compare a plain run
with one under `accelport diagnose`.
"""

import argparse
import os
import sys

torch_before = "torch" in sys.modules

import torch  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--read-stdin", action="store_true")
args = parser.parse_args()

print("argv", sys.argv)
print("cwd", os.getcwd())
print("name", __name__)
print("torch imported before the script", torch_before)
if args.read_stdin:
    print("stdin", sys.stdin.readline().strip())

torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(args.steps * 16, 8), torch.randn(args.steps * 16, 1))
loader = torch.utils.data.DataLoader(data, batch_size=16)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
print("weights", [round(v, 6) for v in model[0].weight.flatten().tolist()[:6]])
print("torch_xla imported", "torch_xla" in sys.modules)
