"""The portable example: the same file trains on CPU, GPU, TPU or Trainium.

    python examples/quickstart.py                       # best available backend
    ACCELPORT_BACKEND=xla PJRT_DEVICE=CPU python examples/quickstart.py
"""

from __future__ import annotations

import torch

import accelport as ap


def main(steps: int = 200) -> float:
    torch.manual_seed(0)
    backend = ap.backend()
    print(f"backend: {backend.name} ({backend.reason})")

    # A small regression problem whose answer is known: y = x @ w_true + 0.1 noise.
    w_true = torch.randn(32, 1)
    batches = []
    for _ in range(steps):
        x = torch.randn(64, 32)
        batches.append((x, x @ w_true + 0.1 * torch.randn(64, 1)))

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    model = model.to(ap.device())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses: list[float] = []

    for step, (x, y) in enumerate(ap.loader(batches), start=1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
        if step % 50 == 0:
            # Read the loss after the step's work is flushed: no extra device round trip.
            ap.after_step(lambda value, s=step: (losses.append(value), print(f"step {s:4d}  loss {value:.4f}")),
                          loss.detach())
    ap.sync()
    m = ap.metrics()
    print(f"steps {m.steps}, compilations {m.compilations}, data wait {m.data_wait_seconds:.3f}s")
    return losses[-1]


if __name__ == "__main__":
    final = main()
    if not final < 0.1:
        raise SystemExit(f"the example did not learn: final loss {final:.4f}")
