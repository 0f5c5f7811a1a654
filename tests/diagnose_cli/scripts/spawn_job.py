"""An unported script that starts its own DDP workers with torch.multiprocessing.spawn (gloo, cpu).

    python spawn_job.py PORT [--slow-rank R] [--start-method spawn|fork|forkserver] [--process] [--evaluate]
                             [--kill-rank R]

--slow-rank: that worker sleeps 0.15 s in its loop each step; every worker sleeps 0.05 s. --process: the workers
are multiprocessing.Process objects of the script's own (with a helper process beside them that trains nothing)
instead of torch.multiprocessing.start_processes. --evaluate: after training, the script starts 2 workers again, that
evaluate (forward passes, no optimizer step). --kill-rank: that worker kills itself with SIGKILL at its 6th step,
before its backward (torch's spawn then ends the other with SIGTERM, or its all-reduce fails).
"""

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def train(rank: int, world: int, port: int, slow: int, kill: int = -1) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "localhost", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for step in range(12):
        x, y = torch.randn(4, 32, generator=g), torch.randn(4, 1, generator=g)
        time.sleep(0.05)
        if rank == kill and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == slow:
            time.sleep(0.15)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()


def evaluate(rank: int) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(4, 32))


def helper(seconds: float) -> None:
    time.sleep(seconds)  # (a logger, a watchdog: a process of the script's that is no rank)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--start-method", default="spawn")
    parser.add_argument("--process", action="store_true")
    parser.add_argument("--evaluate", action="store_true")
    parser.add_argument("--kill-rank", type=int, default=-1)
    args = parser.parse_args()
    if args.process:
        import multiprocessing

        context = multiprocessing.get_context(args.start_method)
        workers = [context.Process(target=helper, args=(0.1,))]
        workers += [context.Process(target=train, args=(rank, 2, args.port, args.slow_rank)) for rank in (0, 1)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert all(worker.exitcode == 0 for worker in workers), [worker.exitcode for worker in workers]
    else:
        mp.start_processes(train, args=(2, args.port, args.slow_rank, args.kill_rank), nprocs=2,
                           start_method=args.start_method)
    if args.evaluate:
        mp.start_processes(evaluate, nprocs=2, start_method=args.start_method)
    print("all workers done")
