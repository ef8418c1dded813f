"""Checksums that cost little: each side hashes a bucket while the next one moves.

The sender starts bucket k as soon as it is packed, hashes it on its checksum worker while it
is on the wire, and sends the digest after it (`digest/{k}`); a receiver hashes bucket k on
its worker while bucket k + 1 arrives and counts it verified only once the digests match.
Every sync here runs over real gloo groups or shared memory, the sender on the test's thread
and each receiver on a thread of its own.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from backends.engines import TransportError
from backends.engines import digests
from backends.engines import sender as sender_module
from backends.engines.control import ControlStore
from backends.engines.receiver import Receiver
from lifecycle.errors import EngineError
from lifecycle.testing import MemoryRollout
from tests.backends.engines.kit import (
    CLASSES,
    HANG_GUARD_S,
    TIMEOUT_S,
    TRANSPORTS,
    assert_kept_old_weights,
    mixed_tensors,
    new_engine,
    old_rollout,
    sync_threads,
)

Events = list[tuple[str, int, str]]
"""(what, bucket, thread name), in the order they happened."""


def _recording_sender(name: str, events: Events, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A sender that records when each bucket starts, is hashed (and on which thread), and when
    its digest is sent."""
    hash_packed = sender_module.xxh3_packed
    hashed = iter(range(1 << 30))  # one worker hashes the buckets in order

    def recorded_hash(data: torch.Tensor, copied: Any) -> int:
        k = next(hashed)
        events.append(("hash begins", k, threading.current_thread().name))
        digest = hash_packed(data, copied)
        events.append(("hashed", k, threading.current_thread().name))
        return digest

    monkeypatch.setattr(sender_module, "xxh3_packed", recorded_hash)

    class Recording(CLASSES[name]):  # type: ignore[valid-type,misc]
        def _start_send(self, k: int, nbytes: int) -> Any:
            handle = super()._start_send(k, nbytes)
            events.append(("started", k, threading.current_thread().name))
            return handle

        def _send_digest(self, k: int, digest: int) -> None:
            events.append(("digest sent", k, threading.current_thread().name))
            super()._send_digest(k, digest)

    return Recording(bucket_bytes=4096, timeout_s=TIMEOUT_S)


def _at(events: Events, what: str, k: int) -> int:
    return next(i for i, (kind, j, _) in enumerate(events) if (kind, j) == (what, k))


@pytest.mark.parametrize("name", TRANSPORTS)
def test_the_sender_starts_each_bucket_before_hashing_it_on_its_worker_and_sends_the_digest_after(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    events: Events = []
    run = sync_threads(_recording_sender(name, events, monkeypatch), [new_engine(name)], mixed_tensors())
    assert run.error is None and run.errors == [None]
    count = run.figures["buckets"]  # type: ignore[index]
    assert count > 4
    main = threading.current_thread().name
    for k in range(count):
        assert _at(events, "started", k) < _at(events, "hash begins", k) < _at(events, "hashed", k)
        assert _at(events, "hashed", k) < _at(events, "digest sent", k)
        assert events[_at(events, "hash begins", k)][2] == f"{name}-checksum_0"
        assert events[_at(events, "digest sent", k)][2] == main
        if k + 2 < count:  # bucket k's slot is refilled only once its hash no longer reads it
            assert _at(events, "digest sent", k) < _at(events, "started", k + 2), k


def _recording_receivers(events: Events, monkeypatch: pytest.MonkeyPatch) -> None:
    """Record, on every receiver, when bucket k landed, was hashed (on which thread), and verified."""
    land, verify = Receiver._land, Receiver._verify

    def landed(self: Receiver, k: int, slot: torch.Tensor) -> None:
        events.append(("landed", k, threading.current_thread().name))
        land(self, k, slot)

    def verified(self: Receiver, k: int) -> None:
        verify(self, k)
        events.append(("verified", k, threading.current_thread().name))

    monkeypatch.setattr(Receiver, "_land", landed)
    monkeypatch.setattr(Receiver, "_verify", verified)


class _Watching(MemoryRollout):
    """A rollout that notes, for every tensor it is handed, how many buckets had verified."""

    def __init__(self, events: Events) -> None:
        super().__init__()
        self.events = events
        self.seen: list[tuple[str, int]] = []

    def load_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        def noted() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named_tensors:
                self.seen.append((name, sum(1 for kind, _, _ in self.events if kind == "verified")))
                yield name, tensor
        super().load_weights(noted())


def _buckets_of(named: list[tuple[str, torch.Tensor]], receiver: Any) -> dict[str, int]:
    """The last bucket each tensor has a piece in."""
    plan = receiver._layout.plan
    return {plan.tensors[p.index].name: k for k, bucket in enumerate(plan.buckets) for p in bucket}


@pytest.mark.parametrize("name", TRANSPORTS)
def test_an_atomic_receiver_hashes_on_its_worker_lets_the_next_bucket_land_and_hands_out_only_after_the_last(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    events: Events = []
    _recording_receivers(events, monkeypatch)
    hashed_on: list[str] = []
    real = digests.xxh3_digest

    def counting(data: torch.Tensor) -> int:  # the receiver's hash (the sender's is xxh3_packed)
        hashed_on.append(threading.current_thread().name)
        return real(data)

    monkeypatch.setattr(digests, "xxh3_digest", counting)
    rollout = _Watching(events)
    run = sync_threads(new_engine(name), [new_engine(name, timeout_s=TIMEOUT_S)], mixed_tensors(), [rollout])
    assert run.error is None and run.errors == [None]
    count = run.figures["buckets"]  # type: ignore[index]
    # on the engine's checksum workers (up to digests.READERS of them: two hashes may overlap), never the receiving thread
    assert len(hashed_on) == count and all(thread.startswith(f"{name}-checksum_") for thread in hashed_on), hashed_on
    for k in range(count - 1):
        assert _at(events, "landed", k + 1) < _at(events, "verified", k), k
    assert [k for kind, k, _ in events if kind == "verified"] == list(range(count))
    assert rollout.seen and all(verified == count for _, verified in rollout.seen)


@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_streamed_receiver_hands_out_no_tensor_of_a_bucket_before_that_bucket_verified(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    events: Events = []
    _recording_receivers(events, monkeypatch)
    named = [(f"whole{i}", torch.randn(700, generator=torch.Generator().manual_seed(i))) for i in range(3)]
    named += mixed_tensors()
    receiver, rollout = new_engine(name, apply="streamed"), _Watching(events)
    run = sync_threads(new_engine(name), [receiver], named, [rollout])
    assert run.error is None and run.errors == [None]
    last = _buckets_of(named, receiver)
    assert [n for n, _ in rollout.seen] == [n for n, _ in named]
    assert all(verified > last[n] for n, verified in rollout.seen)
    assert any(verified < run.figures["buckets"] for _, verified in rollout.seen)  # type: ignore[index]


def _withholding(name: str, timeout_s: float) -> Any:
    class Withholding(CLASSES[name]):  # type: ignore[valid-type,misc]
        """A sender that sends every bucket and never its checksum."""

        def _send_digest(self, k: int, digest: int) -> None:
            pass

    return Withholding(bucket_bytes=4096, timeout_s=timeout_s)


@pytest.mark.parametrize("apply", ["atomic", "streamed"])
@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_checksum_that_never_comes_ends_both_sides_at_the_timeout_and_applies_nothing(name: str, apply: str) -> None:
    timeout_s = 2.0
    rollout = old_rollout()
    run = sync_threads(_withholding(name, timeout_s), [new_engine(name, timeout_s=timeout_s, apply=apply)],
                       mixed_tensors(), [rollout])
    assert run.seconds < timeout_s + 3
    assert isinstance(run.errors[0], TransportError)
    # its own deadline, or, a moment before it, the sender's (whose timer started first) closing the sync
    assert re.search(f"{name} engine: (waiting for 'digest/0' did not finish within timeout_s=2|the sender gave up on "
                     "sync 1 while this receiver was waiting for 'digest/0')", str(run.errors[0])), run.errors[0]
    assert isinstance(run.error, EngineError)
    assert_kept_old_weights(rollout)


MALFORMED = [b"", b"-1", b"DEADBEEFDEADBEEF", b"0x0123456789abcd", b"0123456789abcdef0", b" 123456789abcdef",
             b"\xff" * 16, b"9" * 100_000]


@pytest.mark.parametrize("raw", MALFORMED, ids=lambda raw: repr(raw[:20]))
@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_checksum_that_is_not_16_hex_digits_is_a_rejection_both_sides_name(name: str, raw: bytes) -> None:
    class Garbling(CLASSES[name]):  # type: ignore[valid-type,misc]
        def _send_digest(self, k: int, digest: int) -> None:
            if k == 1:
                self._control().set(f"digest/{k}", raw)
            else:
                super()._send_digest(k, digest)

    rollout = old_rollout()
    run = sync_threads(Garbling(bucket_bytes=4096, timeout_s=TIMEOUT_S),
                       [new_engine(name, timeout_s=TIMEOUT_S)], mixed_tensors(), [rollout])
    assert run.seconds < HANG_GUARD_S
    error = run.errors[0]
    assert isinstance(error, EngineError) and not isinstance(error, TransportError)
    reason = f"bucket 1 of 5: the sender's checksum {raw[:40]!r} ({len(raw)} bytes) is not 16 lowercase hex digits"
    assert reason in str(error) and "nothing from it was applied" in str(error)
    assert isinstance(run.error, EngineError)
    assert str(run.error).startswith(f"{name} engine: 1 of 1 receiver(s) rejected weights v1: rank 1: ")
    assert reason in str(run.error) and len(str(run.error)) < 2000
    assert_kept_old_weights(rollout)


@pytest.mark.parametrize("name", TRANSPORTS)
def test_without_checksums_neither_side_hashes_nor_sends_a_digest(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[int] = []
    monkeypatch.setattr(sender_module, "xxh3_packed", lambda data, copied: hashed.append(1))
    sent: list[int] = []

    class Quiet(CLASSES[name]):  # type: ignore[valid-type,misc]
        def _send_digest(self, k: int, digest: int) -> None:
            sent.append(k)

    monkeypatch.setattr(digests, "xxh3_digest", lambda data: hashed.append(1))
    sender, receiver = Quiet(bucket_bytes=4096, verify=False), Quiet(bucket_bytes=4096, verify=False)
    run = sync_threads(sender, [receiver], mixed_tensors())
    assert run.error is None and run.errors == [None] and sent == [] and hashed == []
    assert not sender.checksums._pools and not receiver.checksums._pools  # no worker started


@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_receiver_that_does_not_verify_reads_no_digest_of_a_sender_that_sends_them(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[str] = []
    get_many = ControlStore.get_many

    def noted(self: ControlStore, keys: list[str], **kwargs: Any) -> list[bytes]:
        read.extend(keys)
        return get_many(self, keys, **kwargs)

    monkeypatch.setattr(ControlStore, "get_many", noted)
    receiver = new_engine(name, timeout_s=TIMEOUT_S, verify=False)
    run = sync_threads(new_engine(name), [receiver], mixed_tensors())
    assert run.error is None and run.errors == [None]
    assert "plan" in read and not any(key.startswith("digest/") for key in read)
    assert not receiver.checksums._pools  # no worker started


def test_a_sender_failing_after_a_bucket_left_fails_a_receiver_waiting_for_its_digest_quickly() -> None:
    class Crashing(CLASSES["gloo"]):  # type: ignore[valid-type,misc]
        def _send_digest(self, k: int, digest: int) -> None:
            raise RuntimeError("trainer crashed before sending digest 0")

    start = time.monotonic()
    rollout = old_rollout()
    run = sync_threads(Crashing(bucket_bytes=4096, timeout_s=TIMEOUT_S), [new_engine("gloo", timeout_s=TIMEOUT_S)],
                       mixed_tensors(), [rollout])
    assert time.monotonic() - start < HANG_GUARD_S  # a receiver that waited out its timeout would take TIMEOUT_S
    assert isinstance(run.error, RuntimeError) and isinstance(run.errors[0], EngineError)
    assert_kept_old_weights(rollout)


def test_an_atomic_shm_receiver_hashes_its_private_copy_never_the_shared_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender refills a shared slot once the receiver said it is done with it, so a hash of
    the slot taken after that would check bytes of another bucket."""
    hashed: list[int] = []
    real = digests.xxh3_digest

    def spying(data: torch.Tensor) -> int:  # the receiver's hash (the sender's is xxh3_packed)
        hashed.append(data.data_ptr())
        return real(data)

    monkeypatch.setattr(digests, "xxh3_digest", spying)
    receiver = new_engine("shm", timeout_s=TIMEOUT_S)
    run = sync_threads(new_engine("shm"), [receiver], mixed_tensors())
    assert run.error is None and run.errors == [None]
    private = [(s.data.data_ptr(), s.data.data_ptr() + s.data.numel()) for s in receiver._staged.slots]  # type: ignore[union-attr]
    shared = [(s.data.data_ptr(), s.data.data_ptr() + s.data.numel()) for s in receiver.slots]
    assert len(hashed) == len(private) > 2
    assert all(any(lo <= p < hi for lo, hi in private) for p in hashed)
    assert not any(lo <= p < hi for p in hashed for lo, hi in shared)
