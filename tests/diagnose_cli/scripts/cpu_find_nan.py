"""A small attention model whose training goes NaN in one known operation, for --find-nan / ACCELPORT_FIND_NAN.

Plain PyTorch (never imports accelport) unless --ported, where it runs through ap.loader and
ap.optimizer_step. Each case breaks one step, through its data or its learning rate:

--case log:       batch 7 is 10,000 times larger: the head's sigmoid reaches 0 and its log is -Inf (forward)
--case sqrt:      batch 5 is shifted down: a block's sqrt(1 + mean) takes a negative (forward)
--case backward:  in batch 4 one position is all zeros: the hand-written norm's sqrt is 0, finite, and its
                  gradient is not (backward of sqrt)
--case softmax:   in batch 3 one sample is all zeros: every key of its attention is masked with -inf (forward)
--case lr:        the schedule makes the learning rate 3e38 at step 6: the update overflows (optimizer; this
                  case scales its loss by 1600, its learning rate down as much, so its gradients exceed 1)
--case input:     batch 6 holds a NaN (sample 3)
--case healthy:   nothing breaks

--no-seed leaves torch's seed unset (the data then differs from run to run, and so may the step);
--ported prints what ap.diagnostics() found, as JSON, after its last line.
"""

import argparse

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--case", required=True, choices=("log", "sqrt", "backward", "softmax", "lr", "input", "healthy"))
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--ported", action="store_true")
parser.add_argument("--no-seed", action="store_true")
args = parser.parse_args()
CASE = args.case
if not args.no_seed:
    torch.manual_seed(0)


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = (x == 0).all(-1)  # positions that are all zeros are padding
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / 8 ** 0.5
        scores = scores.masked_fill(pad[:, None, :], float("-inf"))
        return torch.softmax(scores, dim=-1) @ self.v(x)  # SOFTMAX


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8, bias=False)  # a zero position stays zero
        self.attn = Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if CASE == "backward":
            h = h / (1 + torch.sqrt((h * h).sum(-1, keepdim=True)))  # NORM
        if CASE == "sqrt":
            h = h * torch.sqrt(1 + h.mean(-1, keepdim=True))  # SQRT
        return h + self.attn(h)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        p = torch.sigmoid(self.head(x).mean(1))
        return -torch.log(p)  # LOG


inputs = torch.randn(args.steps * 16, 4, 8)
batch = {"log": 6, "sqrt": 4, "backward": 3, "softmax": 2, "input": 5}.get(CASE)  # counted from 0
if CASE == "log":
    inputs[batch * 16:(batch + 1) * 16] *= 1e4
elif CASE == "sqrt":
    inputs[batch * 16:(batch + 1) * 16] -= 30
elif CASE == "backward":
    inputs[batch * 16 + 2, 1] = 0
elif CASE == "softmax":
    inputs[batch * 16 + 5] = 0
elif CASE == "input":
    inputs[batch * 16 + 3, 2, 1] = float("nan")
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs), batch_size=16)

model = Net()
scale = 1600.0 if CASE == "lr" else 1.0
opt = torch.optim.SGD(model.parameters(), lr=0.01 / scale)
schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 3e40 * scale if CASE == "lr" and step == 5 else 1.0)
if args.ported:
    import accelport as ap

    model = model.to(ap.device())
    loader = ap.loader(loader)
for (x,) in loader:
    loss = model(x).mean() * scale
    loss.backward()
    if args.ported:
        ap.optimizer_step(opt)  # STEP
    else:
        opt.step()  # STEP
    schedule.step()
    opt.zero_grad()
print("done", CASE, [round(v, 5) for v in model.head.weight.flatten().tolist()[:4]])
if args.ported:
    import json

    print("findings", json.dumps([found.to_dict() for found in ap.diagnostics()]))
