"""A torch optimizer's state in the `torch_dcp` format: the state-dict tree torch's DCP helpers
save and load, built without stepping the caller's optimizer, and every check of the saved
state (names, the optimizer's own tensors, steps) before DCP reads a byte of data.
`backends.torch_dcp` calls it."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from backends.dcp_metadata import METADATA
from lifecycle.errors import CheckpointError, shorten
from lifecycle.jsontree import decode, read_json
from lifecycle.optim_identity import classes
from lifecycle.optim_state import PARAM_SHAPED_STATE, state_keys


FORMAT_VERSION = 2
"""Of `optimizer.json`: 2 keys optimizer state by parameter name; 1 (by position) is refused by name."""


@contextmanager
def unstepped(optimizer: torch.optim.Optimizer) -> Iterator[bool]:
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


def optimizer_tree(model: Any, optimizer: torch.optim.Optimizer, lr_scheduler: Any, folder: Path) -> dict[str, Any]:
    """torch's optimizer state dict, keyed by the model's parameter names; an optimizer that has
    not stepped yet has no state in it (`unstepped`)."""
    if not isinstance(model, nn.Module):
        raise CheckpointError(f"{folder}: torch_dcp keys optimizer state by parameter name and needs the "
                              f"model the optimizer steps (model=...), got {type(model).__name__}")
    try:
        with unstepped(optimizer) as empty:
            state = get_optimizer_state_dict(model, optimizer)
    except KeyError as exc:  # torch's own lookup of a parameter's name
        raise CheckpointError(f"{folder}: the optimizer steps a parameter that is not one of the model's, "
                              f"so it has no name to save or load it by") from exc
    if empty:
        state["state"] = {}
    return {"optimizer": state, "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
            **classes(optimizer, lr_scheduler)}


def fresh_template(running: dict[str, Any], optimizer: torch.optim.Optimizer, saved: Any, metadata: Metadata,
                    where: str) -> None:
    """The state DCP fills for an optimizer with none yet, from what optimizer.json and DCP's
    metadata say was saved, not by stepping it: for each key saved or read by its step
    (`state_keys`; one not saved is reported missing) a new tensor, of its parameter's layout
    (a DTensor shard under FSDP2) where it has or must have the parameter's shape, else whole.
    Names the optimizer does not step are left out, for `check_names` to report."""
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
    parameters' names, for `decode` (other entries are left to `check_names` and `_mismatches`).
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


def read_doc(path: Path) -> dict[str, Any]:
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


def check_names(saved: Any, running: dict[str, Any], where: str) -> None:
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


def own_tensors(saved: dict[str, Any], running: dict[str, Any], where: str) -> None:
    """Each parameter's saved state keeps the running state's keys, and each tensor in it is
    the template's own for that key, the one DCP fills: `optimizer.json` naming another
    parameter's buffer, or one buffer for two keys, would load bytes of another shape, or
    alias two moments. (Names are equal: `check_names`.)"""
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
