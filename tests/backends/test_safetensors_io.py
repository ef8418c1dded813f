"""One-pass safetensors I/O: the format other tools read, and checksums computed on the way."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from safetensors.torch import load_file, save_file

import backends.safetensors_io as sio
from backends.safetensors_io import read_file, read_header, write_file
from lifecycle.checksum import PIECE_BYTES, file_digest
from lifecycle.errors import CheckpointError
from tests.edits import write_raw
from tests.guards import within

HANG_GUARD_S = 20


def tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "odd": torch.randint(0, 2, (7,), dtype=torch.bool),
        "w": torch.randn(33, 5),
        "bf": torch.randn(4, 3).bfloat16(),
        "half": torch.randn(3).half(),
        "i64": torch.arange(5),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5),
        "strided": torch.randn(6, 4).t(),
    }


def big() -> dict[str, torch.Tensor]:
    """Tensors over two and a half pieces, one of them across a piece boundary."""
    torch.manual_seed(1)
    return {"a": torch.randn(PIECE_BYTES // 4 + 1000), "b": torch.randn(3, PIECE_BYTES // 8),
            "c": torch.randn(PIECE_BYTES // 16).bfloat16()}


def tree_digest(data: bytes) -> str:
    """The manifest's checksum written out plainly: xxh3_64 of each piece's little-endian xxh3_64."""
    pieces = [data[i:i + PIECE_BYTES] for i in range(0, len(data), PIECE_BYTES)]
    return xxhash.xxh3_64(b"".join(xxhash.xxh3_64_intdigest(p).to_bytes(8, "little") for p in pieces)).hexdigest()


def test_written_file_loads_with_safetensors_and_the_digest_is_the_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    digest = write_file(path, tensors(), {"format": "pt"})
    assert digest == tree_digest(path.read_bytes()) == file_digest(path)
    loaded = load_file(str(path))
    assert all(torch.equal(loaded[k], v) for k, v in tensors().items())


def test_reads_a_file_written_by_safetensors_in_place(tmp_path: Path) -> None:
    path = tmp_path / "b.safetensors"
    save_file({k: v.contiguous() for k, v in tensors().items()}, str(path))
    into = {k: torch.zeros_like(v) for k, v in tensors().items()}
    out = read_file(path, into, expect=file_digest(path))
    for name, value in tensors().items():
        assert torch.equal(into[name], value) and out[name] is into[name]


def test_a_flipped_byte_fails_the_digest_while_reading(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    digest = write_file(path, tensors())
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"c.safetensors: checksum [0-9a-f]+ != manifest {digest}"):
        read_file(path, expect=digest)


def test_only_a_digest_given_to_the_reader_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "d.safetensors"
    digest = write_file(path, tensors())
    read_file(path, expect=digest)
    with pytest.raises(CheckpointError, match="checksum"):
        read_file(path, expect="0" * 16)
    hashed: list[int] = []
    monkeypatch.setattr(sio, "piece_digest", lambda buffers: hashed.append(1) or 0)
    read_file(path)
    assert hashed == []


def test_a_shape_or_dtype_that_differs_is_refused_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "e.safetensors"
    write_file(path, {"w": torch.ones(2, 3)})
    target = torch.zeros(3, 2)
    with pytest.raises(CheckpointError, match="tensor 'w' is F32 \\[2, 3\\] in the file but torch.float32 \\[3, 2\\]"):
        read_file(path, {"w": target})
    assert torch.equal(target, torch.zeros(3, 2))


@pytest.mark.parametrize("keep", [0, 7, 40, -1])
def test_a_truncated_file_is_a_checkpoint_error_naming_it(tmp_path: Path, keep: int) -> None:
    path = tmp_path / "f.safetensors"
    write_file(path, tensors())
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(CheckpointError, match="f.safetensors.*(truncated|corrupt)"):
        read_file(path)


def test_the_digest_of_a_file_of_several_pieces_is_the_tree_of_its_pieces(tmp_path: Path) -> None:
    path = tmp_path / "h.safetensors"
    digest = write_file(path, big())
    data = path.read_bytes()
    assert 2 * PIECE_BYTES < len(data) < 3 * PIECE_BYTES
    assert digest == tree_digest(data) == file_digest(path)
    assert file_digest(path, algorithm="xxh3_64") == xxhash.xxh3_64(data).hexdigest()
    into = {k: torch.zeros_like(v) for k, v in big().items()}
    read_file(path, into, expect=digest)
    assert all(torch.equal(into[k], v) for k, v in big().items())


@pytest.mark.parametrize("where", ["header", 4000, PIECE_BYTES - 1, PIECE_BYTES, 2 * PIECE_BYTES + 5, -1])
def test_a_flipped_byte_in_any_piece_or_the_header_is_caught(tmp_path: Path, where: int | str) -> None:
    path = tmp_path / "i.safetensors"
    digest = write_file(path, big(), {"format": "pt"})
    data = bytearray(path.read_bytes())
    at = data.index(b'"pt"') + 1 if where == "header" else int(where)
    data[at] ^= 0x20 if where == "header" else 0x01  # "pt" to "Pt": a header that still parses
    path.write_bytes(bytes(data))
    assert file_digest(path) != digest
    with pytest.raises(CheckpointError, match=f"i.safetensors: checksum [0-9a-f]+ != manifest {digest}"):
        read_file(path, expect=digest)


def test_a_file_truncated_after_its_header_was_read_is_a_checkpoint_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "j.safetensors"
    write_file(path, big())
    header = read_header(path)
    monkeypatch.setattr(sio, "read_header", lambda _: header)
    with open(path, "r+b") as fh:
        fh.truncate(PIECE_BYTES + 100)
    into = {k: torch.zeros_like(v) for k, v in big().items()}
    with pytest.raises(CheckpointError, match="j.safetensors.*truncated"):
        read_file(path, into)


def test_a_header_handed_in_is_not_read_again_and_the_digest_still_covers_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "j2.safetensors"
    digest = write_file(path, tensors(), {"format": "pt"})
    header = read_header(path)
    monkeypatch.setattr(sio, "read_header", lambda _: pytest.fail("the header was read again"))
    out = read_file(path, header=header, expect=digest)
    assert all(torch.equal(out[k], v) for k, v in tensors().items())
    data = bytearray(path.read_bytes())
    data[data.index(b'"pt"') + 1] ^= 0x20  # the header changed after it was handed in
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"j2.safetensors: checksum [0-9a-f]+ != manifest {digest}"):
        read_file(path, header=header, expect=digest)


def test_a_truncated_file_read_into_a_model_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "k.safetensors"
    write_file(path, big())
    path.write_bytes(path.read_bytes()[:-1])
    into = {k: torch.zeros_like(v) for k, v in big().items()}
    with pytest.raises(CheckpointError, match="k.safetensors.*truncated"):
        read_file(path, into)


def test_short_writes_go_on_from_where_they_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pwritev = os.pwritev
    monkeypatch.setattr(os, "pwritev", lambda fd, buffers, offset: pwritev(fd, [buffers[0][:100_000]], offset))
    path = tmp_path / "l.safetensors"
    digest = write_file(path, big())
    monkeypatch.undo()
    assert digest == tree_digest(path.read_bytes())
    out = read_file(path, expect=digest)
    assert all(torch.equal(out[k], v) for k, v in big().items())


def test_a_failed_write_raises_its_error_without_hashing_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    hashed: list[int] = []
    piece_digest = sio.piece_digest

    def counting(buffers: list[memoryview]) -> int:
        hashed.append(1)
        time.sleep(0.01)  # slower than the write's failure: what is hashed after it shows
        return piece_digest(buffers)

    def disk_full(fd: int, buffers: list[memoryview], offset: int) -> int:
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(sio, "piece_digest", counting)
    monkeypatch.setattr(os, "pwritev", disk_full)
    tensors = {f"t{i}": torch.zeros(PIECE_BYTES // 4) for i in range(16)}
    with pytest.raises(OSError, match="No space left on device"):
        write_file(tmp_path / "full.safetensors", tensors)
    assert len(hashed) < 8  # of 17 pieces: the hashing threads stopped at their next piece


def test_a_foreign_file_with_gaps_between_tensors_reads_and_verifies(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    header = {"x": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]},
              "y": {"dtype": "I64", "shape": [1], "data_offsets": [16, 24]}}
    write_raw(path, header, b"gap" + struct.pack("<2f", 1.5, -2.0) + b"gap!!" + struct.pack("<q", 7) + b"tail")
    into = {"x": torch.zeros(2)}
    out = read_file(path, into, expect=tree_digest(path.read_bytes()))
    assert torch.equal(into["x"], torch.tensor([1.5, -2.0])) and out["y"].tolist() == [7]


def test_tensors_that_share_bytes_are_refused_naming_the_file_and_tensor(tmp_path: Path) -> None:
    path = tmp_path / "n.safetensors"
    header = {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "y": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}
    write_raw(path, header, struct.pack("<2f", 1.0, 2.0))
    with pytest.raises(CheckpointError, match="n.safetensors: tensor 'y' overlaps"):
        read_file(path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("reader", ["read_header", "read_file"])
def test_a_fifo_named_like_a_weight_file_is_refused_without_blocking(tmp_path: Path, reader: str) -> None:
    path = tmp_path / "model.safetensors"
    os.mkfifo(path)
    with pytest.raises(CheckpointError, match=f"{path}: a FIFO, not a regular file"):
        within(HANG_GUARD_S, lambda: getattr(sio, reader)(path))


def test_a_symlink_to_a_weight_file_is_followed_as_in_an_hf_cache_snapshot(tmp_path: Path) -> None:
    blob = tmp_path / "blobs" / "0123abcd"
    blob.parent.mkdir()
    write_file(blob, {"w": torch.arange(4.0)})
    link = tmp_path / "model.safetensors"
    link.symlink_to(blob)
    assert read_file(link)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


BAD_ENTRIES = {
    "offsets-as-strings": {"dtype": "F32", "shape": [16], "data_offsets": ["0", "64"]},
    "offsets-as-floats": {"dtype": "F32", "shape": [16], "data_offsets": [0.0, 64.0]},
    "offsets-as-booleans": {"dtype": "BOOL", "shape": [1], "data_offsets": [False, True]},
    "one-offset": {"dtype": "F32", "shape": [16], "data_offsets": [64]},
    "fractional-dimension": {"dtype": "F32", "shape": [16.5], "data_offsets": [0, 64]},
    "boolean-dimension": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]},
    "negative-dimensions": {"dtype": "F32", "shape": [-1, -16], "data_offsets": [0, 64]},
    "dimension-as-string": {"dtype": "F32", "shape": ["16"], "data_offsets": [0, 64]},
    "overflowing-empty-shape": {"dtype": "F32", "shape": [2**62, 2**62, 0], "data_offsets": [0, 0]},
    "too-large-empty-shape": {"dtype": "F32", "shape": [2**70, 0], "data_offsets": [0, 0]},
    "too-many-dimensions": {"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]},
    "unknown-dtype": {"dtype": "F128", "shape": [4], "data_offsets": [0, 64]},
    "dtype-in-a-list": {"dtype": ["F32"], "shape": [16], "data_offsets": [0, 64]},
    "no-dtype": {"shape": [16], "data_offsets": [0, 64]},
    "not-an-object": "hello",
}


@pytest.mark.parametrize("entry", BAD_ENTRIES.values(), ids=BAD_ENTRIES.keys())
def test_a_malformed_header_entry_is_refused_naming_the_file_and_tensor(tmp_path: Path, entry: Any) -> None:
    path = tmp_path / "o.safetensors"
    write_raw(path, {"w": entry}, bytes(64))
    with pytest.raises(CheckpointError, match=f"{path}: tensor 'w' has a malformed header entry"):
        read_header(path)
    with pytest.raises(CheckpointError, match=f"{path}: tensor 'w'"):
        read_file(path, {"w": torch.zeros(16)})


def test_an_empty_tensor_with_large_dimensions_that_torch_allows_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    write_raw(path, {"w": {"dtype": "F32", "shape": [2**40, 0], "data_offsets": [0, 0]}})
    assert read_file(path)["w"].shape == (2**40, 0)


@pytest.mark.parametrize("metadata", [[1, 2], "pt", {"format": 1}])
def test_metadata_that_is_not_a_string_map_is_refused_naming_the_file(tmp_path: Path, metadata: Any) -> None:
    path = tmp_path / "q.safetensors"
    write_raw(path, {"__metadata__": metadata, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
              bytes(4))
    with pytest.raises(CheckpointError, match=f"{path}: safetensors __metadata__ must map names to strings"):
        read_header(path)


@pytest.mark.parametrize("body", [b'{"a": ' + b"9" * 5000 + b"}", b'{"a\xff": 1}'], ids=["huge-integer", "not-utf8"])
def test_a_header_no_json_parser_takes_is_refused_naming_the_file(tmp_path: Path, body: bytes) -> None:
    path = tmp_path / "r.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body)
    with pytest.raises(CheckpointError, match=f"{path}: not valid JSON: "):
        read_header(path)


def test_a_header_nested_too_deeply_for_the_parser_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "r.safetensors"
    body = b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    path.write_bytes(struct.pack("<Q", len(body)) + body)
    with pytest.raises(CheckpointError, match=f"^{path}: not valid JSON: nested too deeply$"):
        read_header(path)


def test_a_header_that_is_json_but_not_an_object_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "r.safetensors"
    path.write_bytes(struct.pack("<Q", 6) + b"[1, 2]")
    with pytest.raises(CheckpointError, match=f"^{path}: safetensors header is not a JSON object$"):
        read_header(path)


def test_a_tensor_named_like_the_metadata_key_is_refused_before_writing(tmp_path: Path) -> None:
    path = tmp_path / "s.safetensors"
    with pytest.raises(CheckpointError, match=f"{path}: tensor '__metadata__' cannot be saved"):
        write_file(path, {"w": torch.ones(2), "__metadata__": torch.ones(2)})
    assert not path.exists()
