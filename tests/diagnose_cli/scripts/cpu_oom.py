"""A plain-PyTorch loop whose fifth step runs out of GPU memory, as torch raises it (the loop itself trains on
the CPU: the error is CUDA's exception type with the text its caching allocator writes). Never imports accelport.
"""

import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.utils.data.TensorDataset(torch.randn(160, 64), torch.randn(160, 8))
for step, (x, y) in enumerate(torch.utils.data.DataLoader(data, batch_size=16), 1):
    loss = torch.nn.functional.mse_loss(model(x), y)
    if step == 5:
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 15.77 GiB of which "
            "3.12 MiB is free. Including non-PyTorch memory, this process has 15.76 GiB memory in use. Of the "
            "allocated memory 15.20 GiB is allocated by PyTorch, and 180.02 MiB is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
    loss.backward()
    opt.step()
    opt.zero_grad()
print("never reached")
