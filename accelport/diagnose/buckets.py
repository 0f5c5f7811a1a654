"""Bucket lengths computed from the lengths a run actually saw.

Where ``recompilation`` or ``compile-limit`` blames a changing length, the fix
names buckets for *this* data: the fewest boundaries (at most :data:`MAX_BUCKETS`)
that keep the padding they add low (lengths of 64 and more rounded up to a multiple
of 8), with the compilations and the padding share they would give.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Suggestion", "suggest", "varying_dim", "lengths_from_signatures", "describe"]

MAX_BUCKETS = 6
#: Stop adding buckets once the padding they add is at most this share of the padded work.
TARGET_PADDING = 0.10
MULTIPLE = 8  # boundaries are multiples of this once lengths reach MULTIPLE_FROM
MULTIPLE_FROM = 64


@dataclass(frozen=True)
class Suggestion:
    buckets: tuple[int, ...]
    padding_share: float  # of the padded elements along that dimension, the share that is padding
    shapes_seen: int  # distinct lengths seen (a compilation each without buckets)

    @property
    def compilations(self) -> int:
        return len(self.buckets)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def suggest(lengths: Mapping[int, int], *, max_buckets: int = MAX_BUCKETS, target: float = TARGET_PADDING,
            multiple: int | None = None) -> Suggestion | None:
    """The smallest set of buckets (at most ``max_buckets``) whose padding is at most ``target``.

    ``lengths`` maps each length seen to how often it was seen. Where even
    ``max_buckets`` cannot reach the target, the best ``max_buckets`` are returned.
    None when there is nothing to bucket (no positive lengths).
    """
    real = [(int(n), int(c)) for n, c in lengths.items() if int(n) > 0 and int(c) > 0]
    if not real:
        return None
    if multiple is None:
        multiple = MULTIPLE if max(n for n, _ in real) >= MULTIPLE_FROM else 1
    # Boundaries are multiples of ``multiple``: lengths that round up to the same one group
    # together exactly, which keeps the search small (lengths up to 4096: 512 groups at most).
    grouped: dict[int, list[int]] = {}
    for length, count in real:
        g = grouped.setdefault(_round_up(length, multiple), [0, 0])
        g[0] += count
        g[1] += length * count
    xs = sorted(grouped)
    n = len(xs)
    total_real = sum(length * count for length, count in real)
    counts_before, sums_before = [0], [0]  # prefix sums: a group's padding in O(1)
    for x in xs:
        counts_before.append(counts_before[-1] + grouped[x][0])
        sums_before.append(sums_before[-1] + grouped[x][1])

    def padding_of(i: int, j: int) -> float:
        """Padding of lengths xs[i..j], all padded up to the bucket of xs[j]."""
        return float(xs[j] * (counts_before[j + 1] - counts_before[i])
                     - (sums_before[j + 1] - sums_before[i]))

    best: tuple[int, ...] | None = None
    best_pad = 1.0
    inf = float("inf")
    # cost[k][j]: least padding covering xs[0..j] with k buckets, the last ending at xs[j].
    prev = [padding_of(0, j) for j in range(n)]
    back: list[list[int]] = [[-1] * n]
    for k in range(1, max_buckets + 1):
        if k > 1:
            cur = [inf] * n
            arg = [-1] * n
            for j in range(n):
                for i in range(k - 2, j):
                    if prev[i] == inf:
                        continue
                    c = prev[i] + padding_of(i + 1, j)
                    if c < cur[j]:
                        cur[j], arg[j] = c, i
            prev = cur
            back.append(arg)
        if prev[n - 1] == inf:
            break
        # Walk back from the last length to the bucket boundaries.
        ends, j = [], n - 1
        for level in range(k - 1, -1, -1):
            ends.append(j)
            j = back[level][j]
        buckets = tuple(sorted(xs[e] for e in ends))
        padding = prev[n - 1]
        share = padding / (padding + total_real)
        best, best_pad = buckets, share
        if share <= target or k >= n:
            break
    assert best is not None
    return Suggestion(best, best_pad, len(real))


def varying_dim(signatures: Mapping[Any, int]) -> tuple[int, int] | None:
    """(input, dimension) whose size varies most across batch signatures, or None.

    ``signatures`` maps each batch signature (``((shape, dtype), ...)``) to its count.
    """
    sizes: dict[tuple[int, int], set[int]] = {}
    for sig in signatures:
        for i, item in enumerate(sig or ()):
            try:
                shape = tuple(item[0])
            except (TypeError, IndexError):
                continue
            for d, size in enumerate(shape):
                sizes.setdefault((i, d), set()).add(int(size))
    varying = [(len(v), key) for key, v in sizes.items() if len(v) > 1]
    if not varying:
        return None
    # The most distinct sizes wins; ties go to the later dimension (a sequence, not the batch).
    return max(varying, key=lambda t: (t[0], t[1][1], -t[1][0]))[1]


def lengths_from_signatures(signatures: Mapping[Any, int], where: tuple[int, int]) -> Counter[int]:
    """How often each size of input ``where[0]``, dimension ``where[1]``, was seen."""
    i, d = where
    out: Counter[int] = Counter()
    for sig, count in signatures.items():
        try:
            out[int(tuple(sig[i][0])[d])] += count
        except (TypeError, IndexError, ValueError):
            continue
    return out


def describe(s: Suggestion, now: int | None = None) -> str:
    """'ap.data.BucketCollate(buckets=(32, 64, 96, 128)): 4 compilations instead of 87, 11% padding'."""
    instead = now if now is not None and now > s.compilations else s.shapes_seen
    many = "compilation" if s.compilations == 1 else "compilations"
    return (f"ap.data.BucketCollate(buckets={s.buckets!r}): {s.compilations} {many} instead of {instead}, "
            f"{s.padding_share:.0%} padding")
