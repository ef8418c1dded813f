"""Plans, bucket layouts, headers and checksums, without any transport."""

from __future__ import annotations

import pytest
import torch

from backends.engines.buckets import Layout
from backends.engines.slots import HEADER_BYTES, MAGIC, as_slots, read_header, write_header
from backends.engines.sources import Copied
from backends.engines.digests import fold, word_sum_digest, word_sums, xxh3_digest, xxh3_packed
from backends.engines.plan import ALIGN, Plan, TensorMeta, align, make_plan
from tests.backends.engines.kit import mixed_tensors


def _metas(named: list[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    return [TensorMeta(name, t.dtype, tuple(t.shape)) for name, t in named]


def _slots(bucket_bytes: int) -> list[torch.Tensor]:
    return as_slots(torch.zeros(HEADER_BYTES + align(bucket_bytes), dtype=torch.uint8) for _ in range(2))


def _round_trip(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> tuple[Plan, dict[str, torch.Tensor]]:
    """Pack each bucket and unpack it before the next one overwrites its slot, like the pipeline."""
    plan = make_plan(_metas(named), bucket_bytes, verify=True)
    sender = Layout(plan, _slots(bucket_bytes))
    receiver = Layout(plan, sender.slots)
    out: dict[str, torch.Tensor] = {}
    for k in range(len(plan.buckets)):
        sender.pack(k, [t for _, t in named])
        out.update((name, t.clone()) for name, t in receiver.unpack(k))
    return plan, out


@pytest.mark.parametrize("bucket_bytes", [64, 100, 4096, 1 << 20])
def test_every_dtype_and_shape_survives_packing_at_any_bucket_size(bucket_bytes: int) -> None:
    named = mixed_tensors()
    _, out = _round_trip(named, bucket_bytes)
    assert list(out) == [name for name, _ in named]
    for name, tensor in named:
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
        assert torch.equal(out[name], tensor), name


def test_a_tensor_larger_than_a_bucket_is_split_into_chunks_and_rejoined() -> None:
    big = torch.arange(5000, dtype=torch.float32)
    plan, out = _round_trip([("small", torch.ones(3)), ("big", big), ("after", torch.zeros(2))], 4096)
    pieces = [p for bucket in plan.buckets for p in bucket if p.index == 1]
    assert len(pieces) == 5 and sum(p.nbytes for p in pieces) == big.numel() * 4
    assert [p.start for p in pieces] == sorted(p.start for p in pieces)
    assert all(p.nbytes % 4 == 0 for p in pieces)
    assert torch.equal(out["big"], big)


def test_a_tensor_that_fits_a_bucket_is_never_split_and_every_piece_is_aligned() -> None:
    plan = make_plan(_metas([(f"t{i}", torch.ones(300)) for i in range(10)]), 4096, verify=True)
    assert all(p.offset % ALIGN == 0 and p.offset + p.nbytes <= 4096 for bucket in plan.buckets for p in bucket)
    assert sorted(p.index for bucket in plan.buckets for p in bucket) == list(range(10))
    assert all(plan.used(k) <= align(4096) for k in range(len(plan.buckets)))


def test_packing_casts_floating_tensors_to_the_wire_dtype_and_leaves_integers() -> None:
    named = [("w", torch.randn(10)), ("ids", torch.arange(4))]
    metas = [TensorMeta("w", torch.bfloat16, (10,)), TensorMeta("ids", torch.int64, (4,))]
    plan = make_plan(metas, 1024, verify=True)
    layout = Layout(plan, _slots(1024))
    layout.pack(0, [t for _, t in named])
    out = dict(layout.unpack(0))
    assert out["w"].dtype == torch.bfloat16 and torch.equal(out["w"], named[0][1].bfloat16())
    assert torch.equal(out["ids"], named[1][1])


def test_layout_views_live_inside_the_two_slots() -> None:
    plan = make_plan(_metas(mixed_tensors()), 256, verify=True)
    slots = _slots(256)
    layout = Layout(plan, slots)
    owners = {slot.data.untyped_storage().data_ptr() for slot in slots}
    assert all(v.untyped_storage().data_ptr() in owners for views in layout.views for v in views)
    assert layout.fits(slots) and not layout.fits(_slots(256))


def test_layout_views_are_the_slots_bytes_without_autograd_view_tracking() -> None:
    """A receiver keeps a tensor per piece in every set it holds: tensors of the slot's storage
    that autograd does not track as views (half the memory of a tracked view), which see
    every byte later written into the slot."""
    named = [("w", torch.randn(3, 4)), ("b", torch.randn(4, dtype=torch.bfloat16))]
    plan = make_plan(_metas(named), 4096, verify=True)
    layout = Layout(plan, _slots(4096))
    views = layout.bucket_views(0)
    assert not any(v._is_view() or v._base is not None for v in views)
    layout.pack(0, [t for _, t in named])
    assert all(torch.equal(v, t) for v, (_, t) in zip(views, named))
    layout.slots[0].data.zero_()
    assert all(not v.any() for v in views)


def test_header_round_trips_unsigned_64_bit_words() -> None:
    slot = torch.zeros(HEADER_BYTES + 64, dtype=torch.uint8)
    write_header(slot[:HEADER_BYTES], (1 << 64) - 5, 3, 64)
    assert read_header(slot[:HEADER_BYTES]) == (MAGIC, (1 << 64) - 5, 3, 64)


@pytest.mark.parametrize("checksum", [xxh3_digest, word_sum_digest])
def test_checksums_catch_a_flipped_bit_and_swapped_blocks(checksum: object) -> None:
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    base = checksum(data)  # type: ignore[operator]
    flipped = data.clone()
    flipped[12345] ^= 1
    swapped = torch.cat([data[1 << 20:2 << 20], data[:1 << 20], data[2 << 20:]])
    assert checksum(flipped) != base and checksum(swapped) != base  # type: ignore[operator]
    assert checksum(data.clone()) == base  # type: ignore[operator]


def test_packing_says_which_pieces_it_copied_byte_for_byte_so_their_sources_hash_as_the_region() -> None:
    named = [(f"t{i}", torch.randn(100_000 + i)) for i in range(50)] + mixed_tensors()
    bucket = 1 << 20
    plan = make_plan(_metas(named), bucket, verify=True)
    layout = Layout(plan, _slots(bucket))
    sources = 0
    for k in range(len(plan.buckets)):
        copied: Copied = []
        layout.pack(k, [t for _, t in named], copied)
        data = layout.slots[k % 2].data[:plan.used(k)]
        assert xxh3_packed(data, copied) == xxh3_digest(data)
        assert [offset for offset, _, _ in copied] == sorted(offset for offset, _, _ in copied)
        sources += len(copied)
    assert sources == sum(len(b) for b in plan.buckets) - 2  # all but the strided tensor and the empty one


def test_a_slot_scribbled_on_after_packing_fails_the_senders_checksum() -> None:
    named = mixed_tensors()
    plan = make_plan(_metas(named), 4096, verify=True)
    layout = Layout(plan, _slots(4096))
    copied: Copied = []
    layout.pack(0, [t for _, t in named], copied)
    data = layout.slots[0].data[:plan.used(0)]
    data[5] ^= 0xFF
    assert xxh3_packed(data, copied) != xxh3_digest(data)


def test_the_word_sums_fold_to_the_digest_of_the_data_as_it_was_when_they_were_taken() -> None:
    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    sums = word_sums(data)
    base = word_sum_digest(data)
    data[7] ^= 1
    assert fold(sums) == base != word_sum_digest(data)
