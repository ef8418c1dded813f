"""Training extras (RNG states, progress, dataloader position) saved without pickle.

A resumed run must draw the same random numbers and read the same next batch as the run it
replaces. `torch.save` of these would be the easy way, and the way to run an attacker's code
on load; here everything is JSON, plus safetensors for the torch RNG byte states.
"""

from __future__ import annotations

import json
import copy
import random
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from backends.safetensors_io import read_file, write_file

from lifecycle.errors import CheckpointError, shorten
from lifecycle.jsontree import JSON_LIMIT, NotSerializable, decode, encode, read_json
from lifecycle.records import say
from lifecycle.types import Progress, is_count

EXTRA_JSON = "extra.json"
RNG_FILE = "rng.safetensors"
ALLOWED = frozenset({EXTRA_JSON, RNG_FILE})
_PROGRESS_INTS = ("step", "epoch", "consumed_samples", "weights_version")
RESET_WITHOUT_EXTRA = ("epoch", "consumed_samples", "weights_version", "user")
"""The `Progress` fields only extra restores: a resume that does not read it starts them afresh."""


def checked_user(progress: Progress, where: str) -> Any:
    """`progress.user` encoded as extra.json holds it, once `progress` passed the checks a save
    makes (`CheckpointError` naming `where` otherwise)."""
    try:
        user = encode(progress.user, where=where)
    except NotSerializable as exc:
        raise CheckpointError(f"{where}: Progress.user is not JSON-serialisable at {exc.key}") from exc
    check_progress(progress, where)
    return user


def save_extra(folder: Path, progress: Progress, dataloader: Any = None) -> dict[str, str]:
    """Write extra.json and rng.safetensors into `folder` (created when missing); returns the
    digest rng.safetensors was written with, for the manifest."""
    where = str(folder / EXTRA_JSON)
    user = checked_user(progress, where)
    doc = {
        "format_version": 1,
        "progress": {**{k: int(getattr(progress, k)) for k in _PROGRESS_INTS}, "user": user},
        "rng": {"python": _python_rng(), "numpy": _numpy_rng()},
        "dataloader": _dataloader_state(dataloader, where),
    }
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state().cpu()
    doc["rng"]["torch"] = sorted(tensors)
    text = json.dumps(doc, separators=(",", ":")) + "\n"
    if (size := len(text.encode("utf-8"))) > JSON_LIMIT:  # a resume reads no more: refused before any commit
        raise CheckpointError(f"{where}: extra state is {size} bytes encoded, over the {JSON_LIMIT} a resume reads "
                              f"(dataloader state {_size(doc['dataloader'])} bytes, Progress.user "
                              f"{_size(user)} bytes); keep positions, not data, in them")
    folder.mkdir(parents=True, exist_ok=True)
    digest = write_file(folder / RNG_FILE, tensors)
    (folder / EXTRA_JSON).write_text(text, encoding="utf-8")
    return {RNG_FILE: digest}


def _size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")).encode("utf-8"))


def check_progress(progress: Progress, where: str) -> None:
    """Refuse `Progress` fields a resume would refuse (each an integer >= 0), naming them."""
    if bad := [f"{k}={shorten(getattr(progress, k))}" for k in _PROGRESS_INTS if not is_count(getattr(progress, k))]:
        raise CheckpointError(f"{where}: Progress fields must be integers >= 0 (a resume refuses anything else), "
                              f"found {', '.join(bad)}")


def _python_rng() -> dict[str, Any]:
    version, state, gauss = random.getstate()
    return {"version": version, "state": list(state), "gauss_next": gauss}


def _numpy_rng() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {"name": name, "keys": keys.tolist(), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def stateful_loader(dataloader: Any) -> Any:
    """What holds the data position: the object itself when it has `state_dict`, else a torch
    `DataLoader`'s batch sampler or sampler that has one (a `ResumableBatchSampler` given as
    `batch_sampler=`), else the object, whose position is then neither saved nor restored (its
    first save says so: `checkpoint.extra.dataloader_position_unsaved`)."""
    if dataloader is None or callable(getattr(dataloader, "state_dict", None)):
        return dataloader
    for name in ("batch_sampler", "sampler"):
        inner = getattr(dataloader, name, None)
        if callable(getattr(inner, "state_dict", None)) and callable(getattr(inner, "load_state_dict", None)):
            return inner
    return dataloader


_WARNED: weakref.WeakSet[Any] = weakref.WeakSet()
"""Loaders already named as saving no position: once each, not at every save."""


def _first_time(dataloader: Any) -> bool:
    try:
        if dataloader in _WARNED:
            return False
        _WARNED.add(dataloader)
    except TypeError:  # an object that takes no weak reference: said at every save
        pass
    return True


def _dataloader_state(dataloader: Any, where: str) -> Any:
    dataloader = stateful_loader(dataloader)
    state_dict = getattr(dataloader, "state_dict", None)
    if dataloader is not None and not callable(state_dict) and _first_time(dataloader):
        say("warning", "checkpoint.extra.dataloader_position_unsaved", path=where,
                                       dataloader=type(dataloader).__name__,
                                       reason="it has no state_dict(), nor has its sampler: a resume replays its data")
    if dataloader is None or not callable(state_dict):
        return None
    try:
        return encode(state_dict(), where=where)
    except NotSerializable as exc:
        raise CheckpointError(
            f"{where}: state_dict() of dataloader {type(dataloader).__name__} is not "
            f"JSON-serialisable at {exc.key}"
        ) from exc


@dataclass(slots=True)
class _Loaded:
    progress: Progress
    python: tuple[Any, ...]
    numpy: tuple[Any, ...]
    torch: dict[str, torch.Tensor]
    dataloader: Any


def load_extra(folder: Path, dataloader: Any = None, *, restore_rng: bool = True, step: int | None = None) -> Progress:
    """Check everything first, then restore: a bad file never leaves RNGs half-restored
    (`read_extra`, then `apply`)."""
    progress, apply, _ = read_extra(folder, dataloader, restore_rng=restore_rng, step=step)
    apply()
    return progress


def read_extra(
    folder: Path, dataloader: Any = None, *, restore_rng: bool = True, step: int | None = None,
) -> tuple[Progress, Callable[[], None], Callable[[], None]]:
    """The checked progress, with the dataloader already at its saved position, what restores
    the RNGs, and what puts the dataloader back where it was.

    The dataloader goes first, at once: it is the one part that may still refuse its state (its
    own checks: another dataset, another batch size), and it should do so before any weight is
    loaded. Its position before is kept (`state_dict()`) so a resume refused later puts it back
    (the third callable); the RNGs are restored only once the resume is agreed (the second),
    untouched by whatever loading draws. `step`: the step folder's own number, which the saved
    progress must name (a save writes the step it commits; another is damage or forgery)."""
    loaded = _read(folder)
    if step is not None and loaded.progress.step != step:
        raise CheckpointError(f"{folder / EXTRA_JSON}: its progress says step {loaded.progress.step}, but it is "
                              f"in the folder of step {step}")
    holder = stateful_loader(dataloader)
    before = copy.deepcopy(holder.state_dict()) if callable(getattr(holder, "state_dict", None)) else None
    _restore_dataloader(dataloader, loaded.dataloader, folder, step)

    def apply() -> None:
        if restore_rng:
            random.setstate(loaded.python)
            np.random.set_state(loaded.numpy)
            torch.set_rng_state(loaded.torch["torch_cpu"])
            _restore_cuda(loaded.torch)

    def undo() -> None:
        if before is not None and loaded.dataloader is not None:
            holder.load_state_dict(before)

    return loaded.progress, apply, undo


def _read(folder: Path) -> _Loaded:
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: extra folder missing")
    for entry in sorted(folder.iterdir()):
        if entry.name not in ALLOWED or not entry.is_file() or entry.is_symlink():
            raise CheckpointError(f"{entry}: unexpected file in extra folder (only {sorted(ALLOWED)})")
    path = folder / EXTRA_JSON
    doc = read_json(path)
    try:
        return _parse(doc, path, _read_rng(folder / RNG_FILE))
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise CheckpointError(f"{path}: malformed extra state: {exc!r}") from exc


def _read_rng(path: Path) -> dict[str, torch.Tensor]:
    tensors = read_file(path)
    for name, t in tensors.items():
        if t.dtype != torch.uint8 or t.dim() != 1:
            raise CheckpointError(f"{path}: RNG state {name!r} must be a 1-D uint8 tensor")
    if "torch_cpu" not in tensors:
        raise CheckpointError(f"{path}: no 'torch_cpu' RNG state")
    try:
        torch.Generator().set_state(tensors["torch_cpu"])
    except RuntimeError as exc:
        raise CheckpointError(f"{path}: 'torch_cpu' is not a CPU RNG state: {exc}") from exc
    if "cuda" in tensors and torch.cuda.is_available():  # checked here, before any RNG is restored
        want = torch.cuda.get_rng_state().numel()
        if tensors["cuda"].numel() != want:
            raise CheckpointError(f"{path}: 'cuda' holds {tensors['cuda'].numel()} bytes, where this device's "
                                  f"RNG state is {want}")
    return tensors


def _parse(doc: Any, path: Path, rng_tensors: dict[str, torch.Tensor]) -> _Loaded:
    if not isinstance(doc, dict) or doc.get("format_version") != 1:
        raise ValueError("not an extra.json of format_version 1")
    prog = doc["progress"]
    ints = {k: prog[k] for k in _PROGRESS_INTS}
    bad = [k for k, v in ints.items() if type(v) is not int or v < 0]
    if bad:
        raise ValueError(f"progress fields {bad} must be non-negative integers")
    user = decode(prog.get("user", {}), where=str(path))
    if not isinstance(user, dict):
        raise TypeError("progress.user must be an object")
    py, npy = doc["rng"]["python"], doc["rng"]["numpy"]
    if not (isinstance(py["state"], list) and all(type(x) is int for x in py["state"])):
        raise TypeError("rng.python.state must be a list of integers")
    if py["gauss_next"] is not None and not isinstance(py["gauss_next"], float):
        raise TypeError("rng.python.gauss_next must be a float or null")
    _want(py["version"], int, "rng.python.version")
    python_state = (py["version"], tuple(py["state"]), py["gauss_next"])
    if not (isinstance(npy["keys"], list) and all(type(x) is int for x in npy["keys"])):
        raise TypeError("rng.numpy.keys must be a list of integers")
    keys = np.asarray(npy["keys"], dtype=np.uint32)
    if keys.shape != (624,):
        raise ValueError("rng.numpy.keys must hold 624 integers")
    numpy_state = (_want(npy["name"], str, "rng.numpy.name"), keys, _want(npy["pos"], int, "rng.numpy.pos"),
                   _want(npy["has_gauss"], int, "rng.numpy.has_gauss"),
                   float(_want(npy["cached_gaussian"], (int, float), "rng.numpy.cached_gaussian")))
    if not 0 <= numpy_state[2] <= len(keys):
        raise ValueError("rng.numpy.pos must be within 0..624 (numpy reads out of bounds otherwise)")
    random.Random().setstate(python_state)  # a state they refuse fails here, before anything is restored
    np.random.RandomState().set_state(numpy_state)
    dataloader = decode(doc["dataloader"], where=str(path)) if doc.get("dataloader") is not None else None
    progress = Progress(**ints, user=user)
    return _Loaded(progress, python_state, numpy_state, rng_tensors, dataloader)


def _want(value: Any, types: type | tuple[type, ...], name: str) -> Any:
    """`value` when it is of `types` (a bool is not an int here); TypeError naming the field otherwise."""
    if isinstance(value, bool) or not isinstance(value, types):
        names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise TypeError(f"{name} must be of type {names}, found {type(value).__name__}")
    return value


def _restore_cuda(tensors: dict[str, torch.Tensor]) -> None:
    """Only the current device: a worker drives one GPU, and touching all would create a
    CUDA context (and its memory) on every GPU of the host."""
    if "cuda" not in tensors:
        return
    if not torch.cuda.is_available():
        say("warning", "checkpoint.extra.cuda_rng_skipped", reason="no CUDA device")
        return
    torch.cuda.set_rng_state(tensors["cuda"])


def _restore_dataloader(dataloader: Any, state: Any, folder: Path, step: int | None) -> None:
    """A saved position with no dataloader given to take it, or a dataloader with no saved
    position, is said (`checkpoint.extra.dataloader_not_restored`): its data is replayed."""
    dataloader = stateful_loader(dataloader)
    load = getattr(dataloader, "load_state_dict", None)
    if dataloader is None or state is None or not callable(load):
        if state is not None or callable(load):
            say("warning", "checkpoint.extra.dataloader_not_restored", folder=str(folder), step=step,
                content="dataloader", dataloader=None if dataloader is None else type(dataloader).__name__,
                saved_state=state is not None)
        return
    path = folder / EXTRA_JSON
    try:
        load(state)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: dataloader {type(dataloader).__name__} refused its state: {exc}") from exc
    except (KeyError, TypeError, ValueError, IndexError, OverflowError) as exc:
        raise CheckpointError(
            f"{path}: dataloader {type(dataloader).__name__} refused its state: {type(exc).__name__}: {exc}"
        ) from exc
