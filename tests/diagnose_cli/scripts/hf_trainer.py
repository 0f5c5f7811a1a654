"""A HuggingFace Trainer run of a tiny GPT-2 built from a config (no download). Never imports accelport.

--case slow   the dataset is slow to read (100 ms a sample: 800 ms a batch, tens of times a step's compute, so
              that a loaded machine, which slows the compute and not the sleep, cannot bring it under 30%)
--case nan    one sample's embeddings hold a NaN
--case healthy
"""

import argparse
import os
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--case", required=True, choices=("slow", "nan", "healthy"))
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()
torch.manual_seed(0)
EMBED = 32


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return args.steps * 8

    def __getitem__(self, i):
        if args.case == "slow":
            time.sleep(0.1)
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 128, (16,), generator=g)
        embeds = torch.randn(16, EMBED, generator=g) * 0.02
        if args.case == "nan" and i == 5 * 8 + 2:  # in the sixth batch
            embeds[3, 4] = float("nan")
        return {"inputs_embeds": embeds, "labels": ids}


config = GPT2Config(vocab_size=128, n_positions=32, n_embd=EMBED, n_layer=2, n_head=2, bos_token_id=0,
                    eos_token_id=0)
model = GPT2LMHeadModel(config)
training = TrainingArguments(output_dir=os.path.join(tempfile.mkdtemp(), "out"), max_steps=args.steps,
                             per_device_train_batch_size=8, logging_steps=10, save_strategy="no", report_to=[],
                             use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0)
result = Trainer(model=model, args=training, train_dataset=Tokens()).train()
print("done", result.global_step)
