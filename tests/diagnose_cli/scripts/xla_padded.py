"""torch_xla, the usual way, with each batch padded to its longest sequence. Never imports accelport.

MpDeviceLoader and xm.optimizer_step, as torch_xla's examples do; the collate_fn pads every batch
to the length of its longest sample, so nearly every batch has a shape of its own.
"""

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl

FEATURES = 11  # (each test script its own size: torch_xla's graph cache is process-wide)
g = torch.Generator().manual_seed(0)
# Sequences of varied lengths, read in order of length (as a length-grouped sampler would hand them).
lengths = sorted(int(n) for n in torch.randint(4, 120, (8 * 12,), generator=g))
samples = [(torch.randn(n, FEATURES, generator=g), torch.randn((), generator=g)) for n in lengths]


def pad_to_longest(batch):
    xs = torch.nn.utils.rnn.pad_sequence([x for x, _ in batch], batch_first=True)
    return xs, torch.stack([y for _, y in batch])


device = torch_xla.device()
model = torch.nn.Linear(FEATURES, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = torch.utils.data.DataLoader(samples, batch_size=8, collate_fn=pad_to_longest)
for x, y in pl.MpDeviceLoader(loader, device):
    loss = torch.nn.functional.mse_loss(model(x).mean(1).squeeze(-1), y)
    loss.backward()
    xm.optimizer_step(opt)
    opt.zero_grad()
