"""A pickle-free encoding of nested state dicts: JSON for structure, safetensors for tensors.

`state_dict()`s hold tuples, int keys, non-finite floats and tensors, none of which plain
JSON round-trips. Tagged single-key objects carry them; a plain dict never has a key
starting with "__" (such dicts are written as key/value pairs), so tags are unambiguous.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lifecycle.errors import CheckpointError

_TUPLE, _DICT, _TENSOR, _FLOAT = "__tuple__", "__dict__", "__tensor__", "__float__"
_TAGS = {_TUPLE, _DICT, _TENSOR, _FLOAT}


class NotSerializable(CheckpointError):
    """A value in a state dict has no pickle-free encoding; `key` says where it sits."""

    def __init__(self, where: str, key: str, value: object) -> None:
        self.key = key
        super().__init__(f"{where}: value at {key or '<root>'} of type {type(value).__name__} "
                         f"cannot be saved without pickle")


def read_json(path: Path) -> Any:
    """A JSON file of a checkpoint; missing or malformed is a CheckpointError naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON: {exc}") from exc


def read_optimizer_json(path: Path) -> dict[str, Any]:
    """The optimizer.json both the hf and torch_dcp backends write next to their tensors."""
    doc = read_json(path)
    if not isinstance(doc, dict) or doc.get("format_version") != 1 or "optimizer" not in doc:
        raise CheckpointError(f"{path}: not an optimizer.json of format_version 1")
    return doc


def encode(value: Any, *, where: str, tensors: dict[str, torch.Tensor] | None = None) -> Any:
    """JSON-ready form of `value`; tensors go into `tensors` (None: tensors are an error)."""
    return _enc(value, "", where, tensors)


def _enc(value: Any, key: str, where: str, tensors: dict[str, torch.Tensor] | None) -> Any:
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
        items = [_enc(v, f"{key}[{i}]", where, tensors) for i, v in enumerate(value)]
        return {_TUPLE: items} if isinstance(value, tuple) else items
    if isinstance(value, Mapping):
        return _enc_dict(value, key, where, tensors)
    item = getattr(value, "item", None)
    if type(value).__module__ == "numpy" and callable(item):
        return _enc(item(), key, where, tensors)
    raise NotSerializable(where, key, value)


def _enc_dict(value: Mapping[Any, Any], key: str, where: str, tensors: dict[str, torch.Tensor] | None) -> Any:
    plain = all(isinstance(k, str) and not k.startswith("__") for k in value)
    if plain:
        return {k: _enc(v, f"{key}.{k}" if key else k, where, tensors) for k, v in value.items()}
    pairs = []
    for k, v in value.items():
        label = f"{key}[{k!r}]"
        pairs.append([_enc(k, label, where, None), _enc(v, label, where, tensors)])
    return {_DICT: pairs}


def decode(data: Any, *, where: str, tensors: Mapping[str, torch.Tensor] | None = None) -> Any:
    """Inverse of `encode`; a malformed tree is a CheckpointError naming `where` and the key."""
    return _dec(data, "", where, tensors or {})


def _dec(data: Any, key: str, where: str, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(data, list):
        return [_dec(v, f"{key}[{i}]", where, tensors) for i, v in enumerate(data)]
    if not isinstance(data, dict):
        return data
    tags = [k for k in data if k.startswith("__")]
    if not tags:
        return {k: _dec(v, f"{key}.{k}" if key else k, where, tensors) for k, v in data.items()}
    if len(data) != 1 or tags[0] not in _TAGS:
        raise CheckpointError(f"{where}: unknown tag {tags[0]!r} at {key or '<root>'}")
    tag, body = tags[0], data[tags[0]]
    try:
        return _dec_tag(tag, body, key, where, tensors)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: malformed {tag} at {key or '<root>'}: {exc}") from exc


def _dec_tag(tag: str, body: Any, key: str, where: str, tensors: Mapping[str, torch.Tensor]) -> Any:
    if tag == _TUPLE:
        if not isinstance(body, list):
            raise TypeError("expected a list")
        return tuple(_dec(v, f"{key}[{i}]", where, tensors) for i, v in enumerate(body))
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
    out: dict[Any, Any] = {}
    for k, v in body:
        k = _dec(k, key, where, tensors)
        if isinstance(k, list):
            raise TypeError(f"key {k!r} is not hashable")
        out[k] = _dec(v, f"{key}[{k!r}]", where, tensors)
    return out
