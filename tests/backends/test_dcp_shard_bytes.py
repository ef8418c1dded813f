"""A chunk's stored bytes must be the tensor `.metadata` says they are, and a metadata pickle
must leave the enum members and functions it is handed as they were.

DCP's reader `torch.load`s a chunk, narrows it to the part asked for and `copy_`s it into the
destination: a chunk stored as float64 where `.metadata` says float32 was cast (values x3 came
through as 3.0), and one stored twice as long was narrowed to its first half, both silently.
Such a chunk is refused, naming the data file, the tensor and both dtypes and shapes, for
torch_dcp and for Megatron's dist_checkpointing; untouched checkpoints load exactly.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType

from backends.dcp_metadata import METADATA, read_metadata
from backends.torch_dcp import TorchDCPBackend
from lifecycle import CheckpointError
from tests.backends.dist_util import run_ranks
from tests.backends.test_dcp_metadata import stack_global

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def rewrite_chunk(folder: Path, fqn: str, change: Callable[[torch.Tensor], torch.Tensor]) -> Path:
    """Store `change(chunk)` as the first chunk of `fqn`, appended to its data file, with `.metadata`
    pointing at it and otherwise untouched (as /tmp/attack25/B/craft_chunk.py does); the data file."""
    md = pickle.loads((folder / METADATA).read_bytes())
    info = md.storage_data[MetadataIndex(fqn, md.state_dict_metadata[fqn].chunks[0].offsets)]
    data_file = folder / info.relative_path
    data = data_file.read_bytes()
    stored = torch.load(io.BytesIO(data[info.offset:info.offset + info.length]), weights_only=True)
    buf = io.BytesIO()
    torch.save(change(stored), buf)
    info.offset, info.length = len(data), len(buf.getvalue())
    data_file.write_bytes(data + buf.getvalue())
    (folder / METADATA).write_bytes(pickle.dumps(md))
    return data_file


def saved_linear(folder: Path) -> nn.Linear:
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    TorchDCPBackend().save_model(model, folder)
    return model


CHANGES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    "float64_x3": (lambda t: t.double() * 3, r"torch\.float64 of shape \[6, 4\].*torch\.float32 of shape \[6, 4\]"),
    "int32_same_bytes": (lambda t: t.view(torch.int32), r"torch\.int32 of shape \[6, 4\].*torch\.float32"),
    "twice_as_long": (lambda t: torch.cat([t * 5, t]), r"torch\.float32 of shape \[12, 4\].*of shape \[6, 4\]"),
    "transposed": (lambda t: t.t().contiguous(), r"of shape \[4, 6\].*of shape \[6, 4\]"),
}


@pytest.mark.parametrize("change", CHANGES)
def test_torch_dcp_refuses_a_chunk_whose_stored_dtype_or_shape_is_not_the_metadatas_naming_file_tensor_and_both(
    tmp_path: Path, change: str
) -> None:
    saved_linear(tmp_path)
    rewrite, expected = CHANGES[change]
    data_file = rewrite_chunk(tmp_path, "weight", rewrite)
    model = nn.Linear(4, 6)
    with torch.no_grad():
        model.weight.fill_(-1.0)
    with pytest.raises(CheckpointError, match=expected) as caught:
        TorchDCPBackend().load_model(model, tmp_path)
    assert str(data_file) in str(caught.value) and "'weight'" in str(caught.value)
    assert torch.equal(model.weight, torch.full((6, 4), -1.0))  # nothing cast or narrowed into it


def test_torch_dcp_still_loads_a_chunk_rewritten_with_its_own_dtype_and_shape_exactly(tmp_path: Path) -> None:
    """The same rewrite, with a tensor of the metadata's dtype and shape: a legitimate chunk loads."""
    saved = saved_linear(tmp_path)
    rewrite_chunk(tmp_path, "weight", lambda t: t.clone())
    model = nn.Linear(4, 6)
    TorchDCPBackend().load_model(model, tmp_path)
    assert torch.equal(model.weight, saved.weight) and torch.equal(model.bias, saved.bias)


def test_torch_dcp_refuses_a_chunk_whose_bytes_hold_no_tensor(tmp_path: Path) -> None:
    saved_linear(tmp_path)
    data_file = rewrite_chunk(tmp_path, "bias", lambda t: {"not": t})  # type: ignore[return-value,arg-type]
    with pytest.raises(CheckpointError, match=r"tensor 'bias'.* holds a dict, not a tensor") as caught:
        TorchDCPBackend().load_model(nn.Linear(4, 6), tmp_path)
    assert str(data_file) in str(caught.value)


def _dist_ckpt_rewritten_chunks(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    """One gloo rank: a sharded tensor saved by Megatron, loaded back, then with its chunk
    rewritten as float64 and as twice as long."""
    from megatron.core.dist_checkpointing import ShardedTensor

    from backends.dist_ckpt import load_sharded, save_sharded

    def state(value: torch.Tensor) -> dict[str, Any]:
        return {"w": ShardedTensor.from_rank_offsets("w", value, replica_id=0)}

    saved = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    save_sharded(state(saved), tmp / "good")
    same = torch.equal(load_sharded(state(torch.zeros(3, 4)), tmp / "good")["w"], saved)
    errors: dict[str, str | None] = {}
    for name, rewrite in (("dtype", lambda t: t.double() * 3), ("shape", lambda t: torch.cat([t * 5, t]))):
        folder = tmp / name
        folder.mkdir()
        save_sharded(state(saved), folder)
        rewrite_chunk(folder, "w", rewrite)
        try:
            load_sharded(state(torch.zeros(3, 4)), folder)
            errors[name] = None
        except CheckpointError as exc:
            errors[name] = str(exc)
    return {"same": same, **errors}


@pytest.mark.slow
def test_dist_ckpt_refuses_a_chunk_whose_stored_dtype_or_shape_is_not_the_metadatas(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    [result] = run_ranks(_dist_ckpt_rewritten_chunks, tmp_path, world_size=1, timeout_s=240)
    assert result["same"]
    assert result["dtype"] is not None and "torch.float64 of shape [3, 4]" in result["dtype"], result["dtype"]
    assert result["shape"] is not None and "of shape [6, 4]" in result["shape"], result["shape"]
    assert "'w'" in result["dtype"] and str(tmp_path / "dtype") in result["dtype"]


# ---------------------------------------------------------------- enum members and functions handed out


def _build_onto(module: str, name: str, call: bytes, state: bytes) -> bytes:
    """A pickle that gets `module.name`, calls it with `call` (pickled arguments tuple; b"" for
    no call), then BUILDs `state` onto what it got. Not Metadata: refused, but only after the load."""
    return stack_global(module, name)[:-1] + call + state + b"b."


PLANNER = "torch.distributed.checkpoint.planner"


def test_a_pickle_that_renames_a_shared_enum_member_is_undone_and_refused(tmp_path: Path) -> None:
    """Before: `WriteItemType.TENSOR` was renamed (and rehashed) for the whole process."""
    path = tmp_path / METADATA
    path.write_bytes(_build_onto(PLANNER, "WriteItemType", b"K\x01\x85R", b"}\x8c\x06_name_\x8c\x06HACKEDs"))
    with pytest.raises(CheckpointError, match=r"tried to change WriteItemType\.TENSOR\._name_"):
        read_metadata(path)
    assert WriteItemType(1)._name_ == "TENSOR" and hash(WriteItemType.TENSOR) == hash("TENSOR")


def test_a_pickle_that_gives_a_shared_enum_member_another_class_is_undone_and_refused(tmp_path: Path) -> None:
    path = tmp_path / METADATA
    other = stack_global("torch.distributed.checkpoint.metadata", "Metadata")[2:-1]
    state = b"N}\x8c\t__class__" + other + b"s\x86"  # (None, {"__class__": Metadata}): setattr
    path.write_bytes(_build_onto(PLANNER, "WriteItemType", b"K\x01\x85R", state))
    with pytest.raises(CheckpointError, match=r"tried to change WriteItemType\.TENSOR\.__class__"):
        read_metadata(path)
    assert type(WriteItemType.TENSOR) is WriteItemType


def test_a_pickle_that_sets_attributes_of_a_handed_out_function_is_undone_and_refused(tmp_path: Path) -> None:
    """The layout stand-in is a function the pickle can BUILD onto: its defaults are put back."""
    from backends import dcp_metadata

    state = b"N}\x8c\x0c__defaults__\x8c\x07strided\x85s\x86"  # (None, {"__defaults__": ("strided",)})
    path = tmp_path / METADATA
    path.write_bytes(_build_onto("torch.serialization", "_get_layout", b"", state))
    with pytest.raises(CheckpointError, match=r"tried to change _layout\.__defaults__"):
        read_metadata(path)
    assert dcp_metadata._layout.__defaults__ is None
