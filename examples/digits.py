"""A digit classifier on scikit-learn's bundled digits (no download), on any backend.

    python examples/digits.py                                   # best available backend
    ACCELPORT_BACKEND=xla PJRT_DEVICE=CPU python examples/digits.py
    ACCELPORT_METRICS_FILE=digits.jsonl python examples/digits.py && accelport report digits.jsonl

Needs scikit-learn (`pip install scikit-learn`). Batches have a fixed size
(drop_last=True for training), so a compiled backend compiles the training step
once; the final, shorter evaluation batch costs one more compilation.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

import accelport as ap


def load(batch_size: int, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0  # pixel values 0..16
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    train, test = order[:1500], order[1500:]
    return (
        DataLoader(TensorDataset(x[train], y[train]), batch_size=batch_size, shuffle=True, drop_last=True,
                   generator=torch.Generator().manual_seed(seed)),
        DataLoader(TensorDataset(x[test], y[test]), batch_size=128),
    )


def main(epochs: int = 8, batch_size: int = 64, max_steps: int | None = None) -> float:
    torch.manual_seed(0)
    print(f"backend: {ap.backend().name} ({ap.backend().reason})")
    train, test = load(batch_size)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(128, 10)
    ).to(ap.device())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step = 0
    for epoch in range(epochs):
        model.train()
        for x, y in ap.loader(train):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
            step += 1
            if step % 20 == 0:
                ap.after_step(lambda v, e=epoch, s=step: print(f"epoch {e} step {s:4d} loss {v:.3f}"),
                              loss.detach())
            if max_steps is not None and step >= max_steps:
                break
        if max_steps is not None and step >= max_steps:
            break

    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=ap.device())
    total = 0
    with torch.no_grad():
        for x, y in ap.loader(test):
            correct += (model(x).argmax(dim=1) == y).sum()  # stays on the device: no per-batch sync
            total += y.shape[0]
    ap.sync()
    accuracy = correct.item() / total
    m = ap.metrics()
    print(f"test accuracy {accuracy:.3f}  steps {m.steps}  compilations {m.compilations}  "
          f"data wait {m.data_wait_seconds:.2f}s")
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-steps", type=int, default=None)
    args = parser.parse_args()
    main(args.epochs, args.batch_size, args.max_steps)
