"""One-pass safetensors I/O: the format other tools read, and checksums computed on the way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file, save_file

from backends.safetensors_io import read_file, write_file
from lifecycle.checksum import expecting, file_digest, known_digest
from lifecycle.errors import CheckpointError


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


def test_written_file_loads_with_safetensors_and_the_digest_is_the_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    digest = write_file(path, tensors(), {"format": "pt"})
    assert digest == xxhash.xxh3_64(path.read_bytes()).hexdigest() == file_digest(path)
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


def test_a_published_digest_is_checked_and_the_file_reported_verified(tmp_path: Path) -> None:
    path = tmp_path / "d.safetensors"
    digest = write_file(path, tensors())
    with expecting({path: digest}) as verified:
        read_file(path)
    assert str(path.resolve()) in verified
    with expecting({path: "0" * 16}), pytest.raises(CheckpointError, match="checksum"):
        read_file(path)


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


def test_a_remembered_digest_is_forgotten_when_the_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "g.safetensors"
    digest = write_file(path, tensors())
    assert known_digest(path) == digest
    assert known_digest(path) is None
    write_file(path, tensors())
    path.write_bytes(path.read_bytes() + b"x")
    assert known_digest(path) is None
