"""Plain-PyTorch scripts written the way real ones are, each with one thing diagnose must see through. Never
imports accelport.

--case error-filter  the script turns every warning into an error; one input batch holds a NaN
--case manual-sgd    no torch.optim: the weights are updated by hand after each backward pass
                     (p.data.add_(p.grad, alpha=-lr), as pytorch/examples' word language model does);
                     the dataset is slow to read
--case crash         fails with an error at its third step
--case overflow      the loss diverges; math.exp(loss) for the perplexity overflows and ends it
--case collate-pad   a compiled model (dynamic=False) whose collate_fn pads each batch to its longest
                     sequence; prints dynamo's own counters at the end
"""

import argparse
import math
import time
import warnings

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--case", required=True,
                    choices=("error-filter", "manual-sgd", "crash", "overflow", "collate-pad"))
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()
if args.case == "error-filter":
    warnings.simplefilter("error")
torch.manual_seed(0)


class Slow(torch.utils.data.Dataset):
    """Samples that take 3 ms each to read: a batch of 8 waits 24 ms, far more than its step."""

    def __len__(self):
        return args.steps * 8

    def __getitem__(self, i):
        time.sleep(0.003)
        return torch.full((8,), float(i % 5)), torch.tensor([float(i % 3)])


def pad_batch(samples):
    """Pads each batch to its own longest sequence: the length changes from batch to batch."""
    longest = max(len(s) for s in samples)
    return torch.stack([torch.nn.functional.pad(s, (0, longest - len(s))) for s in samples])


if args.case == "collate-pad":
    sequences = [torch.randn(4 + (i * 11) % 37) for i in range(args.steps * 4)]
    loader = torch.utils.data.DataLoader(sequences, batch_size=4, collate_fn=pad_batch)
    model = torch.nn.Linear(1, 1)
    compiled = torch.compile(model, dynamic=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x in loader:
        loss = compiled(x.unsqueeze(-1)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    import torch._dynamo.utils as dynamo_utils

    print("dynamo unique_graphs", dynamo_utils.counters["stats"]["unique_graphs"])
elif args.case == "manual-sgd":
    model = torch.nn.Linear(8, 1)
    lr = 0.01
    for x, y in torch.utils.data.DataLoader(Slow(), batch_size=8):
        loss = torch.nn.functional.mse_loss(model(x), y)
        model.zero_grad()
        loss.backward()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
    print("done", round(float(model.bias), 4))
else:
    inputs = torch.randn(args.steps * 8, 8)
    if args.case == "error-filter":
        inputs[5 * 8 + 1, 2] = float("nan")  # in the sixth batch
    targets = torch.randn(args.steps * 8, 1)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.5 if args.case == "overflow" else 0.01)
    data = torch.utils.data.TensorDataset(inputs, targets)
    for step, (x, y) in enumerate(torch.utils.data.DataLoader(data, batch_size=8)):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if args.case == "crash" and step == 2:
            raise RuntimeError("the checkpoint directory went away")
        if args.case == "overflow":
            print(f"step {step} perplexity {math.exp(loss.item()):.1f}")
    print("done")
