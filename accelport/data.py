"""Static shapes for compiled backends: padding, bucketing, length grouping, masks.

XLA (and torch.compile without dynamic shapes) compiles one graph per distinct
input shape. Variable-length data padded to each batch's maximum produces a new
shape almost every step, so the run spends its time compiling. The fixes:

- :func:`pad_to` pads one tensor to a fixed length;
- :class:`BucketCollate` pads every batch up to the smallest of a few bucket
  lengths (and, given ``batch_size``, a short final batch up to full size), so
  the number of shapes is the number of buckets;
- :class:`LengthGroupedBatchSampler` puts samples of similar length together, so
  bucketing wastes little padding;
- :func:`masked_mean` / :func:`masked_sum` replace boolean indexing
  (``x[mask].mean()`` has a data-dependent shape) with fixed-shape arithmetic.

Nothing here imports torch until it is called.
"""

from __future__ import annotations

import bisect
import math
import numbers
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from accelport.errors import did_you_mean

__all__ = ["pad_to", "BucketCollate", "LengthGroupedBatchSampler", "masked_mean", "masked_sum"]


def _fill_problem(value: Any, dtype: Any) -> str | None:
    """Why a tensor of ``dtype`` cannot hold ``value`` exactly (torch.full would wrap or round it), or None."""
    import torch

    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Number):
        return f"{value!r} is not a number"
    if isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real):
        return None if dtype.is_complex or complex(value).imag == 0 else "a complex value in a real tensor"
    real = float(value)  # type: ignore[arg-type]
    if dtype == torch.bool:
        return None if real in (0.0, 1.0) else "a bool tensor holds only False/True (0 or 1)"
    if dtype.is_floating_point or dtype.is_complex:
        largest = torch.finfo(dtype).max
        return None if not math.isfinite(real) or abs(real) <= largest else f"its largest value is {largest:g}"
    info = torch.iinfo(dtype)
    if not math.isfinite(real) or real != int(real):
        return "it holds whole numbers only"
    if not info.min <= int(value) <= info.max:  # type: ignore[call-overload]
        return f"its range is {info.min} to {info.max}"
    return None


def pad_to(tensor: Any, length: int, dim: int = -1, value: float = 0) -> Any:
    """Pad ``tensor`` along ``dim`` to ``length`` with ``value``.

    Raises ValueError if the tensor is already longer: truncate it yourself or
    choose a larger length (silently cutting data would hide a bug), or if its
    dtype cannot hold ``value`` (-100 in a uint8 tensor would become 156).
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"pad_to needs a torch.Tensor, not {type(tensor).__name__}")
    if tensor.ndim == 0:
        raise ValueError("pad_to needs a tensor with at least one dimension")
    if not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be a non-negative int, not {length!r}")
    if not -tensor.ndim <= dim < tensor.ndim:
        raise ValueError(f"dim {dim} is out of range for a tensor of {tensor.ndim} dimensions")
    problem = _fill_problem(value, tensor.dtype)
    if problem:
        raise ValueError(f"pad_to: a {tensor.dtype} tensor cannot hold the pad value {value!r} ({problem}); "
                         "convert the tensor first (e.g. .long() or .float()) or choose a value it can hold")
    size = tensor.shape[dim]
    if size > length:
        raise ValueError(
            f"tensor is {size} long on dim {dim}, longer than the target {length}: "
            "truncate it first or use a larger length/bucket"
        )
    if size == length:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = length - size
    filler = torch.full(shape, value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([tensor, filler], dim=dim)


class BucketCollate:
    """A DataLoader ``collate_fn`` that pads each batch to the smallest bucket that fits.

    Samples are tensors, tuples or dicts of tensors. Every tensor with at least
    one dimension is padded along its first dimension (the sequence) to the
    bucket length and stacked; 0-d tensors and numbers are stacked as they are,
    and so are the fields named in ``fixed_fields`` (fixed-size features such as
    an image or an embedding, which must not grow to the bucket length).

    Args:
        buckets: allowed sequence lengths, e.g. ``(128, 256, 512, 1024)``.
        pad_value: padding value; a tuple (per position) or mapping (per key)
            gives each field its own, e.g. ``{"input_ids": 0, "labels": -100}``
            so padded labels are ignored by ``cross_entropy``.
        batch_size: if given, a short batch (the last one) is padded up to this
            many samples with all-padding samples, so its shape matches too.
            Without it, use ``DataLoader(drop_last=True)`` or accept one more
            compilation for the last batch.
        too_long: ``"error"`` (default) or ``"truncate"`` for samples longer
            than the largest bucket.
        fixed_fields: keys (dict samples) or positions (tuple samples) of
            fields that are not sequences: stacked, never padded in length
            (a short final batch is still padded to ``batch_size``).
        mask: also give the batch its padding mask, ``(batch, length)`` int64,
            1 at a sample's own positions and 0 at padding (the samples added
            for ``batch_size`` included): for dict samples, the key to put it
            under (``"attention_mask"``, the name models take it by, also lets
            accelport's FLOPs count say the padding share of the batches); for
            tuple samples, ``True`` appends it as the last field. The length is
            that of the first sequence field.
    """

    def __init__(
        self,
        buckets: Sequence[int] = (128, 256, 512, 1024),
        pad_value: float | Sequence[float] | Mapping[str, float] = 0,
        batch_size: int | None = None,
        too_long: str = "error",
        fixed_fields: Sequence[Any] = (),
        mask: str | bool | None = None,
    ) -> None:
        if not buckets or any(not isinstance(b, int) or b <= 0 for b in buckets):
            raise ValueError(f"buckets must be positive ints, e.g. (128, 256, 512), not {buckets!r}")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size <= 0):
            raise ValueError(f"batch_size must be a positive int or None, not {batch_size!r}")
        if too_long not in ("error", "truncate"):
            raise ValueError(f"too_long must be 'error' or 'truncate', not {too_long!r}")
        self.buckets = tuple(sorted(set(buckets)))
        _check_pad_value(pad_value)
        self.pad_value = pad_value
        self.batch_size = batch_size
        self.too_long = too_long
        if isinstance(fixed_fields, (str, int)):  # one name or position, not its characters
            fixed_fields = (fixed_fields,)
        if not isinstance(fixed_fields, (tuple, list, set, frozenset)) or \
                not all(isinstance(f, (str, int)) and not isinstance(f, bool) for f in fixed_fields):
            raise TypeError("fixed_fields must name fields by key (dict samples) or position (tuple samples), "
                            f"e.g. ('pixel_values',) or (1,), not {fixed_fields!r}")
        self.fixed_fields = frozenset(fixed_fields)
        if not (mask is None or mask is False or mask is True or (isinstance(mask, str) and mask)):
            raise TypeError(f"mask must be a key for dict samples (e.g. 'attention_mask'), True for tuple samples, "
                            f"or None, not {mask!r}")
        self.mask = mask or None

    def bucket_for(self, length: int) -> int:
        """The smallest bucket >= ``length`` (the largest if truncating)."""
        i = bisect.bisect_left(self.buckets, length)
        if i == len(self.buckets):
            if self.too_long == "truncate":
                return self.buckets[-1]
            raise ValueError(
                f"a sample of length {length} is longer than the largest bucket {self.buckets[-1]}: "
                "add a larger bucket or pass too_long='truncate'"
            )
        return self.buckets[i]

    def _pad_for(self, key: Any) -> Any:
        pv = self.pad_value
        if isinstance(pv, Mapping):
            return pv.get(key, 0)
        if isinstance(pv, (tuple, list)):
            return pv[key] if isinstance(key, int) and key < len(pv) else 0
        return pv  # a single value (a number, or a scalar of the user's array library)

    def _check_fields(self, first: Any) -> None:
        """Refuse a per-field pad_value that names a field the samples do not have (it would pad with 0)."""
        pv = self.pad_value
        if isinstance(pv, Mapping):
            if not isinstance(first, Mapping):
                raise ValueError(f"pad_value is a mapping (per key) but the samples are {type(first).__name__}s, "
                                 "not dicts: give a tuple (per position) or a single value")
            unknown = [k for k in pv if k not in first]
            if unknown:
                fields = ", ".join(map(repr, first))
                hint = did_you_mean(str(unknown[0]), [str(k) for k in first]) if isinstance(unknown[0], str) else ""
                raise ValueError(f"pad_value names {', '.join(map(repr, unknown))}, which the samples do not "
                                 f"have (their fields: {fields}).{hint} Without a match the field would be "
                                 "padded with 0")
        elif isinstance(pv, (tuple, list)):
            if isinstance(first, Mapping) or not isinstance(first, (tuple, list)):
                what = "dicts" if isinstance(first, Mapping) else f"{type(first).__name__}s"
                raise ValueError(f"pad_value is a tuple (per position) but the samples are {what}: give "
                                 + ("a mapping per key, e.g. {'labels': -100}" if what == "dicts" else
                                    "a single value"))
            if len(pv) > len(first):
                raise ValueError(f"pad_value has {len(pv)} values but the samples have {len(first)} fields: "
                                 "give one value per field")

    def __call__(self, samples: Sequence[Any]) -> Any:
        import torch

        if not samples:
            raise ValueError("BucketCollate got an empty batch")
        if self.batch_size is not None and len(samples) > self.batch_size:
            raise ValueError(f"batch of {len(samples)} samples is larger than batch_size={self.batch_size}")
        first = samples[0]
        self._check_fields(first)
        self._check_mask(first)
        if isinstance(first, Mapping):
            _same_keys(samples)
            fields = {k: [s[k] for s in samples] for k in first}
            out_fields = {k: self._field(v, k, torch) for k, v in fields.items()}
            if isinstance(self.mask, str):
                out_fields[self.mask] = self._mask(fields.items(), torch)
            return out_fields
        if isinstance(first, (tuple, list)):
            _same_length(samples)
            columns = [[s[i] for s in samples] for i in range(len(first))]
            out = [self._field(column, i, torch) for i, column in enumerate(columns)]
            if self.mask is True:
                out.append(self._mask(enumerate(columns), torch))
            return type(first)(out) if isinstance(first, tuple) and not hasattr(first, "_fields") else out
        return self._field(list(samples), None, torch)

    def _check_mask(self, first: Any) -> None:
        mask = self.mask
        if mask is None:
            return
        if isinstance(first, Mapping):
            if not isinstance(mask, str):
                raise ValueError("mask=True is for tuple samples; the samples are dicts: give the key to put the "
                                 "mask under, e.g. mask='attention_mask'")
            if mask in first:
                raise ValueError(f"mask={mask!r} is a field the samples already have: give another key")
        elif isinstance(first, (tuple, list)):
            if mask is not True:
                raise ValueError(f"mask={mask!r} names a key, and the samples are {type(first).__name__}s: give "
                                 "mask=True to append the mask as the last field")
        else:
            raise ValueError("mask needs dict or tuple samples (a field to put it in): the samples are single "
                             f"{type(first).__name__}s")

    def _mask(self, columns: Any, torch: Any) -> Any:
        """1 at each sample's own positions of the first sequence field, 0 at its padding."""
        for key, values in columns:
            tensors = [v if isinstance(v, torch.Tensor) else torch.as_tensor(v) for v in values]
            if key in self.fixed_fields or tensors[0].ndim == 0:
                continue
            length = self.bucket_for(max(t.shape[0] for t in tensors))
            own = torch.tensor([min(t.shape[0], length) for t in tensors])
            mask = (torch.arange(length).unsqueeze(0) < own.unsqueeze(1)).to(torch.int64)
            return self._pad_batch(mask, 0, torch)
        raise ValueError("mask: the samples have no sequence field (every field is 0-d or in fixed_fields)")

    def _field(self, values: list[Any], key: Any, torch: Any) -> Any:
        tensors = [v if isinstance(v, torch.Tensor) else torch.as_tensor(v) for v in values]
        pad = self._pad_for(key)
        problem = _fill_problem(pad, tensors[0].dtype)
        if problem:
            name = "the samples" if key is None else f"field {key!r}"
            raise ValueError(f"{name} is {tensors[0].dtype}, which cannot hold the pad value {pad!r} ({problem}): "
                             f"convert {name} in the dataset (e.g. to torch.int64 with .long()) or give it a "
                             "pad value it can hold")
        if tensors[0].ndim == 0 or key in self.fixed_fields:
            try:
                stacked = torch.stack(tensors)
            except RuntimeError:
                shapes = sorted({tuple(t.shape) for t in tensors})
                raise ValueError(f"field {key!r} is in fixed_fields but its samples differ in shape "
                                 f"({', '.join(map(str, shapes))}): only fixed-size fields can be stacked "
                                 "as they are") from None
            return self._pad_batch(stacked, pad, torch)
        length = self.bucket_for(max(t.shape[0] for t in tensors))
        padded = [pad_to(t[:length], length, dim=0, value=pad) for t in tensors]
        return self._pad_batch(torch.stack(padded), pad, torch)

    def _pad_batch(self, batch: Any, pad: float, torch: Any) -> Any:
        if self.batch_size is None or batch.shape[0] == self.batch_size:
            return batch
        return pad_to(batch, self.batch_size, dim=0, value=pad)


def _check_pad_value(pad_value: Any) -> None:
    def number(v: Any) -> bool:
        return isinstance(v, numbers.Number)

    if isinstance(pad_value, Mapping):
        bad = {k: v for k, v in pad_value.items() if not number(v)}
    elif isinstance(pad_value, (tuple, list)):
        bad = {i: v for i, v in enumerate(pad_value) if not number(v)}
    else:
        bad = {} if number(pad_value) else {"": pad_value}
    if bad:
        where, value = next(iter(bad.items()))
        at = f" (at {where!r})" if where != "" else ""
        raise TypeError(f"pad_value must be a number, a tuple of numbers (per position) or a mapping of numbers "
                        f"(per key), e.g. {{'input_ids': 0, 'labels': -100}}; got {value!r}{at}")


def _same_keys(samples: Sequence[Any]) -> None:
    """Every dict sample has the first one's keys: a field only in later samples would be dropped."""
    keys = list(samples[0])
    for i, sample in enumerate(samples[1:], start=1):
        if not isinstance(sample, Mapping):
            raise ValueError(f"sample {i} is a {type(sample).__name__} but sample 0 is a dict: every sample of a "
                             "batch needs the same structure")
        if sample.keys() != samples[0].keys():
            extra = [k for k in sample if k not in samples[0]]
            missing = [k for k in keys if k not in sample]
            parts = ([f"has {', '.join(map(repr, extra))}, which sample 0 lacks"] if extra else []) + \
                ([f"lacks {', '.join(map(repr, missing))}"] if missing else [])
            raise ValueError(f"sample {i} {' and '.join(parts)} (sample 0 has {', '.join(map(repr, keys))}): every "
                             "sample of a batch needs the same fields; give each sample every field (a "
                             "placeholder where it has none) or drop the field in the dataset")


def _same_length(samples: Sequence[Any]) -> None:
    n = len(samples[0])
    for i, sample in enumerate(samples[1:], start=1):
        if not isinstance(sample, (tuple, list)) or len(sample) != n:
            what = f"{len(sample)} fields" if isinstance(sample, (tuple, list)) else f"a {type(sample).__name__}"
            raise ValueError(f"sample {i} has {what} but sample 0 has {n}: every sample of a batch needs the "
                             "same fields")


class LengthGroupedBatchSampler:
    """Batches of indices whose samples have similar lengths (low padding waste).

    Indices are shuffled (per epoch, with ``seed + epoch``), cut into mega-batches
    of ``batch_size * group_size``, sorted by length inside each, then cut into
    batches; the batch order is shuffled again so lengths do not rise through
    the epoch. Use with ``DataLoader(ds, batch_sampler=..., collate_fn=BucketCollate(...))``.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        group_size: int = 50,
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int = 0,
    ) -> None:
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, not {batch_size!r}")
        if not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"group_size must be a positive int, not {group_size!r}")
        if isinstance(lengths, (str, bytes, Mapping)) or not isinstance(lengths, Iterable):
            raise TypeError("lengths must be non-negative ints, one per sample (e.g. [len(s) for s in dataset]), "
                            f"not {type(lengths).__name__}")
        # Read once: a generator (or any one-shot iterator) would be used up by the check below.
        values = list(lengths)
        bad = next((n for n in values if isinstance(n, bool) or not isinstance(n, int) or n < 0), None)
        if bad is not None:
            raise TypeError("lengths must be non-negative ints, one per sample (e.g. [len(s) for s in dataset]), "
                            f"not {bad!r}")
        self.lengths = values
        self.batch_size = batch_size
        self.group_size = group_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        n = len(self.lengths)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        rng = random.Random(self.seed + self.epoch)
        order = list(range(len(self.lengths)))
        if self.shuffle:
            rng.shuffle(order)
        mega = self.batch_size * self.group_size
        batches: list[list[int]] = []
        for start in range(0, len(order), mega):
            group = sorted(order[start:start + mega], key=lambda i: self.lengths[i], reverse=True)
            batches.extend(group[i:i + self.batch_size] for i in range(0, len(group), self.batch_size))
        if self.drop_last:
            batches = [b for b in batches if len(b) == self.batch_size]
        if self.shuffle:
            rng.shuffle(batches)
        return iter(batches)


def _full_mask(values: Any, mask: Any, name: str) -> Any:
    """``mask`` broadcast to ``values``' shape; refused if it would enlarge ``values`` or is not boolean."""
    import torch

    if not isinstance(values, torch.Tensor) or not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} needs two tensors (values, mask), not {type(values).__name__} and "
                        f"{type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name}: the mask must be a bool tensor, not {mask.dtype}; convert it with "
                        "mask.bool() (or mask > 0)")
    try:
        shape = torch.broadcast_shapes(mask.shape, values.shape)
    except RuntimeError:
        shape = None
    if shape != values.shape:
        raise ValueError(f"{name}: a mask of shape {tuple(mask.shape)} does not broadcast to the values' shape "
                         f"{tuple(values.shape)}; give a mask of that shape, or one with 1 where the values "
                         "have a dimension it should repeat over (e.g. mask[..., None])")
    return mask.expand(values.shape)


def masked_sum(values: Any, mask: Any, dim: int | tuple[int, ...] | None = None) -> Any:
    """Sum of ``values`` where ``mask`` is true, with a fixed output shape.

    Use instead of ``values[mask].sum()``, whose intermediate shape depends on
    the data (a recompilation, or a CPU fallback, every time the count changes).
    ``mask`` is a bool tensor of ``values``' shape or one that broadcasts to it
    (``(B, T, 1)`` over ``(B, T, H)``).
    """
    import torch

    mask = _full_mask(values, mask, "masked_sum")
    zeros = torch.zeros((), dtype=values.dtype, device=values.device)
    kept = torch.where(mask, values, zeros)
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: Any, mask: Any, dim: int | tuple[int, ...] | None = None) -> Any:
    """Mean of ``values`` where ``mask`` is true (0 where nothing is selected), fixed shape.

    A mask that broadcasts (``(B, T, 1)`` over ``(B, T, H)``) counts every value it
    selects, as ``values[mask.expand_as(values)].mean()`` does.
    """
    import torch

    full = _full_mask(values, mask, "masked_mean")
    total = masked_sum(values, full, dim)
    counted = full.to(values.dtype if values.is_floating_point() else torch.get_default_dtype())
    count = counted.sum() if dim is None else counted.sum(dim=dim)
    return total / count.clamp(min=1)
