"""A shm flip sender copies a flattened model's buckets into the weight set together.

Each bucket of a flip set has its own place, back to back, so buckets that lie in the sender's
storage exactly as they lie in the set go in with one memmove (`sender.pack_together`), not
one a bucket: glibc copies a large block faster than the same bytes in bucket-sized calls.
These tests pin that the copy is one call over exactly those buckets, never across storages
or over a bucket that must be packed, that what arrives is bit-identical, and that a bucket
corrupted after the copy still fails its checksum and leaves the rollout on its old set.
"""

from __future__ import annotations

import ctypes
import time
import types
from typing import Any

import pytest
import torch
from torch import nn

import backends.engines.sender as sender_module
from backends.engines.buckets import Layout
from backends.engines.flat import flatten_parameters
from lifecycle.errors import EngineError
from lifecycle.testing import MemoryRollout
from tests.backends.dist_util import free_port
from tests.backends.engines.kit import CLASSES, AdoptingRollout, corrupting, greedy, new_engine, sync_threads, tiny_qwen2, train_step

BUCKET = 1 << 16


def _flip(name: str = "shm") -> Any:
    return new_engine(name, apply="flip", bucket_bytes=BUCKET)


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """What the sender copied: each memmove `pack_together` made as (source, nbytes), and each
    bucket `Layout.pack` packed on its own."""
    seen: dict[str, list[Any]] = {"memmoves": [], "packed": []}

    def memmove(target: int, source: int, nbytes: int) -> None:
        seen["memmoves"].append((source, nbytes))
        ctypes.memmove(target, source, nbytes)

    pack = Layout.pack

    def packing(self: Layout, k: int, *args: Any, **kwargs: Any) -> None:
        seen["packed"].append(k)
        pack(self, k, *args, **kwargs)

    monkeypatch.setattr(sender_module, "ctypes", types.SimpleNamespace(memmove=memmove))
    monkeypatch.setattr(Layout, "pack", packing)
    return seen


def _storages(model: nn.Module) -> list[tuple[int, int]]:
    """(address, bytes) of each storage the model's parameters live in."""
    found = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sorted(found.items())


def test_a_flattened_model_goes_into_the_set_with_one_memmove_for_all_its_buckets_bit_identical(
    copies: dict[str, list[Any]],
) -> None:
    trainer, rollout = tiny_qwen2(0), AdoptingRollout(tiny_qwen2(1))
    flatten_parameters(trainer)
    train_step(trainer, 1)
    [(base, size)] = _storages(trainer)
    sender, receiver = _flip(), _flip()
    try:
        run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [rollout])
        assert run.error is None and run.versions == [1]
        buckets = run.figures["buckets"]  # type: ignore[index]
        assert buckets > 2 and copies["packed"] == []
        [(source, nbytes)] = copies["memmoves"]
        assert source == base and nbytes <= size
        assert nbytes == sum(sender.slots[k].data.numel() for k in range(buckets))  # every bucket, nothing more
        for (name, mine), (_, theirs) in zip(rollout.model.named_parameters(), trainer.named_parameters(), strict=True):
            assert torch.equal(mine, theirs), name
        assert greedy(rollout.model) == greedy(trainer)
    finally:
        receiver.close()
        sender.close()


class _TwoDtypes(nn.Module):
    """float32 weights, then bfloat16 ones: flattened, two storages, and a bucket holding both."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.ParameterList([nn.Parameter(torch.randn(3000)) for _ in range(12)])
        self.half = nn.ParameterList([nn.Parameter(torch.randn(5000).to(torch.bfloat16)) for _ in range(12)])


def test_buckets_of_two_storages_never_share_a_memmove_and_a_mixed_bucket_is_packed_alone(
    copies: dict[str, list[Any]],
) -> None:
    torch.manual_seed(0)
    trainer = _TwoDtypes()
    flatten_parameters(trainer)
    storages = _storages(trainer)
    assert len(storages) == 2
    rollout, sender, receiver = MemoryRollout(), _flip(), _flip()
    try:
        run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [rollout])
        assert run.error is None and run.versions == [1]
        assert len(copies["memmoves"]) == 2 and len(copies["packed"]) == 1
        for source, nbytes in copies["memmoves"]:
            assert any(base <= source and source + nbytes <= base + size for base, size in storages)
        for name, tensor in trainer.named_parameters():
            assert torch.equal(rollout.weights[name], tensor), name
    finally:
        receiver.close()
        sender.close()


@pytest.mark.parametrize("apply", ["atomic", "streamed"])
def test_a_sender_that_reuses_its_two_slots_copies_no_buckets_together(apply: str, copies: dict[str, list[Any]]) -> None:
    trainer = tiny_qwen2(0)
    flatten_parameters(trainer)
    sender, receiver = new_engine("shm", apply=apply, bucket_bytes=BUCKET), new_engine("shm", apply=apply, bucket_bytes=BUCKET)
    try:
        run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [MemoryRollout()])
        assert run.error is None and run.figures["buckets"] > 2  # type: ignore[index]
        assert copies["memmoves"] == [] and copies["packed"] == list(range(run.figures["buckets"]))  # type: ignore[index]
    finally:
        receiver.close()
        sender.close()


class _Six(nn.Module):
    """Six parameters of one bucket each: flattened, they lie in storage order p.0 ... p.5."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.ParameterList([nn.Parameter(torch.randn(BUCKET // 4)) for _ in range(6)])


@pytest.mark.parametrize("order", ["reversed", "one left out", "pairs swapped"])
def test_buckets_sent_in_another_order_than_their_storage_are_never_copied_as_one_range(
    order: str, copies: dict[str, list[Any]],
) -> None:
    torch.manual_seed(0)
    trainer = _Six()
    flatten_parameters(trainer)
    [(base, size)] = _storages(trainer)
    named = list(trainer.named_parameters())
    pairs = {"reversed": named[::-1], "one left out": named[:2] + named[3:],
             "pairs swapped": [named[1], named[0], named[3], named[2], named[5], named[4]]}[order]
    rollout = MemoryRollout()
    sender = new_engine("shm", apply="flip", bucket_bytes=BUCKET, verify=False)  # no checksum to catch a wrong copy
    receiver = new_engine("shm", apply="flip", bucket_bytes=BUCKET, verify=False)
    try:
        run = sync_threads(sender, [receiver], pairs, [rollout])
        assert run.error is None and run.versions == [1]
        for source, nbytes in copies["memmoves"]:
            assert nbytes > 0 and base <= source and source + nbytes <= base + size
        for name, tensor in pairs:
            assert torch.equal(rollout.weights[name], tensor), name
    finally:
        receiver.close()
        sender.close()


def test_a_bucket_corrupted_after_the_one_copy_fails_its_checksum_and_the_rollout_keeps_its_old_set() -> None:
    trainer, rollout = tiny_qwen2(0), AdoptingRollout(tiny_qwen2(1))
    flatten_parameters(trainer)
    sender, receiver = corrupting("shm", apply="flip", bucket_bytes=BUCKET), _flip()
    port = free_port()
    try:
        run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [rollout], version=1, port=port)
        assert run.error is None and run.versions == [1]
        before = {name: tensor.detach().clone() for name, tensor in rollout.model.state_dict().items()}
        tokens, buckets = greedy(rollout.model), run.figures["buckets"]  # type: ignore[index]
        train_step(trainer, 2)
        sender.corrupt = buckets // 2  # type: ignore[attr-defined]
        run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [rollout], version=2, port=port)
        assert isinstance(run.errors[0], EngineError)
        assert f"bucket {buckets // 2} of {buckets} failed its checksum" in str(run.errors[0])
        assert rollout.weights_version == 1
        for name, tensor in rollout.model.state_dict().items():
            assert torch.equal(tensor, before[name]), name
        assert greedy(rollout.model) == tokens
        sender.corrupt = None  # type: ignore[attr-defined]
        run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [rollout], version=2, port=port)
        assert run.error is None and run.versions == [2]
        assert greedy(rollout.model) == greedy(trainer)
    finally:
        receiver.close()
        sender.close()


@pytest.mark.parametrize("at", ["the middle", "the last bucket"])
def test_a_send_failing_after_the_one_copy_leaves_no_checksum_reading_the_weights(
    at: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[Any] = []
    real = sender_module.pack_together

    def spy(*args: Any) -> Any:
        packed = real(*args)
        started.extend(p.digest for p in packed.values())
        return packed

    monkeypatch.setattr(sender_module, "pack_together", spy)
    hash_sent = sender_module._hash_sent

    def slow(*args: Any) -> int:  # checksums still queued or running when the send fails
        time.sleep(0.1)
        return hash_sent(*args)

    monkeypatch.setattr(sender_module, "_hash_sent", slow)

    class Crashing(CLASSES["shm"]):  # type: ignore[valid-type,misc]
        running: list[Any] | None = None

        def send_weights(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().send_weights(*args, **kwargs)
            finally:  # what still reads the weights once send_weights is over
                self.running = [digest for digest in started if not digest.done()]

        def _start_send(self, k: int, nbytes: int) -> Any:
            if k == (2 if at == "the middle" else len(self.slots) - 1):  # a flip sender: one slot a bucket
                raise RuntimeError(f"the store went away at bucket {k}")
            return super()._start_send(k, nbytes)

    trainer = tiny_qwen2(0)
    flatten_parameters(trainer)
    sender, receiver = Crashing(apply="flip", bucket_bytes=BUCKET, timeout_s=20), _flip()
    try:
        run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [MemoryRollout()])
        assert isinstance(run.error, RuntimeError) and "the store went away" in str(run.error)
        assert len(started) > 3 and sender.running == []  # each cancelled or finished as the send raised
    finally:
        receiver.close()
        sender.close()
