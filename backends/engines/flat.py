"""Parameters in one flat storage per dtype and device: the layout a send without packing needs.

A bucketed sync copies every byte twice on the sender: into a bucket, then onto the wire. When
a model's parameters sit in one storage, each at an `ALIGN`-aligned offset (the plan's
alignment), a slice of that storage could be a bucket's data region as it stands.
`flatten_parameters` makes that layout once, before training; `contiguous_layout` finds one
already there (made here, built by hand, or Megatron DDP's param buffers) by storage
arithmetic, without copying a byte. The group engines send a bucket of such a storage as it
stands (`buckets.Layout.region`), and a streamed receiver lands one straight in the rollout's
(`inplace`).

Flattening rehomes each parameter's `.data` and nothing else: every `nn.Parameter` stays the
same object, so `named_parameters()`, optimizers built before or after, tied weights and
autograd are untouched, and optimizers that step in place (AdamW: single-tensor, foreach and
fused) keep writing into the flat storage. Gradients and buffers stay where they are (a sync
packs a buffer as any tensor outside the storage); a buffer that shares storage with a
parameter stops the parameter from moving (it would be cut off from it).

A layout holds only while nothing gives a parameter new `.data`: `load_state_dict(...,
assign=True)`, `model.to(...)` to another dtype or device, `share_memory()`, FSDP wrapping.
Every check here reads the parameters as they are now, so after such a change they say "not
flat" (`contiguous_layout` returns None, `FlatLayout.describes` False), never a stale layout.
Flattening again rebuilds the layout: the parameters still in a storage flattening made move
out of it together (nothing else sees it).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from backends.engines.named import Model, Named, is_model, named_pairs
from backends.engines.plan import ALIGN, align
from backends.engines.sources import memory_problem, outside_storage, place
from lifecycle.errors import EngineError

GroupKey = tuple[torch.device, torch.dtype]
_MADE: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()
"""Storages `_rehome` made: only the parameters moved into them (and layouts) view them."""


class FlattenRefused(EngineError):
    """A parameter cannot be moved into a flat storage; the message names it and says why."""


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one parameter sits in its group's storage."""

    name: str
    """Its first name in `named_parameters()` order."""
    offset: int
    """Bytes from the start of the group's `flat`: a multiple of `ALIGN` in a layout flattening made."""
    nbytes: int
    numel: int
    shape: tuple[int, ...]
    aliases: tuple[str, ...] = ()
    """Its other names: a tied parameter (one object under several names) has one slot."""

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True, slots=True, eq=False)
class FlatGroup:
    """The parameters of one dtype on one device, all in one storage, in storage order."""

    dtype: torch.dtype
    device: torch.device
    flat: torch.Tensor
    """1-D, of `dtype`, from the storage's first byte to the last slot's end rounded up to
    `ALIGN` (or the storage's end): every slot is `flat`'s bytes [offset, end)."""
    slots: tuple[Slot, ...]

    @property
    def data(self) -> torch.Tensor:
        """`flat` as bytes: the region a bucket's data is a slice of."""
        return self.flat.view(torch.uint8)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.dtype.itemsize

    @property
    def aligned(self) -> bool:
        """Whether the storage and every slot start on `ALIGN` bytes, as a bucket region needs."""
        return self.flat.data_ptr() % ALIGN == 0 and all(s.offset % ALIGN == 0 for s in self.slots if s.nbytes)

    def tensor(self, slot: Slot) -> torch.Tensor:
        """The slot's parameter as a view of `flat`, with its shape."""
        step = self.dtype.itemsize
        return self.flat[slot.offset // step:slot.end // step].view(slot.shape)

    def _key(self) -> tuple[object, ...]:
        return (self.dtype, self.device, self.flat.data_ptr(), self.flat.numel(), self.slots)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FlatGroup):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """Every parameter's place: one `FlatGroup` per (device, dtype), in order of first appearance.

    It describes memory, it does not own the parameters: check `describes` before relying on it
    after anything could have replaced a parameter's `.data`.
    """

    groups: tuple[FlatGroup, ...]

    def find(self, name: str) -> tuple[FlatGroup, Slot]:
        """The group and slot of a parameter, by any of its names."""
        for group in self.groups:
            for slot in group.slots:
                if slot.name == name or name in slot.aliases:
                    return group, slot
        raise EngineError(f"parameter {name!r} is not in this flat layout")

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each slot's first name and its view of the flat storage, group by group in storage order."""
        for group in self.groups:
            for slot in group.slots:
                yield slot.name, group.tensor(slot)

    def describes(self, named_tensors: Named) -> bool:
        """Whether these tensors (a model's parameters, a state dict) sit exactly where the layout
        says, every slot named at least once: False after any of them got new `.data`. Cheap
        (pointer arithmetic): an engine holding a layout checks it before every sync."""
        places: dict[str, tuple[int, int]] = {}
        for g, group in enumerate(self.groups):
            for k, slot in enumerate(group.slots):
                for name in (slot.name, *slot.aliases):
                    places[name] = (g, k)
        seen: set[tuple[int, int]] = set()
        for name, tensor in named_pairs(named_tensors):
            place = places.get(name)
            if place is None:
                return False
            group = self.groups[place[0]]
            if not _sits_at(tensor, group, group.slots[place[1]]):
                return False
            seen.add(place)
        return len(seen) == sum(len(group.slots) for group in self.groups)

def flatten_parameters(model: Model) -> FlatLayout:
    """Move every parameter of `model` into one zero-padded storage per (device, dtype), in place.

    Each parameter keeps its object, name(s), shape, dtype, device, values and requires_grad;
    its `.data` becomes the view of its slot, at an `ALIGN`-aligned offset, in
    `named_parameters()` order; its strides become contiguous. A group whose parameters already
    sit in one storage at aligned offsets (flattened before, a single parameter in a storage of
    its own, Megatron DDP's padded param buffers) is left as it is: flattening a flat model copies nothing and
    returns an equal layout.

    Refused (`FlattenRefused`, naming the parameter) before anything moves: sparse, quantized,
    nested or tensor-subclass (DTensor) parameters, meta tensors, lazy parameters not yet
    initialized, dtypes a plan cannot carry, a storage freed or shrunk under a parameter, and a
    parameter that shares its storage with another tensor (a larger tensor it is a view of, a
    buffer, another parameter object) when its group must move: moving it would cut it off. A
    storage flattening made is not shared that way: its parameters move out of it together.
    """
    if not is_model(model):
        raise FlattenRefused(f"flatten_parameters takes a model (an nn.Module, or one that names its parameters and "
                             f"buffers as one does), not a {type(model).__name__}")
    entries = _entries(named_pairs(model), by_place=False)
    for entry in entries:
        _check_movable_kind(entry.name, entry.tensor)
    groups = _grouped(entries)
    owners = _storage_owners(entries, model)
    moves: list[tuple[GroupKey, list[_Entry]]] = []
    found: dict[GroupKey, FlatGroup] = {}
    for key, members in groups.items():
        group = _describe(key, members)
        if group is not None and group.aligned:
            found[key] = group
            continue
        movers = {f"parameter {entry.name!r}" for entry in members}
        for entry in members:
            _check_private(entry, owners, movers, key)
        moves.append((key, members))
    for key, members in moves:
        found[key] = _rehome(key, members)
    return FlatLayout(tuple(found[key] for key in groups))


def contiguous_layout(named_tensors: Named) -> FlatLayout | None:
    """The layout these tensors already have, if every (device, dtype) group sits in one storage.

    Found from data pointers and storage offsets alone, nothing copied: each tensor strided and
    contiguous, its group's tensors in one storage without overlapping (gaps allowed), slots in
    storage order whatever order the names came in. Tensors at the same place are one slot under
    several names (tied weights, in a state dict too). None when any group is spread over
    storages (a parameter whose `.data` was replaced), overlaps, or cannot be described (meta,
    sparse, subclass tensors). Whether offsets are aligned is the group's `aligned`. A value that
    is not a tensor (a state dict's `_extra_state`) is an `EngineError` naming its key.
    """
    entries = _entries(named_pairs(named_tensors), by_place=True)
    if any(kind_problem(entry.tensor) for entry in entries):
        return None
    groups: list[FlatGroup] = []
    for key, members in _grouped(entries).items():
        group = _describe(key, members)
        if group is None:
            return None
        groups.append(group)
    return FlatLayout(tuple(groups))


@dataclass(slots=True)
class _Entry:
    """One tensor to place, under its first name and any others it goes by."""

    name: str
    tensor: torch.Tensor
    aliases: list[str]


def _entries(named: Iterable[tuple[str, Any]], *, by_place: bool) -> list[_Entry]:
    """One entry per distinct tensor object; with `by_place` also one per place in memory, so a
    state dict's two detached views of one tied parameter are one entry."""
    out: dict[object, _Entry] = {}
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            raise EngineError(f"{name!r} is a {type(tensor).__name__}, not a tensor")
        key: object = id(tensor)
        if by_place and not kind_problem(tensor) and tensor.numel():
            key = place(tensor)
        entry = out.get(key)
        if entry is None:
            out[key] = _Entry(name, tensor, [])
        else:
            entry.aliases.append(name)
    return list(out.values())


def _grouped(entries: list[_Entry]) -> dict[GroupKey, list[_Entry]]:
    groups: dict[GroupKey, list[_Entry]] = {}
    for entry in entries:
        groups.setdefault((entry.tensor.device, entry.tensor.dtype), []).append(entry)
    return groups


def kind_problem(tensor: torch.Tensor) -> str | None:
    """Why a tensor has no place in a flat storage, or None."""
    data = tensor.data if isinstance(tensor, nn.Parameter) else tensor
    if type(data) is not torch.Tensor:
        return f"is a {type(data).__name__}, not a plain tensor (flatten the local tensors instead)"
    return memory_problem(tensor)


def _check_movable_kind(name: str, tensor: torch.Tensor) -> None:
    problem = kind_problem(tensor)
    if problem is None and (held := outside_storage(tensor)) is not None:
        problem = (f"reads past its storage's {held} bytes: freed or shrunk (untyped_storage().resize_, as FSDP "
                   "frees unsharded parameters); give it its memory back first")
    if problem is not None:
        raise FlattenRefused(f"cannot flatten parameter {name!r}: it {problem}")


def _storage_ptr(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _storage_owners(entries: list[_Entry], model: Model) -> dict[int, list[str]]:
    """Storage address -> the parameters and buffers in it (those with bytes only)."""
    owners: dict[int, list[str]] = {}
    for entry in entries:
        if entry.tensor.numel():
            owners.setdefault(_storage_ptr(entry.tensor), []).append(f"parameter {entry.name!r}")
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if isinstance(buffer, torch.Tensor) and kind_problem(buffer) is None and buffer.numel():
            owners.setdefault(_storage_ptr(buffer), []).append(f"buffer {name!r}")
    return owners


def _check_private(entry: _Entry, owners: dict[int, list[str]], movers: set[str], key: GroupKey) -> None:
    """Refuse to move a parameter whose storage anything else sees: it would be cut off from it.
    In a storage flattening made, only the parameters moving with it (`movers`) see it."""
    tensor = entry.tensor
    if not tensor.numel():
        return
    made = tensor.untyped_storage() in _MADE
    others = [o for o in owners[_storage_ptr(tensor)] if o not in (movers if made else {f"parameter {entry.name!r}"})]
    device, dtype = key
    why = (f"cannot flatten parameter {entry.name!r}: the {dtype} parameters on {device} do not "
           f"already sit in one storage at {ALIGN}-byte aligned offsets, so they must move, and ")
    if others:
        raise FlattenRefused(why + f"it shares its storage with {', '.join(others[:3])}; moving it would cut "
                             "the two apart")
    if made:
        return
    whole, own = tensor.untyped_storage().nbytes(), tensor.numel() * tensor.element_size()
    if own > whole:  # a stride of 0: moving it gives each element bytes of its own
        raise FlattenRefused(why + f"it is an expanded view whose {own} bytes repeat its storage's {whole}; clone it")
    if tensor.storage_offset() or whole != own:
        raise FlattenRefused(why + f"it is a view of a larger tensor that is not a parameter ({own} of its "
                             f"storage's {whole} bytes); moving it would cut it off from that tensor. "
                             "Clone it first (p.data = p.data.clone()) if nothing else should see it")


def _describe(key: GroupKey, members: list[_Entry]) -> FlatGroup | None:
    """The group as it sits, if its tensors share one storage, each contiguous, none overlapping.

    A tensor with no elements has no bytes to place: it counts as in the storage wherever it is
    (at offset 0 when its own storage is another one)."""
    device, dtype = key
    sized = [e for e in members if e.tensor.numel()]
    storage = (sized or members)[0].tensor.untyped_storage()
    step = dtype.itemsize
    slots: list[Slot] = []
    for entry in members:
        tensor = entry.tensor
        inside = _storage_ptr(tensor) == storage.data_ptr()
        if tensor.numel() and not (inside and tensor.is_contiguous() and outside_storage(tensor) is None):
            return None
        slots.append(_slot(entry, tensor.storage_offset() * step if inside else 0))
    slots.sort(key=lambda s: (s.offset, s.nbytes))
    end = 0
    for slot in slots:
        if slot.offset < end and slot.nbytes:
            return None
        end = max(end, slot.end)
    span = min(align(end), storage.nbytes()) // step
    flat = torch.empty(0, dtype=dtype, device=device).set_(storage, 0, (span,))
    return FlatGroup(dtype, device, flat, tuple(slots))


def _slot(entry: _Entry, offset: int) -> Slot:
    tensor = entry.tensor
    return Slot(entry.name, offset, tensor.numel() * tensor.element_size(), tensor.numel(),
                tuple(tensor.shape), tuple(entry.aliases))


def _rehome(key: GroupKey, members: list[_Entry]) -> FlatGroup:
    """Copy the group into one new zeroed storage and point each parameter's `.data` at its slot.

    Padding is zeroed so that bytes a bucket carries between slots are the same every sync."""
    device, dtype = key
    step = dtype.itemsize
    slots: list[Slot] = []
    end = 0
    for entry in members:
        slot = _slot(entry, align(end))
        slots.append(slot)
        end = slot.end
    flat = torch.zeros(align(end) // step, dtype=dtype, device=device)
    _MADE.add(flat.untyped_storage())
    group = FlatGroup(dtype, device, flat, tuple(slots))
    with torch.no_grad():
        for entry, slot in zip(members, slots):
            view = group.tensor(slot)
            view.copy_(entry.tensor)
            entry.tensor.data = view
    return group


def _sits_at(tensor: Any, group: FlatGroup, slot: Slot) -> bool:
    if not isinstance(tensor, torch.Tensor) or kind_problem(tensor) is not None:
        return False
    if (tensor.device, tensor.dtype, tuple(tensor.shape)) != (group.device, group.dtype, slot.shape):
        return False
    if not tensor.numel():
        return True
    return (tensor.is_contiguous() and _storage_ptr(tensor) == group.flat.untyped_storage().data_ptr()
            and tensor.storage_offset() * group.dtype.itemsize == slot.offset)
