"""DCP's file reader, with every chunk it loads held to the dtype and shape `.metadata` gives it.

`FileSystemReader.read_data` `torch.load`s a chunk's bytes, narrows the tensor to the part the
load asks for and `copy_`s it into the destination. Nothing compares what was loaded with the
metadata: a chunk stored as float64 where `.metadata` says float32 was cast on the way (values x3
loaded as 3.0), one stored twice as long was narrowed to its first half, both without a word.
`ChunkCheckingReader.read_data` is DCP's loop as torch 2.13 has it (one stream per data file,
stream transforms where this torch has them) with one step added: a loaded chunk that is not a
tensor of its entry's dtype and exactly its chunk's sizes is a CheckpointError naming the data
file, the tensor and both dtypes and shapes, raised before anything is copied. DCP has no hook
between its `torch.load` and its `copy_`, hence the loop written out here: a torch upgrade that
changes `FileSystemReader.read_data` should be compared with it.
"""

from __future__ import annotations

import functools
import io
from typing import IO, Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader, Metadata
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.futures import Future

from lifecycle.errors import CheckpointError, shorten

_Chunk = tuple[torch.dtype, torch.Size]
"""What `.metadata` says one chunk's stored tensor is: its entry's dtype, the chunk's sizes."""


def _chunks(metadata: Metadata) -> dict[tuple[str, tuple[int, ...]], _Chunk]:
    """(fqn, chunk offsets) -> the dtype and sizes the chunk stored there must have."""
    return {(fqn, tuple(chunk.offsets)): (entry.properties.dtype, chunk.sizes)
            for fqn, entry in metadata.state_dict_metadata.items() if isinstance(entry, TensorStorageMetadata)
            for chunk in entry.chunks}


def transforms_problem(descriptors: object) -> str | None:
    """Why this reader could not undo the stream transforms (compression) a chunk was saved
    through; `backends.dcp_metadata` asks it of every chunk before any is read."""
    if descriptors is None:
        return None
    if not isinstance(descriptors, list | tuple) or not all(type(d) is str for d in descriptors):
        return "has stream transforms that are not a list of descriptor strings"
    return _unknown_transforms(tuple(descriptors))


@functools.lru_cache(maxsize=64)
def _unknown_transforms(descriptors: tuple[str, ...]) -> str | None:
    """Checked as DCP's reader resolves them (`ExtensionRegistry`: zstd, when a zstd module is
    installed); a torch without stream transforms (before 2.7) can undo none."""
    if not descriptors:
        return None
    try:
        from torch.distributed.checkpoint._extension import ExtensionRegistry
    except ImportError:
        return f"was saved through stream transforms {shorten(repr(list(descriptors)))}, which this torch cannot undo"
    try:
        ExtensionRegistry().from_descriptor_list(descriptors)
    except ValueError as exc:
        return f"was saved through stream transforms {shorten(repr(list(descriptors)))} this process cannot undo ({exc})"
    return None


class ChunkCheckingReader(FileSystemReader):
    """A `FileSystemReader` that refuses a chunk whose stored tensor is not the one `.metadata` describes."""

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._chunks = _chunks(metadata)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                for item in items:
                    self._read_item(stream, name, item, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_item(self, stream: IO[bytes], name: str, item: ReadItem, planner: LoadPlanner) -> None:
        info = self.storage_data[item.storage_index]
        data = self._slice_file(stream, info)
        transforms = getattr(self, "transforms", None)  # stream transforms (compression): newer torch only
        if transforms is not None:
            data = transforms.transform_load_stream(item, getattr(info, "transform_descriptors", None) or (), data)
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(data.read(-1)))
            return
        if not data.seekable():  # torch.load seeks
            data = io.BytesIO(data.read(-1))
        tensor = torch.load(data, map_location="cpu", weights_only=True)
        self._check_chunk(tensor, name, item.storage_index)
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CheckpointError(f"{self.fs.concat_path(self.path, name)}: {item.storage_index.fqn!r} asks for "
                                  f"a part of shape {list(target.size())}, read one of {list(tensor.size())}")
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    def _check_chunk(self, tensor: object, name: str, index: MetadataIndex) -> None:
        where = f"{self.fs.concat_path(self.path, name)}: the chunk of tensor {index.fqn!r} at offsets " \
                f"{list(index.offset or ())}"
        expected = self._chunks.get((index.fqn, tuple(index.offset or ())))
        if expected is None:
            raise CheckpointError(f"{where} is in no entry of .metadata")
        dtype, sizes = expected
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{where} holds a {type(tensor).__name__}, not a tensor")
        if tensor.dtype != dtype or tensor.shape != sizes:
            raise CheckpointError(f"{where} holds {tensor.dtype} of shape {list(tensor.shape)}; .metadata says "
                                  f"{dtype} of shape {list(sizes)}: refusing to cast or narrow it into the load")
