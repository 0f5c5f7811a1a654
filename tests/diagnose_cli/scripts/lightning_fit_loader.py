"""A Lightning run whose dataset is slow to read (40 ms a sample), with a cheap collate_fn of its own, and its
DataLoader handed to trainer.fit (no train_dataloader()). Never imports accelport."""

import time

import lightning as L
import torch


class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 20 * 8

    def __getitem__(self, i):
        time.sleep(0.04)
        return {"x": torch.full((8,), float(i % 5)), "y": torch.tensor([float(i % 3)])}


def collate(samples):
    return torch.stack([s["x"] for s in samples]), torch.stack([s["y"] for s in samples])


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


torch.manual_seed(0)
loader = torch.utils.data.DataLoader(Slow(), batch_size=8, collate_fn=collate)
trainer = L.Trainer(max_steps=20, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Model(), train_dataloaders=loader)
print("done", trainer.global_step)
