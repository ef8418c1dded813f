"""What packing a bucket depends on about the sender's tensors: `describe` says whether they
are where they were last sync, and a `Program` is what packing one bucket from them takes
(`buckets.Layout.program`), worked out once and reused while `describe` finds them unchanged.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

Copied = list[tuple[int, int, int]]
"""(offset in the data region, address, nbytes) of pieces `Layout.pack` copied byte for byte."""
PLAIN = (torch.Tensor, torch.nn.Parameter)
"""Tensor types whose memory is their storage as it stands (no subclass with its own layout)."""


def wire_bytes(src: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a tensor's memory is its values as they travel in `dtype`: that dtype, and no lazy
    conjugate or negation (whose memory holds other values)."""
    return src.dtype == dtype and not (src.is_conj() or src.is_neg())


Source = bytes
"""A fingerprint of the sender's tensors (`describe`): 16 bytes, whatever their count."""

_WORDS = 8192
"""Integers `describe` gathers before it hashes them (64 KiB, with the names of their tensors),
so it never holds a list as long as the tensors."""
_CODES: dict[object, int] = {}
"""Small integers standing for the dtypes and devices `describe` has met, in this process."""
_NUMBERS = itertools.count()
"""Where `_CODES` takes a new number: two threads meeting two new keys at once take two."""


def _code(key: object) -> int:
    code = _CODES.get(key)
    return _CODES.setdefault(key, next(_NUMBERS)) if code is None else code


def describe(named: Sequence[tuple[str, torch.Tensor]], last: Source | None = None) -> Source | None:
    """A fingerprint of all that packing the tensors' pieces depends on: per tensor its name,
    device, dtype, shape, strides, storage offset, address and lazy conjugate and negation bits.
    Equal fingerprints mean the same plan and the same copies from the same addresses. `last`
    itself when the tensors are as `last` describes them (so a sender can tell by identity);
    None when a tensor is not plain strided memory (then nothing is reused).

    The integers (and the names, their lengths among the integers) are hashed with xxh3-128 a
    few thousand at a time, the hash each bucket's bytes are checked with already, so a sender
    keeps 16 bytes however many tensors it sends, and describing them holds 64 KiB or so more
    while it runs. About 4 us a tensor."""
    hasher, words, names = xxhash.xxh3_128(), array("Q"), []

    def flush() -> None:
        hasher.update(words)
        hasher.update("".join(names).encode(errors="surrogatepass"))
        del words[:], names[:]

    for name, t in named:
        if type(t) not in PLAIN or t.layout != torch.strided:
            return None
        dtype, shape = t.dtype, t.size()
        bits = 2 * t.is_neg() + (t.is_conj() if dtype.is_complex else 0)  # only a complex tensor is a lazy conjugate
        words.extend((len(name), _code(t.device), _code(dtype), bits, t.data_ptr(), t.storage_offset(), len(shape),
                      *shape, *t.stride()))
        names.append(name)
        if len(words) >= _WORDS:
            flush()
    flush()
    found = hasher.digest()
    return last if found == last else found


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
