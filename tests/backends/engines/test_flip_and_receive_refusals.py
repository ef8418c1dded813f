"""A flip sender that moves to another rollout group writes no set the first group serves; a
receiver refusing an unreadable `target` says what it asked for; a `receive_into` that could
never have run is refused before the rollout is paused, and its sender hears why."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from backends.engines import Rendezvous, WeightSync, receive_into
from backends.engines.control import ControlStore
from lifecycle.errors import EngineError
from lifecycle.rollout import RolloutState, RolloutWeights
from lifecycle.testing import MemoryRollout
from tests.backends.dist_util import free_port
from tests.backends.engines.kit import HANG_GUARD_S, mixed_tensors, new_engine, old_rollout, sync_threads


class _Viewing(MemoryRollout):
    """Keeps the views it is handed, as an adopting rollout does: a later write into their set shows."""

    def load_weights(self, named_tensors: Any) -> None:
        self.calls.append("load_weights")
        self.weights = dict(named_tensors)


def _serving_v7() -> RolloutWeights:
    rollout = RolloutWeights(lambda named: None)
    with rollout.receiving() as landed:
        landed(7)
    return rollout


def _untouched(rollout: MemoryRollout) -> bool:
    return rollout.weights_version == 7 and not rollout.stale and not rollout.paused


# -- finding 1: a flip sender moving to a second Rendezvous ------------------------------------


def test_a_flip_sender_syncing_a_second_rendezvous_never_writes_the_set_the_first_groups_rollout_serves() -> None:
    sender = new_engine("shm", apply="flip")
    first, second = new_engine("shm", apply="flip"), new_engine("shm", apply="flip")
    group_a, group_b = _Viewing(), _Viewing()
    try:
        assert sync_threads(sender, [first], mixed_tensors(1), [group_a], version=1).versions == [1]
        served = {name: tensor.clone() for name, tensor in group_a.weights.items()}
        assert sync_threads(sender, [second], mixed_tensors(2), [group_b], version=2).versions == [2]
        assert all(torch.equal(group_a.weights[name], value) for name, value in served.items())
        assert all(torch.equal(group_b.weights[name], value) for name, value in mixed_tensors(2))
        assert sync_threads(sender, [first], mixed_tensors(3), [group_a], version=3).versions == [3]
        assert all(torch.equal(group_a.weights[name], value) for name, value in mixed_tensors(3))
        assert all(torch.equal(group_b.weights[name], value) for name, value in mixed_tensors(2))
    finally:
        for engine in (sender, first, second):
            engine.close()


def test_a_flip_sender_syncing_the_same_rendezvous_again_keeps_its_shared_sets() -> None:
    sender, receiver, rollout, port = new_engine("shm", apply="flip"), new_engine("shm", apply="flip"), _Viewing(), free_port()
    try:
        assert sync_threads(sender, [receiver], mixed_tensors(1), [rollout], version=1, port=port).versions == [1]
        kept = [memory.data_ptr() for memory in sender._flip.memory]
        assert sync_threads(sender, [receiver], mixed_tensors(2), [rollout], version=2, port=port).versions == [2]
        assert [memory.data_ptr() for memory in sender._flip.memory] == kept
    finally:
        sender.close()
        receiver.close()


# -- finding 2: an unreadable `target` ----------------------------------------------------------


def test_an_unreadable_target_is_refused_saying_the_receiver_takes_either_set_and_serves_none(
        monkeypatch: pytest.MonkeyPatch) -> None:
    original = ControlStore.set

    def forging(self: ControlStore, key: str, value: Any) -> None:
        original(self, key, b"01" if key == "target" else value)

    monkeypatch.setattr(ControlStore, "set", forging)
    sender, receiver, rollout = new_engine("shm", apply="flip"), new_engine("shm", apply="flip"), old_rollout()
    try:
        run = sync_threads(sender, [receiver], mixed_tensors(1), [rollout], version=8)
        message = str(run.errors[0])
        assert isinstance(run.errors[0], EngineError) and isinstance(run.error, EngineError)
        assert "b'01'" in message and "no weight set (0 or 1)" in message and "either set" in message
        assert "None" not in message and "serves the other" not in message
    finally:
        sender.close()
        receiver.close()


# -- finding 3: a receive_into that cannot run leaves the rollout as it was ----------------------


@pytest.mark.parametrize("folder", ["", "afile/inside"])
def test_a_profile_dir_that_cannot_be_a_folder_is_refused_before_the_rollout_is_paused_and_the_sender_hears_it(
        tmp_path: Path, folder: str) -> None:
    (tmp_path / "afile").write_text("")
    profile_dir = str(tmp_path / folder) if folder else ""
    port = free_port()
    sender, receiver = new_engine("shm", timeout_s=30), new_engine("shm", timeout_s=30)
    heard: dict[str, BaseException] = {}

    def send() -> None:
        try:
            WeightSync(sender).sync(iter(mixed_tensors(1)), Rendezvous("127.0.0.1", port), 8)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            heard["error"] = exc

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    rollout, machine = old_rollout(), _serving_v7()
    try:
        with pytest.raises(EngineError, match="profile_dir"):
            receive_into(receiver, rollout, Rendezvous("127.0.0.1", port), rank=1, profile_dir=profile_dir)
        thread.join(HANG_GUARD_S)
        assert not thread.is_alive()
        assert isinstance(heard.get("error"), EngineError) and "profile_dir" in str(heard["error"])
        assert _untouched(rollout) and "pause" not in rollout.calls
        with pytest.raises(EngineError, match="profile_dir"):
            receive_into(new_engine("naive"), machine, profile_dir=profile_dir)
        assert machine.state == RolloutState.SERVING and machine.weights_version == 7
    finally:
        thread.join(HANG_GUARD_S)
        sender.close()
        receiver.close()


def test_a_second_receive_into_on_an_engine_whose_session_is_under_way_leaves_its_rollout_serving() -> None:
    port = free_port()
    receiver, first = new_engine("shm", timeout_s=30), MemoryRollout()
    thread = threading.Thread(target=receive_into, args=(receiver, first, Rendezvous("127.0.0.1", port)),
                              kwargs={"rank": 1}, daemon=True)
    thread.start()
    try:
        limit = time.monotonic() + HANG_GUARD_S
        while not receiver.busy() and time.monotonic() < limit:
            time.sleep(0.01)
        other, machine = old_rollout(), _serving_v7()
        for rollout in (other, machine):
            with pytest.raises(EngineError, match="a sync is under way on this engine already"):
                receive_into(receiver, rollout, Rendezvous("127.0.0.1", port), rank=1)
        assert _untouched(other) and "pause" not in other.calls
        assert machine.state == RolloutState.SERVING and machine.weights_version == 7
        sent = WeightSync(new_engine("shm"))
        try:
            sent.sync(iter(mixed_tensors(1)), Rendezvous("127.0.0.1", port), 1)
            thread.join(HANG_GUARD_S)  # before the store goes: the receiver reads the sender's 'heard' there
        finally:
            sent.close()
        assert not thread.is_alive() and first.weights_version == 1
    finally:
        thread.join(HANG_GUARD_S)
        receiver.close()


def test_receive_into_without_a_rendezvous_on_an_engine_that_needs_one_leaves_the_rollout_serving() -> None:
    rollout, machine = old_rollout(), _serving_v7()
    for target in (rollout, machine):
        with pytest.raises(EngineError, match="shm engine: needs a Rendezvous"):
            receive_into(new_engine("shm"), target)
    assert _untouched(rollout) and "pause" not in rollout.calls
    assert machine.state == RolloutState.SERVING and machine.weights_version == 7
