"""The plan of a sync: what it says, how the sender makes it, and how a receiver checks it.

The plan names every tensor (name, wire dtype, shape) and where each piece of it sits in
which bucket; the sender computes it from metadata alone and sends it ahead of bucket 0. A
receiver sizes its buffers, builds its views and hands its rollout tensors by what the plan
says, so it trusts none of it: `parse_plan` reads the wire form strictly (an int is an int,
not a bool, float or string) and `check_plan` proves that every tensor is covered exactly
once, byte for byte and in order, by aligned pieces that stay inside their buckets, before
any buffer is allocated. A plan that fails is refused with the reason; the receiver names
itself and tells the sender (see `receiver.accept`).
"""

from __future__ import annotations

import functools
import gc
import io
import itertools
import json
import math
import warnings
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from backends.engines.options import MAX_BUCKET_BYTES, MIN_BUCKET_BYTES
from lifecycle.errors import EngineError

ALIGN = 64
_MAX_INT = (1 << 63) - 1
"""Offsets, sizes and element counts must fit torch's int64 arithmetic."""
_KEYS = ("format", "bucket_bytes", "verify", "tensors", "buckets")
FORMAT = 6
"""The wire format both sides must speak, sent in every plan: 3 sent a group engine's bucket as
two broadcasts (header, then data), which a receiver of another format would post as one; 4
lays a shared flip weight set out as every bucket's data back to back, then the headers
(`slots.join`), where 3 had each header before its bucket's data; 5 sends a group engine's
headers all before bucket 0, in one broadcast, and each bucket's data alone (`collective`);
6 names the plan in a sync's `plan` key by its id, the plan posted once under that id while
it stays the same (`control.reference`)."""


class PlanRefused(EngineError):
    """Why a receiver will not take a sync, without who says so: the engine adds its name and
    rank on its side, and sends the bare reason to the sender."""


@contextmanager
def collector_held() -> Iterator[None]:
    """Python's cyclic garbage collector held off while a plan's objects are built or read: a plan
    of tens of thousands of tensors allocates hundreds of thousands of lists and records, none of
    them in a cycle, and the collector would walk them over and over (about 40% of reading a plan
    of 65536 tensors). Reference counting frees as usual; the collector is on again after, unless
    it was off before. The switch is process-wide: other threads collect no cycles meanwhile,
    and leaving turns the collector on even if another thread turned it off in between."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def untracked_views() -> AbstractContextManager[object]:
    """Where `as_strided` makes a tensor of the same storage that autograd does not track as a
    view of its base, as `Tensor.set_` does: 312 bytes a tensor instead of 600, built in 1.1 us
    instead of 1.6 (a receiver keeps one a tensor in each set it holds). Nothing relies on a
    view's base, and no version counter guards a handed tensor past the lifetime `Incoming`
    gives it: transports and memmoves land bytes without bumping one anyway. Torch's own
    dispatch guard, where the build has it."""
    guard = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", None)
    return nullcontext() if guard is None else guard()


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """A tensor as it travels: its name, wire dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes [start, start + nbytes) of tensor `index`, at `offset` of a bucket's data region."""

    index: int
    offset: int
    start: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Plan:
    """Where every byte of one sync travels; sent ahead of the first bucket.

    It depends only on the tensors' names, dtypes and shapes, so a trainer whose weights keep
    their shapes sends the same plan every sync, and both sides reuse what they built from it.
    """

    bucket_bytes: int
    verify: bool
    tensors: list[TensorMeta]
    buckets: list[list[Piece]]

    def used(self, k: int) -> int:
        """Bytes of bucket k's data region that travel (aligned, so checksums see whole words).

        The last piece ends last: `check_plan` holds every bucket's pieces in offset order."""
        last = self.buckets[k][-1]
        return align(last.offset + last.nbytes)

    def sizes(self) -> list[int]:
        """Every bucket's `used` bytes: what a receiver that keeps every bucket holds of each."""
        return [self.used(k) for k in range(len(self.buckets))]

    @property
    def total_bytes(self) -> int:
        """Every tensor's bytes; only for a plan `check_plan` passed (a received plan's shapes
        are not summed before they are checked)."""
        return sum(meta.nbytes for meta in self.tensors)

    @collector_held()
    def to_bytes(self) -> bytes:
        """The plan as JSON, the bytes `json.dumps` gives for its fields (compact separators),
        written a few thousand entries at a time: building the whole nested list first held
        about five times the plan's bytes while it ran (27 MiB at 65536 tensors)."""
        out = io.BytesIO()
        out.write(b'{"format":%d,"bucket_bytes":%d,"verify":%s,"tensors":[' % (
            FORMAT, self.bucket_bytes, b"true" if self.verify else b"false"))
        _write_entries(out, ([m.name, str(m.dtype).removeprefix("torch."), list(m.shape)] for m in self.tensors))
        out.write(b'],"buckets":[')
        for k, bucket in enumerate(self.buckets):
            out.write(b",[" if k else b"[")
            _write_entries(out, ([p.index, p.offset, p.start, p.nbytes] for p in bucket))
            out.write(b"]")
        out.write(b"]}")
        return out.getvalue()


_BATCH = 4096
"""Entries `Plan.to_bytes` turns into JSON at a time."""


def _write_entries(out: io.BytesIO, entries: Iterator[list[Any]]) -> None:
    """`entries` as the inside of a JSON list (commas between, no brackets)."""
    first = True
    while batch := list(itertools.islice(entries, _BATCH)):
        out.write((("" if first else ",") + json.dumps(batch, separators=(",", ":"))[1:-1]).encode())
        first = False


@collector_held()
def make_plan(metas: Sequence[TensorMeta], bucket_bytes: int, verify: bool) -> Plan:
    """Lay tensors out in order: whole when they fit a bucket, else in chunks filling buckets,
    each chunk but the last a whole number of `ALIGN` bytes, so a receiver that keeps the
    buckets' data back to back holds the chunks back to back (`slots.join`) whatever
    `bucket_bytes` is."""
    buckets: list[list[Piece]] = [[]]
    used = 0
    for index, meta in enumerate(metas):
        size, step = meta.nbytes, meta.dtype.itemsize
        if size > bucket_bytes and ALIGN % step == 0:
            step = ALIGN
        if size <= bucket_bytes and align(used) + size > bucket_bytes:
            buckets.append([])
            used = 0
        start = 0
        while True:
            offset = align(used)
            room = (bucket_bytes - offset) // step * step
            if room <= 0:
                buckets.append([])
                used = 0
                continue
            n = min(room, size - start)
            buckets[-1].append(Piece(index, offset, start, n))
            used, start = offset + n, start + n
            if start >= size:
                break
    return Plan(bucket_bytes, verify, list(metas), [b for b in buckets if b])


@collector_held()
def parse_plan(raw: bytes) -> Plan:
    """The plan in `raw`, read strictly and checked (`check_plan`); `PlanRefused` says what is wrong.

    Reading checks the JSON's shape (objects, lists, and ints that are ints); what the values
    mean, names and bucket_bytes included, is `check_plan`'s to judge."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise PlanRefused(f"it is not JSON ({type(exc).__name__}: {_show(str(exc))})") from None
    if isinstance(data, dict) and (type(data.get("format")) is not int or data["format"] != FORMAT):
        sent = _show(data["format"]) if "format" in data else "older than 3 (it has no 'format' key)"
        raise PlanRefused(f"it is in wire format {sent} and this receiver reads format {FORMAT}: run the same "
                          "version of this library on both sides")
    if not isinstance(data, dict) or sorted(data) != sorted(_KEYS):
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise PlanRefused(f"it must be an object with exactly the keys {', '.join(_KEYS)}; got {_show(got)}")
    if type(data["verify"]) is not bool:
        raise PlanRefused(f"verify must be true or false, got {_show(data['verify'])}")
    # Each entry read is dropped from the parsed JSON at once: its ints and names live on in the
    # plan, its lists do not, so reading holds little more than the JSON at any time (holding both
    # whole doubled the peak: 50 MiB at 65536 tensors).
    entries = _list(data["tensors"], "tensors")
    tensors = []
    for i, entry in enumerate(entries):
        tensors.append(_tensor(i, entry))
        entries[i] = None
    entries = _list(data["buckets"], "buckets")
    buckets = []
    for k, bucket in enumerate(entries):
        buckets.append([_piece(k, j, entry) for j, entry in enumerate(_list(bucket, f"bucket {k}"))])
        entries[k] = None
    plan = Plan(data["bucket_bytes"], data["verify"], tensors, buckets)
    del data, entries
    check_plan(plan)
    return plan


def check_plan(plan: Plan) -> None:
    """Refuse (`PlanRefused`) a plan that does not cover every tensor exactly once.

    Every tensor has a unique non-empty name, a dtype that can travel and a shape torch can
    build. Its pieces, in plan order, start at 0 and each where the one before ended, in whole
    elements, up to its size: no gap, no overlap, no chunk out of order (a receiver rejoins a
    chunked tensor in plan order and hands it out at its last chunk). A zero-byte tensor has
    exactly one zero-byte piece. Inside a bucket, pieces are aligned, in offset order without
    overlapping, and end within `bucket_bytes`; no bucket is empty.
    """
    if not _is_int(plan.bucket_bytes, MIN_BUCKET_BYTES, MAX_BUCKET_BYTES):
        raise PlanRefused(f"bucket_bytes must be an integer in {MIN_BUCKET_BYTES}..{MAX_BUCKET_BYTES}, "
                          f"got {_show(plan.bucket_bytes)}")
    named: dict[str, int] = {}
    for i, meta in enumerate(plan.tensors):
        _check_meta(i, meta)
        if named.setdefault(meta.name, i) != i:
            raise PlanRefused(f"tensors {named[meta.name]} and {i} are both named {_show(meta.name)}")
    filled = [0] * len(plan.tensors)
    pieces = [0] * len(plan.tensors)
    for k, bucket in enumerate(plan.buckets):
        if not bucket:
            raise PlanRefused(f"bucket {k} of {len(plan.buckets)} is empty")
        end = 0
        for j, p in enumerate(bucket):
            if not 0 <= p.index < len(plan.tensors):
                raise PlanRefused(f"bucket {k} piece {j} names tensor {p.index}; the plan has "
                                  f"{len(plan.tensors)} (0..{len(plan.tensors) - 1})")
            meta = plan.tensors[p.index]
            problem = _place_problem(p, end, plan.bucket_bytes) or _piece_problem(p, meta, filled[p.index],
                                                                                   pieces[p.index])
            if problem is not None:  # worded only for a piece that fails: a plan has one piece a tensor or more
                raise PlanRefused(f"bucket {k} piece {j} (tensor {p.index} {_show(meta.name)}) {problem}")
            end = p.offset + p.nbytes
            filled[p.index] += p.nbytes
            pieces[p.index] += 1
    for i, meta in enumerate(plan.tensors):
        if not pieces[i]:
            raise PlanRefused(f"tensor {i} {_show(meta.name)} is in no bucket")
        if filled[i] != meta.nbytes:
            raise PlanRefused(f"tensor {i} {_show(meta.name)} is covered up to byte {filled[i]} of {meta.nbytes}")


def _check_meta(i: int, meta: TensorMeta) -> None:
    if not isinstance(meta.name, str) or not meta.name:
        raise PlanRefused(f"tensor {i} has no name: names are non-empty strings, got {_show(meta.name)}")
    if not isinstance(meta.dtype, torch.dtype) or not travels(meta.dtype):
        raise PlanRefused(f"tensor {i} {_show(meta.name)} has dtype {meta.dtype}, which cannot travel "
                          "(sub-byte and quantized dtypes cannot be copied element by element)")
    elements = 1
    for size in meta.shape:
        if type(size) is not int or size < 0:
            raise PlanRefused(f"tensor {i} {_show(meta.name)} has shape {_show(list(meta.shape))}: "
                              "sizes are non-negative integers")
        elements *= max(size, 1)
        if elements > _MAX_INT:
            break
    if elements * meta.dtype.itemsize > _MAX_INT:
        raise PlanRefused(f"tensor {i} {_show(meta.name)} has shape {_show(list(meta.shape))}, "
                          f"too large for any tensor")


def _place_problem(p: Piece, end: int, bucket_bytes: int) -> str | None:
    """What is wrong with where piece p sits in its bucket, after the piece before it (which
    ends at `end`); None: it sits aligned, after that piece and inside the bucket."""
    if p.offset % ALIGN:
        return f"sits at offset {p.offset} of its bucket, not a multiple of {ALIGN}"
    if p.offset < end:
        return f"at offset {p.offset} overlaps the piece before it in its bucket, which ends at {end}"
    if p.offset + p.nbytes > bucket_bytes:
        return f"ends at byte {p.offset + p.nbytes} of its bucket, past bucket_bytes={bucket_bytes}"
    return None


def _piece_problem(p: Piece, meta: TensorMeta, filled: int, count: int) -> str | None:
    """What is wrong with piece p of `meta`; None: it continues its cover exactly where the
    pieces before it left off."""
    if p.start != filled:
        what = "leaves a gap after" if p.start > filled else "overlaps"
        return (f"carries its bytes {p.start}..{p.start + p.nbytes}, which {what} the {filled} bytes its pieces "
                "before it carry: a tensor's pieces must follow each other")
    if p.nbytes % meta.dtype.itemsize:
        return (f"carries {p.nbytes} bytes, not a whole number of {meta.dtype} elements "
                f"({meta.dtype.itemsize} bytes each)")
    if p.start + p.nbytes > meta.nbytes:
        return f"carries bytes {p.start}..{p.start + p.nbytes}, past the tensor's {meta.nbytes} bytes"
    if p.nbytes == 0 and (meta.nbytes or count):
        return "carries no bytes: only a zero-byte tensor has one, and only one"
    return None


@functools.cache
def travels(dtype: torch.dtype) -> bool:
    """Whether bucket bytes can be viewed as `dtype` and copied element by element, as a
    receiver does to rejoin chunks: every dtype torch has except the sub-byte and quantized ones."""
    raw = torch.zeros(ALIGN + 4 * dtype.itemsize, dtype=torch.uint8)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            whole = torch.empty(4, dtype=dtype)
            whole[:2].copy_(raw[ALIGN:ALIGN + 2 * dtype.itemsize].view(dtype))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


@functools.lru_cache(maxsize=64)  # a plan names a few dtypes once a tensor; a name it refuses is not kept
def wire_dtype(name: str) -> torch.dtype:
    """The torch dtype a plan names ("float32", "uint16", ...)."""
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise PlanRefused(f"{_show(name)} is not a torch dtype")
    return dtype


def _tensor(i: int, entry: Any) -> TensorMeta:
    if not (isinstance(entry, list) and len(entry) == 3):
        raise PlanRefused(f"tensor {i} must be [name, dtype, shape], got {_show(entry)}")
    name, dtype, shape = entry
    if not isinstance(dtype, str):
        raise PlanRefused(f"tensor {i} {_show(name)} has dtype {_show(dtype)}, not a dtype name")
    if not isinstance(shape, list):
        raise PlanRefused(f"tensor {i} {_show(name)} shape must be a list, got {_show(shape)}")
    for d, size in enumerate(shape):
        if not _is_int(size, 0, _MAX_INT):
            raise PlanRefused(f"tensor {i} {_show(name)} size {d} must be an integer in 0..{_MAX_INT}, "
                              f"got {_show(size)}")
    return TensorMeta(name, wire_dtype(dtype), tuple(shape))


def _piece(k: int, j: int, entry: Any) -> Piece:
    if not (isinstance(entry, list) and len(entry) == 4):
        raise PlanRefused(f"bucket {k} piece {j} must be [index, offset, start, nbytes], got {_show(entry)}")
    for what, value in zip(("index", "offset", "start", "nbytes"), entry):
        if not _is_int(value, 0, _MAX_INT):
            raise PlanRefused(f"bucket {k} piece {j} {what} must be an integer in 0..{_MAX_INT}, got {_show(value)}")
    return Piece(*entry)


def _is_int(value: Any, low: int, high: int) -> bool:
    """An int from the wire, not a bool, float or string that would pass for one."""
    return type(value) is int and low <= value <= high


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise PlanRefused(f"{what} must be a list, got {_show(value)}")
    return value


def _show(value: Any) -> str:
    """A value from the wire, quoted and cut short: a message never grows with a hostile plan."""
    try:
        text = repr(value)
    except RecursionError:
        return f"a {type(value).__name__} nested too deep to show"
    return text if len(text) <= 80 else text[:77] + "..."
