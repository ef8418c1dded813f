"""Whether a tensor's chunks cover each of its elements exactly once: the geometry behind
`backends.dcp_metadata`'s layout check, in plain integers (no torch, no DCP types).

DCP copies into each tensor only what its chunks cover, so a tensor with no chunks, or with
chunks that leave part of it out, keeps the values it had before the load and nothing fails.
Chunks in bounds, disjoint and adding up to the tensor's number of elements cover it all;
empty chunks cover nothing. Disjointness is proven by cutting the chunks into slabs that no
two share (see `_overlap`), so the grids DTensor, FSDP2 and Megatron's TP/PP write are checked
in one cut per sharded dimension, not pair by pair.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from itertools import combinations
from typing import NamedTuple

_PAIRWISE = 8
"""Chunks that no cut along a dimension separates are compared pair by pair up to this many."""


class _Box(NamedTuple):
    """The elements `start[d] <= i[d] < end[d]` of a tensor: one non-empty chunk."""

    start: tuple[int, ...]
    end: tuple[int, ...]


def _outside(offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...]) -> str | None:
    if len(offsets) != len(shape) or len(sizes) != len(shape):
        return f"has {len(offsets)} offsets and {len(sizes)} sizes for a {len(shape)}-D tensor"
    if min(offsets + sizes, default=0) < 0:
        return "has a negative offset or size"
    if any(o + n > m for o, n, m in zip(offsets, sizes, shape)):
        return f"reaches past the tensor's size {list(shape)}"
    return None


def _slabs(boxes: list[_Box], dim: int) -> list[list[_Box]]:
    """`boxes` cut along `dim` into groups whose extents there are disjoint from each other's."""
    slabs: list[list[_Box]] = []
    end = -1
    for box in sorted(boxes, key=lambda b: b.start[dim]):
        if box.start[dim] >= end:
            slabs.append([])
        slabs[-1].append(box)
        end = max(end, box.end[dim])
    return slabs


def _overlap(boxes: list[_Box], cuts: int) -> str | None:
    """None once no two boxes are proven to share an element; else why not.

    Boxes in different slabs of one dimension cannot meet, so the boxes are cut into slabs,
    each slab again along some dimension, up to `cuts` times, and compared pairwise once few are
    left: O(cuts * dims * n log n). Boxes that no cut separates are never taken as disjoint unchecked."""
    if len(boxes) <= _PAIRWISE:
        for a, b in combinations(boxes, 2):
            if all(a.start[d] < b.end[d] and b.start[d] < a.end[d] for d in range(len(a.start))):
                return f"has chunks at offsets {list(a.start)} and {list(b.start)} that overlap"
        return None
    for dim in range(len(boxes[0].start) if cuts > 0 else 0):
        if len(slabs := _slabs(boxes, dim)) > 1:
            return next((problem for slab in slabs if (problem := _overlap(slab, cuts - 1)) is not None), None)
    return f"has {len(boxes)} chunks that overlap, or are cut too irregularly to prove they do not"


def tiling_problem(shape: Sequence[int], chunks: Iterable[tuple[Sequence[int], Sequence[int]]]) -> str | None:
    """Why the chunks, (offsets, sizes) pairs, do not cover each element of a tensor of `shape`
    exactly once, or None when they do."""
    shape = tuple(shape)
    if min(shape, default=0) < 0:
        return f"has a negative size {list(shape)}"
    boxes, total = [], 0
    for chunk_offsets, chunk_sizes in chunks:
        offsets, sizes = tuple(chunk_offsets), tuple(chunk_sizes)
        if (problem := _outside(offsets, sizes, shape)) is not None:
            return f"has a chunk at offsets {list(offsets)} with sizes {list(sizes)} that {problem}"
        volume = math.prod(sizes)
        total += volume
        if volume:
            boxes.append(_Box(offsets, tuple(o + n for o, n in zip(offsets, sizes))))
    numel = math.prod(shape)
    if total != numel:
        return (f"has chunks of {total} elements in all for its {numel} (size {list(shape)}): "
                f"{'part of it is in no chunk' if total < numel else 'chunks overlap'}")
    return _overlap(boxes, cuts=2 * len(shape) + 1)
