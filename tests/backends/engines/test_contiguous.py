"""No pack for contiguous storage: group engines send a bucket straight from its weights' storage.

When every piece of a bucket already sits in one storage at the plan's offsets (a model
flattened by `flatten_parameters`), the bucket's data region is a byte range of that storage
(`Layout.region`), and gloo broadcasts it as it stands after the header from its slot. These
tests prove that such a send packs nothing, delivers the very bytes the packing path delivers,
packs only the buckets that cannot go unpacked, and is still verified by every receiver.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from backends.engines.buckets import Layout
from backends.engines.slots import HEADER_BYTES, as_slots
from backends.engines.flat import flatten_parameters
from backends.engines.gloo import GlooEngine
from backends.engines.plan import TensorMeta, make_plan
from lifecycle.errors import EngineError
from lifecycle.testing import MemoryRollout
from tests.backends.dist_util import free_port
from tests.backends.engines.kit import (
    TIMEOUT_S,
    TRANSPORTS,
    ModelRollout,
    assert_kept_old_weights,
    greedy,
    mixed_tensors,
    new_engine,
    old_rollout,
    sync_threads,
    tiny_qwen2,
    train_step,
)


class Packing(GlooEngine):
    """The packing path, for reference: every bucket packed into a slot, whatever its sources."""

    sends_regions = False


def _bits(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _flat_qwen2(seed: int = 0) -> torch.nn.Module:
    model = tiny_qwen2(seed)
    flatten_parameters(model)
    return model


def _received(sender: GlooEngine, named: list[tuple[str, torch.Tensor]]) -> dict[str, bytes]:
    """What one receiver got from `sender`, tensor by tensor, as raw bytes (dtypes checked)."""
    rollout = MemoryRollout()
    run = sync_threads(sender, [new_engine("gloo", bucket_bytes=sender.bucket_bytes)], named, [rollout])
    assert run.error is None and run.errors == [None], (run.error, run.errors)
    for name, tensor in named:
        assert rollout.weights[name].dtype == sender.wire_dtype(tensor), name
    return {name: _bits(tensor) for name, tensor in rollout.weights.items()}


def _assert_same_parameters(got: torch.nn.Module, want: torch.nn.Module) -> None:
    wanted = dict(want.named_parameters())
    for name, param in got.named_parameters():
        assert _bits(param) == _bits(wanted[name]), name


# -- a whole sync ------------------------------------------------------------------------------


def test_a_flattened_qwen2_over_gloo_packs_nothing_and_generates_like_the_trainer(packed: list[int]) -> None:
    trainer, rollout = _flat_qwen2(seed=0), ModelRollout(tiny_qwen2(seed=1))
    assert greedy(rollout.model) != greedy(trainer)
    sender, receiver = new_engine("gloo", bucket_bytes=1 << 14), new_engine("gloo", bucket_bytes=1 << 14)
    port = free_port()
    for version in range(1, 4):
        if version > 1:
            train_step(trainer, seed=version)  # AdamW steps in place: the parameters stay flat
        run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [rollout], version=version,
                           port=port)
        assert run.error is None and run.errors == [None] and run.versions == [version]
        assert run.figures["buckets"] > 4  # type: ignore[index]
        assert packed == [], f"v{version} packed buckets {packed}"
        _assert_same_parameters(rollout.model, trainer)
        assert rollout.generate() == greedy(trainer)


@pytest.mark.parametrize("bucket_bytes", [4096, 1 << 14, 1 << 20, 5000])
def test_the_contiguous_path_delivers_the_very_bytes_the_packing_path_does(
        bucket_bytes: int, packed: list[int]) -> None:
    """4096 and 5000 chunk the embedding over several buckets; 5000 (no multiple of 64) puts
    chunks off the 64-byte grid, so those buckets pack; 1 MiB is one bucket for the whole model."""
    flat = _flat_qwen2(seed=3)
    plain = copy.deepcopy(tiny_qwen2(seed=3))
    flat_named, plain_named = list(flat.named_parameters()), list(plain.named_parameters())
    unpacked = _received(GlooEngine(bucket_bytes=bucket_bytes, timeout_s=TIMEOUT_S), flat_named)
    if bucket_bytes % 64 == 0:
        assert packed == []
    reference = _received(Packing(bucket_bytes=bucket_bytes, timeout_s=TIMEOUT_S), plain_named)
    assert packed  # the reference did pack
    assert unpacked.keys() == reference.keys() == dict(flat_named).keys()
    for name, tensor in plain_named:
        assert unpacked[name] == reference[name] == _bits(tensor), name


def test_a_partly_flat_model_packs_only_the_buckets_that_are_not_contiguous(packed: list[int]) -> None:
    model = _flat_qwen2(seed=4)
    names = [name for name, _ in model.named_parameters()]
    moved = names[len(names) // 2]
    param = model.get_parameter(moved)
    param.data = param.data.clone()  # its own storage now: its bucket must pack
    named = list(model.named_parameters())
    sender = GlooEngine(bucket_bytes=4096, timeout_s=TIMEOUT_S)
    unpacked = _received(sender, named)
    plan = sender._layout.plan  # type: ignore[union-attr]
    i = names.index(moved)
    shared = {k for k, bucket in enumerate(plan.buckets)
              if any(p.index == i for p in bucket) and any(p.index != i and p.nbytes for p in bucket)}
    assert shared and sorted(set(packed)) == sorted(shared) and len(packed) == len(shared)
    packed.clear()
    reference = _received(Packing(bucket_bytes=4096, timeout_s=TIMEOUT_S), named)
    assert len(packed) == len(plan.buckets)
    for name, tensor in named:
        assert unpacked[name] == reference[name] == _bits(tensor), name


def test_a_rollout_dtype_cast_packs_every_bucket_and_matches_the_packing_path(packed: list[int]) -> None:
    named = list(_flat_qwen2(seed=5).named_parameters())
    sender = GlooEngine(bucket_bytes=4096, timeout_s=TIMEOUT_S, rollout_dtype="bfloat16")
    unpacked = _received(sender, named)
    buckets = len(sender._layout.plan.buckets)  # type: ignore[union-attr]
    assert buckets > 4 and packed == list(range(buckets))
    reference = _received(Packing(bucket_bytes=4096, timeout_s=TIMEOUT_S, rollout_dtype="bfloat16"), named)
    for name, tensor in named:
        assert unpacked[name] == reference[name] == _bits(tensor.to(torch.bfloat16)), name


def test_unflattened_tensors_still_arrive_whole_and_a_big_one_goes_unpacked(packed: list[int]) -> None:
    """Each chunk of a tensor too big for a bucket is a range of that tensor: no pack either."""
    named = [("big", torch.randn(5000, generator=torch.Generator().manual_seed(0))), *mixed_tensors()]
    got = _received(GlooEngine(bucket_bytes=4096, timeout_s=TIMEOUT_S), named)
    for name, tensor in named:
        assert got[name] == _bits(tensor), name
    assert not {0, 1, 2, 3} & set(packed) and packed  # 20000 bytes of "big": buckets 0..3 are its chunks


# -- verified on the region path ---------------------------------------------------------------


class _FlipOnLanding(GlooEngine):
    """A receiver whose bucket `bad` has one data byte flipped as it lands, before it is hashed."""

    bad: int | None = 1

    def _wait(self, handle: Any, what: str) -> None:
        super()._wait(handle, what)
        if self.bad is not None and what.startswith(f"bucket {self.bad} of "):
            self.slots[self.bad % len(self.slots)].data[5] ^= 0xFF


def test_a_region_bucket_corrupted_on_arrival_fails_its_checksum_applies_nothing_and_the_next_sync_repairs(
        packed: list[int]) -> None:
    named = list(_flat_qwen2(seed=6).named_parameters())
    sender, receiver, rollout = GlooEngine(bucket_bytes=4096, timeout_s=TIMEOUT_S), _FlipOnLanding(
        bucket_bytes=4096, timeout_s=TIMEOUT_S), old_rollout()
    port = free_port()
    run = sync_threads(sender, [receiver], named, [rollout], version=8, port=port)
    assert packed == []
    assert isinstance(run.errors[0], EngineError) and "bucket 1 of" in str(run.errors[0])
    assert "failed its checksum" in str(run.errors[0]) and "nothing from it was applied" in str(run.errors[0])
    assert isinstance(run.error, EngineError) and "1 of 1 receiver(s) rejected weights v8" in str(run.error)
    assert_kept_old_weights(rollout)
    receiver.bad = None
    run = sync_threads(sender, [receiver], named, [rollout], version=8, port=port)
    assert run.error is None and run.errors == [None] and packed == []
    for name, tensor in named:
        assert _bits(rollout.weights[name]) == _bits(tensor), name


def test_a_group_engines_header_table_is_checked_bucket_by_bucket_against_the_plan() -> None:
    """Every header goes before bucket 0 in one broadcast; a receiver checks bucket k's as k lands."""
    class BadIndex(GlooEngine):
        def header_table(self, plan: Any, version: int) -> torch.Tensor:
            table = super().header_table(plan, version)
            table[2 * HEADER_BYTES + 16] ^= 0x01  # bucket 2's index
            return table

    rollout = old_rollout()
    run = sync_threads(BadIndex(bucket_bytes=4096, timeout_s=TIMEOUT_S), [new_engine("gloo", timeout_s=TIMEOUT_S)],
                       list(_flat_qwen2(seed=7).named_parameters()), [rollout])
    assert isinstance(run.errors[0], EngineError) and "bucket 2 of" in str(run.errors[0])
    assert "arrived with a bad header" in str(run.errors[0]) and "bucket 3, " in str(run.errors[0])
    assert isinstance(run.error, EngineError)
    assert_kept_old_weights(rollout)


def test_a_group_engine_broadcasts_the_header_table_once_and_each_bucket_once() -> None:
    sent: list[int] = []

    class Counted(GlooEngine):
        def _start_send(self, k: int, nbytes: int) -> Any:
            handle = super()._start_send(k, nbytes)
            sent.append(len(handle[1]))
            return handle

    named = list(_flat_qwen2(seed=7).named_parameters())
    rollout = old_rollout()
    run = sync_threads(Counted(bucket_bytes=4096, timeout_s=TIMEOUT_S), [new_engine("gloo", timeout_s=TIMEOUT_S)],
                       named, [rollout])
    assert run.error is None and run.errors == [None]
    assert len(sent) > 2 and sent == [2] + [1] * (len(sent) - 1)  # the table with bucket 0, then data alone
    for name, tensor in named:
        assert _bits(rollout.weights[name]) == _bits(tensor), name


# -- Layout.region -----------------------------------------------------------------------------


def _layout(metas: list[TensorMeta], bucket_bytes: int = 4096, device: str = "cpu") -> Layout:
    plan = make_plan(metas, bucket_bytes, verify=True)
    return Layout(plan, as_slots(torch.empty(64 + bucket_bytes, dtype=torch.uint8, device=device) for _ in range(2)))


def _placed(sizes: list[int], offsets: list[int], total: int, dtype: torch.dtype = torch.float32,
            at: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A byte storage of `total` bytes and one tensor of `sizes[i]` elements at byte `at + offsets[i]`."""
    storage = torch.arange(total, dtype=torch.int64).to(torch.uint8)
    step = dtype.itemsize
    return storage, [storage[at + o:at + o + n * step].view(dtype) for n, o in zip(sizes, offsets)]


def _metas(tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> list[TensorMeta]:
    return [TensorMeta(f"t{i}", dtype or t.dtype, tuple(t.shape)) for i, t in enumerate(tensors)]


def test_the_region_is_the_storage_range_holding_each_piece_where_pack_puts_it() -> None:
    storage, tensors = _placed([10, 0, 33, 1], [0, 64, 64, 256], total=320)
    layout = _layout(_metas(tensors))
    region = layout.region(0, tensors)
    assert region is not None and region.dtype == torch.uint8
    assert region.data_ptr() == storage.data_ptr() and region.numel() == layout.plan.used(0) == 320
    layout.pack(0, tensors)
    slot = layout.slots[0].data[:320]
    for p in layout.plan.buckets[0]:
        assert torch.equal(region[p.offset:p.offset + p.nbytes], slot[p.offset:p.offset + p.nbytes])


@pytest.mark.parametrize("numel", [3072, 3000])
def test_a_chunk_of_a_big_tensor_is_a_region_of_that_tensor_unless_its_aligned_tail_leaves_the_storage(
        numel: int) -> None:
    """12288 bytes are three whole buckets of 4096; of 12000, the last 3808 round up to 3840,
    32 bytes past the tensor's storage: that chunk packs."""
    big = torch.randn(numel)
    layout = _layout(_metas([big]))
    assert len(layout.plan.buckets) == 3
    for k, bucket in enumerate(layout.plan.buckets):
        region = layout.region(k, [big])
        if k == 2 and numel == 3000:
            assert region is None
            continue
        assert region is not None and region.data_ptr() == big.data_ptr() + bucket[0].start
        assert region.numel() == layout.plan.used(k)


@pytest.mark.parametrize("case", ["transposed", "cast", "device", "past_storage", "offsets", "off_grid", "storages",
                                  "empty_only"])
def test_a_bucket_that_is_not_one_aligned_range_of_one_storage_has_no_region(case: str) -> None:
    storage, tensors = _placed([16, 16], [0, 64], total=128)
    metas = _metas(tensors)
    device = "cpu"
    if case == "transposed":
        tensors = [storage[:64].view(torch.float32).view(4, 4).t(), tensors[1]]
        metas = _metas(tensors)
    elif case == "cast":
        metas = _metas(tensors, torch.bfloat16)
    elif case == "device":
        device = "meta"
    elif case == "past_storage":  # the last piece's aligned tail would run past the storage's end
        storage, tensors = _placed([16, 10], [0, 64], total=104)
        metas = _metas(tensors)
    elif case == "offsets":  # packed tightly, not at the plan's 64-byte offsets
        storage, tensors = _placed([10, 10], [0, 40], total=128)
        metas = _metas(tensors)
    elif case == "off_grid":  # at the plan's offsets, from a base 8 bytes past the grid
        storage, tensors = _placed([16, 16], [0, 64], total=200, at=8)
    elif case == "storages":
        tensors = [tensors[0], tensors[1].clone()]
    elif case == "empty_only":
        tensors = [torch.empty(0), torch.empty(0, 3)]
        metas = _metas(tensors)
    layout = _layout(metas, device=device)
    assert len(layout.plan.buckets) == 1
    assert layout.region(0, tensors) is None


def test_the_region_fits_when_the_storage_ends_at_the_aligned_end() -> None:
    _, tensors = _placed([16, 10], [0, 64], total=128)
    assert _layout(_metas(tensors)).region(0, tensors) is not None


def test_shm_never_sends_regions() -> None:
    assert GlooEngine.sends_regions and not new_engine("shm").sends_regions  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", TRANSPORTS)
def test_lazy_conjugate_and_negative_views_travel_as_their_values_not_their_memory(name: str) -> None:
    complex_base = torch.randn(16, dtype=torch.complex64, generator=torch.Generator().manual_seed(3))
    named = [("conj", complex_base.conj()), ("neg", torch._neg_view(torch.arange(16.0)))]
    for _, tensor in named:  # alone in its bucket, from its own aligned storage: a region, but for the lazy view
        layout = Layout(make_plan([TensorMeta("t", tensor.dtype, tuple(tensor.shape))], 4096, verify=True),
                        as_slots([torch.zeros(HEADER_BYTES + 4096, dtype=torch.uint8)]))
        assert layout.region(0, [tensor.resolve_conj().resolve_neg()]) is not None
        assert layout.region(0, [tensor]) is None
    rollout = MemoryRollout()
    run = sync_threads(new_engine(name), [new_engine(name)], named, [rollout])
    assert run.error is None and run.versions == [1]
    for key, tensor in named:
        assert torch.equal(rollout.weights[key], tensor.resolve_conj().resolve_neg()), key
