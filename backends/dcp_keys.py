"""Hashing while a DCP `.metadata` is unpickled: the frozen DCP classes hashed by value are
handed out as stand-ins (MetadataIndex hashed by identity, so no key a pickle builds can collide
with another; the others unhashable), then, once the real hashes are counted and found few per
value, made the real classes. `backends.dcp_metadata`'s unpickler uses it; the opcode walk that
bounds memory is `backends.pickle_budget`'s. Only `storage_data` is rebuilt with the real keys
afterwards (`dcp_metadata`): DCP and Megatron key no other dict or set by MetadataIndex."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from lifecycle.errors import CheckpointError, shorten


HASH_SHARE_LIMIT = 32
"""The most MetadataIndex one hash may have. Real ones share none (64-bit hashes), but an
offset is integers, whose hashes can be chosen: thousands sharing one would make building
`storage_data` take quadratic time."""


class _Sealed(type):
    """The stand-ins' metaclass: a pickle cannot set their attributes (BUILD onto the class)."""

    def __setattr__(cls, name: str, value: object) -> None:
        raise pickle.UnpicklingError(f"tried to set {name} on {cls.__qualname__}")

    def __delattr__(cls, name: str) -> None:
        raise pickle.UnpicklingError(f"tried to delete {name} of {cls.__qualname__}")


def stand_ins(classes: tuple[type, ...], made: list[Any]) -> dict[type, type]:
    """For each of `classes` (hashed by value), a subclass the unpickler hands out instead, each
    instance recorded in `made`: MetadataIndex hashed by identity (no key a pickle builds can
    collide with another), the others not at all (never keys). `made_real` turns them into the
    real classes once the hashes they will have are counted."""
    def new(cls: type, *args: Any, **kwargs: Any) -> Any:
        made.append(obj := object.__new__(cls))
        return obj

    return {real: _Sealed(real.__name__, (real,), {
        "__slots__": (), "__new__": new, "__module__": __name__, "__qualname__": real.__qualname__,
        "__hash__": object.__hash__ if real is MetadataIndex else None}) for real in classes}


def made_real(made: list[Any], stand_ins: dict[type, type], path: Path, size: int) -> None:
    """Count the real hashes of the MetadataIndex made (linear: a dict of hash values, of which
    at most 8 share a bucket's hash) and refuse more than `HASH_SHARE_LIMIT` sharing one; hashing
    their offsets takes at most as many steps as the file has bytes. Then give each its class."""
    real_of = {stand_in: real for real, stand_in in stand_ins.items()}
    shared: dict[int, int] = {}
    dims = 0
    for obj in made:
        if type(obj) not in real_of:
            raise CheckpointError(f"{path}: an object changed its class to {type(obj).__qualname__} while loading")
        if type(obj) is not stand_ins.get(MetadataIndex):
            continue
        fqn, offset = vars(obj).get("fqn"), vars(obj).get("offset")
        if type(fqn) is not str or not (offset is None or type(offset) is torch.Size):
            raise CheckpointError(f"{path}: a MetadataIndex whose fqn is not a str or whose offset is not a torch.Size")
        dims += 0 if offset is None else len(offset)
        if dims > size:
            raise CheckpointError(f"{path}: MetadataIndex offsets of more dimensions than the file has bytes")
        value = MetadataIndex.__hash__(obj)
        if (count := shared.get(value, 0) + 1) > HASH_SHARE_LIMIT:
            raise CheckpointError(f"{path}: {count} MetadataIndex (of {shorten(fqn)}) share one hash: made to "
                                  "collide, so that building storage_data would take quadratic time")
        shared[value] = count
    for obj in made:
        obj.__class__ = real_of[type(obj)]
