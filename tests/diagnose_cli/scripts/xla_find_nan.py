"""A torch_xla loop whose third batch is 10,000 times larger: the head's sigmoid reaches 0 and its log is
-Inf in the forward pass. One torch_xla.sync() per step. Never imports accelport."""

import torch
import torch_xla

FEATURES = 7
torch.manual_seed(0)


class Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(FEATURES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -torch.log(torch.sigmoid(self.fc(x)))  # LOG


inputs = torch.randn(16 * 5, FEATURES)
inputs[2 * 16:3 * 16] *= 1e4  # the third batch
device = torch_xla.device()
model = torch.nn.Sequential(torch.nn.Linear(FEATURES, FEATURES), Head()).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for (x,) in torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs), batch_size=16):
    loss = model(x.to(device)).mean()
    loss.backward()
    opt.step()
    torch_xla.sync()
    opt.zero_grad()
print("trained")
