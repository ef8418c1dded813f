"""Batches of prompts and results across rollouts: a prompt batch's fingerprint (which the run
record keeps per step), a batch split among rollouts, and their results merged back, refusing
any join that would change a value."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lifecycle.errors import LifecycleError, shorten


def fingerprint(value: Any) -> str:
    """A short digest of a batch of prompts: equal prompts give equal digests, and prompts that
    differ anywhere (one element of a tensor or numpy array, one item of a list, tuple or dict
    of them) differ. Tensors and arrays go in by dtype, shape and bytes (bf16 and float8 too),
    containers item by item (a dict's order is no part of it), a dataclass or another object with
    attributes by its type and its fields (a repr summarises a long tensor, or names an address),
    anything else by its repr."""
    digest = hashlib.sha256()
    _feed(digest, value, _DEPTH)
    return digest.hexdigest()[:16]


_DEPTH = 64
"""How deep `fingerprint` follows containers; deeper (a list holding itself), a bounded repr."""


def _feed(digest: Any, value: Any, depth: int) -> None:
    if depth <= 0:
        _tagged(digest, "deep", shorten(value).encode())
    elif isinstance(value, torch.Tensor):
        _tagged(digest, f"tensor {value.dtype} {tuple(value.shape)}", _tensor_bytes(value))
    elif isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)
        if array.dtype.hasobject:
            _tagged(digest, f"objects {array.shape}", b"")
            for item in array.ravel():
                _feed(digest, item, depth - 1)
        else:
            _tagged(digest, f"array {array.dtype!r} {array.shape}", np.ascontiguousarray(array).tobytes())
    elif isinstance(value, Mapping):
        _tagged(digest, f"{type(value).__qualname__} {len(value)}", b"")
        for pair in sorted(_sub(key, depth) + _sub(item, depth) for key, item in value.items()):
            digest.update(pair)
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):  # a list, tuple, deque
        numbers = _numbers(value)
        if numbers is not None:  # token ids: one array, not a walk item by item
            _tagged(digest, f"{type(value).__qualname__} of numbers {numbers.dtype!r} {numbers.shape}",
                    numbers.tobytes())
            return
        _tagged(digest, f"{type(value).__qualname__} {len(value)}", b"")
        for item in value:
            _feed(digest, item, depth - 1)
    elif (fields := _fields(value)) is not None:
        _tagged(digest, f"object {type(value).__module__}.{type(value).__qualname__}", b"")
        _feed(digest, fields, depth - 1)
    else:
        _tagged(digest, type(value).__qualname__, _scalar_bytes(value))


def _fields(value: Any) -> dict[str, Any] | None:
    """A dataclass's fields, or another object's own attributes (`__dict__`); None for a value
    that has none (a number, a string), a class, or an empty `__dict__` (its repr says more)."""
    if isinstance(value, type):
        return None
    if dataclasses.is_dataclass(value):
        return {field.name: getattr(value, field.name, None) for field in dataclasses.fields(value)}
    own = getattr(value, "__dict__", None)
    return dict(own) if isinstance(own, dict) and own else None


def _numbers(value: Sequence[Any]) -> np.ndarray | None:
    """A sequence of plain numbers, or of equal-length sequences of them (token ids), as one
    numpy array; None for anything else (strings, ragged or mixed items, integers past 64 bits)."""
    first = value[0] if len(value) else None
    if not isinstance(first, (int, float, list, tuple)) or isinstance(first, bool):
        return None
    try:
        array = np.asarray(value)
    except (ValueError, TypeError, OverflowError):
        return None
    if array.dtype.kind == "f":  # exact only if no integer is past float64's 2**53: it would round, prompts collide
        leaves: Any = value
        for _ in range(array.ndim - 1):
            leaves = itertools.chain.from_iterable(leaves)
        if any(isinstance(leaf, (int, np.integer)) and not -2**53 <= leaf <= 2**53 for leaf in leaves):
            return None
    return array if array.dtype.kind in "biuf" else None


def _sub(value: Any, depth: int) -> bytes:
    digest = hashlib.sha256()
    _feed(digest, value, depth - 1)
    return digest.digest()


def _tagged(digest: Any, tag: str, data: bytes) -> None:
    """The tag and the data's length before the data: no two values feed the same bytes."""
    digest.update(f"{tag}\0{len(data)}\0".encode())
    digest.update(data)


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes, through a uint8 view (numpy has no bf16 or float8); a quantized one by its
    values; one with no plain storage to read (a meta one) by its repr."""
    try:
        flat = tensor.detach().cpu()
        flat = flat.dequantize() if flat.is_quantized else flat
        flat = (flat.to_dense() if flat.layout != torch.strided else flat).resolve_conj().resolve_neg()
        flat = flat.contiguous().reshape(-1)  # a conjugate or negative view's own values, not its storage's
        return flat.view(torch.uint8).numpy().tobytes()
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return shorten(tensor, 10_000).encode()


def _scalar_bytes(value: Any) -> bytes:
    if isinstance(value, int) and not isinstance(value, bool):
        return hex(value).encode()  # any size (repr refuses integers past 4300 digits)
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    try:
        return repr(value).encode("utf-8", "surrogatepass")
    except Exception:  # noqa: BLE001 - a repr that fails still gets a digest
        return shorten(value).encode("utf-8", "surrogatepass")


def split_batch(prompts: Any, parts: int) -> list[Any]:
    """Split along the first dimension into up to `parts` chunks whose lengths differ by one at
    most (a tensor, a numpy array, or a sequence such as a list), never more chunks than it has
    rows: no rollout gets an empty chunk, whose mean would be NaN (an empty batch goes whole to the
    first rollout, the recipe decides what it means). Anything else is a `LifecycleError` naming its type."""
    if parts == 1:
        return [prompts]
    if isinstance(prompts, torch.Tensor) and prompts.dim() > 0:
        return list(torch.tensor_split(prompts, max(1, min(parts, len(prompts)))))
    if isinstance(prompts, np.ndarray) and prompts.ndim > 0:
        return list(np.array_split(prompts, max(1, min(parts, len(prompts)))))
    if isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)):
        items = list(prompts)  # a deque or a user's sequence need not slice
        count = max(1, min(parts, len(items)))
        sizes = [len(items) // count + (i < len(items) % count) for i in range(count)]  # as np.array_split's
        starts = list(itertools.accumulate(sizes, initial=0))
        return [items[start:start + size] for start, size in zip(starts, sizes)]
    raise LifecycleError(f"the policy's prompts are a {type(prompts).__name__}, which cannot be split between "
                         f"{parts} rollouts: return a tensor, a numpy array or a list (one item per prompt)")


def merge_batches(batches: Sequence[Any], names: Sequence[str] | None = None,
                  sizes: Sequence[int] | None = None) -> dict[str, Any]:
    """Join the rollouts' batches key by key: tensors and numpy arrays concatenated, lists and
    tuples extended, real numbers (a rollout's mean) averaged, each weighted by `sizes`, how
    many prompts that rollout got (equal weights without it; a count of sizes other than of
    batches is a `LifecycleError`, not a value dropped unseen). Batches that are no mappings of
    the same keys, a key whose values are of different kinds, or of any other kind (a string,
    a dict) are a `LifecycleError` naming the rollout and the key: nothing is joined by guess."""
    names = list(names) if names is not None else [f"rollout{i}" for i in range(len(batches))]
    if sizes is not None and len(sizes) != len(batches):
        raise LifecycleError(f"merge_batches got {len(sizes)} size(s) for {len(batches)} rollouts' batches: one "
                             "per batch, how many prompts that rollout got")
    for name, batch in zip(names, batches):
        if not isinstance(batch, Mapping):
            raise LifecycleError(f"{name}'s generate returned a {type(batch).__name__}; it returns a dict of the batch")
    if len(batches) == 1:
        return dict(batches[0])
    keys = list(batches[0])
    for name, batch in zip(names[1:], batches[1:]):
        if set(batch) != set(keys):
            raise LifecycleError(f"{name}'s batch has keys {sorted(map(str, batch))}, {names[0]}'s "
                                 f"{sorted(map(str, keys))}: every rollout returns the same keys")
    weights = [1] * len(batches) if sizes is None or not any(sizes) else list(sizes)
    return {key: _joined(key, [batch[key] for batch in batches], names, weights) for key in keys}


def add_scores(batch: dict[str, Any], scores: Sequence[Any], roles: Sequence[str]) -> dict[str, Any]:
    """`batch` with each trainer's `recipe.score` result added (`roles[i]` returned `scores[i]`).
    A result that is no mapping, or a key the batch already holds (the rollouts' or another
    trainer's), is a `LifecycleError` naming the role and the key: every trainer trains on the
    same batch, and a value replaced unseen would train the others on it."""
    joined = dict(batch)
    source = {key: "the rollouts' batch" for key in joined}
    for role, scored in zip(roles, scores):
        if not isinstance(scored, Mapping):
            raise LifecycleError(f"recipe.score({role!r}, ...) returned {shorten(scored)} ({type(scored).__name__}), "
                                 "not a dict of what the other trainers need (an empty dict for nothing)")
        for key in scored:
            if key in source:
                raise LifecycleError(f"recipe.score({role!r}, ...) returned key {key!r}, which {source[key]} holds "
                                     "already; each trainer adds keys of its own, as every trainer trains on one batch")
            source[key] = f"recipe.score({role!r}, ...)"
        joined.update(scored)
    return joined


def _joined(key: Any, values: list[Any], names: Sequence[str], weights: Sequence[int]) -> Any:
    kinds = {_kind(value) for value in values}
    kind = kinds.pop() if len(kinds) == 1 else None
    try:
        if kind in ("tensor", "array"):
            _check_dtypes(key, values, names)
        if kind == "tensor":
            return torch.cat(values)
        if kind == "array":
            return np.concatenate(values)
        if kind == "list":
            return [item for value in values for item in value]
        if kind == "number":
            weighed = [(weight, float(value)) for weight, value in zip(weights, values) if weight]
            return sum(weight * value for weight, value in weighed) / sum(weight for weight, _ in weighed)
    except (RuntimeError, ValueError, TypeError, OverflowError) as exc:  # shapes or dtypes that do not join
        raise LifecycleError(f"batch key {key!r}: the rollouts' values do not join: {type(exc).__name__}: "
                             f"{shorten(str(exc))}") from None
    found = ", ".join(f"{name}: {type(value).__name__}" for name, value in zip(names, values))
    raise LifecycleError(f"batch key {key!r} cannot be joined across rollouts ({found}): give tensors, numpy "
                         "arrays or lists (one item per sample), or real numbers (averaged)")


def _check_dtypes(key: Any, values: list[Any], names: Sequence[str]) -> None:
    """`LifecycleError` unless the dtype the tensors or arrays join as holds each of theirs exactly
    (int64 ids beside float32 would join as float32 and change past 2**24). Numbers join with
    numbers; any other kind (strings, dates, objects) only with its own: numpy would make text."""
    dtypes = [value.dtype for value in values]
    found = ", ".join(f"{name}: {dtype}" for name, dtype in zip(names, dtypes))
    if isinstance(values[0], np.ndarray) and len(kinds := {d.kind for d in dtypes}) > 1 and not kinds <= set("biufc"):
        raise LifecycleError(f"batch key {key!r}: the rollouts' arrays hold different kinds of values ({found}); "
                             "numbers join with numbers, and strings, dates or objects only with their own kind")
    joined = functools.reduce(torch.promote_types if isinstance(values[0], torch.Tensor) else np.promote_types, dtypes)
    if not all(_exact(dtype, joined) for dtype in dtypes):
        raise LifecycleError(f"batch key {key!r}: joining the rollouts' dtypes ({found}) as {joined} would change "
                             "values; return the same dtype from every rollout")


def _exact(src: Any, dst: Any) -> bool:
    """Every value of dtype `src` (torch's or numpy's) is one of `dst` too. numpy's 'safe' casting,
    which this follows otherwise, takes int64 to float64 (rounding past 2**53); `torch.can_cast`
    takes it even to float16."""
    if src == dst:
        return True
    if isinstance(src, torch.dtype):
        try:
            src, dst = (torch.empty(0, dtype=d).numpy().dtype for d in (src, dst))
        except (TypeError, RuntimeError):  # bf16, float8 (no numpy dtype): a float widens exactly to float32 and up
            return src == torch.bool or (src.is_floating_point and dst in _WIDE)
    rounds = src.kind in "iu" and dst.kind in "fc" and src.itemsize >= 8
    return bool(np.can_cast(src, dst, "safe")) and not rounds


_WIDE = (torch.float32, torch.float64, torch.complex64, torch.complex128)


def _kind(value: Any) -> str | None:
    if isinstance(value, torch.Tensor) and value.ndim == 0:  # a rollout's mean (`rewards.mean()`): a number
        return "number" if not (value.dtype.is_complex or value.dtype == torch.bool) else None
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return "number" if np.issubdtype(value.dtype, np.integer) or np.issubdtype(value.dtype, np.floating) else None
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, np.ndarray):
        return "array"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return "number"
    return None
