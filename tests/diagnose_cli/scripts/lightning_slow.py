"""A Lightning Trainer run whose dataset is slow to read (40 ms a sample: 320 ms a batch). Never imports accelport."""

import time

import lightning as L
import torch


class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 20 * 8

    def __getitem__(self, i):
        time.sleep(0.04)
        return torch.full((8,), float(i % 5)), torch.tensor([float(i % 3)])


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Slow(), batch_size=8)


torch.manual_seed(0)
trainer = L.Trainer(max_steps=20, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Model())
print("done", trainer.global_step)
