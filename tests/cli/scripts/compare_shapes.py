"""A compiled model fed a batch whose length grows each step, as a script that pads each batch to its own
longest sequence does: torch.compile(dynamic=False) compiles a graph per length. --bucket pads every batch
to one length (the fix), so one graph serves every step. Never imports accelport."""

import argparse

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--bucket", action="store_true", help="pad every batch to the longest length")
parser.add_argument("--steps", type=int, default=12)
args = parser.parse_args()
torch.manual_seed(0)
model = torch.nn.Linear(1, 1)
compiled = torch.compile(model, dynamic=False, backend="eager")  # (dynamo's compilations, without inductor's C++)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(args.steps):
    length = 4 + step
    x = torch.randn(4, length)
    if args.bucket:
        x = torch.nn.functional.pad(x, (0, 4 + args.steps - length))
    loss = compiled(x.unsqueeze(-1)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print("done")
