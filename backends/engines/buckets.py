"""Flat transfer buckets: packing by the plan both sides agree on, and unpacking.

A bucket is a 64-byte header (magic, version, bucket index, bytes used) and a data region
holding the tensors, each at a 64-byte aligned offset; a `slots.Slot` holds one bucket, its
header and data adjacent or apart. A tensor larger than a bucket
is split into chunks across consecutive buckets: a receiver that keeps every bucket in
`join`ed slots hands it out as one view of its chunks, back to back; one with two slots
(streamed) rejoins it in a copy. The plan (`plan.py`) comes from tensor metadata alone, so the
sender can pack bucket k+1 while bucket k is on the wire; a bucket's checksum covers its data
region and travels after it (`digests`, `pipeline`).

A bucket whose pieces already sit in one storage at the plan's offsets (a model flattened by
`flat.flatten_parameters`) need not be packed at all: its data region is a byte range of that
storage (`Layout.region`), which the group engines broadcast as it stands.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator, Sequence

import torch

from backends.engines.plan import ALIGN, Piece, Plan, collector_held, untracked_views
from backends.engines.slots import Slot
from backends.engines.sources import PLAIN, Copied, Program, Source, outside_storage, wire_bytes
from lifecycle.errors import EngineError


class Layout:
    """A plan bound to bucket slots: one typed view per piece, built when first needed and reused.

    Bucket k lives in slot k % len(slots) (two slots, or one per bucket, carved apart or
    `join`ed). Building the views
    costs a few microseconds per tensor; for thousands of tensors that is as much as copying
    their bytes, so both sides keep the layout while the plan and the slots stay the same.
    `raw` is the plan as it went over the wire: a receiver reuses the layout for the very same
    bytes, whoever formatted them.
    """

    def __init__(self, plan: Plan, slots: Sequence[Slot], *, raw: bytes = b"") -> None:
        self.plan = plan
        self.raw = raw
        self.slots = list(slots)
        self._views: list[list[torch.Tensor] | None] = [None] * len(plan.buckets)
        self._handed: list[list[tuple[str, torch.Tensor]] | None] = [None] * len(plan.buckets)
        self._partial: dict[int, torch.Tensor] = {}
        self._whole: dict[int, torch.Tensor | None] | None = None
        """Per tensor split across buckets, the one view of all its pieces where they lie back to
        back in one storage and no bucket shares a slot (`unpack`); None where they do not."""
        self._sources: Source | None = None
        self._programs: dict[int, Program] = {}
        self._bound = False
        """Whether `bind_sources` was called: until then nothing is kept (a caller that packs
        without binding may change its tensors between calls)."""

    @functools.cached_property
    def total_bytes(self) -> int:
        """Every tensor's bytes (`Plan.total_bytes`), summed once while the layout is kept."""
        return self.plan.total_bytes

    @property
    def views(self) -> list[list[torch.Tensor]]:
        return [self.bucket_views(k) for k in range(len(self.plan.buckets))]

    def bucket_views(self, k: int) -> list[torch.Tensor]:
        """One typed view per piece of bucket k, into its slot; built when first needed (a sender
        that only memmoves never needs them) and kept."""
        views = self._views[k]
        if views is None:
            data, typed = self.slots[k % len(self.slots)].data, {}
            if self.plan.used(k) > data.numel():  # as_strided is bounded by the storage, not by the region
                raise EngineError(f"bucket {k} takes {self.plan.used(k)} bytes and its slot's data region holds "
                                  f"{data.numel()}")
            with collector_held(), untracked_views():  # thousands of tensors kept: see `plan.collector_held`
                views = self._views[k] = [self._view(data, typed, p) for p in self.plan.buckets[k]]
        return views

    def _view(self, data: torch.Tensor, typed: dict[torch.dtype, torch.Tensor], p: Piece) -> torch.Tensor:
        """Piece p as a view of `data` (its slot's data region), shaped as its tensor when it is
        all of it. One `as_strided` a piece, from the region viewed as the piece's dtype (`typed`
        keeps one a dtype): pieces sit at multiples of `ALIGN`, so of any element size, inside
        the bucket's `used` bytes (`check_plan`), which the region holds (`bucket_views`)."""
        meta = self.plan.tensors[p.index]
        whole = typed.get(meta.dtype)
        if whole is None:
            whole = typed[meta.dtype] = data.view(meta.dtype)
        step = meta.dtype.itemsize
        at = whole.storage_offset() + p.offset // step
        if p.nbytes == meta.nbytes:
            strides = (_contiguous if len(meta.shape) <= 8 else _contiguous.__wrapped__)(meta.shape)
            return whole.as_strided(meta.shape, strides, at)
        return whole.as_strided((p.nbytes // step,), (1,), at)

    def fits(self, slots: Sequence[Slot]) -> bool:
        return len(slots) == len(self.slots) and all(a is b for a, b in zip(slots, self.slots))

    def bind_sources(self, sources: Source | None) -> None:
        """The sender's tensors of this sync as `describe` found them: what packing each bucket
        takes (`Program`) is worked out once and reused while they stay where they were. None
        (tensors `describe` cannot read) or tensors that moved forget it; with None, what this
        sync works out is kept for this sync only."""
        if sources is None or (sources is not self._sources and sources != self._sources):
            self._programs = {}
        self._sources = sources
        self._bound = True

    def program(self, k: int, tensors: Sequence[torch.Tensor]) -> Program:
        """What packing bucket k from `tensors` takes (`Program`): reused while the tensors are the
        ones `bind_sources` was given, worked out again otherwise."""
        program = self._programs.get(k)
        if program is None:
            region = self._find_region(k, tensors)  # bounded by its storage
            if region is None:
                self._check_held(k, tensors)
            host = self.slots[k % len(self.slots)].data.device.type == "cpu"
            program = Program(region, *(self._classify(k, tensors) if host and region is None else ([], [])))
            if self._bound:  # kept for this sync at least; beyond it only while `bind_sources` finds the same tensors
                self._programs[k] = program
        return program

    def _check_held(self, k: int, tensors: Sequence[torch.Tensor]) -> None:
        """`EngineError` naming a piece's tensor that reads bytes its storage no longer holds
        (`outside_storage`): copying it would read freed memory. Checked as a program is worked
        out, so again whenever `describe` finds a tensor moved or its storage of another size."""
        for p in self.plan.buckets[k]:
            if p.nbytes and (held := outside_storage(tensors[p.index])) is not None:
                raise EngineError(f"tensor {p.index} {self.plan.tensors[p.index].name[:80]!r} reads bytes outside its "
                                  f"storage, which holds {held}: its memory was freed or shrunk (resize_), as FSDP "
                                  "frees unsharded parameters; send it while it holds its values")

    def _classify(self, k: int, tensors: Sequence[torch.Tensor]) -> tuple[Copied, list[int]]:
        """Bucket k's pieces that host memory holds as their wire bytes, as memmoves (runs that are
        adjacent both in the sources and in the slot merged into one), and the positions of the
        rest, which torch copies (casts, strided tensors, other devices, lazy conjugates)."""
        moves: Copied = []
        rest: list[int] = []
        for i, p in enumerate(self.plan.buckets[k]):
            src, meta = self._source(p, tensors), self.plan.tensors[p.index]
            if src.device.type == "cpu" and wire_bytes(src, meta.dtype) and src.is_contiguous():
                if not p.nbytes:
                    continue
                address = src.data_ptr() + p.start
                if moves and moves[-1][0] + moves[-1][2] == p.offset and moves[-1][1] + moves[-1][2] == address:
                    offset, start, nbytes = moves[-1]
                    moves[-1] = (offset, start, nbytes + p.nbytes)
                else:
                    moves.append((p.offset, address, p.nbytes))
            else:
                rest.append(i)
        return moves, rest

    def pack(self, k: int, tensors: Sequence[torch.Tensor], copied: Copied | None = None) -> None:
        """Copy bucket k's pieces into its slot, casting to the wire dtype.

        `copied`, when given, gets (offset, address, nbytes) of each run copied byte for byte
        from host memory, in order: where a checksum of the packed bucket can read that run
        without the slot (`xxh3_packed`), so a slot scribbled on after packing fails it.
        A bucket with a `region` is copied with one memmove (one device copy) instead of one a
        piece. Otherwise, into a host slot, the pieces
        host memory holds as their wire bytes are memmoves, one per run of adjacent pieces (the
        bucket's `program`), and torch copies the rest: torch's `copy_` spreads every copy over
        its OpenMP threads, which on cores that also run the transport (gloo's threads, the
        receivers) costs more than it gains.
        """
        data = self.slots[k % len(self.slots)].data
        region = self.region(k, tensors)
        if data.device.type != "cpu":
            self._pack_on_device(k, tensors, data, region)
            return
        base = data.data_ptr()
        if region is not None:  # pieces in place in one storage (a flattened model): one copy, not one a piece
            moves, rest = [(0, region.data_ptr(), region.numel())], []
        else:
            program = self.program(k, tensors)
            moves, rest = program.moves, program.rest
        for offset, address, nbytes in moves:
            ctypes.memmove(base + offset, address, nbytes)
        if copied is not None:
            copied.extend(moves)
        for i in rest:
            self._copy_piece(k, i, tensors)

    def _source(self, p: Piece, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Piece p's tensor, refused (naming it) when its shape is not the plan's: it changed since
        the plan was made of it, and torch would broadcast it, or read past it by address."""
        src, meta = tensors[p.index], self.plan.tensors[p.index]
        if src.shape != meta.shape:
            raise EngineError(f"tensor {p.index} {meta.name[:80]!r} changed shape while it was being sent "
                              f"({list(meta.shape)} in the plan, {list(src.shape)} now): keep the weights as they "
                              "are until send_weights returns")
        return src

    def _copy_piece(self, k: int, i: int, tensors: Sequence[torch.Tensor]) -> None:
        """Piece i of bucket k copied by torch: cast, gathered from strides, or from another device."""
        p, dst = self.plan.buckets[k][i], self.bucket_views(k)[i]
        src = self._source(p, tensors).detach()
        if p.nbytes == self.plan.tensors[p.index].nbytes:
            dst.copy_(src)
        else:
            step = dst.element_size()
            dst.copy_(src.reshape(-1)[p.start // step:(p.start + p.nbytes) // step])

    def _pack_on_device(self, k: int, tensors: Sequence[torch.Tensor], data: torch.Tensor,
                        region: torch.Tensor | None) -> None:
        """A device slot (its data region `data`): a region in one device copy; else whole tensors
        already on the slot's device in a few kernel launches (`_foreach_copy_`), the rest one copy each."""
        if region is not None:
            data[:region.numel()].copy_(region)
            return
        batch: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for i, (p, dst) in enumerate(zip(self.plan.buckets[k], self.bucket_views(k))):
            src = self._source(p, tensors).detach()
            whole = p.nbytes == self.plan.tensors[p.index].nbytes
            if src.device == data.device and wire_bytes(src, dst.dtype) and whole:
                batch[0].append(dst)
                batch[1].append(src)
            else:
                self._copy_piece(k, i, tensors)
        if batch[0]:
            torch._foreach_copy_(*batch)

    def region(self, k: int, tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """Bucket k's data region `[0, plan.used(k))` as a uint8 view of its sources' storage,
        or None when it must be packed.

        It exists when every piece with bytes comes from a plain, strided, contiguous tensor of
        its wire dtype (no cast) on the slot's device, each piece sits at its plan offset from
        one common, `ALIGN`-aligned base, and one storage holds them all and the whole region.
        Then the region holds every piece where `pack` would copy it, so sending it sends the
        bucket without a copy; the bytes between pieces are whatever the storage holds there,
        which the receiver never reads as a tensor and both sides hash as they travel.
        Found with a handful of attribute reads per piece, once while the sources stay where they
        are (`bind_sources`); it never views past the storage's end (the aligned tail of the last
        piece must be inside it too), which is checked again at every use.
        """
        program = self.program(k, tensors)
        if program.region is None:
            return None
        used = self.plan.used(k)
        index, address = program.region
        storage = tensors[index].untyped_storage()
        start = _inside(storage, address, used)
        if start is None:  # another storage at the same addresses: looked for again, and a region
            self._programs.pop(k, None)  # found is inside its storage, so this goes one call deep
            return self.region(k, tensors)
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, start, (used,))

    def _find_region(self, k: int, tensors: Sequence[torch.Tensor]) -> tuple[int, int] | None:
        """(index of a tensor in it, address) of bucket k's region, if it has one: by address, not
        by offset in the storage, which `describe` does not read."""
        used = self.plan.used(k)
        device = self.slots[k % len(self.slots)].data.device
        base, storage, index = -1, None, -1
        for p in self.plan.buckets[k]:
            if not p.nbytes:
                continue  # an empty tensor has no bytes to place, wherever it lives
            src = tensors[p.index]
            if (type(src) not in PLAIN or src.layout != torch.strided or src.device != device
                    or not wire_bytes(src, self.plan.tensors[p.index].dtype) or not src.is_contiguous()):
                return None
            at = src.data_ptr() + p.start - p.offset
            if storage is None:
                base, storage, index = at, src.untyped_storage(), p.index
            elif at != base or src.untyped_storage().data_ptr() != storage.data_ptr():
                return None
        if storage is None or base % ALIGN or _inside(storage, base, used) is None:
            return None
        return index, base

    def reset(self) -> None:
        """Forget chunks of a tensor an aborted receive left half-joined."""
        self._partial.clear()

    def unpack(self, k: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Bucket k's tensors: views into its slot; a tensor split across buckets at its last
        piece, as one view where its pieces lie back to back (`join`), else rejoined in a copy."""
        handed = self._handed[k]
        if handed is None and all(p.nbytes == self.plan.tensors[p.index].nbytes for p in self.plan.buckets[k]):
            handed = self._handed[k] = [(self.plan.tensors[p.index].name, view)
                                        for p, view in zip(self.plan.buckets[k], self.bucket_views(k))]
        if handed is not None:  # no chunk in it: the same list every sync
            yield from handed
            return
        for p, view in zip(self.plan.buckets[k], self.bucket_views(k)):
            meta = self.plan.tensors[p.index]
            if p.nbytes == meta.nbytes:
                yield meta.name, view
                continue
            joined = self._whole_views().get(p.index)
            if joined is not None:  # one view of every piece: handed out at the last one, nothing copied
                if p.start + p.nbytes == meta.nbytes:
                    yield meta.name, joined
                continue
            whole = self._partial.get(p.index)
            if whole is None:
                whole = self._partial[p.index] = torch.empty(meta.shape, dtype=meta.dtype, device=view.device)
            step = meta.dtype.itemsize
            whole.view(-1)[p.start // step:(p.start + p.nbytes) // step].copy_(view)
            if p.start + p.nbytes == meta.nbytes:
                yield meta.name, self._partial.pop(p.index)

    def _whole_views(self) -> dict[int, torch.Tensor | None]:
        """`_whole`, worked out on first use: a split tensor is one view when every bucket has a
        slot of its own (none is refilled during the sync) and each piece starts in memory
        where the one before it ended, all in one storage."""
        if self._whole is None:
            pieces: dict[int, list[tuple[int, Piece]]] = {}
            for k, bucket in enumerate(self.plan.buckets):
                for p in bucket:
                    if p.nbytes != self.plan.tensors[p.index].nbytes:
                        pieces.setdefault(p.index, []).append((k, p))
            own = len(self.slots) >= len(self.plan.buckets)
            self._whole = {index: self._one_view(index, found) if own else None for index, found in pieces.items()}
        return self._whole

    def _one_view(self, index: int, pieces: list[tuple[int, Piece]]) -> torch.Tensor | None:
        datas = [self.slots[k].data for k, _ in pieces]
        storage = datas[0].untyped_storage()
        at = datas[0].data_ptr() + pieces[0][1].offset
        first = at
        for data, (_, p) in zip(datas, pieces):
            if data.untyped_storage().data_ptr() != storage.data_ptr() or data.data_ptr() + p.offset != at:
                return None
            at += p.nbytes
        meta = self.plan.tensors[index]
        offset = first - storage.data_ptr()
        if offset % meta.dtype.itemsize:
            return None
        view = torch.empty(0, dtype=meta.dtype, device=datas[0].device)
        return view.set_(storage, offset // meta.dtype.itemsize, meta.shape)

    def names(self, k: int) -> list[str]:
        return [self.plan.tensors[p.index].name for p in self.plan.buckets[k]]


def _inside(storage: torch.UntypedStorage, address: int, nbytes: int) -> int | None:
    """Where `nbytes` from `address` start in `storage`, None when it does not hold them all."""
    start = address - storage.data_ptr()
    return start if start >= 0 and start + nbytes <= storage.nbytes() else None


@functools.lru_cache(maxsize=1024)
def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape`, as torch gives them. `_view` keeps those of
    up to 8 dimensions, which a plan repeats; a longer shape, the sender's to choose, is worked
    out each time (`__wrapped__`)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


__all__ = ["Layout"]
