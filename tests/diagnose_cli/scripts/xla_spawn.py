"""torch_xla training in a process per device, started with xmp.spawn or torch_xla.launch (the usual multi-core
script). Never imports accelport.

    xla_spawn.py [--launch] [--slow-device N]

``--slow-device N``: the device of ordinal N does 60 ms of extra host work per step.
"""

import sys
import time

import torch
import torch_xla
import torch_xla.distributed.xla_multiprocessing as xmp

FEATURES = 14
STEPS = 12


def train(index: int, slow: int) -> None:
    device = torch_xla.device()
    torch.manual_seed(index)
    model = torch.nn.Linear(FEATURES, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(STEPS):
        x = torch.randn(4, FEATURES)
        if index == slow:
            time.sleep(0.06)  # a slow augmentation on this device's host side
        loss = model(x.to(device)).pow(2).mean()
        loss.backward()
        opt.step()  # (each process on its own: no collective, which XLA:CPU runs across processes only slowly)
        opt.zero_grad()
        torch_xla.sync()


if __name__ == "__main__":
    slow = int(sys.argv[sys.argv.index("--slow-device") + 1]) if "--slow-device" in sys.argv else -1
    if "--launch" in sys.argv:
        torch_xla.launch(train, args=(slow,))
    else:
        xmp.spawn(train, args=(slow,))  # a process per device (CPU_NUM_DEVICES of them on XLA:CPU)
    print("done")
