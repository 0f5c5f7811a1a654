"""A plain-PyTorch critic trained on a loss linear in its output (WGAN-style). Never imports accelport.

One input row holds a NaN, in the sixth batch. The last bias's gradient is the same at every
step (the batch size), NaN weights or not.

--feed loader:  the batches come through a torch DataLoader
--feed slices:  the batches are sliced from one tensor by hand: no loader sees them
"""

import argparse

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--feed", required=True, choices=("loader", "slices"))
parser.add_argument("--steps", type=int, default=12)
args = parser.parse_args()
torch.manual_seed(0)
critic = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(critic.parameters(), lr=0.01)
real = torch.randn(args.steps * 16, 8)
real[5 * 16 + 3, 0] = float("nan")  # in the sixth batch
if args.feed == "loader":
    batches = (x for (x,) in torch.utils.data.DataLoader(torch.utils.data.TensorDataset(real), batch_size=16))
else:
    batches = (real[i:i + 16] for i in range(0, len(real), 16))
for x in batches:
    fake = torch.randn(16, 8)
    loss = critic(fake).mean() - critic(x).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print("done", args.feed, bool(torch.isfinite(critic[2].weight).all()))
