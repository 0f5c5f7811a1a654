"""A plain-PyTorch loop that trains in a thread of its own, still running when the script's last line
has run; a thread pool is left open too (Python stops its threads at exit). Never imports accelport."""

import concurrent.futures
import threading

import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(12)]
go = threading.Event()


def train() -> None:
    go.wait()  # (until the script's last line: the steps all come after it)
    for x, y in data:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    print("trained in a thread", [round(v, 5) for v in model.weight.flatten().tolist()])


pool = concurrent.futures.ThreadPoolExecutor(2)  # never shut down
print("pool says", pool.submit(sum, [1, 2, 3]).result())
threading.Thread(target=train).start()
go.set()
