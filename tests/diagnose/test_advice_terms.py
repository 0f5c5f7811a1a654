"""The fixes in the script's own terms: a Trainer's options under the HuggingFace Trainer, Lightning's under
Lightning, torch_xla's calls in a raw torch_xla loop, never accelport's calls for a loop that is not accelport's."""

from __future__ import annotations

import pytest

from accelport.diagnose import advice
from accelport.diagnose.timing import explain

DEVICE_BOUND = {"device": 0.9, "other": 0.1}


@pytest.mark.parametrize(("style", "lazy", "says"), [
    ("transformers", False, ("TrainingArguments(bf16=True)", "torch_compile=True")),
    ("lightning", False, ('Trainer(precision="bf16-mixed")', "torch.compile(model)")),
    ("torch_xla", True, ('torch.autocast("xla", dtype=torch.bfloat16)',)),
    ("torch", False, ("torch.autocast(device_type, dtype=torch.bfloat16)", "torch.compile(model)")),
    ("accelport", False, ("ap.autocast(torch.bfloat16)", "ap.compile(model)")),
])
def test_the_device_bound_fix_is_spelled_as_the_script_trains(style: str, lazy: bool, says: tuple[str, ...]) -> None:
    line, verdict, fix = explain(DEVICE_BOUND, 10, lazy=lazy, style=style)
    assert verdict.startswith("device-bound")
    assert all(s in fix for s in says), fix
    if style in ("transformers", "lightning", "torch"):
        assert "ap." not in fix  # their loop is not accelport's
    if style == "torch_xla":
        assert "compile" not in fix and "ap.autocast(torch.bfloat16) is the portable spelling" in fix


def test_the_trainers_input_bound_fix_pins_memory_only_where_there_is_a_device_to_copy_to() -> None:
    on_cpu = advice.data_workers("transformers", 0, 4, "cpu")
    assert "dataloader_num_workers=3" in on_cpu and "pin_memory" not in on_cpu
    assert "dataloader_pin_memory=True" in advice.data_workers("transformers", 0, 4, "cuda")
    # The [time] line's fix, which does not know the device, says nothing of pinning either.
    _, _, fix = explain({"data": 0.9, "device": 0.1}, 10, loader={"num_workers": 0}, style="transformers")
    assert "pin_memory" not in fix


def test_lightnings_fixes_name_every_place_a_script_builds_its_dataloader() -> None:
    # A script may hand its DataLoader to trainer.fit instead of defining train_dataloader().
    for fix in (advice.data_workers("lightning", 0, 4), advice.varying_batch("lightning")):
        assert "train_dataloader(), or the one handed to trainer.fit" in fix, fix
        assert "in train_dataloader()" not in fix


def test_a_batch_size_that_varies_from_batch_to_batch_leads_with_padding_not_drop_last() -> None:
    varying = advice.varying_batch("torch_xla", 9)
    assert varying.startswith("The batch size varies from batch to batch (9 sizes): pad every batch up to one size")
    assert varying.index("BucketCollate") < varying.index("drop_last=True")
    assert "only drops a last short batch" in varying
    # Two sizes: the full batch and a last short one, which drop_last does remove.
    assert advice.varying_batch("torch_xla", 2).startswith("Keep the batch size fixed: DataLoader(..., drop_last=True)")
