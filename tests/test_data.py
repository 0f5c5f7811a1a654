"""ap.data: fixed shapes from variable-length data."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import accelport as ap


def test_pad_to_pads_and_refuses_to_truncate() -> None:
    import torch

    t = torch.tensor([[1, 2, 3]])
    out = ap.data.pad_to(t, 5, dim=-1, value=-1)
    assert out.tolist() == [[1, 2, 3, -1, -1]]
    assert ap.data.pad_to(t, 3) is t
    assert ap.data.pad_to(t, 2, dim=0).shape == (2, 3)
    with pytest.raises(ValueError, match="longer than the target 2: truncate"):
        ap.data.pad_to(t, 2)
    with pytest.raises(TypeError, match="torch.Tensor"):
        ap.data.pad_to([1, 2], 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative int"):
        ap.data.pad_to(t, -1)


def test_bucket_collate_pads_to_smallest_bucket_and_per_field_values() -> None:
    import torch

    collate = ap.data.BucketCollate(buckets=(8, 4, 16), pad_value={"ids": 0, "labels": -100})
    assert collate.buckets == (4, 8, 16)
    batch = collate([{"ids": torch.arange(1, 6), "labels": torch.arange(5), "n": 5},
                     {"ids": torch.arange(1, 3), "labels": torch.arange(2), "n": 2}])
    assert batch["ids"].shape == (2, 8)
    assert batch["ids"][1].tolist() == [1, 2, 0, 0, 0, 0, 0, 0]
    assert batch["labels"][1].tolist() == [0, 1] + [-100] * 6
    assert batch["n"].tolist() == [5, 2]


def test_bucket_collate_tuples_and_short_final_batch() -> None:
    import torch

    collate = ap.data.BucketCollate(buckets=(4,), pad_value=(0, -100), batch_size=3)
    x, y = collate([(torch.ones(3, dtype=torch.long), torch.tensor(1))])
    assert x.shape == (3, 4) and y.shape == (3,)
    assert x[1:].eq(0).all() and y.tolist() == [1, -100, -100]


def test_the_padding_mask_marks_each_samples_own_positions_and_the_padded_samples() -> None:
    import torch

    collate = ap.data.BucketCollate(buckets=(4, 8), batch_size=3, mask="attention_mask", pad_value={"labels": -100})
    batch = collate([{"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([1, 2, 3])},
                     {"input_ids": torch.arange(1, 6), "labels": torch.arange(5)}])
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0], [0] * 8]
    assert batch["attention_mask"].dtype == torch.int64
    # The mask selects exactly the labels that are not the ignore index.
    assert torch.equal(batch["attention_mask"].bool(), batch["labels"] != -100)
    x, label, mask = ap.data.BucketCollate(buckets=(4,), mask=True, too_long="truncate")(
        [(torch.arange(6), torch.tensor(0)), (torch.arange(2), torch.tensor(1))])
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]] and x.shape == (2, 4) and label.tolist() == [0, 1]


@pytest.mark.parametrize(("mask", "samples", "message"), [
    (True, [{"a": [1]}], "mask=True is for tuple samples; the samples are dicts: give the key"),
    ("a", [{"a": [1]}], "mask='a' is a field the samples already have"),
    ("attention_mask", [([1], [2])], "give mask=True to append the mask as the last field"),
    (True, [[1, 2]], "the samples have no sequence field"),
])
def test_a_mask_with_nowhere_to_go_is_refused(mask: object, samples: list, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message):
        ap.data.BucketCollate(buckets=(4,), mask=mask)(samples)  # type: ignore[arg-type]


def test_mask_must_be_a_key_or_true() -> None:
    with pytest.raises(TypeError, match="mask must be a key for dict samples"):
        ap.data.BucketCollate(mask=3)  # type: ignore[arg-type]


def test_fixed_size_fields_are_stacked_not_padded_to_the_bucket() -> None:
    import torch

    collate = ap.data.BucketCollate(buckets=(8, 16), fixed_fields=("features",), batch_size=3)
    batch = collate([{"ids": torch.arange(5), "features": torch.ones(10)},
                     {"ids": torch.arange(9), "features": torch.zeros(10)}])
    assert batch["ids"].shape == (3, 16)  # a sequence: padded to the bucket
    assert batch["features"].shape == (3, 10)  # a feature vector: as it is, plus the padded sample
    assert batch["features"][0].eq(1).all() and batch["features"][2].eq(0).all()
    by_position = ap.data.BucketCollate(buckets=(8,), fixed_fields=1)
    x, image = by_position([(torch.arange(3), torch.ones(3, 4, 4)), (torch.arange(6), torch.ones(3, 4, 4))])
    assert x.shape == (2, 8) and image.shape == (2, 3, 4, 4)
    with pytest.raises(ValueError, match="field 1 is in fixed_fields but its samples differ in shape"):
        by_position([(torch.arange(3), torch.ones(3)), (torch.arange(3), torch.ones(4))])
    for wrong in (None, [1.5], True, {"features": 1}):
        with pytest.raises(TypeError, match=r"fixed_fields must name fields by key .* or position"):
            ap.data.BucketCollate(fixed_fields=wrong)  # type: ignore[arg-type]


def test_bucket_collate_bad_input_says_what_to_do() -> None:
    import torch

    with pytest.raises(ValueError, match="positive ints"):
        ap.data.BucketCollate(buckets=())
    with pytest.raises(ValueError, match="too_long must be"):
        ap.data.BucketCollate(too_long="wrap")
    with pytest.raises(ValueError, match="longer than the largest bucket 4: add a larger bucket"):
        ap.data.BucketCollate(buckets=(4,))([torch.ones(9)])
    truncated = ap.data.BucketCollate(buckets=(4,), too_long="truncate")([torch.arange(9)])
    assert truncated.tolist() == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="larger than batch_size=1"):
        ap.data.BucketCollate(batch_size=1)([torch.ones(2), torch.ones(2)])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=12))
def test_bucketed_shapes_are_always_one_of_the_buckets(lengths: list[int]) -> None:
    import torch

    buckets = (32, 64, 128, 512)
    batch = ap.data.BucketCollate(buckets=buckets)([torch.ones(n) for n in lengths])
    assert batch.shape[1] in buckets
    assert batch.shape[1] >= max(lengths)
    assert batch.shape[1] == min(b for b in buckets if b >= max(lengths))
    assert int(batch.sum()) == sum(lengths)  # nothing lost, padding is zeros


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 500), min_size=1, max_size=200), st.integers(1, 16), st.booleans())
def test_length_grouped_sampler_covers_every_index_once(lengths: list[int], bs: int, drop: bool) -> None:
    sampler = ap.data.LengthGroupedBatchSampler(lengths, bs, group_size=4, drop_last=drop, seed=3)
    batches = list(sampler)
    assert len(batches) == len(sampler)
    flat = [i for b in batches for i in b]
    assert len(flat) == len(set(flat))
    if not drop:
        assert sorted(flat) == list(range(len(lengths)))
    assert all(len(b) == bs for b in batches) if drop else all(1 <= len(b) <= bs for b in batches)


def test_length_grouping_reduces_padding_waste() -> None:
    import random

    rng = random.Random(0)
    lengths = [rng.randint(5, 500) for _ in range(2000)]

    def waste(batches: list[list[int]]) -> float:
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)

    grouped = list(ap.data.LengthGroupedBatchSampler(lengths, 16, seed=1))
    order = list(range(len(lengths)))
    rng.shuffle(order)
    plain = [order[i:i + 16] for i in range(0, len(order), 16)]
    assert waste(grouped) < 0.2 * waste(plain)
    epoch0 = list(ap.data.LengthGroupedBatchSampler(lengths, 16, seed=1))
    s = ap.data.LengthGroupedBatchSampler(lengths, 16, seed=1)
    s.set_epoch(1)
    assert epoch0 == grouped and list(s) != grouped  # deterministic per epoch, reshuffled across


def test_masked_reductions_match_boolean_indexing_with_a_fixed_shape() -> None:
    import torch

    torch.manual_seed(0)
    x = torch.randn(4, 7)
    mask = x > 0.3
    assert torch.allclose(ap.data.masked_sum(x, mask), x[mask].sum())
    assert torch.allclose(ap.data.masked_mean(x, mask), x[mask].mean())
    per_row = ap.data.masked_mean(x, mask, dim=1)
    assert per_row.shape == (4,)
    for r in range(4):
        expected = x[r][mask[r]].mean() if mask[r].any() else torch.tensor(0.0)
        assert torch.allclose(per_row[r], expected)
    assert ap.data.masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_a_broadcast_mask_counts_every_value_it_selects() -> None:
    import torch

    values = torch.ones(2, 5, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    # (B, T, 1) over (B, T, H): the mask repeats over H, and so does its count.
    assert ap.data.masked_mean(values, mask[..., None]).item() == 1.0
    assert ap.data.masked_sum(values, mask[..., None]).item() == 5 * 4
    expected = values[mask[..., None].expand_as(values)].mean()
    torch.manual_seed(0)
    x = torch.randn(2, 5, 4)
    assert torch.allclose(ap.data.masked_mean(x, mask[..., None]), x[mask[..., None].expand_as(x)].mean())
    assert expected.item() == 1.0
    per_row = ap.data.masked_mean(x, mask[..., None], dim=(1, 2))
    for r in range(2):
        assert torch.allclose(per_row[r], x[r][mask[r]].mean())
    with pytest.raises(ValueError, match=r"a mask of shape \(2, 5, 4\) does not broadcast to the values' shape "
                                         r"\(2, 5, 1\)"):
        ap.data.masked_mean(torch.ones(2, 5, 1), torch.ones(2, 5, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"the mask must be a bool tensor, not torch.int64; convert it with mask.bool"):
        ap.data.masked_sum(values, mask.long()[..., None])


def test_a_pad_value_the_dtype_cannot_hold_is_refused_naming_field_dtype_and_value() -> None:
    import torch

    samples = [{"ids": torch.arange(3), "labels": torch.tensor([1, 2, 3], dtype=torch.uint8)}]
    with pytest.raises(ValueError, match=r"field 'labels' is torch.uint8, which cannot hold the pad value -100 "
                                         r"\(its range is 0 to 255\)"):
        ap.data.BucketCollate(buckets=(4,), pad_value=-100)(samples)
    as_long = ap.data.BucketCollate(buckets=(4,), pad_value=-100)(
        [{"ids": torch.arange(3), "labels": torch.tensor([1, 2, 3])}])
    assert as_long["labels"].tolist() == [[1, 2, 3, -100]]
    with pytest.raises(ValueError, match=r"a torch.bool tensor cannot hold the pad value 0.5 \(a bool tensor holds "
                                         r"only False/True"):
        ap.data.pad_to(torch.ones(3, dtype=torch.bool), 5, value=0.5)
    with pytest.raises(ValueError, match=r"torch.int64 tensor cannot hold the pad value 0.5 \(it holds whole numbers"):
        ap.data.pad_to(torch.arange(3), 5, value=0.5)
    with pytest.raises(ValueError, match=r"torch.float16 tensor cannot hold the pad value 100000.0 \(its largest"):
        ap.data.pad_to(torch.ones(3, dtype=torch.float16), 5, value=1e5)
    assert ap.data.pad_to(torch.ones(2, dtype=torch.bool), 3, value=False).tolist() == [True, True, False]
    assert ap.data.pad_to(torch.ones(2), 3, value=float("-inf")).tolist() == [1.0, 1.0, float("-inf")]
    # A 0-d field is padded along the batch (a short final batch) with the same check.
    with pytest.raises(ValueError, match=r"field 1 is torch.uint8, which cannot hold the pad value -1"):
        ap.data.BucketCollate(buckets=(4,), pad_value=(0, -1), batch_size=2)(
            [(torch.arange(2), torch.tensor(3, dtype=torch.uint8))])


def test_a_pad_value_for_a_field_the_samples_lack_is_refused_with_the_fields_that_exist() -> None:
    import torch

    samples = [{"input_ids": torch.arange(3), "labels": torch.arange(3)}]
    with pytest.raises(ValueError, match=r"pad_value names 'label', which the samples do not have \(their fields: "
                                         r"'input_ids', 'labels'\)\. Did you mean 'labels'\?"):
        ap.data.BucketCollate(buckets=(4,), pad_value={"label": -100})(samples)
    with pytest.raises(ValueError, match="pad_value is a mapping .* but the samples are tuples"):
        ap.data.BucketCollate(buckets=(4,), pad_value={"labels": -100})([(torch.arange(3), torch.arange(3))])
    with pytest.raises(ValueError, match=r"pad_value is a tuple \(per position\) but the samples are dicts"):
        ap.data.BucketCollate(buckets=(4,), pad_value=(0, -100))(samples)
    with pytest.raises(ValueError, match="pad_value has 3 values but the samples have 2 fields"):
        ap.data.BucketCollate(buckets=(4,), pad_value=(0, -100, 7))([(torch.arange(3), torch.arange(3))])
    for wrong in ("-100", {"labels": "x"}, (0, None)):
        with pytest.raises(TypeError, match="pad_value must be a number, a tuple of numbers"):
            ap.data.BucketCollate(pad_value=wrong)  # type: ignore[arg-type]


def test_fields_that_differ_between_samples_are_an_error_not_dropped() -> None:
    import torch

    collate = ap.data.BucketCollate(buckets=(4,))
    with pytest.raises(ValueError, match=r"sample 1 has 'mask', which sample 0 lacks \(sample 0 has 'ids'\): every "
                                         r"sample of a batch needs the same fields"):
        collate([{"ids": torch.arange(2)}, {"ids": torch.arange(3), "mask": torch.ones(3)}])
    with pytest.raises(ValueError, match=r"sample 1 lacks 'mask'"):
        collate([{"ids": torch.arange(2), "mask": torch.ones(2)}, {"ids": torch.arange(3)}])
    with pytest.raises(ValueError, match="sample 2 has 3 fields but sample 0 has 2"):
        collate([(torch.arange(2), torch.arange(2))] * 2 + [(torch.arange(2),) * 3])
    with pytest.raises(ValueError, match="sample 1 is a list but sample 0 is a dict"):
        collate([{"ids": torch.arange(2)}, [torch.arange(2)]])


def test_lengths_from_a_generator_are_read_once_not_used_up() -> None:
    lengths = [5, 1, 9, 3, 7]
    from_generator = ap.data.LengthGroupedBatchSampler((n for n in lengths), 2, seed=4)
    assert len(from_generator) == 3
    assert list(from_generator) == list(ap.data.LengthGroupedBatchSampler(lengths, 2, seed=4))
    assert list(from_generator) == list(from_generator)  # every epoch, not only the first
    with pytest.raises(TypeError, match=r"lengths must be non-negative ints, one per sample .*, not -1"):
        ap.data.LengthGroupedBatchSampler(iter([3, -1]), 2)
    with pytest.raises(TypeError, match="not int"):
        ap.data.LengthGroupedBatchSampler(7, 2)  # type: ignore[arg-type]
