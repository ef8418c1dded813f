"""DCP's `.metadata` read through a restricted unpickler, for torch_dcp and for Megatron's sharded format.

A DCP checkpoint says where every tensor's bytes sit in one pickled `.metadata` file, and
`torch.distributed.checkpoint.FileSystemReader.read_metadata` reads it with a plain
`pickle.load`: a crafted file would run code as soon as it is read, whatever the manifest's
checksums say (they only prove the file is the one that was committed, and `load.verify: false`
or a `pre_load` folder outside any checkpoint skips them). `MetadataReader` is that reader with
the one pickle replaced: its unpickler hands out only the globals that metadata written by DCP
and by Megatron-Core's `dist_checkpointing` is made of, and refuses every other one before
anything in the file runs. Tensor data is unaffected: DCP reads it with `weights_only=True`.

The allow-list was found by saving real checkpoints (torch DCP: a plain module with bf16, fp16
and int64 tensors, its AdamW state, FSDP2 shards of two gloo ranks, a raw `dcp.save` with
non-tensor entries; Megatron-Core 0.16 `dist_checkpointing` of a GPT model and its optimizer
state at TP1 and TP2) and recording every `find_class` their pickles make. Protocol 2 and newer
pickles (DCP writes the default, 4) build dicts, lists, tuples and sets from opcodes, so no
builtin, `collections` or `copyreg` entry is needed and none is allowed.

What a find_class allow-list alone leaves open is closed after the load: a pickle that sets
attributes on what it is handed (BUILD onto an allowed class, a function standing in for one, or
a shared enum member, not onto an instance) is undone and refused (`backends.pickle_undo`),
and bytes that unpickle into allowed objects of the wrong shape (damage can do that) are
refused unless they form the Metadata structure DCP and Megatron read.

Well-formed Metadata can still describe a load that silently does less than it says (a tensor
part of which is in no chunk keeps its old values). So before DCP reads any data, every
tensor's chunks are proven to tile it exactly (`backends.dcp_tiling`), and every chunk to have
its bytes in a regular file of the folder, with a length a chunk of its size can have.
Checkpoints DCP and Megatron write pass (checked: one process; FSDP2 shards of three gloo ranks,
with the empty chunks FSDP2 records for a rank without a shard; Megatron-Core TP2, whose chunks
are spread over every rank's files).
"""

from __future__ import annotations

import dataclasses
import enum
import io
import math
import os
import pickle
import stat
from collections.abc import Callable
from functools import cache
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from torch.distributed.checkpoint import Metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from backends.dcp_reader import ChunkCheckingReader, transforms_problem
from backends.dcp_tiling import tiling_problem
from backends.dcp_keys import made_real, stand_ins
from backends.pickle_budget import check_budget
from backends.pickle_undo import unchanged
from lifecycle.boundary import kind, name_problem, read_bytes
from lifecycle.errors import CheckpointError, shorten

METADATA = ".metadata"
MAX_METADATA_BYTES = 512 * 1024**2
"""A `.metadata` larger than this is refused unread: the biggest real ones (a few hundred
bytes per tensor chunk, twice that for Megatron) stay far below it. The size alone does not
bound what unpickling may allocate (one byte can build a 216-byte set): `check_budget`
(`backends.pickle_budget`) bounds that, from the opcodes, before anything is unpickled."""

SAVE_OVERHEAD = 64 * 1024
"""The most bytes a data file may spend on one tensor chunk beyond the chunk's own. DCP (and
Megatron's writer) `torch.save` each chunk, cloned first when it is a view of a larger storage,
so the bytes are the chunk's plus zip records and the pickled shape: 1.5-1.7 KiB measured for 0
to 20 dimensions, with torch's 64-byte alignment. A chunk's entry shorter than its own bytes, or
longer than this above them, cannot be that chunk."""

MAX_PATH_CHARS = 4096
"""The longest `StorageMeta.checkpoint_id` path read (PATH_MAX). Parsing one keeps 3 bytes per
character and passes through 17 more (for "a/a/..."): bounded per call, so that what the opcode
walk charges a path call (8 bytes a character) covers it however often one string is reused."""

_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)
"""`torch.<name>` is allowed when it is one of these: values, never callables. Looked up in
`vars(torch)`, so a name cannot make torch's lazy `__getattr__` import a submodule."""


def _layout(name: object) -> torch.layout:
    """Stands in for `torch.serialization._get_layout`, which `torch.layout` pickles through."""
    value = vars(torch).get(name.removeprefix("torch.")) if isinstance(name, str) else None
    if not isinstance(value, torch.layout):
        raise pickle.UnpicklingError(f"{name!r} is not a torch layout")
    return value


def _path_parts(parts: tuple[object, ...]) -> list[str]:
    strings = [part for part in parts if isinstance(part, str)]
    if len(strings) < len(parts) or sum(map(len, strings)) > MAX_PATH_CHARS:
        raise pickle.UnpicklingError(f"a checkpoint_id path not of strings, or of more than {MAX_PATH_CHARS} characters")
    return strings


def _posix_path(*parts: object) -> PurePosixPath:
    return PurePosixPath(*_path_parts(parts))


def _windows_path(*parts: object) -> PureWindowsPath:
    return PureWindowsPath(*_path_parts(parts))


def _member(cls: type[enum.Enum]) -> Callable[[object], enum.Enum]:
    """An enum handed out as a function: REDUCE (how pickle makes a member) works, but no
    object can be given the class (`__class__` set by BUILD), whose hash is its `_name_`."""
    def member(value: object) -> enum.Enum:
        return cls(value)
    member.__qualname__ = cls.__qualname__
    return member


@cache
def _enums() -> tuple[type[enum.Enum], ...]:
    """The enums metadata holds members of, handed out by `_member`."""
    from torch.distributed.checkpoint import metadata, planner

    return metadata._MEM_FORMAT_ENCODING, planner.WriteItemType


@cache
def _allowed() -> dict[tuple[str, str], Any]:
    """(module, name) -> the object the unpickler hands out; built once, on first use."""
    from torch.distributed.checkpoint import filesystem, metadata, planner

    dcp_metadata = ["ChunkStorageMetadata", "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata",
                    "StorageMeta", "Metadata", "MetadataIndex"]
    allowed: dict[tuple[str, str], Any] = {(metadata.__name__, n): getattr(metadata, n) for n in dcp_metadata}
    allowed.update({(cls.__module__, cls.__qualname__): _member(cls) for cls in _enums()})
    allowed[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    # Megatron keeps every rank's save plan in the metadata (`all_local_plans`).
    for name in ("SavePlan", "WriteItem", "TensorWriteData", "BytesIOWriteData"):
        allowed[(planner.__name__, name)] = getattr(planner, name)
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = _layout
    # `StorageMeta.checkpoint_id` is the folder DCP wrote to, a label nothing reads back: it
    # becomes a pure path, which does no I/O and builds on any OS. Functions, not the classes,
    # so the pickle holds no pathlib class it could change. `pathlib._local`: Python 3.13.
    for module in ("pathlib", "pathlib._local"):
        allowed.update({(module, "PosixPath"): _posix_path, (module, "PurePosixPath"): _posix_path,
                        (module, "WindowsPath"): _windows_path, (module, "PureWindowsPath"): _windows_path})
    return allowed


@cache
def _classes() -> tuple[type, ...]:
    """The allowed classes."""
    return tuple(v for v in _allowed().values() if isinstance(v, type))


@cache
def _hashed() -> tuple[type, ...]:
    """The allowed classes hashed by value (frozen dataclasses), so by fields a pickle chooses:
    handed out as stand-ins (`backends.dcp_keys.stand_ins`)."""
    return tuple(c for c in _classes() if dataclasses.is_dataclass(c) and c.__hash__ is not None)


@cache
def _shared() -> tuple[tuple[str, object], ...]:
    """(name, object) of everything a pickle is handed and could BUILD onto (`backends.pickle_undo`):
    the allowed classes, the functions handed out, and the enum members those return (the shared
    members themselves: DCP compares them by identity). torch's values and torch.Size take no attributes."""
    handed = {id(v): (v.__qualname__, v) for v in _allowed().values()}
    return (*handed.values(), *((f"{cls.__qualname__}.{m._name_}", m) for cls in _enums() for m in cls))


class MetadataUnpickler(pickle.Unpickler):
    """Hands out only what DCP metadata is made of; any other global is a CheckpointError."""

    def __init__(self, file: io.BufferedIOBase, path: Path) -> None:
        super().__init__(file)
        self.path = path
        self.made: list[Any] = []
        self.stand_ins = stand_ins(_hashed(), self.made)

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed().get((module, name))
        found = self.stand_ins.get(found, found)
        if found is None and module == "torch" and isinstance(vars(torch).get(name), _TORCH_VALUES):
            found = vars(torch)[name]
        if found is None:
            raise CheckpointError(f"{self.path}: refused to unpickle {module}.{name}, which DCP metadata never "
                                  "holds; nothing in the file was run")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.path}: holds a persistent id, which DCP metadata never has")


def _read_bounded(path: Path) -> bytes:
    """The file's bytes through `lifecycle.boundary`, so a FIFO or device named `.metadata` is
    refused rather than waited on (links followed, as DCP's own open follows them). One over the
    bound is refused by its size before a byte is read."""
    size = _file_size(path)
    if isinstance(size, int) and size > MAX_METADATA_BYTES:
        raise CheckpointError(f"{path}: {size} bytes, more than the {MAX_METADATA_BYTES} a DCP .metadata may "
                              "have; not read")
    # The size found, not the bound: a read allocates its limit up front (512 MiB for every file).
    return read_bytes(path, size if isinstance(size, int) else MAX_METADATA_BYTES, "DCP metadata", follow=True)


def _entry_problem(entry: object) -> str | None:
    if isinstance(entry, BytesStorageMetadata):
        return None
    if not isinstance(entry, TensorStorageMetadata):
        return f"is a {type(entry).__name__}"
    props, size, chunks = (getattr(entry, name, None) for name in ("properties", "size", "chunks"))
    fields = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format,
              "requires_grad": bool, "pin_memory": bool}
    if not isinstance(props, TensorProperties) or not all(isinstance(getattr(props, name, None), wanted)
                                                          for name, wanted in fields.items()):
        return "has malformed tensor properties"
    if not isinstance(size, torch.Size) or not isinstance(chunks, list):
        return "has no size or no chunk list"
    for chunk in chunks:
        if not isinstance(chunk, ChunkStorageMetadata) or not all(
                isinstance(getattr(chunk, name, None), torch.Size) for name in ("offsets", "sizes")):
            return "has a malformed chunk"
    return None


def _storage_problem(index: object, info: object, folder: Path) -> str | None:
    if type(index) is not MetadataIndex or not isinstance(getattr(index, "fqn", None), str):
        return f"storage_data is keyed by a {type(index).__name__}"
    name = getattr(info, "relative_path", None)
    if not isinstance(info, _StorageInfo) or not isinstance(name, str):
        return f"storage_data[{index.fqn!r}] is a {type(info).__name__}"
    if (problem := name_problem(name)) is not None:
        return f"data file {shorten(name)} is not a file in {folder}: {problem}"
    if name.endswith(METADATA):
        return f"storage_data[{index.fqn!r}] names {name!r}, DCP metadata, as its data file"
    if not all(isinstance(getattr(info, field, None), int) for field in ("offset", "length")):
        return f"storage_data[{index.fqn!r}] has no integer offset and length"
    if info.offset < 0 or info.length < 0:
        return f"storage_data[{index.fqn!r}] has a negative offset or length"
    if (problem := transforms_problem(getattr(info, "transform_descriptors", None))) is not None:
        return f"storage_data[{index.fqn!r}] {problem}"
    return None


def _check(metadata: object, path: Path) -> Metadata:
    """Only allowed types can be in it, but not necessarily where DCP expects them: damaged
    bytes can still unpickle, so the structure DCP and Megatron read is checked here."""
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP Metadata")
    entries, storage = getattr(metadata, "state_dict_metadata", None), getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CheckpointError(f"{path}: DCP Metadata without its state_dict_metadata and storage_data dicts")
    if not isinstance(getattr(metadata, "storage_meta", None), (StorageMeta, type(None))):
        raise CheckpointError(f"{path}: storage_meta is a {type(metadata.storage_meta).__name__}")
    for key, entry in entries.items():
        if (problem := _entry_problem(entry) if isinstance(key, str) else "is not named by a str") is not None:
            raise CheckpointError(f"{path}: entry {key!r} {problem}")
    for index, info in storage.items():
        if (problem := _storage_problem(index, info, path.parent)) is not None:
            raise CheckpointError(f"{path}: {problem}")
    # Built while its keys were stand-ins hashed by identity; now hashed as DCP looks them up.
    metadata.storage_data = {index: info for index, info in storage.items()}
    return metadata


def _tiling_problem(entry: TensorStorageMetadata) -> str | None:
    """Why `entry`'s chunks do not cover each of its elements exactly once (`backends.dcp_tiling`)."""
    return tiling_problem(tuple(entry.size), ((chunk.offsets, chunk.sizes) for chunk in entry.chunks))


def _file_size(path: Path) -> int | str:
    """The size of the regular file at `path` (a link followed, as DCP's own open follows it),
    or why there is none. A stat only: a FIFO is named, never opened."""
    try:
        found = path.stat()
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    except ValueError as exc:  # a path Python refuses (a NUL byte): the names are checked first, still
        return f"cannot be read ({exc})"
    return found.st_size if stat.S_ISREG(found.st_mode) else f"is a {kind(found.st_mode)}, not a regular file"


def _data_problem(info: _StorageInfo, nbytes: int, folder: Path, sizes: dict[str, int | str]) -> str | None:
    """Why the bytes `info` points at cannot hold a chunk of `nbytes` bytes (0: any length).
    Stream transforms (compression) may make the stored bytes any length but zero."""
    name, offset, length = info.relative_path, info.offset, info.length
    low, high = (nbytes, nbytes + SAVE_OVERHEAD) if nbytes else (0, None)
    if nbytes and getattr(info, "transform_descriptors", None):
        low, high = 1, None
    if length < low or (high is not None and length > high):
        return (f"has {length} bytes of data in {name!r}, where a chunk of {nbytes} bytes takes "
                f"{low} to {high if high is not None else 'any number of'}")
    if name not in sizes:
        sizes[name] = _file_size(folder / name)
    size = sizes[name]
    if isinstance(size, str):
        return f"has its data in {folder / name}, which {size}"
    if offset + length > size:
        return f"has its data at bytes {offset} to {offset + length} of {folder / name}, which has {size}"
    return None


def _layout_problem(
    fqn: str, entry: Any, storage: dict[Any, Any], folder: Path, sizes: dict[str, int | str]
) -> str | None:
    if isinstance(entry, BytesStorageMetadata):
        info = storage.get(MetadataIndex(fqn))
        return "has no storage_data entry" if info is None else _data_problem(info, 0, folder, sizes)
    if (problem := _tiling_problem(entry)) is not None:
        return problem
    for chunk in entry.chunks:
        info = storage.get(MetadataIndex(fqn, chunk.offsets))
        if info is None:
            return f"has a chunk at offsets {list(chunk.offsets)} with no storage_data entry"
        nbytes = math.prod(chunk.sizes) * entry.properties.dtype.itemsize
        if (problem := _data_problem(info, nbytes, folder, sizes)) is not None:
            return f"has a chunk at offsets {list(chunk.offsets)} that {problem}"
    return None


def _check_layout(metadata: Metadata, path: Path) -> Metadata:
    """Every element of every tensor in exactly one chunk, every chunk and byte entry in a file
    of the folder: else DCP would load part of a tensor, or none of it, and report success."""
    sizes: dict[str, int | str] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if (problem := _layout_problem(fqn, entry, metadata.storage_data, path.parent, sizes)) is not None:
            what = "tensor" if isinstance(entry, TensorStorageMetadata) else "entry"
            raise CheckpointError(f"{path}: {what} {fqn!r} {problem}")
    return metadata


def read_metadata(path: Path) -> Metadata:
    """The `Metadata` in `path`; a CheckpointError naming `path` for anything else."""
    data = _read_bounded(path)
    check_budget(data, path)
    try:
        with unchanged(_shared(), path):
            unpickler = MetadataUnpickler(io.BytesIO(data), path)
            metadata = unpickler.load()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - damaged bytes make the unpickler raise nearly any type
        raise CheckpointError(f"{path}: unreadable DCP metadata (truncated or damaged?): "
                              f"{type(exc).__name__}: {exc}") from exc
    made_real(unpickler.made, unpickler.stand_ins, path, len(data))
    return _check_layout(_check(metadata, path), path)


class MetadataReader(ChunkCheckingReader):
    """DCP's file reader with `.metadata` read by `read_metadata` above, once per reader, and
    every chunk loaded checked against it (`backends.dcp_reader`).

    Reading once also means the metadata a caller checked is the very object DCP then plans
    the load with, not a second read of a file that may have changed in between.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self._read: dict[int | None, Metadata] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id:
            self._read.clear()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank not in self._read:
            self._read[rank] = read_metadata(Path(self._get_metadata_path(rank)))
        metadata = self._read[rank]
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
