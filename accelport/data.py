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
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

__all__ = ["pad_to", "BucketCollate", "LengthGroupedBatchSampler", "masked_mean", "masked_sum"]


def pad_to(tensor: Any, length: int, dim: int = -1, value: float = 0) -> Any:
    """Pad ``tensor`` along ``dim`` to ``length`` with ``value``.

    Raises ValueError if the tensor is already longer: truncate it yourself or
    choose a larger length (silently cutting data would hide a bug).
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
    """

    def __init__(
        self,
        buckets: Sequence[int] = (128, 256, 512, 1024),
        pad_value: float | Sequence[float] | Mapping[str, float] = 0,
        batch_size: int | None = None,
        too_long: str = "error",
        fixed_fields: Sequence[Any] = (),
    ) -> None:
        if not buckets or any(not isinstance(b, int) or b <= 0 for b in buckets):
            raise ValueError(f"buckets must be positive ints, e.g. (128, 256, 512), not {buckets!r}")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size <= 0):
            raise ValueError(f"batch_size must be a positive int or None, not {batch_size!r}")
        if too_long not in ("error", "truncate"):
            raise ValueError(f"too_long must be 'error' or 'truncate', not {too_long!r}")
        self.buckets = tuple(sorted(set(buckets)))
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

    def _pad_for(self, key: Any) -> float:
        pv = self.pad_value
        if isinstance(pv, Mapping):
            return pv.get(key, 0)
        if isinstance(pv, (tuple, list)):
            return pv[key] if isinstance(key, int) and key < len(pv) else 0
        return cast(float, pv)  # a single value (a number, or a scalar of the user's array library)

    def __call__(self, samples: Sequence[Any]) -> Any:
        import torch

        if not samples:
            raise ValueError("BucketCollate got an empty batch")
        if self.batch_size is not None and len(samples) > self.batch_size:
            raise ValueError(f"batch of {len(samples)} samples is larger than batch_size={self.batch_size}")
        first = samples[0]
        if isinstance(first, Mapping):
            fields = {k: [s[k] for s in samples] for k in first}
            return {k: self._field(v, k, torch) for k, v in fields.items()}
        if isinstance(first, (tuple, list)):
            out = [self._field([s[i] for s in samples], i, torch) for i in range(len(first))]
            return type(first)(out) if isinstance(first, tuple) and not hasattr(first, "_fields") else out
        return self._field(list(samples), None, torch)

    def _field(self, values: list[Any], key: Any, torch: Any) -> Any:
        tensors = [v if isinstance(v, torch.Tensor) else torch.as_tensor(v) for v in values]
        pad = self._pad_for(key)
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
        if isinstance(lengths, (str, bytes)) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in lengths):
            raise TypeError("lengths must be non-negative ints, one per sample (e.g. [len(s) for s in dataset])")
        self.lengths = list(lengths)
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


def masked_sum(values: Any, mask: Any, dim: int | None = None) -> Any:
    """Sum of ``values`` where ``mask`` is true, with a fixed output shape.

    Use instead of ``values[mask].sum()``, whose intermediate shape depends on
    the data (a recompilation, or a CPU fallback, every time the count changes).
    """
    import torch

    zeros = torch.zeros((), dtype=values.dtype, device=values.device)
    kept = torch.where(mask, values, zeros)
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: Any, mask: Any, dim: int | None = None) -> Any:
    """Mean of ``values`` where ``mask`` is true (0 where nothing is selected), fixed shape."""
    total = masked_sum(values, mask, dim)
    count = mask.to(values.dtype)
    count = count.sum() if dim is None else count.sum(dim=dim)
    return total / count.clamp(min=1)
