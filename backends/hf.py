"""Plain HF safetensors for torch / `transformers` modules whose weights every rank holds whole.

The model folder is what `from_pretrained` reads: `model.safetensors`, or numbered shards plus
`model.safetensors.index.json`, and `config.json` for a `PreTrainedModel`. The optimizer is
JSON (structure) plus safetensors (tensors), so loading it never unpickles anything.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from backends.base import current_rank, listed
from backends.safetensors_io import NAMES, read_file, read_header, write_file
from lifecycle.boundary import lstat, name_problem, read_bytes
from lifecycle.errors import CheckpointError
from lifecycle.jsontree import decode, encode, parse_json, read_optimizer_json

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
OPTIM_JSON = "optimizer.json"
OPTIM_TENSORS = "optimizer.safetensors"
HF_SHARD_BYTES = 5 * 1024**3
INDEX_LIMIT = 64 * 1024**2
"""Bytes a safetensors index may have: those of the largest public models (~100k tensors) take
about 10 MB."""


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    """None for tensors without memory of their own (meta, empty): they cannot be tied."""
    if t.device.type == "meta" or t.numel() == 0:
        return None
    ptr = t.untyped_storage().data_ptr()
    return (str(t.device), ptr) if ptr else None


def _view_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (_storage_key(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _tied_hints(model: Any) -> set[str]:
    hints = getattr(model, "_tied_weights_keys", None) or ()
    return {str(h) for h in hints}


def _is_hinted(name: str, hints: set[str]) -> bool:
    return any(name == h or name.endswith("." + h) for h in hints)


def alias_groups(state_dict: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Names that are the very same tensor (tied weights), in state-dict order."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, t in state_dict.items():
        if _storage_key(t) is not None:
            groups.setdefault(_view_key(t), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _drop_aliases(state_dict: Mapping[str, torch.Tensor], hints: set[str]) -> dict[str, torch.Tensor]:
    """Keep one name per tied group, the one `from_pretrained` expects (not the tied-to one)."""
    dropped: set[str] = set()
    for names in alias_groups(state_dict):
        keep = next((n for n in names if not _is_hinted(n, hints)), names[0])
        dropped.update(n for n in names if n != keep)
    return {n: t for n, t in state_dict.items() if n not in dropped}


def plan_shards(sizes: Mapping[str, int], max_bytes: int) -> list[list[str]]:
    """Greedy in state-dict order; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_hf_folder(
    state: Mapping[str, torch.Tensor],
    folder: Path,
    *,
    config: Any = None,
    tied_hints: set[str] | frozenset[str] = frozenset(),
    max_shard_bytes: int = HF_SHARD_BYTES,
) -> None:
    """A folder `from_pretrained` reads: weights (sharded with an index when large), config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in [folder / SINGLE, folder / INDEX, *folder.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    state = _drop_aliases(state, set(tied_hints))
    sizes = {n: t.numel() * t.element_size() for n, t in state.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    names = [SINGLE] if len(shards) == 1 else [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    for fname, shard in zip(names, shards):
        write_file(folder / fname, {n: state[n] for n in shard}, metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {n: f for f, shard in zip(names, shards) for n in shard}}
        (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    save_pretrained = getattr(config, "save_pretrained", None)
    if callable(save_pretrained):
        save_pretrained(str(folder))


class HFBackend:
    """Replicated weights: rank 0 writes, every rank reads."""

    name: ClassVar[str] = "hf"
    parallel_invariant: ClassVar[bool] = False
    supports_async: ClassVar[bool] = True
    native_hf: ClassVar[bool] = True
    """`save_model` already writes what `export_hf` would: one copy serves both contents."""
    verifies_reads: ClassVar[bool] = True
    max_shard_bytes: int = HF_SHARD_BYTES

    def __init__(self, max_shard_bytes: int | None = None) -> None:
        if max_shard_bytes is not None:
            if max_shard_bytes < 1:
                raise CheckpointError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
            self.max_shard_bytes = max_shard_bytes

    def save_model(self, model: Any, folder: Path) -> None:
        if current_rank() == 0:
            write_hf_folder(model.state_dict(), folder, config=getattr(model, "config", None),
                            tied_hints=_tied_hints(model), max_shard_bytes=self.max_shard_bytes)

    def export_hf(self, model: Any, folder: Path) -> None:
        self.save_model(model, folder)

    def load_model(self, model: Any, folder: Path) -> None:
        """Strict: every difference between folder and model is reported before a byte loads.

        Tensors are read straight into the model's own, tied names once, each file checked
        against its digest as it is read: a file that fails leaves the model partly overwritten.
        """
        expected = model.state_dict()
        files, problems = self._plan(folder, expected)
        targets = {name for _, names in files for name in names}
        for group in alias_groups(expected):
            if any(n in targets for n in group):
                targets.update(group)
        problems += [f"{folder}: tensor {n!r} missing" for n in expected if n not in targets]
        if problems:
            raise CheckpointError(f"{folder}: weights do not match the model:\n  {listed(problems)}")
        for path, names in files:
            read_file(path, {n: expected[n] for n in names})

    def _plan(
        self, folder: Path, expected: Mapping[str, torch.Tensor]
    ) -> tuple[list[tuple[Path, list[str]]], list[str]]:
        """Which file holds which tensor, from the headers alone; every mismatch found at once.

        With an index, a tensor must be in the one file the index maps it to: a copy in another
        shard is refused rather than loaded (`from_pretrained` would read the index's copy).
        """
        files: list[tuple[Path, list[str]]] = []
        problems: list[str] = []
        weight_files = _weight_files(folder)
        mapped = {n: path for path, names in weight_files for n in names}
        for path, indexed in weight_files:
            header, _, _ = read_header(path)
            problems += [f"{path}: tensor {n!r} listed in {INDEX} but not in the file"
                         for n in indexed if n not in header]
            names = []
            for n, entry in header.items():
                problem = _placement_problem(n, path, mapped) or _fit_problem(n, entry, expected.get(n))
                if problem:
                    problems.append(f"{path}: {problem}")
                else:
                    names.append(n)
            files.append((path, names))
        return files, problems

    def save_optimizer(self, optimizer: Any, lr_scheduler: Any, folder: Path, *, model: Any = None) -> None:
        if current_rank() != 0:
            return
        folder.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        where = str(folder / OPTIM_JSON)
        state = {"optimizer": optimizer.state_dict(),
                 "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None}
        doc = {"format_version": 1, **encode(state, where=where, tensors=tensors)}
        write_file(folder / OPTIM_TENSORS, tensors)
        (folder / OPTIM_JSON).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")

    def load_optimizer(self, optimizer: Any, lr_scheduler: Any, folder: Path, *, model: Any = None) -> None:
        path = folder / OPTIM_JSON
        doc = read_optimizer_json(path)
        state = decode(doc, where=str(path), tensors=read_file(folder / OPTIM_TENSORS))
        sched_state = state.get("lr_scheduler")
        if lr_scheduler is not None and sched_state is None:
            raise CheckpointError(f"{path}: holds no lr_scheduler state but a scheduler was given")
        check_optimizer_state(optimizer, state["optimizer"], path)
        try:
            optimizer.load_state_dict(state["optimizer"])
            if lr_scheduler is not None:
                lr_scheduler.load_state_dict(sched_state)
        except (ValueError, KeyError, TypeError, RuntimeError, AttributeError, OverflowError) as exc:
            raise CheckpointError(f"{path}: does not fit the optimizer or scheduler: {exc!r}") from exc


def _placement_problem(name: str, path: Path, mapped: Mapping[str, Path]) -> str | None:
    """With an index, a tensor found in a file the index does not map it to (another shard's copy)."""
    if not mapped or mapped.get(name) == path:
        return None
    if name in mapped:
        return f"tensor {name!r} is in this file, but {INDEX} maps it to {mapped[name]}"
    return f"tensor {name!r} is in this file but not listed in {INDEX}"


def _fit_problem(name: str, entry: Mapping[str, Any], want: torch.Tensor | None) -> str | None:
    if want is None:
        return f"unexpected tensor {name!r}"
    if list(entry["shape"]) != list(want.shape):
        return f"tensor {name!r} has shape {list(entry['shape'])}, the model expects {list(want.shape)}"
    if NAMES[entry["dtype"]] != want.dtype:
        return f"tensor {name!r} has dtype {NAMES[entry['dtype']]}, the model expects {want.dtype}"
    return None


def _weight_files(folder: Path) -> Iterable[tuple[Path, list[str]]]:
    """(file, names the index puts in it) for each weight file; names empty without an index.

    Symlinks are followed (an HF cache snapshot is all links); FIFOs and other special files
    are refused without blocking (`lifecycle.boundary.open_regular`).
    """
    index = folder / INDEX
    if lstat(index) is None:
        if lstat(folder / SINGLE) is not None:
            return [(folder / SINGLE, [])]
        raise CheckpointError(f"{folder}: no {SINGLE} or {INDEX} (pickled .bin weights are not read)")
    doc = parse_json(read_bytes(index, INDEX_LIMIT, "the safetensors index", follow=True), index)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: not a valid safetensors index: weight_map must be an object")
    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        problem = name_problem(fname) if isinstance(fname, str) else "not a file name"
        if problem is None and not fname.endswith(".safetensors"):
            problem = "not a .safetensors file"
        if problem:
            raise CheckpointError(f"{index}: tensor {name!r} maps to {fname!r}, not a weight file in "
                                  f"{folder} ({problem})")
        by_file.setdefault(fname, []).append(name)
    return [(folder / fname, names) for fname, names in by_file.items()]


PARAM_SHAPED_STATE = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
                                "acc_delta", "exp_inf", "ax"})
"""Per-parameter buffers of torch.optim's optimizers (the Adam family, SGD, RMSprop, Adadelta,
Adamax, ASGD) that always have their parameter's shape."""
SCALAR_STATE = frozenset({"step"})
"""Per-parameter state that is one number, however it is stored."""
_MISSING = object()


def check_optimizer_state(optimizer: Any, saved: Any, path: Path) -> None:
    """Refuse an optimizer state that `load_state_dict` takes but the first step fails on, or
    trains on silently: buffers of another parameter's shape (two swapped), hyper-parameters
    that are not finite numbers where the running optimizer has numbers.

    Generic, not per optimizer: a tensor state must have the shape of the running optimizer's
    own state for that key when it has one; else a known buffer (`PARAM_SHAPED_STATE`) must
    have its parameter's shape, and any other of more than one element must too, up to
    dimensions of 1 (factored moments, as Adafactor keeps) or be flat over the whole group
    (as LBFGS keeps). Dtypes are not compared: `load_state_dict` casts state to its parameter's.
    """
    where = f"{path}: does not fit the optimizer"
    params = _saved_params(optimizer, saved, where)
    state = saved.get("state")
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: optimizer.state must be a mapping of parameter number to state")
    for number, entry in state.items():
        if number not in params:
            raise CheckpointError(f"{where}: optimizer.state holds parameter {number!r}, which no param_group lists")
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where}: state of parameter {number} must be a mapping, found {_clip(entry)}")
        param, group_numel = params[number]
        current = optimizer.state.get(param, {})
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                problem = _state_problem(key, value, param, group_numel, current.get(key))
                if problem:
                    raise CheckpointError(f"{where}: state of parameter {number}, key {key!r}: {problem}")


def _saved_params(optimizer: Any, saved: Any, where: str) -> dict[Any, tuple[torch.Tensor, int]]:
    """Saved parameter number -> (running parameter, elements in its group), matched by order
    as `load_state_dict` matches them; the groups' hyper-parameters are checked on the way."""
    groups = optimizer.param_groups
    saved_groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(saved_groups, list) or len(saved_groups) != len(groups):
        raise CheckpointError(f"{where}: optimizer.param_groups must list {len(groups)} group(s) like the "
                              f"running optimizer's, found {_clip(saved_groups)}")
    params: dict[Any, tuple[torch.Tensor, int]] = {}
    for g, (group, saved_group) in enumerate(zip(groups, saved_groups)):
        group_where = f"{where}: param_groups[{g}]"
        if not isinstance(saved_group, dict):
            raise CheckpointError(f"{group_where} must be a mapping, found {_clip(saved_group)}")
        numbers = saved_group.get("params")
        if (not isinstance(numbers, list) or len(numbers) != len(group["params"])
                or not all(type(n) is int for n in numbers) or len(set(numbers)) != len(numbers)):
            raise CheckpointError(f"{group_where}.params must list {len(group['params'])} distinct parameter numbers "
                                  f"like the running optimizer's group, found {_clip(numbers)}")
        for key, value in group.items():
            if key in ("params", "param_names"):
                continue
            if problem := _hyper_problem(value, saved_group.get(key, _MISSING)):
                raise CheckpointError(f"{group_where}.{key}: {problem}")
        group_numel = sum(p.numel() for p in group["params"])
        for number, param in zip(numbers, group["params"]):
            if number in params:
                raise CheckpointError(f"{group_where}.params: parameter {number} is also in an earlier group")
            params[number] = (param, group_numel)
    return params


def _state_problem(key: str, value: torch.Tensor, param: torch.Tensor, group_numel: int, reference: Any) -> str | None:
    shape = list(value.shape)
    if isinstance(reference, torch.Tensor):
        same = value.shape == reference.shape
        return None if same else f"has shape {shape}, the running optimizer's has {list(reference.shape)}"
    if key in SCALAR_STATE:
        return None if value.numel() == 1 else f"has shape {shape}, one number expected"
    if value.shape == param.shape or (key not in PARAM_SHAPED_STATE and value.numel() <= 1):
        return None
    factored = value.dim() == param.dim() and all(v in (1, p) for v, p in zip(value.shape, param.shape))
    flat = value.dim() == 1 and value.numel() == group_numel
    if key not in PARAM_SHAPED_STATE and (factored or flat):
        return None
    return f"has shape {shape}, its parameter has {list(param.shape)}"


def _hyper_problem(current: Any, saved: Any) -> str | None:
    """Where the running optimizer has a number (or numbers, as Adam's betas), the saved group
    must have finite ones (unless the running one is not finite either)."""
    if _is_number(current):
        if saved is _MISSING:
            return f"missing; the running optimizer has {current!r}"
        if _is_number(saved) and (_finite(saved) or not _finite(current)):
            return None
        return f"must be a finite number like the running optimizer's {current!r}, found {_clip(saved)}"
    if isinstance(current, (tuple, list)) and current and all(_is_number(c) for c in current):
        fits = (isinstance(saved, (tuple, list)) and len(saved) == len(current)
                and all(_is_number(s) and (_finite(s) or not _finite(c)) for s, c in zip(saved, current)))
        return None if fits else (f"must be {len(current)} finite numbers like the running optimizer's "
                                  f"{current!r}, found {_clip(None if saved is _MISSING else saved)}")
    if isinstance(current, bool) and saved is not _MISSING and not isinstance(saved, (bool, type(None))):
        return f"must be true or false like the running optimizer's {current!r}, found {_clip(saved)}"
    return None


def _is_number(value: Any) -> bool:
    """A real number: int or float (not bool), or a tensor of one element (a tensor lr)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer beyond a float's range
        return False


def _clip(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:120] + "..."
