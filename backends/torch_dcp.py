"""`torch.distributed.checkpoint` (DCP) for FSDP2 / DTensor / plain torch modules.

Every rank writes its own shards and DCP records where each piece of every tensor sits, so a
checkpoint saved by one parallel layout loads into another, or into one process with no
process group at all. Model and optimizer state come from torch's own
`torch.distributed.checkpoint.state_dict` helpers, so both are keyed by parameter name as other
DCP users write them: the model's tensors by their names (`0.weight`), the optimizer's as
`optimizer.state.<name>.<key>` (`optimizer.state.0.weight.exp_avg`, torchtitan's keys), whatever
the sharding (FSDP2 keeps the names). The optimizer calls therefore need the model (`model=`).

Only tensors go through DCP: the optimizer's non-tensor state (param groups, which list their
parameters by name, and hyper-parameters) and the lr scheduler's state are JSON through
`lifecycle.jsontree`, because DCP would pickle them and unpickle them on load with
`torch.load(weights_only=False)`.

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
`torch.load(weights_only=True)`. The optimizer's tree and its checks are
`backends.torch_dcp_optim`'s.
"""

from __future__ import annotations

import json
import os
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
    set_model_state_dict,
    set_optimizer_state_dict,
)

from backends.base import TORCH_DCP_CAPABILITIES, FormatBackend, FormatCapabilities, current_rank, listed
from backends.dcp_metadata import METADATA, MetadataReader
from backends.hf import no_meta, write_hf_folder
from backends.torch_dcp_optim import (
    FORMAT_VERSION,
    check_names,
    fresh_template,
    optimizer_tree,
    own_tensors,
    read_doc,
    unstepped,
)
from lifecycle.errors import CheckpointError, shorten
from lifecycle.jsontree import decode, encode
from lifecycle.optim_identity import OPTIM_JSON, check_classes
from lifecycle.optim_state import SCALAR_STATE, check_param_groups, check_scheduler_state, step_problem



def _failure(exc: BaseException) -> str:
    """DCP wraps each rank's error with its traceback; keep only 'rank N: Type: message'."""
    if isinstance(exc, CheckpointException):
        return "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in exc.failures.items())
    return f"{type(exc).__name__}: {exc}"


def _model_tensors(model: nn.Module, folder: Path) -> dict[str, torch.Tensor]:
    """Sharded (DTensor) under FSDP2, plain otherwise; anything but a tensor would need pickle."""
    state = get_model_state_dict(model)
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{folder}: model entry {key!r} is a {type(value).__name__}, not a tensor; "
                                  f"this backend saves and loads tensors only (no pickle)")
    return {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}


def _check_steps(state: dict[str, Any], tensors: dict[str, torch.Tensor], folder: Path, reader: MetadataReader,
                 where: str) -> None:
    """Each parameter's `step` checked (`step_problem`) before anything is read: one the JSON
    holds as a number (an optimizer that keeps a plain int), and one in the shards read first
    into copies, since the template's tensors are the optimizer's own and a step checked after
    the read would have changed the optimizer before its refusal."""
    for name, entry in state.items():
        plain = {key: value for key, value in entry.items() if key in SCALAR_STATE
                 and not isinstance(value, torch.Tensor)} if isinstance(entry, dict) else {}
        for key, value in plain.items():
            if problem := step_problem(value):
                raise CheckpointError(f"{where}: state of {shorten(name)}, key {key!r}: {problem}")
    steps = {name: tensor.clone() for name, tensor in tensors.items() if name.rpartition(".")[2] in SCALAR_STATE}
    if steps:
        _read_into(steps, folder, reader)
    for name, tensor in steps.items():
        if problem := step_problem(tensor):
            raise CheckpointError(f"{where}: {name}: {problem}")


def _write(state: dict[str, torch.Tensor], folder: Path) -> None:
    """The one place DCP writes: a later async save swaps `dcp.save` for `dcp.async_save` here."""
    try:
        dcp.save(state, storage_writer=FileSystemWriter(str(folder)))
    except (CheckpointException, OSError) as exc:
        said = _failure(exc)
        said += "" if "No space left on device" in said else _full_disk(folder)
        raise CheckpointError(f"{folder}: torch.distributed.checkpoint save failed: {said}") from exc


FULL_BELOW = 1024**2
"""Free bytes under which a failed write is put down to a full disk."""


def _full_disk(folder: Path) -> str:
    """What a failed write says when its disk is full: torch's writer reports a short write as
    `unexpected pos 704 vs 598`, with no word of the cause."""
    try:
        stat = os.statvfs(folder)
    except OSError:
        return ""
    free = stat.f_bavail * stat.f_frsize
    return f"; the disk is full: No space left on device (ENOSPC), {free} bytes free" if free < FULL_BELOW else ""


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


def _checked_reader(state: Mapping[str, torch.Tensor], folder: Path,
                    read: tuple[MetadataReader, Metadata] | None = None) -> MetadataReader:
    """The reader to fill `state` with (`read`, when `_reader` ran already), once every
    mismatch with it has been reported.

    The checks are the same on every rank (same files, same global shapes), so either every
    rank raises or none does, and no rank is left waiting in a DCP collective.
    """
    reader, metadata = read or _reader(folder)
    problems = _mismatches(state, metadata, folder)
    if problems:
        raise CheckpointError(f"{folder}: checkpoint does not match:\n  {listed(problems)}")
    return reader


def _read_into(state: dict[str, torch.Tensor], folder: Path, reader: MetadataReader | None = None) -> None:
    """Fill `state`'s tensors in place, from `reader` when it was checked already."""
    reader = reader or _checked_reader(state, folder)
    try:
        dcp.load(state, storage_reader=reader)
    except (CheckpointException, RuntimeError, ValueError, OSError) as exc:
        raise CheckpointError(f"{folder}: torch.distributed.checkpoint load failed: {_failure(exc)}") from exc


class TorchDCPBackend(FormatBackend):
    """Sharded state: every rank calls every method and DCP coordinates who writes what."""

    name: ClassVar[str] = "torch_dcp"
    capabilities: ClassVar[FormatCapabilities] = TORCH_DCP_CAPABILITIES

    def save_model(self, model: nn.Module, folder: Path) -> dict[str, str]:
        """DCP hashes nothing it writes: no digests to hand the manifest."""
        _write(_model_tensors(model, folder), folder)
        return {}

    def load_model(self, model: nn.Module, folder: Path, *, expected: Mapping[str, str] | None = None) -> set[str]:
        """Verifies no file while reading (the manifest's check, when there is one, came first)."""
        state = _model_tensors(model, folder)
        no_meta(state, folder, loading=True)  # else DCP's error speaks of a process group
        _read_into(state, folder)
        loaded: dict[str, Any] = dict(state)
        try:
            set_model_state_dict(model, loaded)
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{folder}: set_model_state_dict failed: {exc}") from exc
        return set()

    def save_optimizer(
        self, optimizer: torch.optim.Optimizer, lr_scheduler: Any, folder: Path, *, model: Any = None
    ) -> dict[str, str]:
        tensors: dict[str, torch.Tensor] = {}
        tree = optimizer_tree(model, optimizer, lr_scheduler, folder)
        doc = encode(tree, where=str(folder / OPTIM_JSON), tensors=tensors)
        _write(tensors, folder)
        if current_rank() == 0:
            text = json.dumps({"format_version": FORMAT_VERSION, **doc}, indent=1) + "\n"
            (folder / OPTIM_JSON).write_text(text, encoding="utf-8")
        return {}

    def load_optimizer(
        self, optimizer: torch.optim.Optimizer, lr_scheduler: Any, folder: Path, *, model: Any = None,
        expected: Mapping[str, str] | None = None,
    ) -> set[str]:
        """The running optimizer's own state is the template DCP fills, so each rank reads
        exactly its own shards; one that has not stepped yet gets one built from what was saved
        (`fresh_template`), and is never stepped. The saved groups and names are
        checked against it before DCP reads a byte, so a refusal leaves the state as it was.
        DCP reads the files unhashed: none is returned as verified against `expected`."""
        path = folder / OPTIM_JSON
        doc = read_doc(path)
        if lr_scheduler is not None and doc.get("lr_scheduler") is None:
            raise CheckpointError(f"{path}: holds no lr_scheduler state but a scheduler was given")
        check_classes(optimizer, lr_scheduler, doc, str(path))
        running = optimizer_tree(model, optimizer, lr_scheduler, folder)
        where = f"{path}: does not fit the optimizer"
        read = _reader(folder)
        saved_state = doc["optimizer"].get("state") if isinstance(doc["optimizer"], dict) else None
        if not optimizer.state or saved_state == {}:  # nothing to fill in place, or nothing saved
            fresh_template(running, optimizer, doc["optimizer"], read[1], str(path))
        check_names(doc["optimizer"], running["optimizer"], where)  # names are plain JSON strings and keys
        tensors: dict[str, torch.Tensor] = {}
        encode(running, where=str(path), tensors=tensors)
        reader = _checked_reader(tensors, folder, read)
        state = decode(doc, where=str(path), tensors=tensors)  # holds `tensors` themselves, filled below
        saved = state["optimizer"]
        check_param_groups(optimizer, saved.get("param_groups") if isinstance(saved, dict) else None, where, ids=str)
        own_tensors(saved["state"], running["optimizer"]["state"], where)
        check_scheduler_state(lr_scheduler, state.get("lr_scheduler"), str(path))
        _check_steps(saved["state"], tensors, folder, reader, where)
        _read_into(tensors, folder, reader)
        options = StateDictOptions(strict=bool(saved["state"]))  # a state saved before the first step is empty
        try:
            with unstepped(optimizer):
                set_optimizer_state_dict(model, optimizer, saved, options=options)
            if lr_scheduler is not None:
                lr_scheduler.load_state_dict(state["lr_scheduler"])
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise CheckpointError(f"{path}: does not fit the optimizer or scheduler: {exc!r}") from exc
        return set()

    def export_hf(self, model: nn.Module, folder: Path) -> dict[str, str]:
        """Every rank joins the gather; rank 0, the only one holding the full tensors, writes
        and returns the digests of the files it wrote."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)
        if current_rank() != 0:
            return {}
        hints = frozenset(getattr(model, "_tied_weights_keys", None) or ())
        return write_hf_folder(state, folder, config=getattr(model, "config", None), tied_hints=hints)
