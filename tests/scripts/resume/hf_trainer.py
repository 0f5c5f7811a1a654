"""A tiny GPT-2 (built from a config, nothing downloaded) trained with transformers' Trainer, saving a checkpoint every
step in out/ and resuming from the newest with trainer.train(resume_from_checkpoint=True) when there is one.
``--ignore-data-skip``: TrainingArguments(ignore_data_skip=True), which starts the resumed epoch's data over."""

import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

torch.set_num_threads(1)
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16))
g = torch.Generator().manual_seed(1)
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 50, (24, 8), generator=g)]
args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, num_train_epochs=2, save_strategy="steps",
                         save_steps=1, logging_steps=1000, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                         dataloader_num_workers=0, ignore_data_skip="--ignore-data-skip" in sys.argv)
resume = os.path.isdir("out") and any(name.startswith("checkpoint-") for name in os.listdir("out"))
Trainer(model=model, args=args, train_dataset=data).train(resume_from_checkpoint=True if resume else None)
