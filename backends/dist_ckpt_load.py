"""Megatron-Core `dist_checkpointing` loads, every refusal found before Megatron reads a shard.

Megatron's sharded format is DCP underneath and keeps DCP's pickled `.metadata`. Every load
here reads it through `backends.dcp_metadata` (Megatron's reader factory is swapped for the
load call only), whose unpickler hands out only the DCP metadata classes, `torch.Size` and
torch dtypes and layouts: a crafted file is refused before anything in it runs, verified by the
manifest or not. `common.pt` is read by Megatron with `torch.load`'s default `weights_only=True`.
Entries DCP stores as bytes (the layers' `_extra_state`) are read with `torch.load`'s
`weights_only=True` first, and refused when that refuses them. A stored tensor in another dtype
than the one the load asks for is refused, as the hf and torch_dcp formats refuse it (Megatron
would round float32 into bfloat16 without a word), and a stored tensor that no rank's load asks
for is refused rather than left behind.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingConfig
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.strategies import torch as mcore_dcp
from megatron.core.dist_checkpointing.validation import StrictHandling
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from backends.base import listed
from backends.dcp_metadata import MetadataReader
from backends.megatron import CheckedBytesPlanner, agree, cpu_safe, library_errors
from lifecycle.boundary import open_regular, read_bytes
from lifecycle.errors import CheckpointError, shorten
from lifecycle.phase import temporarily

MAX_METADATA_JSON = 64 * 1024
"""Megatron's `metadata.json` names four backends and versions: a few hundred bytes."""


def load_sharded(state: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Megatron's torch_dist load, with DCP's pickled `.metadata` read by `backends.dcp_metadata`.

    The metadata is read and checked first, so a refusal is raised as itself, naming the file
    (inside the load, DCP would catch it, warn, and retry with `__<rank>.metadata`). For the
    call only, Megatron's reader factory hands out the reader that read it (DCP then plans with
    that very object) and its planner is `CheckedBytesPlanner`; both are put back in `finally`.
    Every requested tensor's dtype is compared with the stored one before any rank reads
    (`dtype_problem`). Megatron loads only the keys asked for: a stored tensor no rank asks for
    (a separate output layer read into a model with tied embeddings) is refused, not dropped
    (`_mismatch_problem`).
    """
    _check_folder(folder)
    reader = MetadataReader(folder)
    stored = reader.read_metadata().state_dict_metadata
    optimizer_keys = {_is_optimizer_key(v.key) for v in nested_values(state) if hasattr(v, "key")}
    agree(dtype_problem(state, stored, folder))

    def readers(checkpoint_dir: str | Path, cache_metadata: bool = False) -> MetadataReader:
        """Megatron's `_get_filesystem_reader(checkpoint_dir, cache_metadata)`; ours always caches."""
        return reader if Path(checkpoint_dir) == folder else MetadataReader(checkpoint_dir)

    with library_errors("megatron dist_checkpointing load", folder), cpu_safe(), \
            temporarily(mcore_dcp, _get_filesystem_reader=readers, MCoreLoadPlanner=CheckedBytesPlanner):
        loaded, unasked, absent = dist_checkpointing.load(state, str(folder), strict=StrictHandling.RETURN_ALL)
    dropped = sorted(k for k in unasked if (not optimizer_keys or _is_optimizer_key(k) in optimizer_keys)
                     and isinstance(stored.get(k), TensorStorageMetadata))
    agree(_mismatch_problem(folder, dropped, sorted(absent)))
    return loaded


def _requested(state: Any) -> Iterator[ShardedTensor]:
    """Every ShardedTensor the load asks for, those a factory (fused gate/up) builds included."""
    for value in nested_values(state):
        if isinstance(value, ShardedTensorFactory):
            yield from _requested(value.build())
        elif isinstance(value, ShardedTensor):
            yield value


def dtype_problem(state: Any, stored: Mapping[str, Any], folder: Path) -> str | None:
    """Requested tensors whose stored dtype is another: Megatron's load casts into the
    template's dtype without a word (float32 rounded to bfloat16). Absent keys are left to the
    load, which names them (`_mismatch_problem`)."""
    wrong: dict[str, str] = {}
    for sharded in _requested(state):
        meta = stored.get(sharded.key)
        if isinstance(meta, TensorStorageMetadata) and meta.properties.dtype != sharded.dtype:
            wrong.setdefault(sharded.key, f"tensor {sharded.key!r} has dtype {meta.properties.dtype}, "
                                          f"the model expects {sharded.dtype}")
    if not wrong:
        return None
    return f"{folder}: checkpoint does not match:\n  {listed(list(wrong.values()))}"


def _is_optimizer_key(key: str) -> bool:
    """Megatron-LM keeps an optimizer's state beside the weights: a model load leaves it alone, and
    an optimizer load the weights (a load that asks for nothing leaves no stored tensor alone)."""
    return key.startswith("optimizer")


def _mismatch_problem(folder: Path, dropped: list[str], absent: list[str]) -> str | None:
    if absent:
        return f"{folder}: holds no {shorten(absent, 300)}, which this load asks for"
    if dropped:
        return (f"{folder}: holds tensors this load has no place for: {shorten(dropped, 300)} (a separate output "
                "layer for a model with tied embeddings, or another architecture); refusing to drop them")
    return None


def _check_folder(folder: Path) -> None:
    """`metadata.json` and `common.pt`, checked before Megatron opens them: a missing, special
    (a FIFO blocks the read) or oversized file is refused naming it; megatron-core read a 1 GB
    metadata.json whole and a missing common.pt raised an AttributeError of its own."""
    path = folder / "metadata.json"
    if not path.exists():
        raise CheckpointError(f"{folder}: not a Megatron dist checkpoint (no metadata.json)")
    text = read_bytes(path, MAX_METADATA_JSON, "Megatron metadata.json", follow=True)
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise CheckpointError(f"{path}: not valid JSON: {exc}") from exc
    fields = {f.name: {"str": str, "int": int}.get(f.type, f.type) for f in dataclasses.fields(CheckpointingConfig)}
    if not isinstance(doc, dict) or not isinstance(doc.get("sharded_backend"), str) or any(
            k not in fields or type(v) is not fields[k] for k, v in doc.items()):
        raise CheckpointError(f"{path}: must map {', '.join(fields)} to strings and integers (sharded_backend "
                              f"required), found {shorten(doc, 200)}")
    open_regular(folder / "common.pt", follow=True).close()
