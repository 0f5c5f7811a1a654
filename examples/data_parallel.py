"""Data-parallel training on several processes: the same script, started by `accelport launch`.

    accelport launch --nprocs 2 examples/data_parallel.py          # 2 CPU processes (gloo) here
    accelport launch --nprocs 8 examples/data_parallel.py          # 8 GPUs / TPU chips / NeuronCores
    python examples/data_parallel.py                               # also runs alone (world size 1)

Each replica reads its own share of the data (DistributedSampler), gradients
are averaged over replicas in ap.optimizer_step, only the main process prints
and writes the checkpoint, and at the end every replica checks that it holds
the same parameters as the others.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import accelport as ap


def main(steps: int = 60, checkpoint: str | None = None) -> float:
    torch.manual_seed(0)  # same initial weights on every replica
    dev = ap.device()
    ap.print(f"{ap.world_size()} replica(s) on {ap.backend().name}")

    w_true = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))
    # steps batches of 32 for each replica: the data grows with the number of replicas.
    x = torch.randn(32 * steps * ap.world_size(), 16, generator=torch.Generator().manual_seed(2))
    data = TensorDataset(x, x @ w_true)
    sampler = DistributedSampler(data, num_replicas=ap.world_size(), rank=ap.rank(), shuffle=True, seed=0,
                                 drop_last=True)
    loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)

    model = torch.nn.Linear(16, 1).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    last = torch.zeros((), device=dev)
    for step, (xb, yb) in enumerate(ap.loader(loader), start=1):
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        ap.optimizer_step(opt)  # gradients averaged over replicas, then the step
        opt.zero_grad()
        last = loss.detach()
        if step % 20 == 0:
            ap.print(f"step {step:3d} loss", last)  # main process only, after the step has run

    # Every replica must hold the same parameters: compare against the average.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    mean = ap.all_reduce(flat.clone(), op="mean")
    if not torch.allclose(flat, mean, atol=1e-6):
        raise SystemExit(f"rank {ap.rank()}: parameters diverged from the other replicas")

    # One path for every replica: torchrun gives all workers of a job the same run id.
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", str(os.getpid()))
    path = checkpoint or os.path.join(tempfile.gettempdir(), f"accelport-dp-{run_id}.pt")
    if ap.is_main_process():
        ap.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    ap.barrier()  # the checkpoint is complete before anyone reads it
    state = ap.load(path)
    assert torch.equal(state["model"]["weight"].cpu(), model.weight.detach().cpu())
    ap.barrier()
    if ap.is_main_process() and checkpoint is None:
        os.unlink(path)
    final = float(ap.all_reduce(last.clone(), op="mean").cpu())
    ap.print(f"final loss {final:.5f} (mean over replicas); replicas agree")
    return final


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint", help="where to write the checkpoint (default: a temporary file)")
    args = parser.parse_args()
    main(args.steps, args.checkpoint)
