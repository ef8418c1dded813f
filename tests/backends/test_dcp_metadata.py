"""DCP's pickled `.metadata` is read by a restricted unpickler, never by `pickle.load`.

A `.metadata` replaced by a pickle whose payload creates a marker file is refused with a
CheckpointError naming the file and the refused global, and the marker never appears: through
the torch_dcp backend, through `Lifecycle.resume()` with and without verification, through a
hand-made `pre_load` folder, and through the dist_ckpt backend (Megatron's reader). Real
checkpoints of both kinds read back exactly what DCP wrote.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader, Metadata

from backends import dcp_metadata
from backends.dcp_metadata import MAX_METADATA_BYTES, METADATA, MetadataReader, read_metadata
from backends.torch_dcp import TorchDCPBackend
from lifecycle import CheckpointError, Lifecycle, State
from lifecycle.checksum import ALGORITHM, file_digest
from lifecycle.manifest import MANIFEST
from tests.backends.dist_util import run_ranks
from tests.guards import within

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ROLE = "actor"
HANG_GUARD_S = 20


class Exploit:
    """Unpickling this creates `marker`: proof that something unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


class TouchExploit(Exploit):
    """The same through `pathlib`, whose path classes the metadata may name (as pure paths)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


EXPLOITS = {"io.open": Exploit, "pathlib.Path.touch": TouchExploit}


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    live = tmp_path / "proof-the-payload-is-live"
    pickle.loads(pickle.dumps(Exploit(live)))
    pickle.loads(pickle.dumps(TouchExploit(live.with_suffix(".touch"))))
    assert live.exists() and live.with_suffix(".touch").exists()
    return tmp_path / "pwned"


def plant(path: Path, marker: Path, kind: str = "io.open", pad: bool = False) -> None:
    """Replace `path` with the exploit; padded with bytes the unpickler never reaches, it keeps
    the original size (what `checkpoint.load.verify: false` still checks)."""
    bomb = pickle.dumps(EXPLOITS[kind](marker))
    size = path.stat().st_size
    assert len(bomb) <= size
    path.write_bytes(bomb + b"\0" * (size - len(bomb)) if pad else bomb)


def net() -> nn.Module:
    """bf16, fp16 and int64 entries, so their dtypes are in the metadata."""
    return nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 3).to(torch.bfloat16),
                         nn.Embedding(4, 2).to(torch.float16))


def trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    return model, optimizer


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A torch_dcp model folder and optimizer folder of a trained model."""
    model, optimizer = trained()
    TorchDCPBackend().save_model(model, tmp_path / "model")
    (tmp_path / "optimizer").mkdir()
    TorchDCPBackend().save_optimizer(optimizer, None, tmp_path / "optimizer", model=model)
    return tmp_path


def stack_global(module: str, name: str) -> bytes:
    """A protocol 4 pickle of just the global `module.name` (dotted names allowed)."""
    def text(value: str) -> bytes:
        data = value.encode()
        return b"\x8c" + bytes([len(data)]) + data

    return b"\x80\x04" + text(module) + text(name) + b"\x93."


def call(module: str, name: str, arg: str) -> bytes:
    """A protocol 4 pickle that calls `module.name(arg)`."""
    data = arg.encode()
    return stack_global(module, name)[:-1] + b"\x8c" + bytes([len(data)]) + data + b"\x85R."


# ---------------------------------------------------------------- real metadata


@pytest.mark.parametrize("part", ["model", "optimizer"])
def test_real_torch_dcp_metadata_reads_back_equal_to_what_dcp_wrote(saved: Path, part: str) -> None:
    path = saved / part / METADATA
    assert read_metadata(path) == pickle.loads(path.read_bytes())


def test_torch_dcp_loads_bit_exactly_without_ever_calling_the_plain_reader(saved: Path) -> None:
    """FileSystemReader.read_metadata (plain pickle.load) is made to fail: neither the
    pre-check nor dcp.load may reach it."""
    want_model, want_optimizer = trained()
    model, optimizer = trained(seed=1)
    with mock.patch.object(FileSystemReader, "read_metadata", side_effect=AssertionError("plain pickle.load")):
        TorchDCPBackend().load_model(model, saved / "model")
        TorchDCPBackend().load_optimizer(optimizer, None, saved / "optimizer", model=model)
    got, want = model.state_dict(), want_model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype
                                             for k in got)
    for p, q in zip(model.parameters(), want_model.parameters()):
        assert all(torch.equal(optimizer.state[p][k], want_optimizer.state[q][k]) for k in ("exp_avg", "exp_avg_sq"))


def test_a_load_reads_metadata_once_and_dcp_plans_with_that_object(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read: list[Metadata] = []
    planned: list[Metadata] = []
    real_read, real_plan = dcp_metadata.read_metadata, DefaultLoadPlanner.set_up_planner

    def reading(path: Path) -> Metadata:
        read.append(real_read(path))
        return read[-1]

    def planning(self: DefaultLoadPlanner, state_dict: Any, metadata: Metadata | None = None,
                 is_coordinator: bool = False) -> None:
        planned.append(metadata)
        real_plan(self, state_dict, metadata, is_coordinator)

    monkeypatch.setattr(dcp_metadata, "read_metadata", reading)
    monkeypatch.setattr(DefaultLoadPlanner, "set_up_planner", planning)
    TorchDCPBackend().load_model(net(), saved / "model")
    assert len(read) == 1 and len(planned) == 1 and planned[0] is read[0]


def test_the_reader_keeps_what_it_read_when_the_file_changes_after(saved: Path) -> None:
    reader = MetadataReader(saved / "model")
    first = reader.read_metadata()
    (saved / "model" / METADATA).write_bytes(b"replaced after the check")
    assert reader.read_metadata() is first


# ---------------------------------------------------------------- the exploit, through the backend


@pytest.mark.parametrize("kind", sorted(EXPLOITS))
def test_exploit_in_model_metadata_is_refused_naming_file_and_global(saved: Path, marker: Path, kind: str) -> None:
    path = saved / "model" / METADATA
    plant(path, marker, kind)
    with pytest.raises(CheckpointError) as caught:
        TorchDCPBackend().load_model(net(), saved / "model")
    assert str(path) in str(caught.value) and f"refused to unpickle {kind}" in str(caught.value)
    assert not marker.exists()


def test_exploit_in_optimizer_metadata_is_refused_naming_file_and_global(saved: Path, marker: Path) -> None:
    path = saved / "optimizer" / METADATA
    plant(path, marker)
    model, optimizer = trained(seed=1)
    with pytest.raises(CheckpointError) as caught:
        TorchDCPBackend().load_optimizer(optimizer, None, saved / "optimizer", model=model)
    assert str(path) in str(caught.value) and "refused to unpickle io.open" in str(caught.value)
    assert not marker.exists()


def test_dcp_fallback_to_a_rank_local_metadata_goes_through_the_same_unpickler(
    saved: Path, marker: Path, refusals: list[str]
) -> None:
    """Without a global .metadata, dcp.load asks the reader for `__<rank>.metadata`."""
    (saved / "model" / METADATA).unlink()
    path = saved / "model" / f"__0{METADATA}"
    path.write_bytes(pickle.dumps(Exploit(marker)))
    with pytest.raises(CheckpointException, match="refused to unpickle io.open") as caught:  # DCP wraps it
        dcp.load(net().state_dict(), storage_reader=MetadataReader(saved / "model"))
    assert str(path) in str(caught.value)
    assert refusals[-1].startswith(f"{path}: refused to unpickle io.open")
    assert not marker.exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("name", [METADATA, f"__0{METADATA}"])
def test_a_fifo_named_like_metadata_is_refused_without_blocking(saved: Path, name: str) -> None:
    """A FIFO no writer opens would block a plain open for ever (Megatron's load, DCP's fallback)."""
    folder = saved / "model"
    (folder / METADATA).unlink()
    os.mkfifo(folder / name)
    rank = 0 if name.startswith("__") else None
    with pytest.raises(CheckpointError, match=f"{folder / name}: a FIFO, not a regular file"):
        within(HANG_GUARD_S, lambda: MetadataReader(folder).read_metadata(rank=rank))
    with pytest.raises(CheckpointError, match=f"{folder / name}: a FIFO, not a regular file"):
        within(HANG_GUARD_S, lambda: read_metadata(folder / name))


# ---------------------------------------------------------------- the allow-list


@pytest.mark.parametrize(("module", "name"), [
    ("os", "system"), ("posix", "system"), ("builtins", "eval"), ("builtins", "getattr"), ("builtins", "open"),
    ("torch", "load"), ("torch", "tensor"), ("torch", "Tensor"), ("torch", "dtype"), ("torch", "nn"),
    ("torch", "_C"), ("torch", "ops.aten"), ("torch.serialization", "load"), ("torch._utils", "_rebuild_tensor_v2"),
    ("collections", "OrderedDict"), ("copyreg", "_reconstructor"), ("pathlib", "Path"),
    ("torch.distributed.checkpoint.metadata", "os"), ("torch.distributed.checkpoint.metadata", "torch"),
    ("torch.distributed.checkpoint.metadata", "Metadata.__init__"), ("torch.distributed.checkpoint", "load"),
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreLoadPlanner"),
])
def test_globals_outside_the_allow_list_are_refused_by_name(tmp_path: Path, module: str, name: str) -> None:
    path = tmp_path / METADATA
    path.write_bytes(stack_global(module, name))
    with pytest.raises(CheckpointError, match="refused to unpickle") as caught:
        read_metadata(path)
    assert f"{path}: refused to unpickle {module}.{name}," in str(caught.value)


@pytest.mark.parametrize(("module", "name", "arg"), [
    ("os", "system", "touch {marker}"),
    ("builtins", "eval", "open({marker!r}, 'w')"),
    ("builtins", "exec", "open({marker!r}, 'w')"),
    ("subprocess", "getoutput", "touch {marker}"),
])
def test_a_refused_call_never_runs(tmp_path: Path, module: str, name: str, arg: str) -> None:
    marker = str(tmp_path / "pwned")
    path = tmp_path / METADATA
    path.write_bytes(call(module, name, arg.format(marker=marker)))
    with pytest.raises(CheckpointError, match=f"{module}.{name}"):
        read_metadata(path)
    assert not os.path.exists(marker)


@pytest.mark.parametrize(("module", "name", "value"), [
    ("torch", "float32", torch.float32), ("torch", "bfloat16", torch.bfloat16), ("torch", "float8_e4m3fn",
    torch.float8_e4m3fn), ("torch", "strided", torch.strided), ("torch", "channels_last", torch.channels_last),
    ("torch", "Size", torch.Size),
])
def test_torch_values_are_allowed_by_type_and_are_still_not_metadata(
    tmp_path: Path, module: str, name: str, value: Any
) -> None:
    path = tmp_path / METADATA
    path.write_bytes(stack_global(module, name))
    with pytest.raises(CheckpointError, match=f"holds a {type(value).__name__}, not DCP Metadata"):
        read_metadata(path)


def test_the_layout_stand_in_hands_out_layouts_only(tmp_path: Path) -> None:
    path = tmp_path / METADATA
    path.write_bytes(call("torch.serialization", "_get_layout", "torch.float32"))
    with pytest.raises(CheckpointError, match="unreadable DCP metadata.*not a torch layout"):
        read_metadata(path)


def test_a_pickle_that_builds_onto_an_allowed_class_is_undone_and_refused(tmp_path: Path) -> None:
    """BUILD onto the class `Metadata` itself would set its `__eq__` for the whole process."""
    path = tmp_path / METADATA
    state = b"N}\x8c\x06__eq__\x8c\x01xs\x86b."  # (None, {"__eq__": "x"}) then BUILD
    path.write_bytes(stack_global("torch.distributed.checkpoint.metadata", "Metadata")[:-1] + state)
    before = Metadata.__eq__
    with pytest.raises(CheckpointError, match=r"tried to change Metadata\.__eq__"):
        read_metadata(path)
    assert Metadata.__eq__ is before


def test_a_persistent_id_is_refused(tmp_path: Path) -> None:
    path = tmp_path / METADATA
    path.write_bytes(b"\x80\x04\x8c\x01xQ.")
    with pytest.raises(CheckpointError, match="persistent id"):
        read_metadata(path)


# ---------------------------------------------------------------- damaged and oversized files


def test_every_truncation_and_byte_flip_of_real_metadata_is_metadata_or_a_checkpoint_error(tmp_path: Path) -> None:
    """Damaged bytes may still unpickle into allowed objects: whatever comes out is Metadata DCP
    can use, or a CheckpointError naming the file, never another exception; and what comes out
    loads the saved weights exactly or is a CheckpointError, never a load of part of them."""
    torch.manual_seed(0)
    saved = nn.Linear(2, 2, dtype=torch.bfloat16)
    TorchDCPBackend().save_model(saved, tmp_path / "model")
    shutil.copytree(tmp_path / "model", tmp_path / "damaged")
    original = (tmp_path / "model" / METADATA).read_bytes()
    path = tmp_path / "damaged" / METADATA
    variants = [original[:cut] for cut in range(len(original))]
    variants += [original[:i] + bytes([original[i] ^ (0xFF if i % 2 else 0x01)]) + original[i + 1:]
                 for i in range(len(original))]
    refused = 0
    for data in variants:
        path.write_bytes(data)
        try:
            assert isinstance(read_metadata(path), Metadata)
            model = nn.Linear(2, 2, dtype=torch.bfloat16)
            TorchDCPBackend().load_model(model, path.parent)
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), saved.parameters())), data
        except CheckpointError as exc:
            assert str(path.parent) in str(exc)
            refused += 1
    assert refused > len(original)


def test_metadata_over_the_size_bound_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / METADATA
    with path.open("wb") as f:
        f.truncate(MAX_METADATA_BYTES + 1)  # sparse: no disk space used
    with mock.patch.object(dcp_metadata.MetadataUnpickler, "load", side_effect=AssertionError("read")), \
            pytest.raises(CheckpointError, match=f"{path}: {MAX_METADATA_BYTES + 1} bytes, more than"):
        read_metadata(path)


@pytest.mark.parametrize("payload", [{"a": 1}, [1, 2], None, torch.Size([2])])
def test_a_pickle_of_allowed_things_that_is_not_metadata_is_refused(tmp_path: Path, payload: Any) -> None:
    path = tmp_path / METADATA
    path.write_bytes(pickle.dumps(payload))
    with pytest.raises(CheckpointError, match=f"{path}: holds a {type(payload).__name__}, not DCP Metadata"):
        read_metadata(path)


# ---------------------------------------------------------------- through Lifecycle.resume() and pre_load


def lifecycle_at(root: Path, verify: bool = True, **checkpoint: Any) -> Lifecycle:
    model, optimizer = trained(seed=7)
    cfg = {"checkpoint": {"root": str(root), "save": {"format": "torch_dcp"}, "load": {"verify": verify},
                          **checkpoint}}
    return Lifecycle(cfg, role=ROLE, model=model, optimizer=optimizer)


def resign(folder: Path) -> None:
    """Re-describe every file in the manifest, as someone rewriting the files would."""
    path = folder / MANIFEST
    manifest = json.loads(path.read_text())
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest["files"] = [{"path": rel, "size": (folder / rel).stat().st_size, ALGORITHM: file_digest(folder / rel)}
                         for rel in files]
    path.write_text(json.dumps(manifest))


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A run whose step 1 was saved in torch_dcp; returns the step's role folder."""
    root = tmp_path / "ckpt"
    lc = lifecycle_at(root)
    lc.init_load()
    lc.save(1)
    lc.close()
    return root / "global_step_1" / ROLE


def refused_resume(lc: Lifecycle, *needles: str) -> None:
    with pytest.raises(CheckpointError) as caught:
        lc.resume()
    for needle in needles:
        assert needle in str(caught.value), f"{needle!r} not in: {caught.value}"
    assert lc.state is State.FAILED


@pytest.fixture
def refusals(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What the restricted unpickler refused, even where the caller reports something else."""
    seen: list[str] = []
    real = dcp_metadata.read_metadata

    def spy(path: Path) -> Metadata:
        try:
            return real(path)
        except CheckpointError as exc:
            seen.append(str(exc))
            raise

    monkeypatch.setattr(dcp_metadata, "read_metadata", spy)
    return seen


@pytest.mark.parametrize("part", ["model", "optimizer"])
def test_resume_with_verify_off_refuses_a_same_size_exploit(
    run: Path, marker: Path, refusals: list[str], part: str
) -> None:
    """Sizes match, checksums are not read: the unpickler refuses it. The failed load then has
    the resumer check the folder fully, so the error it reports is the checksum it finds."""
    path = run / part / METADATA
    plant(path, marker, pad=True)
    refused_resume(lifecycle_at(run.parent.parent, verify=False), str(path))
    refusal = f"{path}: refused to unpickle io.open, which DCP metadata never holds; nothing in the file was run"
    assert refusals == [refusal]
    assert not marker.exists()


@pytest.mark.parametrize("part", ["model", "optimizer"])
def test_resume_with_a_resigned_manifest_refuses_the_exploit(run: Path, marker: Path, part: str) -> None:
    path = run / part / METADATA
    plant(path, marker)
    resign(run)
    refused_resume(lifecycle_at(run.parent.parent), str(path), "refused to unpickle io.open")
    assert not marker.exists()


def test_pre_load_from_a_hand_made_checkpoint_refuses_the_exploit(run: Path, marker: Path, tmp_path: Path) -> None:
    handmade = tmp_path / "handmade"
    shutil.copytree(run, handmade)
    path = handmade / "model" / METADATA
    plant(path, marker)
    resign(handmade)
    lc = lifecycle_at(tmp_path / "fresh", pre_load={"format": "torch_dcp", "path": str(handmade / "model")})
    with pytest.raises(CheckpointError, match="refused to unpickle io.open") as caught:
        lc.init_load()
    assert str(path) in str(caught.value)
    assert not marker.exists()


# ---------------------------------------------------------------- Megatron dist_checkpointing (one gloo rank)


def _dist_ckpt_round_trip_and_exploit(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    """TP1: save model and a torch optimizer with dist_ckpt, load them back through Megatron
    with the plain reader made to fail, then load a model folder whose .metadata is an exploit
    and an optimizer folder whose .metadata lost a tensor's chunks."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_dcp

    from backends.dist_ckpt import DistCkptBackend
    from backends.megatron import build_model

    model = build_model(tmp / "hf", tp=1)
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=0.01)
    for p in model.parameters():
        p.grad = torch.rand_like(p)
    optimizer.step()
    backend = DistCkptBackend()
    backend.save_model(model, tmp / "model")
    backend.save_optimizer(optimizer, None, tmp / "optimizer", model=model)
    params = [p.detach().clone() for p in model.parameters()]
    moments = [optimizer.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
            optimizer.state[p]["exp_avg_sq"].zero_()
    factory = mcore_dcp._get_filesystem_reader
    with mock.patch.object(FileSystemReader, "read_metadata", side_effect=AssertionError("plain pickle.load")):
        backend.load_model(model, tmp / "model")
        backend.load_optimizer(optimizer, None, tmp / "optimizer", model=model)
    same = (all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
            and all(torch.equal(optimizer.state[p]["exp_avg_sq"], m) for p, m in zip(model.parameters(), moments)))
    equal_metadata = all(read_metadata(tmp / part / METADATA) == pickle.loads((tmp / part / METADATA).read_bytes())
                         for part in ("model", "optimizer"))
    plant(tmp / "model" / METADATA, tmp / "pwned")
    try:
        backend.load_model(model, tmp / "model")
        error = None
    except CheckpointError as exc:
        error = str(exc)
    path = tmp / "optimizer" / METADATA
    metadata = pickle.loads(path.read_bytes())
    fqn = next(k for k, entry in metadata.state_dict_metadata.items() if getattr(entry, "chunks", None))
    metadata.state_dict_metadata[fqn].chunks = []
    path.write_bytes(pickle.dumps(metadata))
    try:
        backend.load_optimizer(optimizer, None, tmp / "optimizer", model=model)
        chunk_error = None
    except CheckpointError as exc:
        chunk_error = str(exc)
    return {"same": same, "equal_metadata": equal_metadata, "error": error, "chunk_error": chunk_error,
            "emptied": fqn, "factory_restored": mcore_dcp._get_filesystem_reader is factory}


@pytest.mark.slow
def test_dist_ckpt_loads_bit_exactly_through_the_restricted_reader_and_refuses_an_exploit_and_lost_chunks(
    tmp_path: Path,
) -> None:
    pytest.importorskip("megatron.core")
    pytest.importorskip("mbridge")
    from tests.backends.megatron_util import make_hf_checkpoint

    make_hf_checkpoint(tmp_path / "hf")
    [result] = run_ranks(_dist_ckpt_round_trip_and_exploit, tmp_path, world_size=1, timeout_s=240)
    assert result["same"] and result["equal_metadata"] and result["factory_restored"]
    assert result["error"] is not None
    assert result["error"].startswith(f"{tmp_path / 'model' / METADATA}: refused to unpickle io.open"), \
        result["error"]  # raised as itself, not through DCP's fallback to a rank's own metadata
    assert not (tmp_path / "pwned").exists()
    chunk_error = result["chunk_error"]
    assert chunk_error is not None and str(tmp_path / "optimizer" / METADATA) in chunk_error
    assert f"tensor {result['emptied']!r} has chunks of 0 elements" in chunk_error, chunk_error


def _dist_ckpt_bytes_entry_exploit(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    """A Megatron checkpoint whose one byte entry (how DCP stores a ShardedObject, or a layer's
    `_extra_state`) unpickles into a call: refused through `load_sharded`; a plain one loads."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.dist_checkpointing.strategies import torch as mcore_dcp

    from backends.dist_ckpt import load_sharded, save_sharded
    from backends.megatron import cpu_safe

    marker = tmp / "pwned"
    save_sharded({"extra": ShardedObject("extra", {"step": 3}, (1,), (0,), replica_id=0)}, tmp / "good")
    good = load_sharded({"extra": ShardedObject("extra", None, (1,), (0,), replica_id=0)}, tmp / "good")
    (tmp / "bad").mkdir()
    with cpu_safe():  # save_sharded would refuse to pickle nothing; this writes what an attacker would
        dist_checkpointing.save({"extra": ShardedObject("extra", Exploit(marker), (1,), (0,), replica_id=0)},
                                str(tmp / "bad"))
    planner = mcore_dcp.MCoreLoadPlanner
    try:
        load_sharded({"extra": ShardedObject("extra", None, (1,), (0,), replica_id=0)}, tmp / "bad")
        error = None
    except CheckpointError as exc:
        error = str(exc)
    return {"good": good["extra"], "error": error, "ran": marker.exists(),
            "planner_restored": mcore_dcp.MCoreLoadPlanner is planner and planner.__name__ == "MCoreLoadPlanner"}


@pytest.mark.slow
def test_dist_ckpt_byte_entries_are_read_weights_only_and_an_exploit_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    [result] = run_ranks(_dist_ckpt_bytes_entry_exploit, tmp_path, world_size=1, timeout_s=240)
    assert result["good"] == {"step": 3} and result["planner_restored"]
    assert result["error"] is not None and "refused to unpickle" in result["error"], result["error"]
    assert str(tmp_path / "bad") in result["error"] and not result["ran"]
    assert not (tmp_path / "pwned").exists()
