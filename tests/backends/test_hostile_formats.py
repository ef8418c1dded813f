"""Weight files and metadata made to mislead or exhaust a reader: refused, naming the file, in bounded memory.

A tied pair stored twice with different bytes, a gap or tail of bytes no tensor claims, a JSON
object naming a key twice, a DCP `.metadata` whose few bytes unpickle into gigabytes, and a save
from an `atexit` hook, when no thread can start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn

from backends import dcp_metadata
from backends.dcp_metadata import METADATA, read_metadata
from backends.hf import INDEX, SINGLE, HFBackend
from backends.safetensors_io import read_file, read_header, write_file
from lifecycle.checksum import file_digest
from lifecycle.errors import CheckpointError
from lifecycle.jsontree import parse_json, read_json
from tests.edits import write_raw
from tests.guards import within

HANG_GUARD_S = 20
REPO = Path(__file__).resolve().parents[2]


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4, 2)
        self.head = nn.Linear(2, 4, bias=False)
        self.head.weight = self.embed.weight


# ---------------------------------------------------------------- tied pairs stored twice


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "two-shards"])
def test_a_tied_pair_stored_twice_loads_only_when_both_copies_are_byte_identical(tmp_path: Path, sharded: bool) -> None:
    def folder(name: str, embed: torch.Tensor, head: torch.Tensor) -> Path:
        where = tmp_path / name
        where.mkdir()
        if not sharded:
            write_file(where / SINGLE, {"embed.weight": embed, "head.weight": head})
            return where
        write_file(where / "a.safetensors", {"embed.weight": embed})
        write_file(where / "b.safetensors", {"head.weight": head})
        (where / INDEX).write_text(json.dumps({"weight_map": {"embed.weight": "a.safetensors",
                                                              "head.weight": "b.safetensors"}}))
        return where

    model = Tied()
    before = model.embed.weight.detach().clone()
    conflicting = folder("conflicting", torch.zeros(4, 2), torch.ones(4, 2))
    with pytest.raises(CheckpointError) as caught:
        HFBackend().load_model(model, conflicting)
    message = str(caught.value)
    assert "'embed.weight'" in message and "'head.weight'" in message and str(conflicting) in message, message
    assert torch.equal(model.embed.weight, before)  # refused before a byte loads
    same = torch.arange(8.0).reshape(4, 2)
    HFBackend().load_model(model, folder("identical", same, same.clone()))
    assert torch.equal(model.embed.weight, same) and model.head.weight is model.embed.weight


def test_read_file_refuses_two_destinations_that_share_memory(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    write_file(path, {"a": torch.zeros(4), "b": torch.ones(4)})
    shared = torch.full((4,), 7.0)
    with pytest.raises(CheckpointError, match=rf"{path}: tensors 'a' and 'b' would be read into the same memory"):
        read_file(path, {"a": shared, "b": shared})
    assert shared.tolist() == [7.0] * 4


# ---------------------------------------------------------------- gaps and tails


def test_a_tail_no_tensor_claims_is_refused_at_once_without_a_manifest_digest(tmp_path: Path) -> None:
    write_file(tmp_path / SINGLE, nn.Linear(4, 4).state_dict())
    with open(tmp_path / SINGLE, "r+b") as fh:
        fh.truncate(1 << 36)  # 64 GiB, sparse: no disk space used
    model = nn.Linear(4, 4)
    before = model.weight.detach().clone()
    for load in (lambda: read_file(tmp_path / SINGLE), lambda: HFBackend().load_model(model, tmp_path)):
        with pytest.raises(CheckpointError, match=f"{tmp_path / SINGLE}: .*belong to no tensor"):
            within(HANG_GUARD_S, load)
    assert torch.equal(model.weight, before)


def test_gaps_a_manifest_digest_covers_are_hashed_from_the_file_without_scratch_memory(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    gap = 32 * 1024 * 1024
    write_raw(path, {"x": {"dtype": "F32", "shape": [2], "data_offsets": [gap, gap + 8]}})
    with open(path, "r+b") as fh:
        fh.seek(0, os.SEEK_END)
        fh.seek(gap, os.SEEK_CUR)  # a sparse gap before the tensor, and the same after it
        fh.write(torch.tensor([1.5, -2.0]).numpy().tobytes())
        fh.truncate(fh.tell() + gap)
    digest = file_digest(path)
    into = {"x": torch.zeros(2)}
    tracemalloc.start()
    try:
        read_file(path, into, expect=digest)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert into["x"].tolist() == [1.5, -2.0]
    assert peak < 4 * 1024 * 1024, f"{peak} bytes of scratch for {2 * gap} bytes of gaps"


# ---------------------------------------------------------------- JSON naming a key twice


def test_a_safetensors_header_naming_a_tensor_twice_is_refused_naming_key_and_file(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    header = (b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
              b'"w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}')
    path.write_bytes(len(header).to_bytes(8, "little") + header + torch.tensor([1.0, 1.0, 2.0, 2.0]).numpy().tobytes())
    for read in (read_header, read_file):
        with pytest.raises(CheckpointError, match=f"{path}: .*key 'w' twice"):
            read(path)


def test_an_index_naming_a_tensor_twice_is_refused_naming_key_and_file(tmp_path: Path) -> None:
    write_file(tmp_path / "a.safetensors", {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)})
    write_file(tmp_path / "b.safetensors", {"weight": torch.ones(2, 2)})
    (tmp_path / INDEX).write_text('{"weight_map": {"weight": "a.safetensors", "bias": "a.safetensors", '
                                  '"weight": "b.safetensors"}}')
    with pytest.raises(CheckpointError, match=f"{tmp_path / INDEX}: .*key 'weight' twice"):
        HFBackend().load_model(nn.Linear(2, 2), tmp_path)


def test_checkpoint_json_naming_a_key_twice_at_any_depth_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "optimizer.json"
    path.write_text('{"format_version": 1, "optimizer": {"state": {}, "state": {"lr": 1}}}')
    with pytest.raises(CheckpointError, match=f"{path}: .*key 'state' twice"):
        read_json(path)
    assert parse_json(b'{"a": {"b": 1}, "c": [{"b": 2}]}', path) == {"a": {"b": 1}, "c": [{"b": 2}]}


# ---------------------------------------------------------------- DCP metadata that unpickles into gigabytes


def _global(module: str, name: str) -> bytes:
    return b"".join(b"\x8c" + bytes([len(s)]) + s.encode() for s in (module, name)) + b"\x93"


def _metadata_bombs() -> dict[str, bytes]:
    """Each a few hundred KiB at most; each would allocate hundreds of MiB to GiB if unpickled."""
    proto, keys = b"\x80\x04", 20_000
    items = b"".join(b"\x8c" + bytes([len(k)]) + k + b"K\x01" for k in (f"k{i}".encode() for i in range(keys)))
    return {
        "sets": proto + b"](" + b"\x8f" * 50_000 + b"e.",  # EMPTY_SET: 1 byte, a 216-byte set
        "dicts": proto + b"](" + b"}" * 100_000 + b"e.",  # EMPTY_DICT: 1 byte, a 64-byte dict
        "memo-index": proto + b"Nr" + (1 << 27).to_bytes(4, "little") + b".",  # a memo table of 2 GiB
        # one list of 20k ints, memoized, then handed to torch.Size 2000 times: 160 KiB a call
        "copied-list": proto + _global("torch", "Size") + b"\x94](" + b"K\x01" * keys + b"e\x94]("
        + b"h\x00h\x01\x85R" * 2000 + b"e.",
        # one state dict of 20k keys, memoized, then set on 2000 fresh objects: 1 MiB a BUILD
        "copied-state": proto + _global("torch.distributed.checkpoint.metadata", "StorageMeta") + b"\x94}\x94("
        + items + b"u](" + b"h\x00)\x81h\x01b" * 2000 + b"e.",
    }


@pytest.mark.parametrize("bomb", _metadata_bombs().values(), ids=_metadata_bombs().keys())
def test_metadata_whose_unpickling_would_take_many_times_its_size_is_refused_unpickled(
    tmp_path: Path, bomb: bytes
) -> None:
    path = tmp_path / METADATA
    path.write_bytes(bomb)
    with mock.patch.object(dcp_metadata.MetadataUnpickler, "load") as load, \
            pytest.raises(CheckpointError, match=f"{path}: "):
        within(HANG_GUARD_S, lambda: read_metadata(path))
    assert not load.called


# ---------------------------------------------------------------- a save from an atexit hook


def test_a_weight_file_written_from_an_atexit_hook_is_complete(tmp_path: Path) -> None:
    """Once the interpreter's exit hooks run, `concurrent.futures` refuses new threads: the
    file is then hashed in the calling thread, and written whole with its right digest."""
    script = textwrap.dedent(f"""
        import atexit, sys
        sys.path.insert(0, {str(REPO)!r})
        import torch
        from pathlib import Path
        from backends.safetensors_io import write_file
        from lifecycle.checksum import file_digest

        def last() -> None:
            path = Path({str(tmp_path / "last.safetensors")!r})
            digest = write_file(path, {{"w": torch.arange(6.0)}})
            print("saved", digest == file_digest(path))

        atexit.register(last)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0 and done.stdout.strip() == "saved True", done.stdout + done.stderr
    assert read_file(tmp_path / "last.safetensors")["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
