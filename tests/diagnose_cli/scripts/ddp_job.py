"""An unported DDP training script (gloo, cpu) for the job tests, with one fault chosen per run.

    torchrun --nproc-per-node 2 ddp_job.py [--slow-rank R] [--slow-data-rank R] [--extra-step-rank R]
                                             [--fail-rank R] [--steps N] [--manual] [--nan-rank R]
                                             [--kill-rank R] [--ddp-uneven]
                                             [--die-after-rank R] [--fsdp] [--lone-collective-rank R]
                                             [--recompile-rank R] [--memory-rank R]

--slow-rank: that rank sleeps 0.15 s in the loop each step (host work, an augmentation of its own).
--slow-data-rank: that rank's Dataset sleeps 0.05 s per sample (4 per batch) in the main process.
--extra-step-rank: that rank takes one step more, without DDP (uneven inputs; DDP itself would hang).
--fail-rank: that rank raises after its steps.
--ddp-uneven: with --extra-step-rank, keep DDP (or FSDP2): that rank hangs in its extra step's collective (the
DDP hang).
--recompile-rank: the model is compiled (torch.compile, shapes static) on every rank, and that rank's batch has
one row more each step (its last sample repeated): it compiles a new program each step, the others once.
--lone-collective-rank: that rank alone calls dist.all_reduce after its steps (rank-0-only work gone wrong): it
waits for partners that never come.
--memory-rank: that rank keeps 64 MiB of host tensors a step in a list (metrics kept on that rank alone).
--die-after-rank: that rank kills itself with SIGKILL 3 s after its steps (while rank 0 waits for its summary).
--kill-rank: that rank kills itself with SIGKILL at step 5 (out of memory, as the kernel ends it).
--nan-rank: that rank's batch at step 5 holds a NaN (DDP's all-reduce carries it to the others).
--manual: no DDP; the script averages the gradients itself with dist.all_reduce before each step.
--fsdp: FSDP2 (fully_shard on each layer and the model) instead of DDP: all-gathers in the forward and the
backward, reduce-scatters in the backward.
Every rank sleeps 0.05 s in its loop each step, so a balanced job's step is that long on a busy machine too.
"""

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--slow-rank", type=int, default=-1)
parser.add_argument("--slow-data-rank", type=int, default=-1)
parser.add_argument("--extra-step-rank", type=int, default=-1)
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--manual", action="store_true")
parser.add_argument("--nan-rank", type=int, default=-1)
parser.add_argument("--kill-rank", type=int, default=-1)
parser.add_argument("--ddp-uneven", action="store_true")
parser.add_argument("--die-after-rank", type=int, default=-1)
parser.add_argument("--fsdp", action="store_true")
parser.add_argument("--lone-collective-rank", type=int, default=-1)
parser.add_argument("--recompile-rank", type=int, default=-1)
parser.add_argument("--memory-rank", type=int, default=-1)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
uneven = args.extra_step_rank >= 0 and not args.ddp_uneven
if args.fsdp:
    from torch.distributed.fsdp import fully_shard

    for layer in (net[0], net[2]):
        fully_shard(layer)
    model = fully_shard(net)
else:
    model = net if uneven or args.manual else DDP(net)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
if args.recompile_rank >= 0:
    model = torch.compile(model, backend="aot_eager", dynamic=False)


class Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4 * (args.steps + 1)

    def __getitem__(self, i: int):
        if rank == args.slow_data_rank:
            time.sleep(0.05)
        g = torch.Generator().manual_seed(1000 * rank + i)
        return torch.randn(32, generator=g), torch.randn(1, generator=g)


loader = torch.utils.data.DataLoader(Samples(), batch_size=4)
steps = args.steps + (1 if rank == args.extra_step_rank else 0)
kept = []
for step, (x, y) in enumerate(loader):
    if step == steps:
        break
    time.sleep(0.05)
    if rank == args.kill_rank and step == 4:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == args.nan_rank and step == 4:
        x[0, 0] = float("nan")
    if rank == args.slow_rank:
        time.sleep(0.15)
    if rank == args.memory_rank:
        kept.append(torch.full((16 * 2**20,), float(step)))  # 64 MiB, written: resident
    if rank == args.recompile_rank:
        x, y = torch.cat([x] + [x[-1:]] * (step + 1)), torch.cat([y] + [y[-1:]] * (step + 1))
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    if args.manual:
        for p in net.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
    opt.step()
if uneven:
    for p in net.parameters():  # the one collective: the ranks' weights averaged at the end
        dist.all_reduce(p.data)
if rank == args.lone_collective_rank:
    dist.all_reduce(torch.ones(1))
print(f"rank {rank} done")
if rank == args.die_after_rank:
    time.sleep(3)
    os.kill(os.getpid(), signal.SIGKILL)
if rank == args.fail_rank:
    raise RuntimeError(f"rank {rank} failed after its steps")
dist.destroy_process_group()
