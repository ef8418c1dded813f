"""Where a bucket lives: a `Slot`, its 64-byte header and its data region, adjacent (a buffer
of `slot_bytes`) or apart (`join`), and the header's format.

The header holds the magic of the bucket format, the sync's version, the bucket's index and
the bytes it uses, so a receiver tells a bucket of another sync or another place from the
one it waits for before it hashes or hands out any of it (`receiver`). `join` carves one slot per
bucket from one buffer, every bucket's data back to back and the headers after them, so a
tensor split across buckets lies whole in the buffer (`buckets.Layout.unpack`).

Every buffer slots are carved from is marked as the engine's memory (`mark`), refilled by later
buckets or syncs, unless it holds a flip weight set (`sets.WeightSets.hold`), whose views a
rollout may keep: `refilled` tells the two apart for any view of them, however it was handed on.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from backends.engines.plan import align

HEADER_BYTES = 64
SLOTS = 2
"""The sender's bucket slots, and a streamed receiver's: bucket k lives in slot k % 2."""
MAGIC = 0x4C43_5753_0000_0002
"""Format 2: the checksum travels after the bucket, not in its header (format 1)."""
_MASK = (1 << 64) - 1
_MARKS: weakref.WeakKeyDictionary[torch.UntypedStorage, bool] = weakref.WeakKeyDictionary()
"""Storages of engine buffers, by whether a rollout may keep views of them (a flip weight set);
an entry goes with its storage (torch keeps one storage object while the memory lives)."""


def mark(buffer: torch.Tensor, *, keepable: bool = False) -> None:
    """Mark a buffer's storage as engine memory: refilled by later buckets or syncs (slots,
    staging), unless `keepable` (a flip weight set), which no carving of it undoes."""
    storage = buffer.untyped_storage()
    if keepable:
        _MARKS[storage] = True
    else:
        _MARKS.setdefault(storage, False)


def refilled(tensor: torch.Tensor) -> bool:
    """Whether a tensor views engine memory that later buckets or syncs overwrite (not a flip
    weight set): a rollout cannot keep it as its weights (`adopt_weights`)."""
    if type(tensor).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        return False  # a subclass with no memory of its own (a DTensor): no engine hands one out
    return _MARKS.get(tensor.untyped_storage()) is False


def slot_bytes(data_bytes: int) -> int:
    """A slot's size for `data_bytes` of bucket data: the header, then the data aligned."""
    return HEADER_BYTES + align(data_bytes)


class Slot(NamedTuple):
    """Where one bucket lives: its header and its data region, adjacent or apart."""

    head: torch.Tensor
    """`HEADER_BYTES` bytes."""
    data: torch.Tensor
    """The data region, at least as long as the bucket's data."""

    @property
    def nbytes(self) -> int:
        return self.head.numel() + self.data.numel()


def as_slots(buffers: Iterable[torch.Tensor]) -> list[Slot]:
    """Each buffer one slot: its header, then its data (`slot_bytes`)."""
    slots = []
    for buffer in buffers:
        mark(buffer)
        slots.append(Slot(buffer[:HEADER_BYTES], buffer[HEADER_BYTES:]))
    return slots


def joined_bytes(sizes: Sequence[int]) -> int:
    """The bytes `join` carves buckets of `sizes` data bytes from."""
    return sum(align(size) for size in sizes) + HEADER_BYTES * len(sizes)


def join(sizes: Sequence[int], buffer: torch.Tensor) -> list[Slot]:
    """One slot per bucket of `sizes` data bytes, carved from one buffer (`joined_bytes`): every
    bucket's data back to back, then the headers. A tensor split across buckets then lies whole
    in the buffer, so a receiver that keeps every bucket hands it out as one view
    (`Layout.unpack`)."""
    mark(buffer)
    slots, at, heads = [], 0, sum(align(size) for size in sizes)
    for k, size in enumerate(sizes):
        head = buffer[heads + k * HEADER_BYTES:heads + (k + 1) * HEADER_BYTES]
        slots.append(Slot(head, buffer[at:at + align(size)]))
        at += align(size)
    return slots


def write_header(head: torch.Tensor, version: int, k: int, used: int) -> None:
    """Fill a slot's header (`Slot.head`)."""
    words = [MAGIC, version, k, used, 0, 0, 0, 0]
    signed = [w - (1 << 64) if w >= 1 << 63 else w for w in words]
    head.copy_(torch.tensor(signed, dtype=torch.int64).view(torch.uint8))


def read_header(head: torch.Tensor) -> tuple[int, int, int, int]:
    """(magic, version, bucket index, bytes used) of a slot's header, as unsigned integers."""
    words = [w & _MASK for w in head.view(torch.int64).tolist()]
    return words[0], words[1], words[2], words[3]


__all__ = ["HEADER_BYTES", "MAGIC", "SLOTS", "Slot", "as_slots", "join", "joined_bytes", "mark", "read_header",
           "refilled", "slot_bytes", "write_header"]
