"""What packing a bucket depends on about the sender's tensors: `describe` says whether they
are where they were last sync, and a `Program` is what packing one bucket from them takes
(`buckets.Layout.program`), worked out once and reused while `describe` finds them unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Copied = list[tuple[int, int, int]]
"""(offset in the data region, address, nbytes) of pieces `Layout.pack` copied byte for byte."""
PLAIN = (torch.Tensor, torch.nn.Parameter)
"""Tensor types whose memory is their storage as it stands (no subclass with its own layout)."""


def wire_bytes(src: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a tensor's memory is its values as they travel in `dtype`: that dtype, and no lazy
    conjugate or negation (whose memory holds other values)."""
    return src.dtype == dtype and not (src.is_conj() or src.is_neg())


Source = tuple[object, ...]
"""What packing a bucket depends on about one sender tensor (`describe`)."""


def describe(named: Sequence[tuple[str, torch.Tensor]], last: list[Source] | None = None) -> list[Source] | None:
    """Per tensor, its name and all that packing its pieces depends on: type, device, dtype,
    shape, strides, storage offset, address and lazy conjugate and negation bits. Equal lists
    mean the same plan and the same copies from the same addresses. `last` itself when every
    tensor is as `last` describes it (so a sender holds one description, not two); None when
    a tensor is not plain strided memory (then nothing is reused). About 4 us a tensor."""
    if any(type(t) not in PLAIN or t.layout != torch.strided for _, t in named):
        return None
    out: list[Source] = []
    same = last is not None and len(last) == len(named)
    for i, (name, t) in enumerate(named):
        entry = (name, t.device, t.dtype, t.shape, t.stride(), t.storage_offset(), t.data_ptr(), t.is_conj(),
                 t.is_neg())
        if same:
            if entry == last[i]:  # type: ignore[index]
                continue
            same, out = False, list(last[:i])  # type: ignore[index]
        out.append(entry)
    return last if same else out


@dataclass(frozen=True)
class Program:
    """What packing one bucket takes, worked out from its tensors (`Layout.program`)."""

    region: tuple[int, int] | None
    """(index of a tensor, byte offset in its storage) where the bucket's data region sits in
    one storage as it would be packed (`Layout.region`); None when it must be packed."""
    moves: Copied
    """Host memmoves into a host slot: (offset in the data region, address, nbytes), adjacent
    pieces merged into one run."""
    rest: list[int]
    """Positions in the bucket of the pieces torch copies (`Layout._copy_piece`)."""


__all__ = ["PLAIN", "Copied", "Program", "Source", "describe", "wire_bytes"]
