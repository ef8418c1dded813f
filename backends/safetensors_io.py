"""Safetensors files written and read in one pass, with the file's checksum computed on the way.

A checkpoint must be checksummed to be trusted, but hashing a file after writing it, or
before loading it, reads every byte a second time. Here the checksum is computed from the
tensors' memory while the same bytes stream to or from the file, on a second thread
(xxh3 and file I/O both release the GIL), so integrity costs next to nothing. Reads can go
straight into the destination tensors: one copy, and no fresh memory to fault in.

The files follow the safetensors format (little-endian u64 header length, JSON header,
contiguous data) and load with `safetensors` and `transformers` as usual.
"""

from __future__ import annotations

import json
import mmap
import struct
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch

from lifecycle.checksum import Hasher, expected_digest, file_digest, mark_verified, remember
from lifecycle.errors import CheckpointError

DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.uint16: "U16",
    torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32", torch.uint32: "U32",
    torch.float32: "F32", torch.float64: "F64", torch.int64: "I64", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
NAMES: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


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
    """Write `tensors` as one safetensors file; returns (and remembers) its xxh3_64 digest."""
    prepared = {name: _prepare(t, name) for name, t in tensors.items()}
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, tensor in prepared.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-(8 + len(encoded)) % 8)
    prefix = struct.pack("<Q", len(encoded)) + encoded
    hasher = Hasher()
    try:
        with open(path, "wb", buffering=0) as fh:
            _write_all(fh, memoryview(prefix))
            hasher.feed(prefix)
            for tensor in prepared.values():
                view = _raw(tensor)
                _write_all(fh, view)
                hasher.feed(view)
    except BaseException:
        hasher.abandon()
        raise
    digest = hasher.digest()
    remember(path, digest)
    return digest


def _write_all(fh: Any, view: memoryview) -> None:
    """Unbuffered writes skip a copy, but may be short: go on until every byte is out."""
    done = 0
    while done < len(view):
        done += fh.write(view[done:])


def read_header(path: Path) -> tuple[dict[str, dict[str, Any]], dict[str, str], int]:
    """Tensor entries, metadata and the data section's start; a damaged header is a CheckpointError."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            raw_len = fh.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (length,) = struct.unpack("<Q", raw_len)
            if length > min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{path}: truncated or corrupt safetensors header (length {length})")
            header = json.loads(fh.read(length))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: safetensors header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    _check_layout(path, header, size - 8 - length)
    return header, metadata, 8 + length


def _check_layout(path: Path, header: dict[str, Any], data_size: int) -> None:
    """Every tensor's bytes lie inside the file and agree with its dtype and shape."""
    for name, entry in header.items():
        try:
            dtype = NAMES[entry["dtype"]]
            begin, end = (int(x) for x in entry["data_offsets"])
            numel = 1
            for dim in entry["shape"]:
                numel *= int(dim)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {entry!r}") from None
        expected = numel * torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= end <= data_size or end - begin != expected:
            raise CheckpointError(
                f"{path}: tensor {name!r} needs bytes [{begin}, {end}) of {data_size}: file truncated or corrupt"
            )


def read_file(
    path: Path, into: Mapping[str, torch.Tensor] | None = None, *, expect: str | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of `path`, copied out of a read-only mapping while its xxh3_64 is checked.

    Tensors named in `into` are filled in place (shapes and dtypes checked first), the rest
    are new. The digest must match `expect`, or the one a resume published for the file
    (`checksum.expecting`), else CheckpointError; tensors of `into` then hold bad bytes.
    """
    expect = expect if expect is not None else expected_digest(path)
    header, _, start = read_header(path)
    targets = dict(into or {})
    for name, entry in header.items():
        dest = targets.get(name)
        if dest is not None and (list(dest.shape) != list(entry["shape"]) or dest.dtype != NAMES[entry["dtype"]]):
            raise CheckpointError(f"{path}: tensor {name!r} is {entry['dtype']} {entry['shape']} in the file "
                                  f"but {dest.dtype} {list(dest.shape)} in the model")
    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    data = memoryview(mapped)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: only ever copied from
        whole = torch.frombuffer(mapped, dtype=torch.uint8)
    hasher = Hasher() if expect is not None else None
    out: dict[str, torch.Tensor] = {}
    position = start
    try:
        if hasher is not None:
            hasher.feed(data[:start])
        for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            begin, end = (start + offset for offset in entry["data_offsets"])
            if begin != position and hasher is not None:
                hasher.abandon()
                hasher = None
            out[name] = _copy_out(whole[begin:end], entry, targets.get(name))
            if hasher is not None:
                hasher.feed(data[begin:end])
            position = end
    except BaseException:
        if hasher is not None:
            hasher.abandon()
        raise
    if hasher is not None:
        _compare(path, hasher.digest(), expect)
    elif expect is not None:
        _compare(path, file_digest(path), expect)  # gaps between tensors: not our writer's file
    if expect is not None:
        mark_verified(path)
    return out


def _copy_out(raw: torch.Tensor, entry: dict[str, Any], dest: torch.Tensor | None) -> torch.Tensor:
    """Copy one tensor's bytes out of the mapping, into `dest` when it can take them directly."""
    with torch.no_grad():
        if dest is not None and dest.device.type == "cpu" and dest.is_contiguous():
            dest.detach().reshape(-1).view(torch.uint8).copy_(raw)
            return dest
        tensor = raw.clone().view(NAMES[entry["dtype"]]).reshape(list(entry["shape"]))
        if dest is None:
            return tensor
        dest.copy_(tensor)
        return dest


def _compare(path: Path, got: str, want: str | None) -> None:
    if want is not None and got != want:
        raise CheckpointError(f"{path}: checksum {got} != manifest {want}")
