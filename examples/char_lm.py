"""A small character-level transformer language model on the lines of a text file.

    python examples/char_lm.py                       # the interpreter's LICENSE text
    python examples/char_lm.py --text my.txt --padding bucket
    ACCELPORT_BACKEND=xla PJRT_DEVICE=CPU python examples/char_lm.py --padding batch-max --steps 60

Lines have different lengths. With ``--padding batch-max`` every batch is
padded to its own longest line: on a compiled backend (XLA) each new length is a
new graph, and accelport's diagnostics say so ("recompilation ... input 0
changed from (16, 71) to (16, 64) ... bucket with ap.data.BucketCollate").
With ``--padding bucket`` (the default) batches are padded to one of four
bucket lengths and grouped by length, so the graph compiles at most four times.
"""

from __future__ import annotations

import argparse
import os
import sysconfig

import torch
from torch.utils.data import DataLoader

import accelport as ap

BUCKETS = (32, 64, 96, 128)
PAD = 0  # byte 0 never occurs in text: use it as padding; labels are padded with -100 (ignored)


def default_text() -> str:
    """The interpreter's LICENSE text: present on every Python install."""
    for candidate in (os.path.join(sysconfig.get_path("stdlib"), "LICENSE.txt"),
                      os.path.join(sysconfig.get_config_var("prefix") or "", "LICENSE.txt")):
        if os.path.exists(candidate):
            return candidate
    raise SystemExit("no LICENSE.txt next to this Python: pass --text FILE")


def lines_of(path: str, max_len: int = BUCKETS[-1]) -> list[torch.Tensor]:
    """Each non-empty line as bytes + newline, at most ``max_len`` long (a sample: input and target)."""
    with open(path, "rb") as f:
        raw = [line.strip() for line in f.read().splitlines()]
    out = []
    for line in raw:
        if len(line) >= 8:
            data = (line + b"\n")[: max_len + 1]
            out.append(torch.tensor(list(data), dtype=torch.long))
    if not out:
        raise SystemExit(f"{path} has no lines of 8 bytes or more")
    return out


class Lines(torch.utils.data.Dataset):
    def __init__(self, samples: list[torch.Tensor]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = self.samples[i]
        return {"input_ids": s[:-1], "labels": s[1:]}


def pad_to_batch_max(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The common collate that makes XLA recompile: pad to this batch's longest line."""
    length = max(b["input_ids"].shape[0] for b in batch)
    return {
        "input_ids": torch.stack([ap.data.pad_to(b["input_ids"], length, 0, PAD) for b in batch]),
        "labels": torch.stack([ap.data.pad_to(b["labels"], length, 0, -100) for b in batch]),
    }


class CharLM(torch.nn.Module):
    def __init__(self, dim: int = 64, layers: int = 2, heads: int = 4, max_len: int = BUCKETS[-1]) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, dim)
        self.pos = torch.nn.Parameter(torch.zeros(max_len, dim))
        block = torch.nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, 256)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        causal = torch.triu(torch.full((n, n), float("-inf"), device=ids.device), diagonal=1)
        h = self.embed(ids) + self.pos[:n]
        # is_causal=True: otherwise PyTorch compares the mask with a causal one (torch.equal)
        # to decide, which reads a device value on the host every step (a host sync).
        return self.head(self.blocks(h, mask=causal, is_causal=True))


def make_loader(samples: list[torch.Tensor], padding: str, batch_size: int, seed: int = 0) -> DataLoader:
    data = Lines(samples)
    if padding == "bucket":
        sampler = ap.data.LengthGroupedBatchSampler([len(s) - 1 for s in samples], batch_size, seed=seed,
                                                    drop_last=True)
        collate = ap.data.BucketCollate(BUCKETS, pad_value={"input_ids": PAD, "labels": -100})
        return DataLoader(data, batch_sampler=sampler, collate_fn=collate)
    if padding == "batch-max":
        return DataLoader(data, batch_size=batch_size, shuffle=True, drop_last=True, collate_fn=pad_to_batch_max,
                          generator=torch.Generator().manual_seed(seed))
    raise SystemExit(f"--padding must be 'bucket' or 'batch-max', not {padding!r}")


def main(text: str | None = None, padding: str = "bucket", steps: int = 200, batch_size: int = 16) -> dict:  # type: ignore[type-arg]
    torch.manual_seed(0)
    path = text or default_text()
    samples = lines_of(path)
    print(f"backend: {ap.backend().name}; {len(samples)} lines from {path}; padding: {padding}")
    model = CharLM().to(ap.device())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses: list[float] = []
    step = 0
    while step < steps:
        for batch in ap.loader(make_loader(samples, padding, batch_size, seed=step)):
            logits = model(batch["input_ids"])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                                     ignore_index=-100)
            loss.backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
            step += 1
            if step % 10 == 0 or step == steps:
                ap.after_step(losses.append, loss.detach())
            if step % 50 == 0:
                ap.after_step(lambda v, s=step: print(f"step {s:4d} loss {v:.3f}"), loss.detach())
            if step >= steps:
                break
    ap.sync()
    m = ap.metrics()
    found = ap.diagnostics()
    print(f"steps {m.steps}, compilations {m.compilations}, distinct batch shapes {m.batch_signatures}, "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    for d in found:
        print(f"diagnosis [{d.kind}]: {d.text}")
    return {"losses": losses, "metrics": m, "diagnoses": [d.kind for d in found]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", help="a text file (default: the interpreter's LICENSE text)")
    parser.add_argument("--padding", choices=("bucket", "batch-max"), default="bucket")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    main(args.text, args.padding, args.steps, args.batch_size)
