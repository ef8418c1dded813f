"""DCP `.metadata` made to cost time rather than memory: keys that share one hash, oversized
paths, chunks saved through transforms nothing here can undo. Each is refused with a
CheckpointError naming the file; legitimate metadata of the same size still loads.

No test measures speed: each asserts the refusal of the crafted input (before anything is
unpickled, where the opcode walk can tell) and that the same shape with ordinary keys loads.
"""

from __future__ import annotations

import pickle
import struct
import tracemalloc
from pathlib import Path, PurePosixPath
from unittest import mock

import pytest
import torch
from torch.distributed.checkpoint import Metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta

from backends import dcp_metadata
from backends.dcp_metadata import MAX_PATH_CHARS, METADATA, read_metadata
from backends.dcp_keys import HASH_SHARE_LIMIT
from backends.torch_dcp import TorchDCPBackend
from lifecycle.errors import CheckpointError
from tests.backends.test_dcp_metadata import net, stack_global

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

_MERSENNE = (1 << 61) - 1  # int hashes are taken modulo this prime
_MASK = (1 << 64) - 1
_P1, _P2, _P5 = 11400714785074694791, 14029467366897019727, 2870177450012600261  # CPython's tuple hash


def _int(value: int) -> bytes:
    """LONG1 of `value`, as pickle writes any int."""
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data


def _dict_of(keys: list[bytes]) -> bytes:
    """A protocol 4 pickle of a dict whose keys are these pickled values, each mapped to None."""
    return b"\x80\x04}(" + b"".join(key + b"N" for key in keys) + b"u."


def _refused_unpickled(path: Path, data: bytes, needle: str) -> str:
    """Write `data` to `path`; reading it is refused naming the file, nothing unpickled."""
    path.write_bytes(data)
    with mock.patch.object(dcp_metadata.MetadataUnpickler, "load") as load, \
            pytest.raises(CheckpointError, match=f"{path}: ") as caught:
        read_metadata(path)
    assert not load.called
    assert needle in str(caught.value), caught.value
    return str(caught.value)


def _rotl31(x: int) -> int:
    return ((x << 31) | (x >> 33)) & _MASK


def _colliding_offsets(count: int) -> list[torch.Size]:
    """2-d offsets whose hashes are all equal: CPython's tuple hash solved for the second item."""
    def after_first(a: int) -> int:
        return _rotl31((_P5 + hash(a) * _P2) & _MASK) * _P1 & _MASK

    target = (after_first(0) + 1 * _P2) & _MASK  # what (0, 1) adds up to before its last rotation
    inverse = pow(_P2, -1, 1 << 64)
    found = []
    for a in range(1, 100 * count):
        second = (target - after_first(a)) * inverse & _MASK
        if second < _MERSENNE:  # a non-negative int below the prime hashes to itself
            found.append(torch.Size([a, second]))
            if len(found) == count:
                break
    assert len({hash(offset) for offset in found}) == 1
    return found


class _Index(MetadataIndex):
    """Pickled as a MetadataIndex, hashed by identity: so that writing colliding keys is not
    itself quadratic."""

    __hash__ = object.__hash__

    def __reduce_ex__(self, protocol: object) -> tuple[object, ...]:
        return MetadataIndex, (self.fqn,), dict(vars(self))  # made by a call, its fields set by BUILD


def _storage_only(offsets: list[torch.Size]) -> bytes:
    """Metadata with no tensors and one storage_data entry per offset (of one fqn)."""
    return pickle.dumps(Metadata(state_dict_metadata={}, storage_data={
        _Index("w", offset): _StorageInfo("__0_0.distcp", 0, 1) for offset in offsets}))


# ---------------------------------------------------------------- keys the opcode walk refuses


def test_a_dict_whose_wide_int_keys_all_hash_to_zero_is_refused_before_anything_is_unpickled(tmp_path: Path) -> None:
    """60000 such keys took 80 s to unpickle; within int64 at most 8 ints share a hash."""
    data = _dict_of([_int(k * _MERSENNE) for k in range(1, 2001)])
    _refused_unpickled(tmp_path / METADATA, data, "integer of 9 bytes")


NEVER_KEYS = {
    "int": b"K\x07", "int64": _int(3 * _MERSENNE), "float": b"G" + struct.pack(">d", 2.0),
    "tuple": b"K\x01K\x02\x86", "empty-tuple": b")", "none": b"N", "bool": b"\x88",
    "torch.Size": stack_global("torch", "Size")[2:-1] + b"](K\x01e\x85R",
}


@pytest.mark.parametrize("kind", NEVER_KEYS)
def test_dict_keys_of_kinds_dcp_never_uses_are_refused_before_anything_is_unpickled(tmp_path: Path, kind: str) -> None:
    key = NEVER_KEYS[kind]
    _refused_unpickled(tmp_path / METADATA, _dict_of([key]), "dict key or set item")


def test_set_items_of_kinds_dcp_never_uses_are_refused_before_anything_is_unpickled(tmp_path: Path) -> None:
    items = b"".join(b"K" + bytes([k]) for k in range(1, 100))
    _refused_unpickled(tmp_path / METADATA, b"\x80\x04(" + items + b"\x91.", "dict key or set item")
    _refused_unpickled(tmp_path / METADATA, b"\x80\x04\x8f(" + items + b"\x90.", "dict key or set item")


# ---------------------------------------------------------------- MetadataIndex keys


def test_metadata_index_keys_whose_offsets_share_one_hash_are_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / METADATA
    path.write_bytes(_storage_only(_colliding_offsets(4 * HASH_SHARE_LIMIT)))
    with pytest.raises(CheckpointError, match=f"{path}: {HASH_SHARE_LIMIT + 1} MetadataIndex .* share one hash"):
        read_metadata(path)


def test_as_many_metadata_index_keys_with_ordinary_offsets_load_as_real_keys_dcp_can_look_up(tmp_path: Path) -> None:
    path = tmp_path / METADATA
    offsets = [torch.Size([a, 0]) for a in range(4 * HASH_SHARE_LIMIT)]
    path.write_bytes(_storage_only(offsets))
    storage = read_metadata(path).storage_data
    assert len(storage) == len(offsets) and all(type(index) is MetadataIndex for index in storage)
    assert storage[MetadataIndex("w", torch.Size([5, 0]))].relative_path == "__0_0.distcp"


def test_real_metadata_reads_back_with_real_classes_and_lookups_that_work(tmp_path: Path) -> None:
    TorchDCPBackend().save_model(net(), tmp_path)
    metadata = read_metadata(tmp_path / METADATA)
    assert metadata == pickle.loads((tmp_path / METADATA).read_bytes())
    for fqn, entry in metadata.state_dict_metadata.items():
        for chunk in entry.chunks:
            assert type(metadata.storage_data[MetadataIndex(fqn, chunk.offsets)]) is _StorageInfo


def test_frozen_dcp_objects_other_than_metadata_index_are_refused_as_dict_keys(tmp_path: Path) -> None:
    """A WriteItem hashes its fields, which BUILD sets to anything: it is never a key."""
    item = stack_global("torch.distributed.checkpoint.planner", "WriteItem")[2:-1] + b")\x81}(\x8c\x05index"
    item += _int(5 * _MERSENNE >> 4) + b"ub"
    path = tmp_path / METADATA
    path.write_bytes(_dict_of([item]))
    with pytest.raises(CheckpointError, match=f"{path}: .*unhashable type: 'WriteItem'"):
        read_metadata(path)


def test_an_object_cannot_be_given_an_enum_class_whose_hash_its_name_would_steer(tmp_path: Path) -> None:
    """Enums are handed out as functions: BUILD cannot set one as an object's `__class__`."""
    obj = stack_global("torch.distributed.checkpoint.metadata", "BytesStorageMetadata")[2:-1] + b")\x81"
    obj += b"N}\x8c\x09__class__" + stack_global("torch.distributed.checkpoint.planner", "WriteItemType")[2:-1]
    obj += b"s\x86b}\x8c\x06_name_K\x01K\x02\x86sb"
    path = tmp_path / METADATA
    path.write_bytes(_dict_of([obj]))
    with pytest.raises(CheckpointError, match=f"{path}: .*__class__ must be set to a class"):
        read_metadata(path)


def test_a_pickle_cannot_change_the_metadata_index_it_is_handed(tmp_path: Path) -> None:
    path = tmp_path / METADATA
    state = b"N}\x8c\x08__hash__\x8c\x01xs\x86b."
    path.write_bytes(stack_global("torch.distributed.checkpoint.metadata", "MetadataIndex")[:-1] + state)
    before = MetadataIndex.__hash__
    with pytest.raises(CheckpointError, match=f"{path}: .*tried to set __hash__ on MetadataIndex"):
        read_metadata(path)
    assert MetadataIndex.__hash__ is before


# ---------------------------------------------------------------- checkpoint_id paths, and the read itself


def test_a_checkpoint_id_path_longer_than_path_max_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / METADATA
    path.write_bytes(pickle.dumps(PurePosixPath("ab/" * MAX_PATH_CHARS)))
    with pytest.raises(CheckpointError, match=f"{path}: .*more than {MAX_PATH_CHARS} characters"):
        read_metadata(path)


def test_metadata_with_an_ordinary_checkpoint_id_path_loads(tmp_path: Path) -> None:
    path = tmp_path / METADATA
    label = PurePosixPath("/checkpoints/run/global_step_7/actor/model")
    path.write_bytes(pickle.dumps(Metadata(state_dict_metadata={}, storage_data={}, storage_meta=StorageMeta(checkpoint_id=label))))
    assert read_metadata(path).storage_meta.checkpoint_id == label


def test_reading_small_metadata_allocates_about_its_size_not_the_512_mib_bound(tmp_path: Path) -> None:
    path = tmp_path / METADATA
    path.write_bytes(_storage_only([torch.Size([a, 0]) for a in range(100)]))
    tracemalloc.start()
    try:
        read_metadata(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024**2, peak


# ---------------------------------------------------------------- stream transforms


@pytest.mark.parametrize("descriptors", [["x"], ["stream.zstd/9"], [1], "stream.zstd/1"],
                         ids=["unknown", "unknown-version", "not-a-string", "not-a-list"])
def test_a_chunk_saved_through_transforms_dcp_cannot_undo_here_is_refused_naming_file_and_entry(
    tmp_path: Path, descriptors: object
) -> None:
    TorchDCPBackend().save_model(net(), tmp_path)
    path = tmp_path / METADATA
    metadata = pickle.loads(path.read_bytes())
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index].transform_descriptors = descriptors
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=f"{path}: storage_data\\[{index.fqn!r}\\] .*transforms"):
        read_metadata(path)
