"""Safetensors files written and read in one pass, with the file's checksum computed on the way.

A checkpoint must be checksummed to be trusted, but hashing a file after writing it, or
before loading it, reads every byte a second time. Here the checksum is a tree over pieces
of the file (`lifecycle.checksum`), hashed on every core while the bytes move (xxh3,
numpy's copy and file I/O all release the GIL), so integrity costs little.

Writes go out in file order from the calling thread while other threads hash the pieces
from the tensors' memory: measured steadier than writing pieces from several threads at
once. Reads are split into pieces that the threads copy out of a read-only mapping
straight into the destination tensors, each hashing its piece right after, while the bytes
are in cache: one copy, and no fresh memory to fault in. A mapping, because the kernel's
copy in preadv measured slower than faulting the mapping in.

The files follow the safetensors format (little-endian u64 header length, JSON header,
contiguous data) and load with `safetensors` and `transformers` as usual.
"""

from __future__ import annotations

import itertools
import json
import mmap
import os
import struct
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from lifecycle.boundary import open_regular, os_errors
from lifecycle.checksum import PIECE_BYTES, piece_digest, submitted, tree_digest
from lifecycle.errors import CheckpointError, shorten
from lifecycle.jsontree import parse_json

DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.uint16: "U16",
    torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32", torch.uint32: "U32",
    torch.float32: "F32", torch.float64: "F64", torch.int64: "I64", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
NAMES: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024
METADATA = "__metadata__"
"""The header key safetensors reserves for the file's string metadata: no tensor may have it."""
MAX_DIMS = 64
"""Dimensions one tensor may have: far beyond any model's, and a bound on a header's work."""
_MAX_BYTES = 2**63 - 1
"""What a tensor's size in bytes must fit (torch's storage size is an int64), zero-sized ones too."""
_IOV_MAX = 1024
"""The most buffers one pwritev takes on Linux; a piece of many small tensors has more."""


def _raw(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray())
    return memoryview(flat.view(torch.uint8).numpy())


def _prepare(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if tensor.dtype not in DTYPES:
        raise CheckpointError(f"tensor {name!r}: dtype {tensor.dtype} has no safetensors name")
    return tensor.detach().to("cpu").contiguous()


def write_file(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> str:
    """Write `tensors` as one safetensors file; returns its digest (`checksum.ALGORITHM`).

    The digest is of the bytes handed to the kernel, hashed from the tensors' memory while
    they are written: a caller passes it on to the manifest, which then never reads the file.
    """
    if METADATA in tensors:
        raise CheckpointError(f"{path}: tensor {METADATA!r} cannot be saved: safetensors reserves that name "
                              f"for the header's metadata, so the file could never be loaded; rename it")
    prepared = {name: _prepare(t, name) for name, t in tensors.items()}
    header: dict[str, Any] = {METADATA: dict(metadata)} if metadata else {}
    offset = 0
    for name, tensor in prepared.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-(8 + len(encoded)) % 8)
    prefix = struct.pack("<Q", len(encoded)) + encoded
    pieces = _by_piece([memoryview(prefix), *(_raw(tensor) for tensor in prepared.values())])
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    stop = threading.Event()

    def digest_of(index: int) -> int:
        if stop.is_set():
            raise CheckpointError(f"{path}: the write failed; its checksum is abandoned")
        return piece_digest(pieces[index])

    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="checksum") as pool:
            hashing = submitted(pool, tree_digest, len(pieces), digest_of)
            try:
                for index, piece in enumerate(pieces):
                    _write_all(path, fd, piece, index * PIECE_BYTES)
            except BaseException:
                stop.set()  # the hashing threads stop at their next piece instead of hashing the rest
                raise
            # No thread could start (an `atexit` hook runs after `concurrent.futures` stopped
            # taking work): the pieces are hashed here, from the same memory, once written.
            digest = tree_digest(len(pieces), digest_of) if hashing is None else hashing.result()
    finally:
        os.close(fd)
    return digest


def _by_piece(buffers: Iterable[memoryview]) -> list[list[memoryview]]:
    """Buffers that tile a file from its first byte, in order, cut at the pieces' boundaries."""
    pieces: list[list[memoryview]] = []
    room = 0
    for view in buffers:
        while len(view):
            if not room:
                pieces.append([])
                room = PIECE_BYTES
            part = view[:room]
            pieces[-1].append(part)
            room -= len(part)
            view = view[len(part):]
    return pieces


def _write_all(path: Path, fd: int, buffers: list[memoryview], offset: int) -> None:
    """pwritev may write fewer bytes than asked, and takes at most _IOV_MAX buffers: go on until all are out."""
    while buffers:
        written = os.pwritev(fd, buffers[:_IOV_MAX], offset)
        if written <= 0:
            raise CheckpointError(f"{path}: pwritev wrote nothing at byte {offset}")
        offset += written
        buffers = _skip(buffers, written)


def _skip(buffers: list[memoryview], count: int) -> list[memoryview]:
    """What is left of `buffers` once their first `count` bytes are written."""
    while count and count >= len(buffers[0]):
        count -= len(buffers[0])
        buffers = buffers[1:]
    return [buffers[0][count:], *buffers[1:]] if count else buffers


class Header(NamedTuple):
    """A safetensors file's header, parsed and checked (`read_header`)."""

    tensors: dict[str, dict[str, Any]]
    """Tensor name -> its entry (dtype, shape, data_offsets), every entry checked."""
    metadata: dict[str, str]
    start: int
    """Where the data section starts: the length prefix and the header's bytes."""
    unclaimed: int = 0
    """Bytes of the data section no tensor's offsets claim: gaps between tensors and a tail after
    the last, which `safetensors` refuses and only a manifest's digest can vouch for (`read_file`)."""


def read_header(path: Path) -> Header:
    """Tensor entries, metadata and the data section's start; a damaged header is a CheckpointError.

    A FIFO or other special file is refused at once, never waited on (`open_regular` following links).
    """
    with open_regular(path, follow=True) as fh, os_errors("cannot read the safetensors header", path):
        size = os.fstat(fh.fileno()).st_size
        raw_len = fh.read(8)
        if len(raw_len) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (length,) = struct.unpack("<Q", raw_len)
        if length > min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{path}: truncated or corrupt safetensors header (length {length})")
        raw = fh.read(length)
    header = parse_json(raw, path)
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop(METADATA, None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: safetensors {METADATA} must map names to strings")
    unclaimed = _check_layout(path, header, size - 8 - length)
    return Header(header, metadata, 8 + length, unclaimed)


def _check_layout(path: Path, header: dict[str, Any], data_size: int) -> int:
    """Every tensor's bytes lie inside the file, agree with its dtype and shape, and are no other
    tensor's; returns the bytes of the data section no tensor claims.

    Offsets and dimensions must be JSON integers (not strings, floats or booleans), never
    negative, and the tensor's size in bytes must fit torch's int64 even for one of zero
    elements, so that nothing after this check can fail on a header's value.
    """
    for name, entry in header.items():
        expected = _entry_bytes(entry)
        if isinstance(expected, str):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry ({expected}): "
                                  f"{shorten(entry, 200)}")
        begin, end = entry["data_offsets"]
        if not begin <= end <= data_size or end - begin != expected:
            raise CheckpointError(
                f"{path}: tensor {name!r} needs bytes [{begin}, {end}) of {data_size}: file truncated or corrupt"
            )
    position = claimed = 0
    for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
        begin, end = entry["data_offsets"]
        if begin < end:
            if begin < position:
                raise CheckpointError(f"{path}: tensor {name!r} overlaps the bytes of another tensor")
            claimed += end - begin
            position = end
    return data_size - claimed


def unclaimed_problem(path: Path, header: Header) -> str | None:
    """Why `path` cannot be read without a manifest's digest: bytes no tensor claims. Such a file
    is refused by `safetensors` (so by `from_pretrained`), and nothing but a digest says what they
    are; a reader given the digest hashes them straight from the file (`read_file`)."""
    if not header.unclaimed:
        return None
    return (f"{path}: {header.unclaimed} bytes of its data section belong to no tensor (a gap between "
            "tensors or a tail after the last): safetensors refuses such a file, and no manifest digest covers them")


def _entry_bytes(entry: Any) -> int | str:
    """The bytes one tensor's header entry describes, or why it cannot describe a tensor."""
    if not isinstance(entry, dict):
        return "not an object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in NAMES:
        return f"dtype must be one of {sorted(NAMES)}"
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_natural(d) for d in shape):
        return f"shape must be a list of at most {MAX_DIMS} non-negative integers"
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_natural(x) for x in offsets):
        return "data_offsets must be two non-negative integers"
    itemsize = NAMES[dtype].itemsize
    bound = _MAX_BYTES // itemsize
    span = numel = 1
    for dim in shape:
        span *= max(dim, 1)  # bounded even when a dimension of 0 makes the tensor empty
        numel *= dim
        if span > bound:
            return f"shape {shorten(shape, 200)} would need more than {_MAX_BYTES} bytes"
    return numel * itemsize


def _natural(value: Any) -> bool:
    return type(value) is int and value >= 0


def read_file(
    path: Path, into: Mapping[str, torch.Tensor] | None = None, *, expect: str | None = None,
    header: Header | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of `path`, read piece by piece while the file's digest is checked.

    Tensors named in `into` are filled in place (shapes and dtypes checked first), the rest
    are new. With `expect` (the manifest's digest), the file is hashed as it is read and must
    match, else CheckpointError; CPU tensors of `into` then hold bad bytes. A return means the
    file was verified whenever `expect` was given: the caller reports it so, and nothing
    hashes it again. Without `expect`, nothing is hashed.
    `header`: what `read_header` already returned for `path` (a caller that planned from it),
    so it is not read and parsed again; the digest covers the header's bytes all the same.
    """
    header = header if header is not None else read_header(path)
    if expect is None and (problem := unclaimed_problem(path, header)):
        raise CheckpointError(problem)
    entries, start = header.tensors, header.start
    targets = dict(into or {})
    _check_distinct(path, {name: dest for name, dest in targets.items() if name in entries})
    for name, entry in entries.items():
        dest = targets.get(name)
        if dest is not None and (list(dest.shape) != list(entry["shape"]) or dest.dtype != NAMES[entry["dtype"]]):
            raise CheckpointError(f"{path}: tensor {name!r} is {entry['dtype']} {entry['shape']} in the file "
                                  f"but {dest.dtype} {list(dest.shape)} in the model")
    out = {name: _landing(entry, targets.get(name)) for name, entry in entries.items()}
    source = _mapping(path)
    pieces = _by_piece(_tiles(path, entries, out, start, source))
    digest = tree_digest(len(pieces), lambda i: _read_piece(source, pieces[i], i, hashed=expect is not None))
    if expect is not None:
        _compare(path, digest, expect)
    with torch.no_grad():
        for name, dest in targets.items():
            if name in out and out[name] is not dest:
                out[name] = dest.copy_(out[name])
    return out


def _check_distinct(path: Path, targets: Mapping[str, torch.Tensor]) -> None:
    """Two destinations over the same memory (tied weights) would each be filled from their own
    bytes of the file, by threads at once: a mix of the two, piece by piece. Refused instead."""
    if pair := overlapping(targets):
        raise CheckpointError(f"{path}: tensors {pair[0]!r} and {pair[1]!r} would be read into the same memory "
                              "(tied weights?); read one of them only")


def overlapping(tensors: Mapping[str, torch.Tensor]) -> tuple[str, str] | None:
    """Two of `tensors` whose memory overlaps, or None: what `read_file` refuses to read into,
    so a writer can refuse a file no load could fill."""
    spans = []
    for name, tensor in tensors.items():
        if tensor.numel() and tensor.device.type != "meta":
            extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
            spans.append((str(tensor.device), tensor.data_ptr(), tensor.data_ptr() + extent * tensor.element_size(),
                          name))
    spans.sort(key=lambda span: span[:2])
    for (device, _, end, first), (other, begin, _, second) in itertools.pairwise(spans):
        if device == other and begin < end:
            return first, second
    return None


def _landing(entry: dict[str, Any], dest: torch.Tensor | None) -> torch.Tensor:
    """Where a tensor's bytes are read to: `dest` itself when it is contiguous on the CPU, else a new tensor."""
    if dest is not None and dest.device.type == "cpu" and dest.is_contiguous():
        return dest
    return torch.empty(list(entry["shape"]), dtype=NAMES[entry["dtype"]])


def _mapping(path: Path) -> np.ndarray:
    """The file's bytes, mapped read-only; unmapped once the array and every view of it are gone.

    A file cut short while it is mapped faults the reader (SIGBUS), as safetensors' own mapping
    does; one cut short before is refused by the size checks.
    """
    with open_regular(path, follow=True) as fh, os_errors("cannot map", path):
        size = os.fstat(fh.fileno()).st_size
        if not size:
            raise CheckpointError(f"{path}: empty file: truncated")
        return np.frombuffer(mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ), dtype=np.uint8)


def stored_equal(first: tuple[Path, Header, str], second: tuple[Path, Header, str]) -> bool:
    """Whether two tensors, each given as (file, its header, name), hold the same bytes, compared
    in the files' mappings a piece at a time: no copy, and memory bounded by a piece."""
    views = []
    for path, header, name in (first, second):
        begin, end = (header.start + offset for offset in header.tensors[name]["data_offsets"])
        source = _mapping(path)
        if len(source) < end:
            raise CheckpointError(f"{path}: {len(source)} bytes, but its header lists {end}: file truncated")
        views.append(source[begin:end])
    a, b = views
    return len(a) == len(b) and all(np.array_equal(a[at:at + PIECE_BYTES], b[at:at + PIECE_BYTES])
                                    for at in range(0, len(a), PIECE_BYTES))


def _tiles(
    path: Path, header: dict[str, Any], out: Mapping[str, torch.Tensor], start: int, source: np.ndarray
) -> list[memoryview]:
    """Buffers for every byte of the file in order: the tensors' destinations, and for the header
    and any gap or tail (`Header.unclaimed`) the file's own bytes in the read-only mapping, which
    are hashed where they lie: no scratch memory, however large a gap (overlaps `read_header` refused)."""
    tiles = [memoryview(source[:start])]
    position = start
    for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        begin, end = (start + offset for offset in entry["data_offsets"])
        if begin == end:
            continue
        if begin > position:
            tiles.append(memoryview(source[position:begin]))
        tiles.append(_raw(out[name].detach()))
        position = end
    if len(source) < position:
        raise CheckpointError(f"{path}: {len(source)} bytes, but its header lists {position}: file truncated")
    if len(source) > position:
        tiles.append(memoryview(source[position:]))
    return tiles


def _read_piece(source: np.ndarray, buffers: list[memoryview], index: int, *, hashed: bool) -> int:
    """Copy piece `index` out of the mapping, then hash it while its bytes are in cache (0 unhashed).
    A read-only buffer is the mapping itself (header, gap): hashed in place, never copied."""
    offset = index * PIECE_BYTES
    for buffer in buffers:
        if not buffer.readonly:
            np.copyto(np.asarray(buffer), source[offset:offset + len(buffer)])
        offset += len(buffer)
    return piece_digest(buffers) if hashed else 0


def _compare(path: Path, got: str, want: str | None) -> None:
    if want is not None and got != want:
        raise CheckpointError(f"{path}: checksum {got} != manifest {want}")
