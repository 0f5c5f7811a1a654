"""Plain-PyTorch training loops that go wrong on the native path (cpu, inductor). Never imports accelport.

--case shapes:    a compiled model (dynamic=False) fed a new sequence length every step
--case breaks:    a compiled model whose forward reads a tensor into Python on every call
--case nan:       one input batch holds a NaN
--case bf16:      bf16 weights trained with SGD at lr 1e-5: every update rounds away
--case healthy:   fixed shapes, compiled once, fp32
"""

import argparse

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--case", required=True, choices=("shapes", "breaks", "nan", "bf16", "healthy"))
parser.add_argument("--steps", type=int, default=14)
args = parser.parse_args()
torch.manual_seed(0)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if args.case == "breaks" and h.sum().item() > 1e9:  # a graph break on every call
            h = h * 0
        return h


net = Net()
if args.case == "bf16":
    net = net.to(torch.bfloat16)
model = torch.compile(net, dynamic=False) if args.case in ("shapes", "breaks", "healthy") else net
opt = torch.optim.SGD(net.parameters(), lr=1e-5 if args.case == "bf16" else 0.01)
dtype = torch.bfloat16 if args.case == "bf16" else torch.float32
inputs = torch.randn(args.steps * 16, 8, dtype=dtype)
if args.case == "nan":
    inputs[5 * 16 + 3, 0] = float("nan")  # in the sixth batch
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs), batch_size=16)
for step, (x,) in enumerate(loader):
    if args.case == "shapes":
        x = torch.randn(4 + step, 8)
    loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print("done", args.case, [round(v, 5) for v in net.fc.weight.float().flatten().tolist()[:4]])
