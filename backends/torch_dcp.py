"""`torch.distributed.checkpoint` (DCP) for FSDP2 / DTensor / plain torch modules.

Every rank writes its own shards and DCP records where each piece of every tensor sits, so a
checkpoint saved by one parallel layout loads into another, or into one process with no
process group at all. Only tensors go through DCP: the optimizer's non-tensor state (param
groups, hyper-parameters) and the lr scheduler's state are JSON through `lifecycle.jsontree`,
because DCP would pickle them and unpickle them on load with `torch.load(weights_only=False)`.

DCP's own `.metadata`, which says which bytes of which file hold which tensor, is a pickle.
It is never read with a plain `pickle.load` here: `backends.dcp_metadata.MetadataReader` reads
it, for the checks below and for `dcp.load` alike (one read, one object), with an unpickler
that hands out only the DCP metadata classes, `torch.Size` and torch dtypes and layouts, so a
crafted file is refused before anything in it runs, whether or not the manifest was verified.
Metadata that is not a DCP `Metadata`, names non-tensor entries (which DCP would `torch.load`
with `weights_only=False`), points at a file outside the folder, or has a tensor whose chunks
do not tile it exactly or whose bytes are not in the folder's files (DCP would fill only what
the chunks cover and leave the rest of the model as it was, without an error) is refused
before DCP reads a byte of data. Tensor data itself is read by DCP with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import (
    CheckpointException,
    FileSystemWriter,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from backends.base import current_rank, listed
from backends.dcp_metadata import METADATA, MetadataReader
from backends.hf import write_hf_folder
from lifecycle.errors import CheckpointError
from lifecycle.jsontree import decode, encode, read_optimizer_json
from lifecycle.optim_state import check_param_groups

OPTIM_JSON = "optimizer.json"


def _failure(exc: BaseException) -> str:
    """DCP wraps each rank's error with its traceback; keep only 'rank N: Type: message'."""
    if isinstance(exc, CheckpointException):
        return "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in exc.failures.items())
    return f"{type(exc).__name__}: {exc}"


class _ParamsByIndex(nn.Module):
    """Stands in for the model in `get/set_optimizer_state_dict`, which key state by parameter name.

    The backend protocol hands the optimizer calls no model, so each parameter is named by its
    position in the optimizer, as `optimizer.state_dict()` itself does. That position does not
    change with FSDP2 / DTensor sharding, so the layout stays parallel-invariant.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for i, p in enumerate(params):
            if not isinstance(p, nn.Parameter):
                raise CheckpointError(f"optimizer parameter {i} is a {type(p).__name__}, not an nn.Parameter")
            self.register_parameter(f"param{i}", p)


def _model_tensors(model: nn.Module, folder: Path) -> dict[str, torch.Tensor]:
    """Sharded (DTensor) under FSDP2, plain otherwise; anything but a tensor would need pickle."""
    state = get_model_state_dict(model)
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{folder}: model entry {key!r} is a {type(value).__name__}, not a tensor; "
                                  f"this backend saves and loads tensors only (no pickle)")
    return {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}


def _optimizer_tree(optimizer: Any, lr_scheduler: Any) -> dict[str, Any]:
    """The optimizer's state, created first by torch's zero-lr step when it is still empty
    (as in torchtitan): a saved and a fresh optimizer then hold the same tensors to match."""
    return {"optimizer": get_optimizer_state_dict(_ParamsByIndex(optimizer), optimizer),
            "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None}


def _write(state: dict[str, torch.Tensor], folder: Path) -> None:
    """The one place DCP writes: a later async save swaps `dcp.save` for `dcp.async_save` here."""
    try:
        dcp.save(state, storage_writer=FileSystemWriter(str(folder)))
    except (CheckpointException, OSError) as exc:
        raise CheckpointError(f"{folder}: torch.distributed.checkpoint save failed: {_failure(exc)}") from exc


def _reader(folder: Path) -> tuple[MetadataReader, Metadata]:
    """The reader DCP will load with, and the metadata it has already read (restricted
    unpickler) and checked (every tensor tiled by chunks whose bytes are in the folder)."""
    if not (folder / METADATA).is_file():
        what = "no such folder" if not folder.is_dir() else f"no {METADATA} file"
        raise CheckpointError(f"{folder}: not a torch_dcp checkpoint ({what}; an unfinished save?)")
    reader = MetadataReader(folder)
    return reader, reader.read_metadata()


def _mismatches(state: Mapping[str, torch.Tensor], metadata: Metadata, folder: Path) -> list[str]:
    saved = metadata.state_dict_metadata
    problems = [f"{folder}: unexpected entry {k!r}" for k in saved if k not in state]
    for key, t in state.items():
        meta = saved.get(key)
        if meta is None:
            problems.append(f"{folder}: tensor {key!r} missing")
        elif not isinstance(meta, TensorStorageMetadata):
            problems.append(f"{folder}: entry {key!r} is not a tensor (pickled bytes are not read)")
        elif tuple(meta.size) != tuple(t.shape):
            problems.append(f"{folder}: tensor {key!r} has shape {list(meta.size)}, "
                            f"the model expects {list(t.shape)}")
        elif meta.properties.dtype != t.dtype:
            problems.append(f"{folder}: tensor {key!r} has dtype {meta.properties.dtype}, "
                            f"the model expects {t.dtype}")
    return problems


def _read_into(state: dict[str, torch.Tensor], folder: Path) -> None:
    """Fill `state`'s tensors in place; every mismatch is reported before DCP reads any data.

    The checks are the same on every rank (same files, same global shapes), so either every
    rank raises or none does, and no rank is left waiting in a DCP collective.
    """
    reader, metadata = _reader(folder)
    problems = _mismatches(state, metadata, folder)
    if problems:
        raise CheckpointError(f"{folder}: checkpoint does not match:\n  {listed(problems)}")
    try:
        dcp.load(state, storage_reader=reader)
    except (CheckpointException, RuntimeError, ValueError, OSError) as exc:
        raise CheckpointError(f"{folder}: torch.distributed.checkpoint load failed: {_failure(exc)}") from exc


class TorchDCPBackend:
    """Sharded state: every rank calls every method and DCP coordinates who writes what."""

    name: ClassVar[str] = "torch_dcp"
    parallel_invariant: ClassVar[bool] = True
    supports_async: ClassVar[bool] = True
    native_hf: ClassVar[bool] = False
    verifies_reads: ClassVar[bool] = False

    def save_model(self, model: nn.Module, folder: Path) -> None:
        _write(_model_tensors(model, folder), folder)

    def load_model(self, model: nn.Module, folder: Path) -> None:
        state = _model_tensors(model, folder)
        _read_into(state, folder)
        loaded: dict[str, Any] = dict(state)
        try:
            set_model_state_dict(model, loaded)
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{folder}: set_model_state_dict failed: {exc}") from exc

    def save_optimizer(
        self, optimizer: torch.optim.Optimizer, lr_scheduler: Any, folder: Path, *, model: Any = None
    ) -> None:
        tensors: dict[str, torch.Tensor] = {}
        doc = encode(_optimizer_tree(optimizer, lr_scheduler), where=str(folder / OPTIM_JSON), tensors=tensors)
        _write(tensors, folder)
        if current_rank() == 0:
            text = json.dumps({"format_version": 1, **doc}, indent=1) + "\n"
            (folder / OPTIM_JSON).write_text(text, encoding="utf-8")

    def load_optimizer(
        self, optimizer: torch.optim.Optimizer, lr_scheduler: Any, folder: Path, *, model: Any = None
    ) -> None:
        """The running optimizer's own state (created by a zero step if empty) is the template
        DCP fills, so each rank reads exactly its own shards."""
        path = folder / OPTIM_JSON
        doc = read_optimizer_json(path)
        if lr_scheduler is not None and doc.get("lr_scheduler") is None:
            raise CheckpointError(f"{path}: holds no lr_scheduler state but a scheduler was given")
        tensors: dict[str, torch.Tensor] = {}
        encode(_optimizer_tree(optimizer, lr_scheduler), where=str(path), tensors=tensors)
        _read_into(tensors, folder)
        state = decode(doc, where=str(path), tensors=tensors)
        saved = state["optimizer"]
        check_param_groups(optimizer, saved.get("param_groups") if isinstance(saved, dict) else None,
                           f"{path}: does not fit the optimizer", ids=str)
        try:
            set_optimizer_state_dict(_ParamsByIndex(optimizer), optimizer, state["optimizer"])
            if lr_scheduler is not None:
                lr_scheduler.load_state_dict(state["lr_scheduler"])
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise CheckpointError(f"{path}: does not fit the optimizer or scheduler: {exc!r}") from exc

    def export_hf(self, model: nn.Module, folder: Path) -> None:
        """Every rank joins the gather; rank 0, the only one holding the full tensors, writes."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)
        if current_rank() == 0:
            hints = frozenset(getattr(model, "_tied_weights_keys", None) or ())
            write_hf_folder(state, folder, config=getattr(model, "config", None), tied_hints=hints)
