"""A group engine's process group forms from what the peers write in the sync's store, which
anyone who reaches it can write too: whatever is there, and whatever a side cannot do, ends
both sides at once with a `TransportError` naming the rank and the key, never a crash of the
process (gloo read an empty address as memory it does not own), a raw `MemoryError`, or a
wait for `timeout_s`.

The sender runs on the test's thread and each receiver on a thread of its own; a peer that
writes by hand plays rank 1 through a store client of its own. Each side must end well before
`timeout_s` (a hang guard, not a speed check).
"""

from __future__ import annotations

import re
import struct
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from backends.engines import Rendezvous, TransportError, WeightSync
from backends.engines import gloo as gloo_module
from backends.engines.control import ControlStore
from backends.engines.gloo import GlooEngine
from lifecycle.errors import EngineError
from tests.backends.dist_util import free_port
from tests.backends.engines.kit import (
    HANG_GUARD_S,
    TIMEOUT_S,
    TRANSPORTS,
    assert_kept_old_weights,
    mixed_tensors,
    new_engine,
    old_rollout,
    sync_threads,
)
from tests.backends.engines.test_hostile_control import _sync_with_a_key_written


def _record(hostname: bytes, address: bytes, pairs: int) -> bytes:
    """A gloo rank record as gloo lays it out: each length in 8 bytes, then its bytes, then one
    8-byte sequence number per rank."""
    return (struct.pack("=Q", len(hostname)) + hostname + struct.pack("=Q", len(address)) + address
            + struct.pack(f"={pairs}q", *range(pairs)))


_INET = struct.pack("=H", 2) + bytes(126) + struct.pack("=q", -1)  # AF_INET, 127 bytes of no address, seq -1

HOSTILE_ADDRESSES: dict[str, bytes] = {
    "empty": b"",
    "shorter than a length": b"\x01\x02",
    "an address length past the end": bytes.fromhex("0000000000000000ffffffffffff7f000000000000000000"),
    "a host name length past the end": struct.pack("=Q", 1 << 40) + bytes(200),
    "an address of another size": _record(b"vm", bytes(24), 2),
    "no sequence number for each rank": _record(b"vm", _INET, 0),
    "a sequence number cut short": _record(b"vm", _INET, 2)[:-3],
    "no IP address family": _record(b"vm", bytes(136), 2),
    "64 random-looking bytes": bytes(range(64)),
}


def _peer(port: int) -> Any:
    """Rank 1 by hand: a client of the sender's store, once the sender opened sync 1."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        try:
            client = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=HANG_GUARD_S),
                                   wait_for_workers=False)
            break
        except RuntimeError:  # the sender is not listening yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    client.wait(["sync1/open"])
    return client


@pytest.mark.parametrize("case", list(HOSTILE_ADDRESSES))
def test_a_malformed_gloo_address_a_peer_posts_fails_the_sender_with_a_transport_error_naming_rank_and_key(
        case: str) -> None:
    """A peer claims rank 1, agrees, and posts `case` as its gloo address: an empty one killed the
    sender's process (SIGSEGV) and a crafted one raised a raw MemoryError (std::bad_alloc)."""
    out: dict[str, BaseException] = {}
    port = free_port()

    def send() -> None:
        try:
            WeightSync(new_engine("gloo", timeout_s=TIMEOUT_S)).sync(
                iter(mixed_tensors()), Rendezvous("127.0.0.1", port, receivers=1), 1)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    start = time.monotonic()
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    peer = _peer(port)
    peer.add("sync1/joined/1", 1)
    peer.set("sync1/group/0/1", HOSTILE_ADDRESSES[case])
    peer.multi_set(["sync1/engine/1", "sync1/world/1", "sync1/pid/1"], ["gloo", "2", "x"])
    sender.join(HANG_GUARD_S)
    assert not sender.is_alive() and time.monotonic() - start < HANG_GUARD_S
    error = out.get("error")
    assert isinstance(error, TransportError), repr(error)
    assert re.search(r"rank 0 cannot read rank 1's gloo address under 'sync1/group/0/1'", str(error)), str(error)


def test_a_well_formed_gloo_address_of_the_same_size_still_forms_the_group() -> None:
    """The check refuses what gloo cannot read, nothing an honest peer writes: a sync of two
    receivers forms its group and lands on both."""
    run = sync_threads(new_engine("gloo"), [new_engine("gloo"), new_engine("gloo")], mixed_tensors())
    assert run.error is None and run.errors == [None, None] and run.versions == [1, 1], (run.error, run.errors)


def test_an_empty_gloo_address_of_the_sender_fails_the_receiver_with_a_transport_error_naming_rank_and_key() -> None:
    """Someone wrote the sender's address empty before the sender wrote its own: the receiver
    read it and its process died (SIGSEGV). The sender writes its own once the receiver has
    ended, and fails at once too: it reads the receiver's refusal in place of its address."""
    read = threading.Event()

    class Overwritten(GlooEngine):
        def _make_group(self, store: Any, topology: Any, timeout: timedelta) -> Any:
            store.set("0/0", b"")
            read.wait(HANG_GUARD_S)
            return super()._make_group(store, topology, timeout)

    class Receiver(GlooEngine):
        def _make_group(self, store: Any, topology: Any, timeout: timedelta) -> Any:
            try:
                return super()._make_group(store, topology, timeout)
            finally:
                read.set()

    rollout = old_rollout()
    run = sync_threads(Overwritten(bucket_bytes=4096, timeout_s=TIMEOUT_S),
                       [Receiver(bucket_bytes=4096, timeout_s=TIMEOUT_S)], mixed_tensors(), [rollout])
    assert run.seconds < HANG_GUARD_S
    assert isinstance(run.errors[0], TransportError), repr(run.errors[0])
    assert "rank 1 cannot read rank 0's gloo address under 'sync1/group/0/0'" in str(run.errors[0]), str(run.errors[0])
    assert isinstance(run.error, TransportError), repr(run.error)
    assert "rank 1 refused to form the group: rank 1 cannot read rank 0's gloo address" in str(run.error), run.error
    assert_kept_old_weights(rollout)


# -- a side that cannot make its gloo device -----------------------------------------------------

def _no_device_on(sender: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender's (it runs on the test's thread) or the receivers' gloo device cannot be made:
    gloo's own error for an interface the host does not have (GLOO_SOCKET_IFNAME=nosuchif0)."""
    made = gloo_module._device

    def device(host: str) -> Any:
        if (threading.current_thread() is threading.main_thread()) == sender:
            return dist.ProcessGroupGloo.create_device(interface="nosuchif0")
        return made(host)

    monkeypatch.setattr(gloo_module, "_device", device)


def test_a_receiver_that_cannot_make_its_gloo_device_refuses_the_sync_and_the_sender_fails_at_once_naming_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver found out only after both sides agreed to form the group, so the sender
    waited out timeout_s forming it, with a message naming neither the rank nor the reason."""
    _no_device_on(sender=False, monkeypatch=monkeypatch)
    rollout = old_rollout()
    run = sync_threads(new_engine("gloo", timeout_s=TIMEOUT_S), [new_engine("gloo", timeout_s=TIMEOUT_S)],
                       mixed_tensors(), [rollout])
    assert run.seconds < HANG_GUARD_S
    assert isinstance(run.error, TransportError), repr(run.error)
    assert re.search(r"rank 1 refused the sync: rank 1 cannot make its gloo device: .*nosuchif0", str(run.error))
    assert isinstance(run.errors[0], TransportError), repr(run.errors[0])
    assert "rank 1 cannot make its gloo device" in str(run.errors[0])
    assert_kept_old_weights(rollout)


def test_a_sender_that_cannot_make_its_gloo_device_says_so_and_the_receiver_fails_at_once_naming_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender found out only after it told the receivers to form the group, so a receiver
    waited out timeout_s forming it although the sender had closed the sync at once."""
    _no_device_on(sender=True, monkeypatch=monkeypatch)
    rollout = old_rollout()
    run = sync_threads(new_engine("gloo", timeout_s=TIMEOUT_S), [new_engine("gloo", timeout_s=TIMEOUT_S)],
                       mixed_tensors(), [rollout])
    assert run.seconds < HANG_GUARD_S
    assert isinstance(run.error, TransportError) and "rank 0 cannot make its gloo device" in str(run.error), run.error
    assert isinstance(run.errors[0], TransportError), repr(run.errors[0])
    assert re.search(r"the sender formed no group: rank 0 cannot make its gloo device: .*nosuchif0",
                     str(run.errors[0])), str(run.errors[0])
    assert_kept_old_weights(rollout)


# -- the receiver's claim of its rank ------------------------------------------------------------

@pytest.mark.parametrize("count", [b"9223372036854775807", b"9999999999999999999"])
@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_rank_claim_past_the_stores_int64_fails_the_receiver_at_once_naming_the_key(name: str, count: bytes) -> None:
    """19 digits past what torch's store can add 1 to: it dropped the connection, which the
    receiver took for a lost store and retried every 50 ms until timeout_s, naming nothing."""
    run, rollout = _sync_with_a_key_written(name, lambda link: f"sync{link.number}/joined/1", count)
    assert run.seconds < HANG_GUARD_S
    assert isinstance(run.errors[0], TransportError), repr(run.errors[0])
    assert re.match(rf"{name} engine: sync 1 holds {re.escape(repr(count))} \(19 bytes\) under 'joined/1', not a count",
                    str(run.errors[0])), str(run.errors[0])
    assert_kept_old_weights(rollout)


# -- the sender's word that it forms the group -----------------------------------------------------

def test_an_unreadable_forming_is_refused_by_the_receiver_and_the_sender_forming_the_group_hears_it_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Someone wrote over the sender's `forming`: the receiver refused it, but the sender, forming
    the group by then, was not told and waited out timeout_s."""
    set_key = ControlStore.set

    def overwritten(self: ControlStore, key: str, value: bytes | str) -> None:
        set_key(self, key, b"\xff" if key == "forming" else value)

    monkeypatch.setattr(ControlStore, "set", overwritten)
    rollout = old_rollout()
    run = sync_threads(new_engine("gloo", timeout_s=TIMEOUT_S), [new_engine("gloo", timeout_s=TIMEOUT_S)],
                       mixed_tensors(), [rollout])
    assert run.seconds < HANG_GUARD_S
    assert isinstance(run.errors[0], TransportError), repr(run.errors[0])
    assert "rank 1 cannot read the sender's word under 'forming': sent an unreadable answer b'\\xff'" in str(
        run.errors[0]), str(run.errors[0])
    assert isinstance(run.error, EngineError), repr(run.error)
    assert re.search(r"rank 1 refused to form the group: rank 1 cannot read the sender's word under 'forming'",
                     str(run.error)), str(run.error)
    assert_kept_old_weights(rollout)


def test_a_gloo_whose_own_address_record_is_laid_out_otherwise_is_not_judged() -> None:
    """Another torch's gloo writes another layout: its peers' records pass as they did, rather
    than every group being refused."""
    from backends.engines.gloo import address_problem

    assert address_problem(b"\x00" * 3, own=b"\x01", world_size=2) is None
    assert address_problem(b"", own=None, world_size=2) is not None
