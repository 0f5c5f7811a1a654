"""torch_xla training in two processes started with xmp.spawn (the usual multi-core script). Never imports
accelport."""

import torch
import torch_xla
import torch_xla.distributed.xla_multiprocessing as xmp

FEATURES = 14


def train(index: int) -> None:
    device = torch_xla.device()
    model = torch.nn.Linear(FEATURES, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        loss = model(torch.randn(4, FEATURES, device=device)).pow(2).mean()
        loss.backward()
        opt.step()  # (each process on its own: no collective, which XLA:CPU runs across processes only slowly)
        opt.zero_grad()
        torch_xla.sync()


if __name__ == "__main__":
    xmp.spawn(train, args=())  # a process per device (CPU_NUM_DEVICES of them on XLA:CPU)
    print("done")
