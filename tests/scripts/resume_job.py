"""A training job that checkpoints itself with ap.Checkpointer (tests/test_resume.py, tests/launch/).

    python resume_job.py OUT CKPT [--steps 60] [--every 10] [--kill-at STEP --kill-rank R] [--hang-at STEP]
                         [--pause-at STEP] [--shard] [--workers N [--persistent] [--start-method M]] [--generator]
                         [--numpy-sampler] [--stateful] [--background] [--prefetch N] [--step-seconds S]

A seeded, shuffled DataLoader (a DistributedSampler with several ranks), dropout, AdamW,
a learning-rate schedule, and draws from Python's and numpy's global generators every
step: a resumed run matches an uninterrupted one only if all of it is restored. Each rank
writes OUT/seen-rank<r>-<pid>.json (the sample indices of each step it took) and, at the
end, OUT/final-rank<r>.pt (its parameters, gathered whole when sharded).

``--kill-at STEP --kill-rank R``: rank R SIGKILLs itself after that step's update, in the
first attempt only (TORCHELASTIC_RESTART_COUNT unset or 0); ``--kill-at 23,47``: at step 23 in the first
attempt, at 47 in the second; ``--hang-at STEP``: rank R hangs
there instead (asleep, outside any collective; first attempt only) until ``accelport launch
--timeout`` stops it; ``--kill-in-save STEP``: each rank
SIGKILLs itself in that step's save, once its own part is written (first attempt only). ``--pause-at STEP``: every
rank stops there (before the step's checkpoint call) and writes OUT/ready-rank<r> until
it gets a stop request (the test then signals the launch). ``--step-seconds S``: each step takes at
least S seconds (a sleep), so that the ranks' stop agreement, which comes about every 0.25 s of
steps, falls within a known number of steps (0.01: at most every 25 steps).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time
from collections.abc import Iterator

import numpy as np
import torch

import accelport as ap

BATCH = 4
SAMPLES = 96


class NumpyShuffle(torch.utils.data.Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(np.random.permutation(self.n).tolist())

    def __len__(self) -> int:
        return self.n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("ckpt")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--kill-at", default=None, help="STEP, or STEP,STEP,...: one per attempt")
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--hang-at", type=int, default=None)
    parser.add_argument("--pause-at", type=int, default=None)
    parser.add_argument("--kill-in-save", type=int, default=None)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--shard", action="store_true")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--stateful", action="store_true")
    parser.add_argument("--background", action="store_true")
    parser.add_argument("--prefetch", type=int, default=None)
    parser.add_argument("--persistent", action="store_true", help="persistent_workers=True (with --workers)")
    parser.add_argument("--start-method", default=None, help="how loader workers start: fork, spawn, forkserver")
    parser.add_argument("--generator", action="store_true", help="the loader draws its order from a generator")
    parser.add_argument("--numpy-sampler", action="store_true", help="a sampler that shuffles with numpy")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world = ap.rank(), ap.world_size()

    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                                 torch.nn.Linear(32, 1)).to(ap.device())
    if args.shard:
        model = ap.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.9)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True), torch.arange(SAMPLES))
    torch.manual_seed(100 + rank)  # each rank its own dropout
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    sampler: torch.utils.data.Sampler[int] | None = (
        torch.utils.data.DistributedSampler(data, shuffle=True, seed=3) if world > 1 else None)
    if args.stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader: torch.utils.data.DataLoader = StatefulDataLoader(data, batch_size=BATCH, shuffle=sampler is None,
                                                                 sampler=sampler, num_workers=args.workers)
    else:
        order = torch.Generator().manual_seed(5) if args.generator else None
        if args.numpy_sampler:  # (as bucketing samplers often do: numpy's global generator)
            sampler = NumpyShuffle(SAMPLES)
        loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=sampler is None, sampler=sampler,
                                             num_workers=args.workers, persistent_workers=args.persistent,
                                             generator=order, multiprocessing_context=args.start_method)

    ckpt = ap.Checkpointer(args.ckpt, every_steps=args.every, background=args.background)
    step = ckpt.restore(model=model, optimizer=opt, scheduler=sched, loader=loader)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    first_attempt = attempt == 0
    kills = [int(v) for v in args.kill_at.split(",")] if args.kill_at else []
    kill_at = kills[attempt] if attempt < len(kills) else None
    if args.kill_in_save is not None and first_attempt:
        import accelport.checkpoint

        write = accelport.checkpoint.atomic_torch_save

        def write_then_die(torch_module: object, obj: object, path: str) -> None:
            write(torch_module, obj, path)
            if f"step-{args.kill_in_save:08d}" in path and os.path.basename(path).startswith("rank-"):
                os.kill(os.getpid(), signal.SIGKILL)  # this rank's part is on disk; the checkpoint is not complete

        accelport.checkpoint.atomic_torch_save = write_then_die  # type: ignore[assignment]
    seen: list[list[int]] = []
    record = os.path.join(args.out, f"seen-rank{rank}-{os.getpid()}.json")
    epoch = ckpt.epoch
    while step < args.steps:
        if isinstance(sampler, torch.utils.data.DistributedSampler):
            sampler.set_epoch(epoch)
        for xb, yb, idx in ap.loader(loader, prefetch=args.prefetch):  # prefetch=N: read ahead in a thread
            xb = xb + 0.01 * random.random() + 0.01 * float(np.random.rand())
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
            sched.step()
            if args.step_seconds:
                time.sleep(args.step_seconds)
            step += 1
            seen.append([step, *idx.tolist()])
            with open(record, "w") as f:
                json.dump({"start": step - len(seen), "seen": seen}, f)
            if step == kill_at and rank == args.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.hang_at and rank == args.kill_rank and first_attempt:
                while True:
                    time.sleep(1)
            if step == args.pause_at:
                open(os.path.join(args.out, f"ready-rank{rank}"), "w").close()
                while not ckpt.stop_requested:
                    time.sleep(0.05)
            ckpt.step()
            if step >= args.steps:
                break
        epoch += 1
    ckpt.close()  # a background save still being written completes here
    if args.shard:
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    else:
        state = model.state_dict()
    torch.save({k: v.detach().cpu().clone() for k, v in state.items()}, os.path.join(args.out, f"final-rank{rank}.pt"))


if __name__ == "__main__":
    main()
