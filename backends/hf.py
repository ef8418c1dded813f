"""Plain HF safetensors for torch / `transformers` modules whose weights every rank holds whole.

The model folder is what `from_pretrained` reads: `model.safetensors`, or numbered shards plus
`model.safetensors.index.json`, and `config.json` for a `PreTrainedModel`. The optimizer is
JSON (structure) plus safetensors (tensors), so loading it never unpickles anything.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from backends.base import current_rank, listed
from backends.safetensors_io import NAMES, read_file, read_header, write_file
from lifecycle.errors import CheckpointError
from lifecycle.jsontree import decode, encode, read_optimizer_json

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
OPTIM_JSON = "optimizer.json"
OPTIM_TENSORS = "optimizer.safetensors"
HF_SHARD_BYTES = 5 * 1024**3


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
        """Which file holds which tensor, from the headers alone; every mismatch found at once."""
        files: list[tuple[Path, list[str]]] = []
        problems: list[str] = []
        for path, indexed in _weight_files(folder):
            header, _, _ = read_header(path)
            problems += [f"{path}: tensor {n!r} listed in {INDEX} but not in the file"
                         for n in indexed if n not in header]
            names = []
            for n, entry in header.items():
                want = expected.get(n)
                if want is None:
                    problems.append(f"{path}: unexpected tensor {n!r}")
                elif list(entry["shape"]) != list(want.shape):
                    problems.append(f"{path}: tensor {n!r} has shape {list(entry['shape'])}, "
                                    f"the model expects {list(want.shape)}")
                elif NAMES[entry["dtype"]] != want.dtype:
                    problems.append(f"{path}: tensor {n!r} has dtype {NAMES[entry['dtype']]}, "
                                    f"the model expects {want.dtype}")
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
        try:
            optimizer.load_state_dict(state["optimizer"])
            if lr_scheduler is not None:
                lr_scheduler.load_state_dict(sched_state)
        except (ValueError, KeyError, TypeError, RuntimeError, AttributeError, OverflowError) as exc:
            raise CheckpointError(f"{path}: does not fit the optimizer or scheduler: {exc!r}") from exc


def _weight_files(folder: Path) -> Iterable[tuple[Path, list[str]]]:
    """(file, names the index puts in it) for each weight file; names empty without an index."""
    index = folder / INDEX
    if not index.is_file():
        if (folder / SINGLE).is_file():
            return [(folder / SINGLE, [])]
        raise CheckpointError(f"{folder}: no {SINGLE} or {INDEX} (pickled .bin weights are not read)")
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a valid safetensors index: {exc!r}") from exc
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: weight_map must be an object")
    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        if not isinstance(fname, str) or "/" in fname or "\\" in fname or fname in ("", ".", ".."):
            raise CheckpointError(f"{index}: tensor {name!r} maps to {fname!r}, not a file in {folder}")
        by_file.setdefault(fname, []).append(name)
    return [(folder / fname, names) for fname, names in by_file.items()]
