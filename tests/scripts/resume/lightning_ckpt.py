"""A Lightning run that checkpoints every step (ModelCheckpoint(every_n_train_steps=1, save_last=True)) and
resumes with trainer.fit(..., ckpt_path="last") when a checkpoint is there."""

import os

import lightning as L
import torch


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


torch.set_num_threads(1)
L.seed_everything(0)
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g))
loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))
checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath="ckpt", every_n_train_steps=1, save_last=True,
                                                  save_top_k=0)
trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, callbacks=[checkpoints],
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Model(), train_dataloaders=loader, ckpt_path="last" if os.path.exists("ckpt/last.ckpt") else None)
