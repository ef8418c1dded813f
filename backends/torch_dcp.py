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
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
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

from backends.base import TORCH_DCP_CAPABILITIES, FormatBackend, FormatCapabilities, current_rank, listed
from backends.dcp_metadata import METADATA, MetadataReader
from backends.hf import write_hf_folder
from lifecycle.errors import CheckpointError, shorten
from lifecycle.jsontree import decode, encode, read_json
from lifecycle.optim_identity import OPTIM_JSON, check_classes, classes
from lifecycle.optim_state import (
    PARAM_SHAPED_STATE,
    SCALAR_STATE,
    check_param_groups,
    check_scheduler_state,
    state_keys,
    step_problem,
)

FORMAT_VERSION = 2
"""Of `optimizer.json`: 2 keys optimizer state by parameter name; 1 (by position) is refused by name."""


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


@contextmanager
def _unstepped(optimizer: torch.optim.Optimizer) -> Iterator[bool]:
    """torch's state-dict helpers create an empty optimizer's state by running its step (zero
    lr, zero grads) on the caller's optimizer: a save before the first step would change the
    run (Adam's step count), a refused load would leave state behind, and an optimizer whose
    update does not scale with lr would move the weights. While the state is empty it holds one
    empty entry, which torch takes for a state and steps nothing; yields whether it did."""
    first = next((p for group in optimizer.param_groups for p in group["params"]), None)
    if optimizer.state or first is None:
        yield False
        return
    optimizer.state[first] = {}
    try:
        yield True
    finally:
        if optimizer.state.get(first) == {}:
            del optimizer.state[first]


def _optimizer_tree(model: Any, optimizer: torch.optim.Optimizer, lr_scheduler: Any, folder: Path) -> dict[str, Any]:
    """torch's optimizer state dict, keyed by the model's parameter names; an optimizer that has
    not stepped yet has no state in it (`_unstepped`)."""
    if not isinstance(model, nn.Module):
        raise CheckpointError(f"{folder}: torch_dcp keys optimizer state by parameter name and needs the "
                              f"model the optimizer steps (model=...), got {type(model).__name__}")
    try:
        with _unstepped(optimizer) as empty:
            state = get_optimizer_state_dict(model, optimizer)
    except KeyError as exc:  # torch's own lookup of a parameter's name
        raise CheckpointError(f"{folder}: the optimizer steps a parameter that is not one of the model's, "
                              f"so it has no name to save or load it by") from exc
    if empty:
        state["state"] = {}
    return {"optimizer": state, "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
            **classes(optimizer, lr_scheduler)}


def _fresh_template(running: dict[str, Any], optimizer: torch.optim.Optimizer, saved: Any, metadata: Metadata,
                    where: str) -> None:
    """The state DCP fills for an optimizer with none yet, from what optimizer.json and DCP's
    metadata say was saved, not by stepping it: for each key saved or read by its step
    (`state_keys`; one not saved is reported missing) a new tensor, of its parameter's layout
    (a DTensor shard under FSDP2) where it has or must have the parameter's shape, else whole.
    Names the optimizer does not step are left out, for `_check_names` to report."""
    params: dict[str, torch.Tensor] = {}
    room: dict[str, int] = {}
    for group, named in zip(optimizer.param_groups, running["optimizer"]["param_groups"]):
        params.update(zip(named["params"], group["params"]))
        room.update(dict.fromkeys(named["params"], max(1, sum(p.numel() for p in group["params"]))))
    raw = saved.get("state") if isinstance(saved, dict) else None
    if not isinstance(raw, dict):
        return
    shapes = _metadata_shapes(metadata, room, where)
    state = {name: decode(entry, where=where, tensors=shapes) for name, entry in raw.items() if name in params}
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    group_of = {n: g for g in (groups if isinstance(groups, list) else []) if isinstance(g, dict)
                for n in (g.get("params") if isinstance(g.get("params"), list) else []) if isinstance(n, str)}
    template: dict[str, Any] = {}
    for name, entry in state.items():
        if isinstance(entry, dict):
            needed = dict.fromkeys(state_keys(optimizer, group_of.get(name)) - entry.keys(), torch.empty(()))
            template[name] = {key: _like(key, value, params[name]) for key, value in {**entry, **needed}.items()}
    running["optimizer"]["state"] = template


def _metadata_shapes(metadata: Metadata, room: dict[str, int], where: str) -> dict[str, torch.Tensor]:
    """Meta tensors of the metadata's entries `optimizer.state.<name>.<key>` for the running
    parameters' names, for `decode` (other entries are left to `_check_names` and `_mismatches`).
    An entry with more elements than its parameter's group holds (a state flat over the group is
    the largest torch keeps) is refused before its shape, which comes from the file, is built."""
    shapes: dict[str, torch.Tensor] = {}
    for key, meta in metadata.state_dict_metadata.items():
        rest = key.removeprefix("optimizer.state.") if key.startswith("optimizer.state.") else ""
        owner = max((rest[:i] for i, c in enumerate(rest) if c == "." and rest[:i] in room), key=len, default=None)
        if owner is None or not isinstance(meta, TensorStorageMetadata):
            continue
        size = [int(d) for d in meta.size]
        if min(size, default=0) < 0 or math.prod(d for d in size if d) > room[owner]:
            raise CheckpointError(f"{where}: entry {key!r} of {METADATA} has shape {shorten(size, 120)}, more "
                                  f"elements than the group of parameter {owner!r} ({room[owner]}) holds")
        shapes[key] = torch.empty(size, dtype=meta.properties.dtype, device="meta")
    return shapes


def _like(key: str, value: Any, param: torch.Tensor) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if value.shape == param.shape or key in PARAM_SHAPED_STATE:
        return torch.empty_like(param, dtype=value.dtype, requires_grad=False)
    return torch.empty(value.shape, dtype=value.dtype)


def _read_doc(path: Path) -> dict[str, Any]:
    doc = read_json(path)
    version = doc.get("format_version") if isinstance(doc, dict) else None
    if version == 1:
        raise CheckpointError(f"{path}: format_version 1 keys optimizer state by position in the optimizer "
                              f"(optimizer.state.param<i>); this torch_dcp reads state keyed by parameter name "
                              f"(format_version {FORMAT_VERSION}) only")
    if version != FORMAT_VERSION or "optimizer" not in doc:
        raise CheckpointError(f"{path}: not a torch_dcp optimizer.json of format_version {FORMAT_VERSION}")
    return doc


def _same_names(saved: Any, running: Any, where: str) -> None:
    missing, extra = sorted(set(running) - set(saved), key=str), sorted(set(saved) - set(running), key=str)
    found = ([f"lacks {shorten(missing, 200)}"] if missing else []) + (
        [f"has {shorten(extra, 200)}, which the running optimizer does not"] if extra else [])
    if found:
        raise CheckpointError(f"{where} {' and '.join(found)}")


def _check_names(saved: Any, running: dict[str, Any], where: str) -> None:
    """`set_optimizer_state_dict` pairs saved groups and state with parameters by name and passes
    over names it does not know: a group whose names all differ would load without its
    hyper-parameters, and the step fail on them. Run before `check_param_groups`, so that a
    parameter more or less is named; groups that are not lists of names are left to it."""
    if not isinstance(saved, dict):
        return
    groups = saved.get("param_groups")
    for g, (group, want) in enumerate(zip(groups if isinstance(groups, list) else [], running["param_groups"])):
        names = group.get("params") if isinstance(group, dict) else None
        if isinstance(names, list) and all(isinstance(n, str) for n in names):
            _same_names(names, want["params"], f"{where}: param_groups[{g}].params")
    state = saved.get("state")
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: optimizer.state must map parameter names to their state, "
                              f"found {shorten(state, 120)}")
    _same_names(state, running["state"], f"{where}: optimizer.state")


def _own_tensors(saved: dict[str, Any], running: dict[str, Any], where: str) -> None:
    """Each parameter's saved state keeps the running state's keys, and each tensor in it is
    the template's own for that key, the one DCP fills: `optimizer.json` naming another
    parameter's buffer, or one buffer for two keys, would load bytes of another shape, or
    alias two moments. (Names are equal: `_check_names`.)"""
    for name, want in running.items():
        entry = saved.get(name)
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where}: state of {shorten(name)} must be a mapping, found {shorten(entry, 120)}")
        if missing := [key for key in want if key not in entry]:
            raise CheckpointError(f"{where}: state of {shorten(name)} lacks {shorten(missing, 120)}, which the "
                                  "running optimizer keeps")
        for key, value in entry.items():
            own = want.get(key)
            if (isinstance(value, torch.Tensor) or isinstance(own, torch.Tensor)) and value is not own:
                raise CheckpointError(f"{where}: state of {shorten(name)}, key {shorten(key)}: optimizer.json gives "
                                      "it another tensor than its own (another key's or parameter's, or none)")


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
        tree = _optimizer_tree(model, optimizer, lr_scheduler, folder)
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
        (`_fresh_template`), and is never stepped. The saved groups and names are
        checked against it before DCP reads a byte, so a refusal leaves the state as it was.
        DCP reads the files unhashed: none is returned as verified against `expected`."""
        path = folder / OPTIM_JSON
        doc = _read_doc(path)
        if lr_scheduler is not None and doc.get("lr_scheduler") is None:
            raise CheckpointError(f"{path}: holds no lr_scheduler state but a scheduler was given")
        check_classes(optimizer, lr_scheduler, doc, str(path))
        running = _optimizer_tree(model, optimizer, lr_scheduler, folder)
        where = f"{path}: does not fit the optimizer"
        read = _reader(folder)
        saved_state = doc["optimizer"].get("state") if isinstance(doc["optimizer"], dict) else None
        if not optimizer.state or saved_state == {}:  # nothing to fill in place, or nothing saved
            _fresh_template(running, optimizer, doc["optimizer"], read[1], str(path))
        _check_names(doc["optimizer"], running["optimizer"], where)  # names are plain JSON strings and keys
        tensors: dict[str, torch.Tensor] = {}
        encode(running, where=str(path), tensors=tensors)
        reader = _checked_reader(tensors, folder, read)
        state = decode(doc, where=str(path), tensors=tensors)  # holds `tensors` themselves, filled below
        saved = state["optimizer"]
        check_param_groups(optimizer, saved.get("param_groups") if isinstance(saved, dict) else None, where, ids=str)
        _own_tensors(saved["state"], running["optimizer"]["state"], where)
        check_scheduler_state(lr_scheduler, state.get("lr_scheduler"), str(path))
        _check_steps(saved["state"], tensors, folder, reader, where)
        _read_into(tensors, folder, reader)
        options = StateDictOptions(strict=bool(saved["state"]))  # a state saved before the first step is empty
        try:
            with _unstepped(optimizer):
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
