"""Plain HF safetensors for torch / `transformers` modules whose weights every rank holds whole.

The model folder is what `from_pretrained` reads: `model.safetensors`, or numbered shards plus
`model.safetensors.index.json`, and `config.json` for a `PreTrainedModel`. The optimizer is
JSON (structure) plus safetensors (tensors), so loading it never unpickles anything.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from backends.base import HF_CAPABILITIES, FormatBackend, FormatCapabilities, current_rank, listed
from backends.safetensors_io import (
    NAMES,
    Header,
    overlapping,
    read_file,
    read_header,
    stored_equal,
    unclaimed_problem,
    write_file,
)
from lifecycle.boundary import lstat, name_problem, read_bytes
from lifecycle.errors import CheckpointError
from lifecycle.jsontree import decode, encode, parse_json, read_optimizer_json
from lifecycle.optim_identity import OPTIM_JSON, by_name, check_classes, classes, parameter_names
from lifecycle.optim_state import check_optimizer_state, check_scheduler_state
from lifecycle.records import say

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
OPTIM_TENSORS = "optimizer.safetensors"
HF_SHARD_BYTES = 5 * 1024**3
"""The default largest weight file, as `save_pretrained` writes them."""
MAX_SHARD_BYTES = 1 << 40
"""1 TiB: no filesystem or hub takes one file larger."""
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
) -> dict[str, str]:
    """A folder `from_pretrained` reads: weights (sharded with an index when large), config.json.

    Returns each weight file's name and the digest it was written with, for the manifest."""
    only_tensors(state, folder)
    state = _drop_aliases(state, set(tied_hints))
    sizes = {n: t.numel() * t.element_size() for n, t in state.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    for shard in shards:  # what `read_file` would refuse to read into, refused before a file is written
        if pair := overlapping({n: state[n] for n in shard}):
            raise CheckpointError(f"{folder}: model entries {pair[0]!r} and {pair[1]!r} share memory without being "
                                  "the same tensor (one is a slice or view of the other), so no load could fill "
                                  "both; register a copy (clone()) or make one non-persistent")
    folder.mkdir(parents=True, exist_ok=True)
    for stale in [folder / SINGLE, folder / INDEX, *folder.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    names = [SINGLE] if len(shards) == 1 else [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    digests = {fname: write_file(folder / fname, {n: state[n] for n in shard}, metadata={"format": "pt"})
               for fname, shard in zip(names, shards)}
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {n: f for f, shard in zip(names, shards) for n in shard}}
        (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    save_pretrained = getattr(config, "save_pretrained", None)
    if callable(save_pretrained):
        save_pretrained(str(folder))
    return digests


@dataclass(frozen=True, kw_only=True, slots=True)
class HFOptions:
    """The hf format's own keys of `checkpoint.save`."""

    max_shard_bytes: int = field(default=HF_SHARD_BYTES, metadata={"ge": 1, "le": MAX_SHARD_BYTES})
    """Largest weight file: a bigger state dict is split into numbered shards plus an index,
    as `save_pretrained` does, so no single file outgrows what a filesystem or upload takes."""

    def __post_init__(self) -> None:
        size = self.max_shard_bytes
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_SHARD_BYTES:
            raise CheckpointError(f"max_shard_bytes must be an integer in 1..{MAX_SHARD_BYTES}, got {size!r}")


class HFBackend(FormatBackend):
    """Replicated weights: rank 0 writes, every rank reads."""

    name: ClassVar[str] = "hf"
    capabilities: ClassVar[FormatCapabilities] = HF_CAPABILITIES
    Options: ClassVar[type[HFOptions]] = HFOptions

    @property
    def max_shard_bytes(self) -> int:
        """`checkpoint.save.max_shard_bytes`, through the options the format was built with."""
        return int(self.options.max_shard_bytes)

    def save_model(self, model: Any, folder: Path) -> dict[str, str]:
        if current_rank() != 0:
            return {}
        return write_hf_folder(model.state_dict(), folder, config=getattr(model, "config", None),
                               tied_hints=_tied_hints(model), max_shard_bytes=self.max_shard_bytes)

    def export_hf(self, model: Any, folder: Path) -> dict[str, str]:
        return self.save_model(model, folder)

    def load_model(self, model: Any, folder: Path, *, expected: Mapping[str, str] | None = None) -> set[str]:
        """Strict: every difference between folder and model is reported before a byte loads.

        Tensors are read straight into the model's own, tied names once: a folder holding two
        names of one tied tensor loads only when both hold the same bytes. A weight file with a
        digest in `expected` is checked as it is read and returned as verified; one that fails
        leaves the model partly overwritten.
        """
        state = model.state_dict()
        only_tensors(state, folder, loading=True)
        files, problems = self._plan(folder, state, expected or {})
        targets = {name for _, header, _ in files for name in header.tensors}  # a misfit is reported once, as such
        groups = alias_groups(state)
        for group in groups:
            if any(n in targets for n in group):
                targets.update(group)
        problems += [f"{folder}: tensor {n!r} missing" for n in state if n not in targets]
        aside, conflicts = _stored_twice(files, groups)
        problems += conflicts
        if problems:
            raise CheckpointError(f"{folder}: weights do not match the model:\n  {listed(problems)}")
        verified: set[str] = set()
        for path, header, names in files:
            rel = path.relative_to(folder).as_posix()
            want = (expected or {}).get(rel)
            read_file(path, {n: state[n] for n in names if n not in aside}, expect=want, header=header)
            if want is not None:
                verified.add(rel)
        return verified

    def _plan(
        self, folder: Path, expected: Mapping[str, torch.Tensor], digests: Mapping[str, str]
    ) -> tuple[list[tuple[Path, Header, list[str]]], list[str]]:
        """Which file holds which tensor, from the headers alone; every mismatch found at once.
        Each file's header is kept for its read, which then parses it no second time. A file
        with bytes no tensor claims is refused unless `digests` (the manifest's) vouches for it.

        With an index, a tensor must be in the one file the index maps it to: a copy in another
        shard is refused rather than loaded (`from_pretrained` would read the index's copy).
        """
        files: list[tuple[Path, Header, list[str]]] = []
        problems: list[str] = []
        listed = weight_files(folder)
        mapped = {n: path for path, names in listed for n in names}
        for path, indexed in listed:
            header = read_header(path)
            if path.relative_to(folder).as_posix() not in digests and (problem := unclaimed_problem(path, header)):
                problems.append(problem)
            problems += [f"{path}: tensor {n!r} listed in {INDEX} but not in the file"
                         for n in indexed if n not in header.tensors]
            names = []
            for n, entry in header.tensors.items():
                problem = placement_problem(n, path, mapped) or _fit_problem(n, entry, expected.get(n))
                if problem:
                    problems.append(f"{path}: {problem}")
                else:
                    names.append(n)
            files.append((path, header, names))
        return files, problems

    def save_optimizer(
        self, optimizer: Any, lr_scheduler: Any, folder: Path, *, model: Any = None
    ) -> dict[str, str]:
        if current_rank() != 0:
            return {}
        folder.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        where = str(folder / OPTIM_JSON)
        state = {"optimizer": optimizer.state_dict(),
                 "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None}
        doc = {"format_version": 1, **encode(state, where=where, tensors=tensors), **classes(optimizer, lr_scheduler),
               "param_names": parameter_names(model, optimizer)}
        digest = write_file(folder / OPTIM_TENSORS, tensors)
        (folder / OPTIM_JSON).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        return {OPTIM_TENSORS: digest}

    def load_optimizer(
        self, optimizer: Any, lr_scheduler: Any, folder: Path, *, model: Any = None,
        expected: Mapping[str, str] | None = None,
    ) -> set[str]:
        """The tensors are checked against their digest in `expected` as they are read, before
        anything is loaded: a damaged file leaves the optimizer as it was."""
        path = folder / OPTIM_JSON
        doc = read_optimizer_json(path)
        want = (expected or {}).get(OPTIM_TENSORS)
        state = decode(doc, where=str(path), tensors=read_file(folder / OPTIM_TENSORS, expect=want))
        sched_state = state.get("lr_scheduler")
        if lr_scheduler is not None and sched_state is None:
            raise CheckpointError(f"{path}: holds no lr_scheduler state but a scheduler was given")
        check_classes(optimizer, lr_scheduler, doc, str(path))
        check_scheduler_state(lr_scheduler, sched_state, str(path))
        saved = _matched_by_name(optimizer, state, model, path)
        check_optimizer_state(optimizer, saved, path)
        try:
            optimizer.load_state_dict(saved)
            if lr_scheduler is not None:
                lr_scheduler.load_state_dict(sched_state)
        except (ValueError, KeyError, TypeError, RuntimeError, AttributeError, OverflowError) as exc:
            raise CheckpointError(f"{path}: does not fit the optimizer or scheduler: {exc!r}") from exc
        return set() if want is None else {OPTIM_TENSORS}


def _matched_by_name(optimizer: Any, state: Mapping[str, Any], model: Any, path: Path) -> Any:
    """The saved optimizer state with its groups and parameters in the running optimizer's
    order by parameter name (`by_name`). A checkpoint written before names were recorded, or a
    load without the model (or with a parameter that is not the model's), goes by position as
    `load_state_dict` does, with a warning: a model whose modules are declared in another order
    would give each parameter another's state."""
    saved_names, running_names = state.get("param_names"), parameter_names(model, optimizer)
    if saved_names is not None and running_names is not None:
        return by_name(state["optimizer"], saved_names, running_names, optimizer, f"{path}: does not fit the optimizer")
    say("warning", "checkpoint.optimizer.loaded_by_position", path=str(path),
        reason="the checkpoint records no parameter names" if saved_names is None
        else "the running optimizer steps a parameter that is not the model's (or no model was given)")
    return state["optimizer"]


def _stored_twice(
    files: list[tuple[Path, Header, list[str]]], groups: list[list[str]]
) -> tuple[set[str], list[str]]:
    """Names of one tied tensor that the files hold more than once: the copies after the first,
    which are compared with it (`stored_equal`) and then left unread (two reads into one memory
    at once would mix them), and a problem for each copy whose bytes differ from the first's (which one the model
    should get is unknowable). Our saves and `save_pretrained` write one name per tied tensor."""
    where = {name: (path, header, name) for path, header, names in files for name in names}
    aside: set[str] = set()
    problems: list[str] = []
    for group in groups:
        stored = [where[name] for name in group if name in where]
        for copy in stored[1:]:
            aside.add(copy[2])
            if not stored_equal(stored[0], copy):
                problems.append(f"{copy[0]}: tensor {copy[2]!r} and tensor {stored[0][2]!r} (in {stored[0][0]}) "
                                "are one tied tensor in the model but hold different bytes; keep one of them")
    return aside, problems


def placement_problem(name: str, path: Path, mapped: Mapping[str, Path]) -> str | None:
    """With an index, a tensor found in a file the index does not map it to (another shard's copy)."""
    if not mapped or mapped.get(name) == path:
        return None
    if name in mapped:
        return f"tensor {name!r} is in this file, but {INDEX} maps it to {mapped[name]}"
    return f"tensor {name!r} is in this file but not listed in {INDEX}"


def only_tensors(state: Mapping[str, Any], folder: Path, *, loading: bool = False) -> None:
    """Refuse a model whose state holds a module's non-tensor extra state, or a meta tensor
    (no data to write, no memory to load into), naming it."""
    if odd := next((n for n, t in state.items() if not isinstance(t, torch.Tensor)), None):
        raise CheckpointError(f"{folder}: model entry {odd!r} is a {type(state[odd]).__name__}, not a tensor; "
                              "safetensors holds tensors only (no pickle)")
    no_meta(state, folder, loading=loading)


def no_meta(state: Mapping[str, torch.Tensor], folder: Path, *, loading: bool) -> None:
    """Refuse a meta tensor, naming it: a save has no data to write, a load no memory to fill."""
    if meta := next((n for n, t in state.items() if t.device.type == "meta"), None):
        if loading:
            raise CheckpointError(f"{folder}: model entry {meta!r} is a meta tensor, which has no memory to load "
                                  "into; materialise the model (to_empty()) before loading")
        raise CheckpointError(f"{folder}: model entry {meta!r} is a meta tensor, which holds no data; "
                              "materialise it (to_empty and initialise, or load) before saving")


def _fit_problem(name: str, entry: Mapping[str, Any], want: torch.Tensor | None) -> str | None:
    if want is None:
        return f"unexpected tensor {name!r}"
    if list(entry["shape"]) != list(want.shape):
        return f"tensor {name!r} has shape {list(entry['shape'])}, the model expects {list(want.shape)}"
    if NAMES[entry["dtype"]] != want.dtype:
        return f"tensor {name!r} has dtype {NAMES[entry['dtype']]}, the model expects {want.dtype}"
    return None


def weight_files(folder: Path) -> Iterable[tuple[Path, list[str]]]:
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
