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
attributes on an allowed class (BUILD onto the class, not an instance) is undone and refused,
and bytes that unpickle into allowed objects of the wrong shape (damage can do that) are
refused unless they form the Metadata structure DCP and Megatron read.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, Metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from lifecycle.errors import CheckpointError

METADATA = ".metadata"
MAX_METADATA_BYTES = 512 * 1024**2
"""A `.metadata` larger than this is refused unread: the biggest real ones (a few hundred
bytes per tensor chunk, twice that for Megatron) stay far below it, and an unpickler given a
huge file could exhaust memory before it finds anything to refuse."""

_GONE = object()
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)
"""`torch.<name>` is allowed when it is one of these: values, never callables. Looked up in
`vars(torch)`, so a name cannot make torch's lazy `__getattr__` import a submodule."""


def _layout(name: object) -> torch.layout:
    """Stands in for `torch.serialization._get_layout`, which `torch.layout` pickles through."""
    value = vars(torch).get(name.removeprefix("torch.")) if isinstance(name, str) else None
    if not isinstance(value, torch.layout):
        raise pickle.UnpicklingError(f"{name!r} is not a torch layout")
    return value


def _posix_path(*parts: str) -> PurePosixPath:
    return PurePosixPath(*parts)


def _windows_path(*parts: str) -> PureWindowsPath:
    return PureWindowsPath(*parts)


@cache
def _allowed() -> dict[tuple[str, str], Any]:
    """(module, name) -> the object the unpickler hands out; built once, on first use."""
    from torch.distributed.checkpoint import filesystem, metadata, planner

    dcp_metadata = ["ChunkStorageMetadata", "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata",
                    "StorageMeta", "Metadata", "MetadataIndex", "_MEM_FORMAT_ENCODING"]
    allowed: dict[tuple[str, str], Any] = {(metadata.__name__, n): getattr(metadata, n) for n in dcp_metadata}
    allowed[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    # Megatron keeps every rank's save plan in the metadata (`all_local_plans`).
    for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"):
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
    """The allowed classes, whose attributes a pickle's BUILD could try to set."""
    return tuple(v for v in _allowed().values() if isinstance(v, type))


@contextmanager
def _classes_unchanged(path: Path) -> Iterator[None]:
    """A pickle can BUILD onto a class it was handed, not only onto an instance, and so set
    attributes of DCP's classes for the whole process. That is undone and refused here."""
    before = [(cls, dict(vars(cls))) for cls in _classes()]
    try:
        yield
    finally:
        changed = []
        for cls, attrs in before:
            now = dict(vars(cls))
            for name in now.keys() - attrs.keys():
                delattr(cls, name)
                changed.append(f"{cls.__qualname__}.{name}")
            for name, value in attrs.items():
                if now.get(name, _GONE) is not value:
                    setattr(cls, name, value)
                    changed.append(f"{cls.__qualname__}.{name}")
        if changed:
            raise CheckpointError(f"{path}: tried to change {', '.join(sorted(changed))} of DCP's classes; "
                                  "undone and refused")


class MetadataUnpickler(pickle.Unpickler):
    """Hands out only what DCP metadata is made of; any other global is a CheckpointError."""

    def __init__(self, file: io.BufferedIOBase, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed().get((module, name))
        if found is None and module == "torch" and isinstance(vars(torch).get(name), _TORCH_VALUES):
            found = vars(torch)[name]
        if found is None:
            raise CheckpointError(f"{self.path}: refused to unpickle {module}.{name}, which DCP metadata never "
                                  "holds; nothing in the file was run")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.path}: holds a persistent id, which DCP metadata never has")


def _read_bounded(path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(MAX_METADATA_BYTES + 1) if size <= MAX_METADATA_BYTES else b""
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read DCP metadata: {exc}") from exc
    if size > MAX_METADATA_BYTES or len(data) > MAX_METADATA_BYTES:
        raise CheckpointError(f"{path}: {max(size, len(data))} bytes, more than the {MAX_METADATA_BYTES} "
                              "a DCP .metadata may have; not read")
    return data


def _entry_problem(entry: object) -> str | None:
    if isinstance(entry, BytesStorageMetadata):
        return None
    if not isinstance(entry, TensorStorageMetadata):
        return f"is a {type(entry).__name__}"
    props, size, chunks = (getattr(entry, name, None) for name in ("properties", "size", "chunks"))
    fields = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format,
              "requires_grad": bool, "pin_memory": bool}
    if not isinstance(props, TensorProperties) or not all(isinstance(getattr(props, name, None), kind)
                                                          for name, kind in fields.items()):
        return "has malformed tensor properties"
    if not isinstance(size, torch.Size) or not isinstance(chunks, list):
        return "has no size or no chunk list"
    for chunk in chunks:
        if not isinstance(chunk, ChunkStorageMetadata) or not all(
                isinstance(getattr(chunk, name, None), torch.Size) for name in ("offsets", "sizes")):
            return "has a malformed chunk"
    return None


def _storage_problem(index: object, info: object, folder: Path) -> str | None:
    if not isinstance(index, MetadataIndex) or not isinstance(getattr(index, "fqn", None), str):
        return f"storage_data is keyed by a {type(index).__name__}"
    name = getattr(info, "relative_path", None)
    if not isinstance(info, _StorageInfo) or not isinstance(name, str):
        return f"storage_data[{index.fqn!r}] is a {type(info).__name__}"
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        return f"data file {name!r} is not a file in {folder}"
    if not all(isinstance(getattr(info, field, None), int) for field in ("offset", "length")):
        return f"storage_data[{index.fqn!r}] has no integer offset and length"
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
    return metadata


def read_metadata(path: Path) -> Metadata:
    """The `Metadata` in `path`; a CheckpointError naming `path` for anything else."""
    data = _read_bounded(path)
    try:
        with _classes_unchanged(path):
            metadata = MetadataUnpickler(io.BytesIO(data), path).load()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - damaged bytes make the unpickler raise nearly any type
        raise CheckpointError(f"{path}: unreadable DCP metadata (truncated or damaged?): "
                              f"{type(exc).__name__}: {exc}") from exc
    return _check(metadata, path)


class MetadataReader(FileSystemReader):
    """DCP's file reader with `.metadata` read by `read_metadata` above, once per reader.

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
