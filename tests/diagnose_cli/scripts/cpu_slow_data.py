"""A plain-PyTorch loop whose dataset is slow to read, with num_workers=0. Never imports accelport.

`--exit N` ends it with sys.exit(N) after training, `--raise` with an exception, `--terminate`
with SIGTERM (a scheduler's kill) to itself.
"""

import argparse
import os
import signal
import sys
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=16)
parser.add_argument("--exit", type=int, default=None)
parser.add_argument("--raise", dest="fail", action="store_true")
parser.add_argument("--terminate", action="store_true")
args = parser.parse_args()


class SlowSamples(torch.utils.data.Dataset):
    """Each sample takes 2 ms to "decode": 16 ms a batch, far more than the step itself."""

    def __len__(self):
        return args.steps * 8

    def __getitem__(self, i):
        time.sleep(0.002)
        return torch.full((4,), float(i % 7)), torch.tensor([float(i % 3)])


loader = torch.utils.data.DataLoader(SlowSamples(), batch_size=8, num_workers=0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


def check_the_loss(value):
    raise ValueError(f"the loss is {value:.3f}, which this script refuses")


if args.fail:
    check_the_loss(float(loss))
if args.exit is not None:
    sys.exit(args.exit)
if args.terminate:
    print("trained; now killed", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)  # never reached: SIGTERM ends it here
