"""Every tensor's chunks in a DCP `.metadata` must tile it, and point at real bytes, before DCP reads any.

DCP copies into a tensor only what its chunks cover and reports success, so metadata whose
chunks are gone, missing, overlapping or out of range, or whose bytes are not where it says,
would leave the model with its fresh weights (or part of them) while resume logs a verified
checkpoint. Each case is a CheckpointError naming the `.metadata` file and the tensor: through
the backend, with the model untouched, and through `Lifecycle.resume()` with the manifest
re-signed, after which the step before still resumes exactly. A checkpoint cut by hand into
several chunks per tensor (one empty, as FSDP2 writes for a rank without a shard) loads
bit-exactly, and the tiling proof agrees with counting elements on generated layouts.
"""

from __future__ import annotations

import itertools
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.checkpoint import Metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from backends import dcp_metadata
from backends.dcp_metadata import METADATA, SAVE_OVERHEAD, MetadataReader, read_metadata
from backends.torch_dcp import TorchDCPBackend
from lifecycle import CheckpointError, Lifecycle, State
from tests.backends.test_dcp_metadata import ROLE, net, resign, trained
from tests.guards import within

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

DATA = "__0_0.distcp"
HANG_GUARD_S = 20
Box = tuple[tuple[int, ...], tuple[int, ...]]
CUTS: dict[str, list[Box]] = {
    "0.weight": [((0, 0), (3, 3)), ((0, 3), (3, 3)), ((3, 0), (3, 3)), ((3, 3), (3, 3))],
    "0.bias": [((0,), (2,)), ((2,), (4,)), ((6,), (0,))],
    "2.weight": [((0, 0), (1, 6)), ((1, 0), (2, 6))],
}
"""How `write_cut` cuts `net()`'s tensors (the rest stay whole); the empty chunk at the end of
`0.bias` is what FSDP2 records for a rank that holds no shard of a tensor."""


def write_cut(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A DCP checkpoint of `tensors` written as DCP writes one (each chunk `torch.save`d into
    a data file, where it sits recorded in storage_data), with those in CUTS in several chunks."""
    entries: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    with (folder / DATA).open("wb") as f:
        for fqn, tensor in tensors.items():
            chunks = []
            for offsets, sizes in CUTS.get(fqn, [((0,) * tensor.dim(), tuple(tensor.shape))]):
                start = f.tell()
                torch.save(tensor[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].clone(), f)
                storage[MetadataIndex(fqn, offsets)] = _StorageInfo(DATA, start, f.tell() - start)
                chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            entries[fqn] = TensorStorageMetadata(TensorProperties(dtype=tensor.dtype), tensor.shape, chunks)
    (folder / METADATA).write_bytes(pickle.dumps(Metadata(entries, storage_data=storage)))


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- the malformed cases


def _chunks(md: Metadata, fqn: str) -> list[ChunkStorageMetadata]:
    return md.state_dict_metadata[fqn].chunks


def _key(md: Metadata, fqn: str, i: int) -> MetadataIndex:
    return MetadataIndex(fqn, _chunks(md, fqn)[i].offsets)


def _info(md: Metadata, fqn: str, i: int) -> _StorageInfo:
    return md.storage_data[_key(md, fqn, i)]


def no_chunks(md: Metadata, folder: Path) -> None:
    _chunks(md, "0.weight").clear()


def a_missing_chunk(md: Metadata, folder: Path) -> None:
    del _chunks(md, "0.weight")[3]


def overlapping_chunks(md: Metadata, folder: Path) -> None:
    """The chunk at [0, 3] moved a row down, over [3, 3]: the volumes still add up, row 0 is in no chunk."""
    info = md.storage_data.pop(_key(md, "0.weight", 1))
    _chunks(md, "0.weight")[1] = ChunkStorageMetadata(torch.Size([1, 3]), torch.Size([3, 3]))
    md.storage_data[MetadataIndex("0.weight", [1, 3])] = info


def an_out_of_range_offset(md: Metadata, folder: Path) -> None:
    _chunks(md, "0.weight")[3].offsets = torch.Size([2**40, 3])


def offsets_of_the_wrong_rank(md: Metadata, folder: Path) -> None:
    _chunks(md, "0.bias")[0].offsets = torch.Size([0, 0])


def sizes_of_the_wrong_rank(md: Metadata, folder: Path) -> None:
    _chunks(md, "0.bias")[0].sizes = torch.Size([2, 2])


def a_chunk_without_storage(md: Metadata, folder: Path) -> None:
    del md.storage_data[_key(md, "0.weight", 2)]


def storage_in_a_missing_file(md: Metadata, folder: Path) -> None:
    _info(md, "0.weight", 2).relative_path = "__9_0.distcp"


def storage_past_the_end_of_its_file(md: Metadata, folder: Path) -> None:
    info = _info(md, "0.weight", 3)
    info.offset = (folder / info.relative_path).stat().st_size - info.length + 1


def storage_shorter_than_its_chunk(md: Metadata, folder: Path) -> None:
    _info(md, "0.weight", 0).length = 3 * 3 * 4 - 1


def storage_longer_than_a_save_of_its_chunk(md: Metadata, folder: Path) -> None:
    info = _info(md, "0.weight", 0)
    info.offset, info.length = 0, 3 * 3 * 4 + SAVE_OVERHEAD + 1
    data = folder / info.relative_path
    with data.open("ab") as f:
        f.truncate(max(info.length, data.stat().st_size))


def a_negative_storage_offset(md: Metadata, folder: Path) -> None:
    _info(md, "0.weight", 0).offset = -1


CASES: dict[str, tuple[Callable[[Metadata, Path], None], str, str]] = {
    "no chunks": (no_chunks, "0.weight", "part of it is in no chunk"),
    "a missing chunk": (a_missing_chunk, "0.weight", "part of it is in no chunk"),
    "overlapping chunks": (overlapping_chunks, "0.weight", "chunks at offsets [1, 3] and [3, 3] that overlap"),
    "an out-of-range offset": (an_out_of_range_offset, "0.weight", "reaches past the tensor's size [6, 6]"),
    "offsets of the wrong rank": (offsets_of_the_wrong_rank, "0.bias", "2 offsets and 1 sizes for a 1-D tensor"),
    "sizes of the wrong rank": (sizes_of_the_wrong_rank, "0.bias", "1 offsets and 2 sizes for a 1-D tensor"),
    "a chunk without storage": (a_chunk_without_storage, "0.weight", "at offsets [3, 0] with no storage_data entry"),
    "storage in a missing file": (storage_in_a_missing_file, "0.weight", "__9_0.distcp, which cannot be read"),
    "storage past the end of its file": (storage_past_the_end_of_its_file, "0.weight", f"{DATA}, which has"),
    "storage shorter than its chunk": (storage_shorter_than_its_chunk, "0.weight", "a chunk of 36 bytes takes 36 to"),
    "storage longer than a save of its chunk": (
        storage_longer_than_a_save_of_its_chunk, "0.weight", f"takes 36 to {36 + SAVE_OVERHEAD}"),
    "a negative storage offset": (a_negative_storage_offset, "0.weight", "negative offset or length"),
}


def damage(folder: Path, case: str) -> Path:
    path = folder / METADATA
    metadata = pickle.loads(path.read_bytes())
    CASES[case][0](metadata, folder)
    path.write_bytes(pickle.dumps(metadata))
    return path


def assert_names(error: BaseException, path: Path, case: str) -> None:
    _, fqn, problem = CASES[case]
    assert str(path) in str(error) and repr(fqn) in str(error) and problem in str(error), str(error)


# ---------------------------------------------------------------- through the backend


@pytest.fixture
def cut(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    model, _ = trained()
    (tmp_path / "model").mkdir()
    write_cut(tmp_path / "model", weights(model))
    return tmp_path / "model", weights(model)


def test_a_checkpoint_cut_into_chunks_with_an_empty_one_loads_bit_exactly(cut: Any) -> None:
    folder, want = cut
    assert len(read_metadata(folder / METADATA).state_dict_metadata["0.weight"].chunks) == 4
    model, _ = trained(seed=1)
    TorchDCPBackend().load_model(model, folder)
    assert same(weights(model), want)


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_chunks_are_refused_naming_file_and_tensor_before_any_data_is_read(cut: Any, case: str) -> None:
    folder, _ = cut
    path = damage(folder, case)
    model, _ = trained(seed=1)
    before = weights(model)
    with mock.patch.object(MetadataReader, "read_data", side_effect=AssertionError("DCP read data")) as read, \
            pytest.raises(CheckpointError) as caught:
        TorchDCPBackend().load_model(model, folder)
    assert_names(caught.value, path, case)
    assert not read.called and same(weights(model), before)


def test_metadata_naming_itself_as_a_data_file_is_refused(cut: Any) -> None:
    folder, _ = cut
    path = folder / METADATA
    metadata = pickle.loads(path.read_bytes())
    _info(metadata, "0.weight", 0).relative_path = METADATA
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"storage_data\['0.weight'\] names '.metadata', DCP metadata"):
        TorchDCPBackend().load_model(net(), folder)


@pytest.mark.parametrize(("name", "problem"), [
    ("__0_0\x00.distcp", "holds a NUL byte"), ("x" * 300, "longer than 255"), ("\ud800.distcp", "cannot be encoded"),
    ("sub/__0_0.distcp", "holds a path separator"), ("..", "is not a file name"),
], ids=["nul", "over-long", "not-encodable", "separator", "dot-dot"])
def test_a_data_file_name_no_file_can_have_is_refused_naming_the_metadata(cut: Any, name: str, problem: str) -> None:
    """Refused with the other checks of the metadata, never as a raw ValueError from a stat of it."""
    folder, _ = cut
    path = folder / METADATA
    metadata = pickle.loads(path.read_bytes())
    _info(metadata, "0.weight", 0).relative_path = name
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError) as caught:
        TorchDCPBackend().load_model(net(), folder)
    message = str(caught.value)
    assert message.startswith(f"{path}: data file ") and f"is not a file in {folder}: " in message, message
    assert problem in message, message


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_data_file_that_is_a_fifo_is_refused_by_its_kind_without_opening_it(cut: Any) -> None:
    folder, _ = cut
    os.mkfifo(folder / "__1_0.distcp")
    path = folder / METADATA
    metadata = pickle.loads(path.read_bytes())
    _info(metadata, "0.weight", 0).relative_path = "__1_0.distcp"
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp, which is a FIFO, not a regular file"):
        within(HANG_GUARD_S, lambda: TorchDCPBackend().load_model(net(), folder))


@pytest.mark.parametrize("part", ["model", "optimizer"])
def test_emptied_chunks_of_a_real_checkpoint_are_refused(tmp_path: Path, part: str) -> None:
    """The reported attack on what DCP itself wrote: every chunk list emptied."""
    model, optimizer = trained()
    backend = TorchDCPBackend()
    backend.save_model(model, tmp_path / "model")
    (tmp_path / "optimizer").mkdir()
    backend.save_optimizer(optimizer, None, tmp_path / "optimizer", model=model)
    path = tmp_path / part / METADATA
    metadata = pickle.loads(path.read_bytes())
    for entry in metadata.state_dict_metadata.values():
        entry.chunks = []
    path.write_bytes(pickle.dumps(metadata))
    fresh, fresh_optimizer = trained(seed=1)
    with pytest.raises(CheckpointError, match="part of it is in no chunk") as caught:
        if part == "model":
            backend.load_model(fresh, tmp_path / part)
        else:
            backend.load_optimizer(fresh_optimizer, None, tmp_path / part, model=fresh)
    assert str(path) in str(caught.value) and "tensor '" in str(caught.value)


# ---------------------------------------------------------------- through Lifecycle.resume()


def lifecycle_at(root: Path, **resume: Any) -> Lifecycle:
    model, optimizer = trained(seed=7)
    cfg = {"checkpoint": {"root": str(root), "save": {"format": "torch_dcp"}},
           "resume": {"on_damaged": "refuse", **resume}}
    return Lifecycle(cfg, role=ROLE, model=model, optimizer=optimizer)


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """Steps 1 and 2 with different weights; step 2's model cut into chunks and re-signed."""
    root = tmp_path / "ckpt"
    lc = lifecycle_at(root)
    lc.init_load()
    saved = {}
    for step in (1, 2):
        with torch.no_grad():
            for p in lc.parts.model.parameters():
                p.add_(step)
        lc.save(step)
        saved[step] = weights(lc.parts.model)
    lc.close()
    folder = root / "global_step_2" / ROLE / "model"
    for data in folder.glob("*.distcp"):
        data.unlink()
    write_cut(folder, saved[2])
    resign(folder.parent)
    return root, saved


def test_resume_loads_the_step_cut_into_chunks_bit_exactly(run: Any) -> None:
    root, saved = run
    lc = lifecycle_at(root)
    assert lc.resume() == 2 and same(weights(lc.parts.model), saved[2])


@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_refuses_malformed_chunks_under_a_resigned_manifest_and_the_step_before_still_resumes(
    run: Any, case: str
) -> None:
    root, saved = run
    folder = root / "global_step_2" / ROLE / "model"
    path = damage(folder, case)
    resign(folder.parent)
    lc = lifecycle_at(root)
    with pytest.raises(CheckpointError, match="cannot resume from step 2") as caught:
        lc.resume()
    assert_names(caught.value, path, case)
    assert lc.state is State.FAILED
    before = lifecycle_at(root, mode="path", path=str(root / "global_step_1"))
    assert before.resume() == 1 and same(weights(before.parts.model), saved[1])


# ---------------------------------------------------------------- the tiling proof against counting


def _covered_once(shape: tuple[int, ...], boxes: list[Box]) -> bool:
    counts = torch.zeros(shape, dtype=torch.int64)
    for offsets, sizes in boxes:
        counts[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] += 1
    return bool((counts == 1).all())


def _problem(shape: tuple[int, ...], boxes: list[Box]) -> str | None:
    chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in boxes]
    return dcp_metadata._tiling_problem(TensorStorageMetadata(TensorProperties(), torch.Size(shape), chunks))


def _cuts(draw: st.DrawFn, length: int) -> list[tuple[int, int]]:
    points = sorted(draw(st.sets(st.integers(1, length - 1), max_size=3))) if length > 1 else []
    bounds = [0, *points, length]
    return list(zip(bounds, [b - a for a, b in itertools.pairwise(bounds)]))


@st.composite
def grids(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    """A grid, as DTensor / FSDP2 / Megatron TP cut tensors, with each cell's last dimension
    cut again unevenly (Megatron's flattened ranges), some empty chunks, in any order."""
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    boxes: list[Box] = []
    for cell in itertools.product(*(_cuts(draw, n) for n in shape)):
        *outer, (last_offset, last_size) = cell
        for o, n in (_cuts(draw, last_size) if draw(st.booleans()) else [(0, last_size)]):
            boxes.append(((*(c[0] for c in outer), last_offset + o), (*(c[1] for c in outer), n)))
    if draw(st.booleans()):
        boxes.append((tuple(shape), (0,) * len(shape)))
    return shape, draw(st.permutations(boxes))


@st.composite
def damaged(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    """A grid with one chunk dropped, doubled, moved, grown or shrunk by one along one dimension."""
    shape, boxes = draw(grids())
    i, dim = draw(st.integers(0, len(boxes) - 1)), draw(st.integers(0, len(shape) - 1))
    offsets, sizes = map(list, boxes[i])
    how = draw(st.sampled_from(["drop", "double", "move", "grow", "shrink"]))
    if how == "drop":
        return shape, boxes[:i] + boxes[i + 1:]
    if how == "double":
        return shape, [*boxes, boxes[i]]
    step = draw(st.sampled_from([-1, 1]))
    if how == "move":
        offsets[dim] = max(0, min(shape[dim] - sizes[dim], offsets[dim] + step))
    else:
        sizes[dim] = max(0, min(shape[dim] - offsets[dim], sizes[dim] + (1 if how == "grow" else -1)))
    return shape, [*boxes[:i], (tuple(offsets), tuple(sizes)), *boxes[i + 1:]]


@settings(max_examples=300, deadline=None)
@given(grids())
def test_every_grid_with_uneven_last_cuts_is_proven_a_tiling(layout: tuple[tuple[int, ...], list[Box]]) -> None:
    shape, boxes = layout
    assert _covered_once(shape, boxes)
    assert _problem(shape, boxes) is None


@settings(max_examples=500, deadline=None)
@given(st.one_of(damaged(), grids()))
def test_no_layout_is_taken_for_a_tiling_unless_it_covers_every_element_once(
    layout: tuple[tuple[int, ...], list[Box]],
) -> None:
    shape, boxes = layout
    assert (_problem(shape, boxes) is None) == _covered_once(shape, boxes)


PINWHEEL = [((0, 0), (2, 1)), ((0, 1), (1, 2)), ((1, 1), (1, 1)), ((2, 0), (1, 2)), ((1, 2), (2, 1))]
"""Five boxes tiling 3 x 3 that no straight cut separates."""


def test_a_pinwheel_no_cut_separates_is_proven_pairwise() -> None:
    assert _covered_once((3, 3), PINWHEEL) and _problem((3, 3), PINWHEEL) is None
    centre_moved = [*PINWHEEL[:2], ((0, 0), (1, 1)), *PINWHEEL[3:]]
    assert "overlap" in str(_problem((3, 3), centre_moved))


def test_many_chunks_no_cut_separates_are_refused_rather_than_taken_as_disjoint() -> None:
    """A pinwheel twice the size, each box halved across its length: a tiling of 6 x 6, but of
    more chunks than are compared pairwise, and no DCP or Megatron layout; refused, never
    passed unproven."""
    boxes = [((0, 0), (4, 1)), ((0, 1), (4, 1)), ((0, 2), (1, 4)), ((1, 2), (1, 4)), ((2, 2), (2, 1)),
             ((2, 3), (2, 1)), ((4, 0), (1, 4)), ((5, 0), (1, 4)), ((2, 4), (4, 1)), ((2, 5), (4, 1))]
    assert _covered_once((6, 6), boxes)
    assert "10 chunks that overlap, or are cut too irregularly to prove" in str(_problem((6, 6), boxes))


def test_a_tensor_cut_into_ninety_thousand_chunks_is_checked_in_seconds() -> None:
    """Comparing every pair would be four billion comparisons."""
    chunks = [ChunkStorageMetadata(torch.Size([r, c]), torch.Size([1, 1])) for r in range(300) for c in range(300)]
    entry = TensorStorageMetadata(TensorProperties(), torch.Size([300, 300]), chunks[::-1])
    began = time.perf_counter()
    assert dcp_metadata._tiling_problem(entry) is None
    assert time.perf_counter() - began < 15
