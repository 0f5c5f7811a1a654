"""The fixes in the script's own terms: what to change, spelled as the script is written.

A finding names one fix; how it is spelled depends on how the script trains
(``RunView.style``):

- ``accelport``: a ported loop (``ap.loader``, ``ap.optimizer_step``): accelport's own calls;
- ``torch``: plain PyTorch (a DataLoader, ``optimizer.step()``): plain PyTorch first, and
  ``ap.*`` only where it is the one call that does it (it then says it is portable);
- ``torch_xla``: a raw torch_xla loop: torch_xla's spelling first (``xm.add_step_closure``,
  ``torch_xla.sync()``, ``MpDeviceLoader``), accelport's as the portable alternative;
- ``transformers``: a HuggingFace ``Trainer`` (or Accelerate) loop: its ``TrainingArguments``
  and collators, since the loop is the library's;
- ``lightning``: a Lightning ``Trainer``: its Trainer flags, ``LightningModule`` hooks and DataLoaders.

Each function returns one sentence (or a few) that starts with a capital and ends with a period.
"""

from __future__ import annotations

__all__ = ["STYLES", "host_reads", "data_workers", "varying_batch", "varying_length", "unseen_shapes",
           "data_dependent", "never_synced", "sync_long_loops", "overflow", "optimizer_step", "kept_graphs",
           "shard_model", "accumulate", "device_bound"]

STYLES = ("accelport", "torch", "torch_xla", "transformers", "lightning")


def optimizer_step(style: str) -> str:
    """The call that ends a step, as the script spells it."""
    return {"accelport": "ap.optimizer_step(opt)", "torch_xla": "xm.optimizer_step(opt)",
            "transformers": "the Trainer's optimizer step", "lightning": "the Trainer's optimizer step"
            }.get(style, "optimizer.step()")


def host_reads(style: str) -> str:
    """Reading device values in every step: read them once the step has run, or less often."""
    if style == "accelport":
        return ("Log with ap.after_step(fn, loss) instead: it runs fn with host values once the step has run, "
                "without an extra round trip.")
    if style == "torch_xla":
        return ("Read them in a step closure instead: xm.add_step_closure(fn, args=(loss,)) runs fn with host "
                "values after the step's graph has run, without a sync of its own (ap.after_step(fn, loss) is "
                "the portable spelling).")
    if style == "transformers":
        return ("The Trainer itself reads the loss only every logging_steps; a read in every step comes from "
                "your code (a callback's on_step_end, compute_loss, a metric): read device values there only "
                "every logging_steps, or keep them on the device and read them once per log.")
    if style == "lightning":
        return ("Do not call .item() in training_step: log tensors with self.log(\"loss\", loss) (Lightning "
                "reads them every log_every_n_steps), and keep running values on the device.")
    return ("Keep the value on the device and read it once per log interval (accumulate loss.detach() into a "
            "device tensor, call .item() every N steps); ap.after_step(fn, loss) does this portably.")


#: Where a Lightning script builds its training DataLoader: its train_dataloader() (or a LightningDataModule's), or
#: the one it hands to trainer.fit(model, train_dataloaders=...); the run does not say which.
_LIGHTNING_LOADER = ("where the script builds its training DataLoader (train_dataloader(), or the one handed to "
                     "trainer.fit)")


def data_workers(style: str, workers: int | None, cpus: int, device_type: str | None = None) -> str:
    """More loader workers (or cheaper samples), where the loop waits for data; pinned memory only where there is
    a device to copy to (``device_type`` other than cpu: on cpu, pinning is a copy for nothing)."""
    if workers is not None and workers >= cpus:
        return (f"num_workers={workers} already uses every CPU core ({cpus}): make each sample cheaper "
                "(pre-tokenise, cache decoded data) or use a machine with more cores.")
    # A worker per core, less the one the training loop runs on; more than 8 rarely helps.
    n = max(1, min(cpus - 1, 8)) if not workers else min(cpus, max(workers * 2, workers + 1))
    if style == "transformers":
        pin = ", dataloader_pin_memory=True" if device_type not in (None, "cpu") else ""
        return (f"Prepare batches in parallel: TrainingArguments(dataloader_num_workers={n}{pin}), and tokenise "
                "the dataset once beforehand (dataset.map) rather than in __getitem__ or the collator.")
    if style == "lightning":
        return (f"Prepare batches in parallel: DataLoader(..., num_workers={n}, persistent_workers=True) "
                f"{_LIGHTNING_LOADER}, and move decoding out of training_step.")
    if workers is None:
        text = (f"Load the batches through a torch DataLoader with num_workers={n} (at most the {cpus} CPU cores), "
                "and move decoding and augmentation out of the training loop.")
    else:
        text = (f"Set num_workers to {n} in the DataLoader (now {workers}; {cpus} CPU cores) so batches are "
                "prepared in parallel while the device computes, or make each sample cheaper.")
    if style == "accelport":
        text = text[:-1] + "; ap.loader(..., prefetch=N) loads more batches ahead."
    elif style == "torch_xla":
        text = text[:-1] + " (MpDeviceLoader already overlaps the upload with the step)."
    return text


def varying_batch(style: str, sizes: int | None = None) -> str:
    """The batch dimension changes: a fixed batch size. ``sizes``: how many batch sizes were seen; more than two is
    no last short batch but a size that varies from batch to batch, which drop_last does not fix."""
    if style == "transformers":
        how = "TrainingArguments(dataloader_drop_last=True)"
    elif style == "lightning":
        how = f"DataLoader(..., drop_last=True) {_LIGHTNING_LOADER}"
    else:
        how = "DataLoader(..., drop_last=True)"
    if sizes is not None and sizes > 2:
        return (f"The batch size varies from batch to batch ({sizes} sizes): pad every batch up to one size "
                "(ap.data.BucketCollate(..., batch_size=N) as the collate_fn, the padded rows masked out of the "
                "loss), or to a few sizes (a sampler that makes batches of a few fixed sizes), so that a few graphs "
                f"serve every batch; {how} only drops a last short batch.")
    return (f"Keep the batch size fixed: {how} drops the last short batch of each epoch (or pad it up to the "
            "batch size: ap.data.BucketCollate(..., batch_size=N) as the collate_fn), and a batch made in the loop "
            "should always have the same size.")


def varying_length(style: str, buckets: str | None) -> str:
    """A sequence (or image) dimension changes from batch to batch: pad to a few lengths."""
    if style == "transformers":
        return ("Pad to a few lengths: DataCollatorWithPadding(tokenizer, pad_to_multiple_of=64) as the "
                "data_collator (or padding=\"max_length\" when tokenising), with "
                "TrainingArguments(group_by_length=True) to keep padding low"
                + (f"; for this data, {buckets}." if buckets else "."))
    collate = f"collate_fn={buckets}" if buckets else "collate_fn=ap.data.BucketCollate(buckets=(128, 256, 512))"
    return (f"Pad to a fixed length, or bucket: {collate} (a collate_fn for any DataLoader, no porting needed), "
            "with ap.data.LengthGroupedBatchSampler to keep padding low.")


def unseen_shapes(style: str) -> tuple[str, str]:
    """The batches' shapes are unknown (no loader accelport sees): (what was seen, the fix)."""
    if style == "accelport":
        seen = "the batches did not come through ap.loader, so their shapes are unknown"
        see = "Iterate with `for batch in ap.loader(data):` to have the input whose shape changes named"
    else:
        seen = "the batches did not come through a DataLoader, so their shapes are unknown"
        see = "Load the batches through a torch DataLoader to have the input whose shape changes named"
    return seen, (f"{see}. The usual causes are batches of varying shape (pad to a fixed length, or bucket with "
                  "ap.data.BucketCollate) and data-dependent ops (boolean indexing x[mask], torch.nonzero; use "
                  "ap.data.masked_sum / masked_mean, torch.where).")


def data_dependent() -> str:
    return ("Replace data-dependent ops (boolean indexing x[mask], torch.nonzero, .item() feeding Python control "
            "flow) with fixed-shape ones (torch.where, ap.data.masked_sum / masked_mean), and pad tensors made "
            "inside the step to a fixed size.")


def never_synced(style: str) -> str:
    """A lazy loop that never syncs."""
    return ("Add torch_xla.sync() (xm.mark_step() on older torch_xla) right after optimizer.step(), or iterate "
            "the batches through torch_xla.distributed.parallel_loader.MpDeviceLoader, which syncs once per "
            "batch; a ported loop (ap.loader, ap.optimizer_step) syncs by itself.")


def sync_long_loops(style: str) -> str:
    """A lazy loop outside the steps that grows one huge graph."""
    if style == "accelport":
        return ("Call ap.sync() once per iteration of that loop, or iterate it with ap.loader, which syncs once "
                "per batch.")
    return ("Call torch_xla.sync() once per iteration of that loop (evaluation, generation, metric "
            "accumulation), or iterate it through MpDeviceLoader, which syncs once per batch (ap.sync() is the "
            "portable spelling).")


def overflow(style: str) -> str:
    """A loss or gradient that overflowed: the learning rate, clipping, fp32."""
    if style == "transformers":
        return ("Lower TrainingArguments(learning_rate=...) or add warmup_steps; the Trainer already clips "
                "gradients (max_grad_norm=1.0), so look at the loss: bf16=True rather than fp16, and the loss "
                "computed in fp32.")
    if style == "lightning":
        return ("Lower the learning rate (or warm it up), clip gradients with Trainer(gradient_clip_val=1.0), and "
                "compute the loss in fp32 (precision=\"bf16-mixed\" rather than \"16-mixed\").")
    step = optimizer_step(style)
    return ("Lower the learning rate (or warm it up), clip gradients with "
            f"torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) before {step} (without a Python branch on "
            "the returned norm, which recompiles on XLA), and compute the loss in fp32 "
            "(loss_fn(logits.float(), y)) under autocast.")


def kept_graphs(style: str) -> str:
    """Losses (or outputs) kept with their autograd graph from step to step: keep a number instead."""
    if style == "torch_xla":
        return ("Keep the value, not its graph: losses.append(loss.detach()), and read it in a step closure, "
                "xm.add_step_closure(fn, args=(loss,)), which hands fn the host value once the step's graph has "
                "run (ap.after_step(fn, loss) is the portable spelling); loss.item() inside the step syncs.")
    if style == "transformers":
        return ("The Trainer keeps only detached losses: a kept graph comes from your code (compute_loss, a "
                "callback, a metric); keep loss.detach() or loss.item() there.")
    if style == "lightning":
        return ("Return the loss from training_step and log it with self.log(\"loss\", loss); a list you keep "
                "yourself must hold loss.detach() or loss.item().")
    text = ("Keep a number, not the tensor: losses.append(loss.item()) or total += loss.item() (a host read each "
            "step), or loss.detach() to keep it on the device")
    if style == "accelport":
        return (text + "; better, log through ap.after_step(fn, loss), which hands fn the host value once the "
                "step has run, without a read inside the step.")
    return text + "; ap.after_step(fn, loss) does it portably, without a read inside the step."


def shard_model(style: str, devices: int) -> str:
    """Sharding parameters, gradients and optimizer state over ``devices`` devices, as the script would ask."""
    if style == "transformers":
        return f"FSDP over {devices} devices (TrainingArguments(fsdp=\"full_shard\"))"
    if style == "lightning":
        return f"FSDP over {devices} devices (Trainer(strategy=\"fsdp\", devices={devices}))"
    if style in ("torch", "torch_xla"):
        return f"ap.shard(model) over {devices} devices (the portable call: FSDP2 on GPUs, SPMD on XLA)"
    return f"ap.shard(model) over {devices} devices"


def accumulate(style: str, steps: int) -> str:
    """Keeping the effective batch with ``steps`` micro-batches per optimizer step."""
    if style == "transformers":
        return f"TrainingArguments(gradient_accumulation_steps={steps})"
    if style == "lightning":
        return f"Trainer(accumulate_grad_batches={steps})"
    return f"accumulating gradients over {steps} micro-batches before {optimizer_step(style)}"


def device_bound(style: str, lazy: bool) -> str:
    """Doing less per sample on the device, as the script would ask for it: mixed precision, and compiling where
    the backend runs eagerly (a lazy backend compiles every step's graph already)."""
    if style == "transformers":
        faster = "bf16 mixed precision, TrainingArguments(bf16=True)" + ("" if lazy else ", or torch_compile=True")
    elif style == "lightning":
        faster = "bf16 mixed precision, Trainer(precision=\"bf16-mixed\")" + (
            "" if lazy else ", or compile the model: model = torch.compile(model) before trainer.fit")
    elif style == "torch_xla":
        faster = ("bf16 mixed precision: with torch.autocast(\"xla\", dtype=torch.bfloat16): around the forward "
                  "pass and the loss (ap.autocast(torch.bfloat16) is the portable spelling)")
    elif style == "torch":
        faster = "mixed precision (with torch.autocast(device_type, dtype=torch.bfloat16):)" + (
            "" if lazy else ", or model = torch.compile(model)")
    else:
        faster = "mixed precision (with ap.autocast(torch.bfloat16):)" + ("" if lazy else ", or ap.compile(model)")
    return ("The step's own work on the device takes the largest share, where a healthy run spends its time; to "
            f"go faster, do less of it per sample: {faster}.")
