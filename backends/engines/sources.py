"""What packing a bucket depends on about the sender's tensors: `describe` says whether they
are where they were last sync, and a `Program` is what packing one bucket from them takes
(`buckets.Layout.program`), worked out once and reused while `describe` finds them unchanged.
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from backends.engines.plan import TensorMeta, travels
from lifecycle.errors import EngineError, shorten

Copied = list[tuple[int, int, int]]
"""(offset in the data region, address, nbytes) of pieces `Layout.pack` copied byte for byte."""
PLAIN = (torch.Tensor, torch.nn.Parameter)
"""Tensor types whose memory is their storage as it stands (no subclass with its own layout)."""


def wire_bytes(src: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a tensor's memory is its values as they travel in `dtype`: that dtype, and no lazy
    conjugate or negation (whose memory holds other values)."""
    return src.dtype == dtype and not (src.is_conj() or src.is_neg())


Source = bytes
"""A fingerprint of the sender's tensors (`describe`): 16 bytes, whatever their count."""

_CHUNK = 512
"""Tensors `describe` reads at a time: it holds their attributes (some 250 bytes a tensor) while
it hashes them, never a list as long as the tensors."""
_PLAIN = frozenset(PLAIN)
_CODES: dict[object, int] = {}
"""Small integers standing for the dtypes and devices `describe` has met, in this process."""
_NUMBERS = itertools.count()
"""Where `_CODES` takes a new number: two threads meeting two new keys at once take two."""
_EXTRA_STATE = "_extra_state"
"""The last part of the state dict key of a module's extra state (torch's `_EXTRA_STATE_KEY_SUFFIX`)."""
_dtype, _device, _shape = operator.attrgetter("dtype"), operator.attrgetter("device"), operator.attrgetter("shape")


def _code(key: object) -> int:
    code = _CODES.get(key)
    return _CODES.setdefault(key, next(_NUMBERS)) if code is None else code


def describe(named: Sequence[tuple[str, torch.Tensor]], last: Source | None = None,
             held: list[torch.UntypedStorage] | None = None) -> Source | None:
    """A fingerprint of all that packing the tensors' pieces depends on, and of every byte they
    reach: per tensor its name, device, dtype, shape, address, whether it is contiguous (and if
    not, its strides), how many bytes its storage holds, and its lazy conjugate and negation
    bits. Equal fingerprints mean the same plan, the same copies from the same addresses and the
    same bytes reached, each inside its storage (a storage shrunk or freed and given memory again
    at the same address tells by its size: `Layout.program` checks the bounds again): a contiguous
    tensor is its bytes at its address, whatever its strides on size-1 dimensions or its offset
    in its storage (`Layout.region` places a region by address too); any other tensor is copied
    by torch from the tensor as it is at the time, and reaches what its strides say (which a
    receiver's kept landing relies on: `inplace.Landing`). `last` itself when
    the tensors are as `last` describes them (so a sender can tell by identity); None when a
    tensor is not plain strided memory (then nothing is reused, and the sender checks each
    tensor: `memory_problem`). `held`, when given, gets every tensor's storage (a sender holds
    them until its last bucket is hashed): read here anyway, so not read twice.

    Read by column, `_CHUNK` tensors at a time: each attribute of every tensor in the chunk by
    one `map` (the loop runs in C, so a tensor costs its torch attribute reads, about 1 us in
    all), hashed with xxh3-128, the hash each bucket's bytes are checked with already, so a
    sender keeps 16 bytes however many tensors it sends. Each chunk's count goes first, and
    every column has a length that count or an earlier column fixes (names by their lengths,
    shapes by the dims, strides by the dims of the tensors marked not contiguous; one dtype and
    device for the whole chunk, marked as such, or one each),
    so two different chunks never hash the same bytes. A tensor of another layout is told by
    torch refusing its address or its sizes (sparse and mkldnn tensors have no data pointer, a
    nested tensor no sizes), not by reading its layout; a meta tensor by its device and a
    quantized or sub-byte one by its dtype."""
    hasher = xxhash.xxh3_128()
    update = hasher.update
    try:
        items = iter(named)
        while chunk := list(itertools.islice(items, _CHUNK)):
            names, tensors = zip(*chunk, strict=True)  # every item a pair: `sendable` names one that is not
            update(len(chunk).to_bytes(8, "little"))
            if not set(map(type, tensors)) <= _PLAIN:
                return None
            dtypes, devices, shapes = list(map(_dtype, tensors)), list(map(_device, tensors)), list(map(_shape, tensors))
            kinds, wheres = set(dtypes), set(devices)
            if any(device.type == "meta" for device in wheres) or not all(map(travels, kinds)):
                return None
            if len(kinds) == 1 and len(wheres) == 1:  # the common case: one code each for the chunk
                update(array("Q", (1, _code(*kinds), _code(*wheres))))
            else:
                update(array("Q", (2, *map(_code, dtypes), *map(_code, devices))))
            update(array("Q", map(len, names)))
            update("".join(names).encode(errors="surrogatepass"))
            contiguous = bytes(map(torch.Tensor.is_contiguous, tensors))
            update(array("Q", map(torch.Tensor.data_ptr, tensors)))  # raises first for what has no storage
            storages = list(map(torch.Tensor.untyped_storage, tensors))
            for column in (array("Q", map(torch.UntypedStorage.nbytes, storages)), array("Q", map(len, shapes)),
                           array("Q", itertools.chain.from_iterable(shapes)), contiguous,
                           bytes(map(torch.Tensor.is_neg, tensors))):
                update(column)
            if held is not None:
                held.extend(storages)
            if 0 in contiguous:  # the strides of those that are not: what they reach (a landing checks it)
                strided = itertools.compress(tensors, map(operator.not_, contiguous))
                update(array("q", itertools.chain.from_iterable(map(torch.Tensor.stride, strided))))
            if any(dtype.is_complex for dtype in kinds):  # only a complex tensor is a lazy conjugate
                update(bytes(map(torch.Tensor.is_conj, tensors)))
    except RuntimeError:  # no address (sparse, mkldnn) or no sizes (nested): not plain memory
        return None
    except (TypeError, ValueError):  # not (str, tensor) pairs: `sendable` says which
        return None
    found = hasher.digest()
    return last if found == last else found


def state_weights(model: Any) -> Iterator[tuple[str, Any]]:
    """A model's weights as a sync sends them: its state dict (parameters and persistent
    buffers), each tied tensor once, under its first name (a receiver ties them again by name).
    Tied means one `place` (a view of another shape, or an empty tensor, is a weight of its
    own). Only tensors that share an address with another have their place read: the rest cost
    their address, a small part of what the state dict itself costs. What is not plain memory goes as it is, for the sender to refuse.
    A module's extra state (`get_extra_state`, a dict or a TransformerEngine layer's tensor of
    bytes) is no weight and stays behind, as `adopt_weights` never asks for it."""
    state = model.state_dict()
    extra = _extra_state_keys(model, state)
    items = [(name, tensor) for name, tensor in state.items() if name not in extra]
    addresses = _addresses([tensor for _, tensor in items])
    shared = {address for address, count in collections.Counter(addresses).items() if count > 1 and address}
    seen: set[object] = set()
    for (name, tensor), address in zip(items, addresses):
        if address in shared and memory_problem(tensor) is None and tensor.numel():
            key = place(tensor)
            if key in seen:
                continue
            seen.add(key)
        yield name, tensor


def _extra_state_keys(model: Any, state: Mapping[str, Any]) -> frozenset[str]:
    """The state dict keys of the extra state of a model's modules: `{prefix}_extra_state` of
    each module whose class overrides `get_extra_state` (torch saves it for those only), under
    every name a shared module goes by. For a model that is no `nn.Module` (a `MegatronModel`'s
    chunks, TransformerEngine layers in them), every key torch's suffix names so."""
    if not isinstance(model, torch.nn.Module):
        return frozenset(name for name in state if name == _EXTRA_STATE or name.endswith(f".{_EXTRA_STATE}"))
    base = torch.nn.Module.get_extra_state
    return frozenset(f"{prefix}.{_EXTRA_STATE}" if prefix else _EXTRA_STATE
                     for prefix, module in model.named_modules(remove_duplicate=False)
                     if type(module).get_extra_state is not base)


def _addresses(tensors: list[Any]) -> list[int]:
    """Each tensor's data pointer; 0 for what is not plain memory (it is never taken for another)."""
    if set(map(type, tensors)) <= _PLAIN:
        try:
            return list(map(torch.Tensor.data_ptr, tensors))
        except RuntimeError:  # a sparse or mkldnn tensor: read them one by one
            pass
    return [tensor.data_ptr() if isinstance(tensor, torch.Tensor) and memory_problem(tensor) is None else 0
            for tensor in tensors]


def pairs_of(engine: str, named: Any) -> list[Any]:
    """What a sender was handed, as a list: a mapping (a state dict) gives its items, an
    `nn.Module` its `state_weights` (what `Lifecycle.sync_weights` sends), pairs themselves;
    `EngineError` naming anything else, with what to send instead where it can tell."""
    if isinstance(named, Mapping):
        return list(named.items())
    if isinstance(named, torch.nn.Module):
        return list(state_weights(named))
    hint = None
    if isinstance(named, torch.Tensor):
        hint = "send [(name, tensor)]"
    elif callable(getattr(named, "state_dict", None)) or callable(getattr(named, "named_parameters", None)):
        hint = ("it is no nn.Module: send its state_dict() (a MegatronModel's gathers the HF-named weights, on "
                "every rank) or (name, tensor) pairs")
    elif isinstance(named, (str, bytes)) or not isinstance(named, Iterable):
        hint = ""
    if hint is not None:
        raise EngineError(f"{engine} engine: these weights cannot travel: expected a model, a state dict or "
                          f"(name, tensor) pairs, got a {type(named).__name__}" + (f": {hint}" if hint else ""))
    return list(named)


def sendable(engine: str, named: Iterable[Any] | Mapping[Any, Any]) -> list[tuple[str, torch.Tensor]]:
    """What a sender was handed, as a list of (name, tensor) pairs (`pairs_of`); `EngineError`
    naming the first item that is not a pair of a str and a tensor of plain memory
    (`memory_problem`)."""
    pairs = pairs_of(engine, named)
    for i, item in enumerate(pairs):
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            problem = f"item {i} is {_shown(item)}, not a (name, tensor) pair"
        elif not isinstance(item[0], str):
            problem = f"item {i} is named by {_shown(item[0])}, not a str"
        elif not isinstance(item[1], torch.Tensor):
            problem = f"tensor {i} {_shown(item[0])} is a {type(item[1]).__name__}, not a tensor"
        elif (kind := memory_problem(item[1])) is not None:
            problem = f"tensor {i} {_shown(item[0])} {kind}"
        else:
            continue
        raise EngineError(f"{engine} engine: these weights cannot travel: {problem}")
    return pairs


def metas_of(engine: str, pairs: list[tuple[str, torch.Tensor]], wire_dtype: Callable[[torch.Tensor], torch.dtype],
             *, checked: bool) -> list[TensorMeta]:
    """The plan's metadata of a sender's pairs (`checked`: `describe` read every one as plain
    memory, else `sendable` checks them); `EngineError` naming a tensor whose dtype torch cannot
    cast to its wire dtype (`engine.rollout_dtype`), before anything is posted."""
    if not checked:
        sendable(engine, pairs)
    metas = [TensorMeta(name, wire_dtype(t), tuple(t.shape)) for name, t in pairs]
    for i, ((name, tensor), meta) in enumerate(zip(pairs, metas)):
        if meta.dtype != tensor.dtype and not casts(tensor.dtype, meta.dtype):
            raise EngineError(f"{engine} engine: these weights cannot travel: tensor {i} {_shown(name)} of dtype "
                              f"{tensor.dtype} cannot be cast to engine.rollout_dtype {meta.dtype}")
    return metas


def _shown(value: Any) -> str:
    return shorten(value, 77) if isinstance(value, (str, bytes, int, float, type(None))) else f"a {type(value).__name__}"


@functools.cache
def casts(source: torch.dtype, wire: torch.dtype) -> bool:
    """Whether torch can cast `source` to `wire`, as packing does under `engine.rollout_dtype`."""
    try:
        torch.zeros(2, dtype=source).to(wire)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def place(tensor: torch.Tensor) -> tuple[object, ...]:
    """Where a tensor's values lie: two tensors of one place are one (tied weights, or a state
    dict's detached views of one parameter). By address and, for a tensor that is not
    contiguous, strides: a contiguous tensor is its bytes at its address, whatever its storage
    or the strides of its size-1 dimensions, as `describe` reads it."""
    return (tensor.device, tensor.dtype, tensor.data_ptr(), tuple(tensor.shape),
            None if tensor.is_contiguous() else tensor.stride())


def span(tensor: torch.Tensor) -> tuple[int, int]:
    """The addresses [low, high) of every byte a (strided, non-empty) tensor reads."""
    low = high = tensor.data_ptr()
    for size, stride in zip(tensor.shape, tensor.stride()):
        reach = (size - 1) * stride * tensor.element_size()
        low, high = (low + reach, high) if reach < 0 else (low, high + reach)
    return low, high + tensor.element_size()


def outside_storage(tensor: torch.Tensor) -> int | None:
    """The bytes its storage holds when a strided tensor reads past them (or before them), else
    None: a storage freed or shrunk under it (`untyped_storage().resize_`, as FSDP frees unsharded
    parameters), where copying it would read memory no longer its own."""
    if not tensor.numel():
        return None
    storage = tensor.untyped_storage()
    low, high = span(tensor)
    held = storage.nbytes()
    return held if low < storage.data_ptr() or high > storage.data_ptr() + held else None


def memory_problem(tensor: torch.Tensor) -> str | None:
    """Why a tensor's values are not plain strided memory a sync can copy, or None: a subclass
    that dispatches its own ops, another layout (sparse, mkldnn), a nested or quantized tensor,
    the meta device (no data), a lazy module's parameter or buffer before its first forward (no
    shape yet), or a dtype a plan cannot carry (sub-byte)."""
    if isinstance(tensor, torch.nn.parameter.UninitializedTensorMixin):  # reading its shape raises
        return "is an uninitialized lazy parameter or buffer (a Lazy* module): run a forward first"
    if type(tensor).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:  # DTensor, a fake tensor: its
        # storage is not its values (a DTensor's data pointer is 0); a Parameter subclass's is
        return f"is a {type(tensor).__name__}, a tensor subclass, not plain tensor memory: send its local tensors"
    if tensor.layout != torch.strided:
        return f"is not a strided tensor (layout {tensor.layout})"
    if tensor.is_nested or tensor.is_quantized:
        return "is a nested or quantized tensor"
    if tensor.device.type == "meta":
        return "is on the meta device, with no data: materialize the model (to_empty and init, or load) first"
    if not travels(tensor.dtype):
        return f"has dtype {tensor.dtype}, which a sync plan cannot carry"
    return None


@dataclass(frozen=True)
class Program:
    """What packing one bucket takes, worked out from its tensors (`Layout.program`)."""

    region: tuple[int, int] | None
    """(index of a tensor, address) where the bucket's data region starts, in that tensor's
    storage, as it would be packed (`Layout.region`); None when it must be packed."""
    moves: Copied
    """Host memmoves into a host slot: (offset in the data region, address, nbytes), adjacent
    pieces merged into one run."""
    rest: list[int]
    """Positions in the bucket of the pieces torch copies (`Layout._copy_piece`)."""


__all__ = ["PLAIN", "Copied", "Program", "Source", "casts", "describe", "memory_problem", "metas_of", "outside_storage",
           "pairs_of", "place", "span",
           "sendable", "state_weights", "wire_bytes"]
