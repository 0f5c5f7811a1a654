"""A ported loop (ap.loader, ap.optimizer_step) whose fourth step asks the host for 4 PiB: a real allocation
failure of torch's CPU allocator, raised in the script's own code and never caught."""

import torch

import accelport as ap

ap.use("cpu")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = [(torch.randn(16, 64), torch.randn(16, 8)) for _ in range(10)]
for step, (x, y) in enumerate(ap.loader(data), 1):
    loss = torch.nn.functional.mse_loss(model(x), y)
    if step == 4:
        scratch = torch.empty(1 << 50)  # 4 PiB of float32
    loss.backward()
    ap.optimizer_step(opt)
    opt.zero_grad()
