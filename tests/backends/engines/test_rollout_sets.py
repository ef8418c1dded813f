"""Flip into weight sets the rollout owns (`SharedSlotEngine.rollout_owns_sets`, cuda_ipc's way),
on a host: through a test-only shm engine with the same flag (`kit.RolloutSetsShm`), since the
protocol is the shared-slot engine's and cuda_ipc runs only on a GPU (its GPU tests are in
test_cuda_ipc.py). The flip tests that take every kind are in test_flip.py."""

from __future__ import annotations

import time
from typing import Any

import pytest

from backends.engines.shared import set_bytes
from lifecycle.errors import EngineError
from tests.backends.dist_util import free_port
from tests.backends.engines.kit import (
    CLASSES, HANG_GUARD_S, AdoptingRollout, assert_kept_old_weights, greedy, mixed_tensors, old_rollout, sync_threads,
    tiny_qwen2, train_step,
)
from tests.backends.engines.test_flip import _flip, _inside, _served, _set, _unchanged, _Viewing



def test_with_the_rollouts_sets_the_sender_writes_into_what_the_receiver_created_and_a_new_sender_finds_them() -> None:
    """The receiver creates and publishes its sets; a sender closed after sync 1 (its mappings
    gone) and a fresh one in its place write syncs 2 and 3 into them, the set not served each time."""
    trainer, rollout = tiny_qwen2(0), AdoptingRollout(tiny_qwen2(1))
    receiver, port = _flip("shm-rollout-sets"), free_port()
    senders = [_flip("shm-rollout-sets"), _flip("shm-rollout-sets")]
    try:
        for version, sender, target in ((1, senders[0], 0), (2, senders[1], 1), (3, senders[1], 0)):
            train_step(trainer, version)
            run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [rollout], version=version,
                               port=port)
            assert run.error is None and run.versions == [version], (run.error, run.errors)
            assert sender._mapped_from == receiver._own_sets != b"" and not sender._paths
            assert receiver._flip.serving == target
            for key, param in rollout.model.named_parameters():
                assert _inside(param, _set(receiver, target)), key
            assert greedy(rollout.model) == greedy(trainer)
            if version == 1:
                sender.close()
    finally:
        receiver.close()
        for sender in senders:
            sender.close()


class _Forging(CLASSES["shm-rollout-sets"]):  # type: ignore[valid-type,misc]
    """A sender led astray as a store writer could lead it: to the set the rollout serves (a
    forged `target/{rank}`), or to other sets than the receiver's (a forged `sets/{rank}`)."""

    served = False
    decoy: bytes | None = None

    def _open_rollout_sets(self, plan: Any) -> int:
        if self.decoy is not None:
            self._control().set(f"sets/{self._topology().receivers[0]}", self.decoy)
        asked = super()._open_rollout_sets(plan)
        return 1 - asked if self.served else asked


@pytest.mark.parametrize("forged", ["the served set", "another rollout's sets"])
def test_with_the_rollouts_sets_a_sender_led_to_other_memory_is_refused_before_a_byte_is_written(forged: str) -> None:
    sender = _Forging(apply="flip", bucket_bytes=4096, timeout_s=10)
    receiver, rollout, port = _flip("shm-rollout-sets", bucket_bytes=4096), _Viewing(), free_port()
    other = _flip("shm-rollout-sets", bucket_bytes=4096)
    try:
        assert sync_threads(sender, [receiver], mixed_tensors(0), [rollout], version=1, port=port).versions == [1]
        before = _served(rollout)
        decoys = other._create(set_bytes(receiver._flip.layouts[0].plan))
        for decoy in decoys:
            decoy.fill_(0x5A)
        if forged == "the served set":
            sender.served = True
        else:
            sender.decoy = other._publish()
        run = sync_threads(sender, [receiver], mixed_tensors(1), [rollout], version=2, port=port)
        assert isinstance(run.errors[0], EngineError) and "this receiver asked for" in str(run.errors[0])
        assert isinstance(run.error, EngineError) and "refused to take weight set" in str(run.error)
        assert _unchanged(rollout, before) and rollout.weights_version == 1 and receiver._flip.serving == 0
        assert all(bool((decoy == 0x5A).all()) for decoy in decoys)
        sender.served, sender.decoy = False, None
        assert sync_threads(sender, [receiver], mixed_tensors(1), [rollout], version=2, port=port).versions == [2]
        assert _unchanged(rollout, dict(mixed_tensors(1)))
    finally:
        receiver.close()
        sender.close()
        other.close()


def test_with_the_rollouts_sets_a_second_receiver_is_refused_and_both_keep_their_weights() -> None:
    sender = _flip("shm-rollout-sets", bucket_bytes=4096)
    receivers = [_flip("shm-rollout-sets", bucket_bytes=4096) for _ in range(2)]
    rollouts = [old_rollout(), old_rollout()]
    try:
        run = sync_threads(sender, receivers, mixed_tensors(), rollouts)
        assert isinstance(run.error, EngineError) and "for one receiver a sync; this sync has 2" in str(run.error)
        assert all(isinstance(error, EngineError) for error in run.errors)
        for rollout in rollouts:
            assert_kept_old_weights(rollout)
    finally:
        sender.close()
        for receiver in receivers:
            receiver.close()


@pytest.mark.parametrize(("sender_name", "receiver_name"), [("shm", "shm-rollout-sets"), ("shm-rollout-sets", "shm")])
def test_flip_with_the_senders_sets_on_one_side_and_the_rollouts_on_the_other_is_refused(
        sender_name: str, receiver_name: str) -> None:
    sender, receiver = _flip(sender_name, bucket_bytes=4096), _flip(receiver_name, bucket_bytes=4096)
    start = time.monotonic()
    run = sync_threads(sender, [receiver], mixed_tensors())
    sender.close()
    receiver.close()
    assert time.monotonic() - start < HANG_GUARD_S
    assert isinstance(run.error, EngineError) and isinstance(run.errors[0], EngineError)
    assert "sender and receivers must be the same engine" in str(run.errors[0])
