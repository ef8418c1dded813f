"""A pickle-free encoding of nested state dicts: JSON for structure, safetensors for tensors.

`state_dict()`s hold tuples, int keys, non-finite floats and tensors, none of which plain
JSON round-trips. Tagged single-key objects carry them; a plain dict never has a key
starting with "__" (such dicts are written as key/value pairs), so tags are unambiguous.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lifecycle.boundary import read_bytes
from lifecycle.errors import CheckpointError, shorten

JSON_LIMIT = 256 * 1024**2
"""Bytes a checkpoint's JSON file may have: optimizer structure and dataloader positions take
kilobytes to a few megabytes; a larger file is refused unread rather than parsed into memory."""
CONFIG_JSON_LIMIT = 16 * 1024**2
"""Bytes a model's `config.json` may have: it is kilobytes; anything past this is not one."""
MAX_DEPTH = 64
"""Levels of nesting `encode` and `decode` follow. Optimizer, scheduler and dataloader states
nest a handful deep (optimizer -> state -> parameter -> key -> value); 64 is far beyond any of
them, well inside Python's recursion limit, and stops a planted file or a value that contains
itself with a `CheckpointError` naming the key rather than a `RecursionError`."""
_TUPLE, _DICT, _TENSOR, _FLOAT = "__tuple__", "__dict__", "__tensor__", "__float__"
_TAGS = {_TUPLE, _DICT, _TENSOR, _FLOAT}
MAX_SAME_HASH = 32
"""Keys of one decoded dict that may share a hash. Distinct keys of a real state (optimizer
parameter ids, RNG and progress keys) share none; within int64 at most 9 ints can, floats a few
hundred (powers of two 61 apart), tuples without bound: 32 refuses every flood and no real state."""


class NotSerializable(CheckpointError):
    """A value in a state dict has no pickle-free encoding; `key` says where it sits.

    It keeps the value's type name, not the value (which need not pickle), so it crosses a
    process boundary whole: `type_name` rebuilds it without the value."""

    def __init__(self, where: str, key: str, value: object = None, *, type_name: str | None = None) -> None:
        self.where = where
        self.key = key
        self.type_name = type(value).__name__ if type_name is None else type_name
        super().__init__(f"{where}: value at {key or '<root>'} of type {self.type_name} "
                         f"cannot be saved without pickle")

    def __reduce__(self) -> tuple[object, ...]:
        return _not_serializable, (type(self), self.where, self.key, self.type_name)


def _not_serializable(cls: type[NotSerializable], where: str, key: str, type_name: str) -> NotSerializable:
    return cls(where, key, type_name=type_name)


def read_json(path: Path, limit: int = JSON_LIMIT) -> Any:
    """A JSON file of a checkpoint; missing, special (a FIFO), too large or malformed is a
    CheckpointError naming it. Opened through `lifecycle.boundary`: never a symlink, never blocks."""
    return parse_json(read_bytes(path, limit, "the JSON file"), path)


def read_config_json(path: Path) -> Any:
    """A model's `config.json`, parsed: read bounded, through a symlink (an HF cache snapshot is
    all links) but never blocking on a FIFO (`boundary.read_bytes`); a `CheckpointError` naming
    it for every way that fails."""
    return parse_json(read_bytes(path, CONFIG_JSON_LIMIT, "config.json", follow=True), path)


class _DuplicateKey(ValueError):
    """An object names one key twice: JSON leaves it to the reader which one counts."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """The object, built in C; the key named twice looked for only when it lost an item."""
    out = dict(pairs)
    if len(out) == len(pairs):
        return out
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _DuplicateKey(f"an object names the key {shorten(key, 200)} twice; which one counts is ambiguous")
        seen.add(key)
    return out


def parse_json(raw: bytes, path: Path) -> Any:
    """`raw` as UTF-8 JSON; every way it can fail is a CheckpointError naming `path`.

    An object naming a key twice is refused: `json` keeps the last, `safetensors` refuses such a
    header, so two readers of one checkpoint file could see different contents."""
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except RecursionError:
        raise CheckpointError(f"{path}: not valid JSON: nested too deeply") from None
    except _DuplicateKey as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    except ValueError as exc:  # not UTF-8, not JSON, or an integer too long to convert
        raise CheckpointError(f"{path}: not valid JSON: {exc}") from None


def read_optimizer_json(path: Path) -> dict[str, Any]:
    """The optimizer.json both the hf and torch_dcp backends write next to their tensors."""
    doc = read_json(path)
    if not isinstance(doc, dict) or doc.get("format_version") != 1 or "optimizer" not in doc:
        raise CheckpointError(f"{path}: not an optimizer.json of format_version 1")
    return doc


def encode(value: Any, *, where: str, tensors: dict[str, torch.Tensor] | None = None) -> Any:
    """JSON-ready form of `value`; tensors go into `tensors` (None: tensors are an error)."""
    return _enc(value, "", where, tensors, 0)


def _too_deep(where: str, key: str) -> CheckpointError:
    """A list, tuple or dict `MAX_DEPTH` containers deep: the same bound on both sides."""
    place = key if len(key) <= 120 else "..." + key[-120:]
    return CheckpointError(f"{where}: value at {place or '<root>'} is nested more than {MAX_DEPTH} levels deep")


def _enc(value: Any, key: str, where: str, tensors: dict[str, torch.Tensor] | None, depth: int) -> Any:
    if depth >= MAX_DEPTH and isinstance(value, (list, tuple, Mapping)):
        raise _too_deep(where, key)
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {_FLOAT: repr(value)}
    if isinstance(value, torch.Tensor):
        if tensors is None:
            raise NotSerializable(where, key, value)
        name = key or "tensor"
        while name in tensors:
            name += "'"
        tensors[name] = value
        return {_TENSOR: name}
    if isinstance(value, (list, tuple)):
        items = [_enc(v, f"{key}[{i}]", where, tensors, depth + 1) for i, v in enumerate(value)]
        return {_TUPLE: items} if isinstance(value, tuple) else items
    if isinstance(value, Mapping):
        return _enc_dict(value, key, where, tensors, depth)
    item = getattr(value, "item", None)
    if type(value).__module__ == "numpy" and callable(item):
        if getattr(value, "ndim", 0) != 0:  # an array, not a scalar: `item()` would drop its shape or fail
            raise NotSerializable(where, key, value)
        return _enc(item(), key, where, tensors, depth)
    raise NotSerializable(where, key, value)


def _enc_dict(
    value: Mapping[Any, Any], key: str, where: str, tensors: dict[str, torch.Tensor] | None, depth: int
) -> Any:
    plain = all(isinstance(k, str) and not k.startswith("__") for k in value)
    if plain:
        return {k: _enc(v, f"{key}.{k}" if key else k, where, tensors, depth + 1) for k, v in value.items()}
    pairs = []
    for k, v in value.items():
        label = f"{key}[{k!r}]"
        pairs.append([_enc(k, label, where, None, depth + 1), _enc(v, label, where, tensors, depth + 1)])
    return {_DICT: pairs}


def decode(data: Any, *, where: str, tensors: Mapping[str, torch.Tensor] | None = None) -> Any:
    """Inverse of `encode`; a malformed tree is a CheckpointError naming `where` and the key."""
    return _dec(data, "", where, tensors or {}, 0)


def _dec(data: Any, key: str, where: str, tensors: Mapping[str, torch.Tensor], depth: int) -> Any:
    if isinstance(data, list):
        if depth >= MAX_DEPTH:
            raise _too_deep(where, key)
        return [_dec(v, f"{key}[{i}]", where, tensors, depth + 1) for i, v in enumerate(data)]
    if not isinstance(data, dict):
        return data
    tags = [k for k in data if k.startswith("__")]
    leaf = len(data) == 1 and tags[:1] in ([_TENSOR], [_FLOAT])  # a tensor or a float, not a container
    if depth >= MAX_DEPTH and not leaf:
        raise _too_deep(where, key)
    if not tags:
        return {k: _dec(v, f"{key}.{k}" if key else k, where, tensors, depth + 1) for k, v in data.items()}
    if len(data) != 1 or tags[0] not in _TAGS:
        raise CheckpointError(f"{where}: unknown tag {tags[0]!r} at {key or '<root>'}")
    tag, body = tags[0], data[tags[0]]
    try:
        return _dec_tag(tag, body, key, where, tensors, depth)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: malformed {tag} at {key or '<root>'}: {exc}") from exc


def _dec_tag(
    tag: str, body: Any, key: str, where: str, tensors: Mapping[str, torch.Tensor], depth: int
) -> Any:
    if tag == _TUPLE:
        if not isinstance(body, list):
            raise TypeError("expected a list")
        return tuple(_dec(v, f"{key}[{i}]", where, tensors, depth + 1) for i, v in enumerate(body))
    if tag == _FLOAT:
        if body not in ("inf", "-inf", "nan"):
            raise ValueError(f"{body!r} is not inf, -inf or nan")
        return float(body)
    if tag == _TENSOR:
        if not isinstance(body, str) or body not in tensors:
            raise ValueError(f"tensor {body!r} is not in the tensor file")
        return tensors[body]
    if not isinstance(body, list) or not all(isinstance(p, list) and len(p) == 2 for p in body):
        raise TypeError("expected a list of [key, value] pairs")
    keys = [_dec(k, key, where, tensors, depth + 1) for k, _ in body]
    _check_hashes(keys, key, where)
    out: dict[Any, Any] = {}
    for k, (_, v) in zip(keys, body):
        out[k] = _dec(v, f"{key}[{k!r}]", where, tensors, depth + 1)
    return out


def _check_hashes(keys: list[Any], key: str, where: str) -> None:
    """Refuse keys of which more than `MAX_SAME_HASH` share one hash, before a dict is built of them.

    Keys of one hash land on one probe chain, so each insertion compares with all before it:
    80,000 ints `k * (2**61 - 1)` (all hashing to 0) took 92 s. Strings hash with a random
    seed, but ints, floats and tuples of them have hashes anyone can steer. Hash values are
    counted as ints, of which at most 9 distinct int64 values share a hash, so the count is linear.
    A list or dict key, or a tuple holding one, is a TypeError, reported with the key's place."""
    counts = Counter(map(hash, keys))
    if counts and (most := max(counts.values())) > MAX_SAME_HASH:
        raise CheckpointError(f"{where}: {most} keys of the dict at {key or '<root>'} share one hash (at most "
                              f"{MAX_SAME_HASH} may), as only a file crafted to make loading slow has")
