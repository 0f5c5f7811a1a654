"""A 2-process data-parallel job for tests/launch/test_launch.py (run by `accelport launch --nprocs 2`).

Writes what each rank saw and holds to OUT_DIR/rank<r>.pt; the test compares the
ranks with each other and with one process training on the combined batches.
"""

from __future__ import annotations

import sys
import warnings

import torch

import accelport as ap

STEPS = 20


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def make_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    # The same 2 * STEPS batches on every rank: ap.loader(shard=True) splits them.
    g = torch.Generator().manual_seed(1)
    w = torch.randn(6, 1, generator=g)
    out = []
    for _ in range(2 * STEPS):
        x = torch.randn(8, 6, generator=g)
        out.append((x, x @ w + 0.1 * torch.randn(8, 1, generator=g)))
    return out


def main(out_dir: str) -> None:
    rank, world = ap.rank(), ap.world_size()
    result: dict[str, object] = {"rank": rank, "world": world, "main": ap.is_main_process()}

    # 1. Training: every rank takes its share of the batches; gradients are averaged, in
    # buckets: a spy (the real collective still runs) counts the all-reduces of each step.
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    steps = 0
    calls_per_step: list[int] = []
    real_all_reduce = torch.distributed.all_reduce

    def counting_all_reduce(*args: object, **kwargs: object) -> object:
        calls_per_step[-1] += 1
        return real_all_reduce(*args, **kwargs)

    for x, y in ap.loader(make_data(), shard=True):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        calls_per_step.append(0)
        torch.distributed.all_reduce = counting_all_reduce
        try:
            ap.optimizer_step(opt)
        finally:
            torch.distributed.all_reduce = real_all_reduce
        opt.zero_grad()
        steps += 1
    result["steps"] = steps
    result["all_reduce_calls_per_step"] = calls_per_step
    result["parameters"] = len(list(model.parameters()))
    result["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    # 2. A parameter that gets a gradient on one rank only must not hang the job.
    torch.manual_seed(2)
    branches = torch.nn.ModuleList([torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)])
    x = torch.full((4, 3), float(rank + 1))
    branches[rank](x).sum().backward()
    result["local_grads"] = [None if p.grad is None else p.grad.clone() for p in branches.parameters()]
    ap.optimizer_step(torch.optim.SGD(branches.parameters(), lr=0.0))
    result["averaged_grads"] = [None if p.grad is None else p.grad.clone() for p in branches.parameters()]

    # 3. Collectives.
    t = torch.tensor([1.0, 2.0]) * (rank + 1)
    result["sum"] = ap.all_reduce(t.clone(), op="sum")
    result["mean"] = ap.all_reduce(t.clone(), op="mean")
    strided = (torch.arange(6.0).view(2, 3) * (rank + 1)).T  # not contiguous
    result["strided_sum"] = ap.all_reduce(strided, op="sum").clone()
    ap.barrier()

    # 4. The loader's warning: none with a DistributedSampler, exactly one without.
    ds = torch.utils.data.TensorDataset(torch.arange(8.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sampler = torch.utils.data.DistributedSampler(ds, shuffle=False)
        result["sampled"] = [b[0].tolist() for b in ap.loader(torch.utils.data.DataLoader(ds, batch_size=2,
                                                                                       sampler=sampler))]
        result["warnings_with_sampler"] = sum(issubclass(w.category, ap.DiagnosticWarning) for w in caught)
        plain = torch.utils.data.DataLoader(ds, batch_size=2)
        for _ in range(2):  # two epochs, one warning
            list(ap.loader(plain))
        list(ap.loader(torch.utils.data.DataLoader(ds, batch_size=4)))
    result["warnings_without_sampler"] = sum(issubclass(w.category, ap.DiagnosticWarning) for w in caught)

    # 5. Printing and checkpoints: only the main process acts.
    ap.print("PRINTED-BY-RANK", rank, torch.tensor(1.5))
    ap.save({"writer": torch.tensor(rank)}, f"{out_dir}/shared.pt")
    ap.barrier()
    torch.save(result, f"{out_dir}/rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
