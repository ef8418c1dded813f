"""`apply: flip`: a sync lands in the weight set the rollout does not serve (gloo's own sets, the
ones shm's sender shares, or the rollout's own ones the sender writes into), the receiver
verifies it in place, and the rollout adopts views into it; a bad bucket leaves the rollout on
the set it serves. What only the rollout's own sets do is in test_rollout_sets.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from backends.engines import Rendezvous, WeightSync, adopt_weights, receive_into
from backends.engines.control import plan_id
from backends.engines.shared import _pick, set_bytes
from lifecycle.errors import EngineError
from lifecycle.testing import MemoryRollout
from tests.backends.dist_util import free_port
from tests.backends.engines.kit import (
    REPO, CLASSES, HANG_GUARD_S, AdoptingRollout, corrupting, greedy, mixed_tensors, new_engine, read_case, sync_threads,
    tiny_qwen2, train_step,
)

BUCKET = 1 << 16


FLIPPING = ["gloo", "shm", "shm-rollout-sets"]
"""gloo lands a sync in the receiver's own two sets; shm in the two the sender shares; with the
rollout's sets (cuda_ipc's way), in the two the receiver creates and the sender writes into."""


def _flip(name: str = "shm", **kwargs: Any) -> Any:
    return new_engine(name, apply="flip", bucket_bytes=kwargs.pop("bucket_bytes", BUCKET), **kwargs)


def _set(engine: Any, index: int) -> list[torch.Tensor]:
    """Set `index` of a flip receiver: one shared file (shm) or its bucket buffers (gloo)."""
    memory = engine._flip.memory[index]
    return [memory] if isinstance(memory, torch.Tensor) else list(memory)


def _inside(tensor: torch.Tensor, regions: list[torch.Tensor]) -> bool:
    return any(region.data_ptr() <= tensor.data_ptr()
               and tensor.data_ptr() + tensor.nbytes <= region.data_ptr() + region.numel() for region in regions)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("name", FLIPPING)
def test_each_sync_fills_the_other_set_and_the_rollout_adopts_it_without_a_private_copy(name: str) -> None:
    trainer, rollout = tiny_qwen2(0), AdoptingRollout(tiny_qwen2(1))
    sender, receiver = _flip(name), _flip(name)
    port = free_port()
    try:
        for version, target in ((1, 0), (2, 1), (3, 0)):
            train_step(trainer, version)
            run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [rollout], version=version,
                               port=port)
            assert run.error is None and run.versions == [version], (run.error, run.errors)
            assert receiver._flip.serving == target and receiver._layout is None
            assert getattr(receiver, "_staged", None) is None
            if name.startswith("shm"):
                assert _set(receiver, 0)[0].numel() == set_bytes(receiver._flip.layouts[target].plan)
            for key, param in rollout.model.named_parameters():
                assert _inside(param, _set(receiver, target)), key
                assert not _inside(param, _set(receiver, 1 - target)), key
            assert greedy(rollout.model) == greedy(trainer)
    finally:
        receiver.close()
        sender.close()
    assert greedy(rollout.model) == greedy(trainer), "the adopted set outlives the engine's own hold on it"


@pytest.mark.parametrize("name", FLIPPING)
def test_two_sets_laid_out_for_one_plan_keep_one_copy_of_its_bytes(name: str) -> None:
    trainer, rollout = tiny_qwen2(0), AdoptingRollout(tiny_qwen2(1))
    sender, receiver = _flip(name), _flip(name)
    port = free_port()
    try:
        for version in (1, 2):
            run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [rollout], version=version,
                               port=port)
            assert run.error is None and run.versions == [version], (run.error, run.errors)
        first, second = receiver._flip.layouts
        assert first is not None and second is not None and first.plan is second.plan
        assert first.raw is second.raw
    finally:
        receiver.close()
        sender.close()


@pytest.mark.parametrize("name", FLIPPING)
def test_tensors_larger_than_a_bucket_are_adopted_as_views_into_the_set_not_copies(name: str) -> None:
    trainer, rollout = tiny_qwen2(0), AdoptingRollout(tiny_qwen2(1))
    sender, receiver = _flip(name, bucket_bytes=8192), _flip(name, bucket_bytes=8192)
    big = [key for key, param in trainer.named_parameters() if param.nbytes > 8192]
    assert "model.embed_tokens.weight" in big and len(big) >= 4
    port = free_port()
    try:
        for version, target in ((1, 0), (2, 1)):
            train_step(trainer, version)
            run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [rollout], version=version,
                               port=port)
            assert run.error is None and run.versions == [version], (run.error, run.errors)
            for key, param in rollout.model.named_parameters():
                assert _inside(param, _set(receiver, target)), key
                assert torch.equal(param, dict(trainer.named_parameters())[key]), key
            assert greedy(rollout.model) == greedy(trainer)
    finally:
        receiver.close()
        sender.close()


@pytest.mark.parametrize("name", FLIPPING)
def test_a_corrupted_last_bucket_leaves_the_rollout_on_its_old_set_bit_identical_and_generating_as_before(
    name: str,
) -> None:
    trainer, rollout = tiny_qwen2(0), AdoptingRollout(tiny_qwen2(1))
    sender, receiver = corrupting(name, apply="flip", bucket_bytes=BUCKET), _flip(name)
    port = free_port()
    try:
        run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [rollout], version=1, port=port)
        assert run.error is None and run.versions == [1]
        before, tokens = _state(rollout.model), greedy(rollout.model)
        where = {key: param.data_ptr() for key, param in rollout.model.named_parameters()}
        buckets = run.figures["buckets"]  # type: ignore[index]
        assert buckets > 2
        train_step(trainer, 2)
        sender.corrupt = buckets - 1  # type: ignore[attr-defined]
        run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [rollout], version=2, port=port)
        assert isinstance(run.error, EngineError) and isinstance(run.errors[0], EngineError)
        assert f"bucket {buckets - 1} of {buckets} failed its checksum" in str(run.errors[0])
        assert rollout.weights_version == 1 and receiver._flip.serving == 0
        assert {key: param.data_ptr() for key, param in rollout.model.named_parameters()} == where
        for key, tensor in _state(rollout.model).items():
            assert torch.equal(tensor, before[key]), key
        assert greedy(rollout.model) == tokens
        sender.corrupt = None  # type: ignore[attr-defined]
        run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [rollout], version=2, port=port)
        assert run.error is None and run.versions == [2] and receiver._flip.serving == 1
        assert greedy(rollout.model) == greedy(trainer)
    finally:
        receiver.close()
        sender.close()


def test_a_gloo_flip_receiver_takes_any_sender_and_its_own_sets_only() -> None:
    named = mixed_tensors()
    sender, receiver, rollout, port = new_engine("gloo"), _flip("gloo", bucket_bytes=4096), MemoryRollout(), free_port()
    try:
        for version in (1, 2, 3):
            run = sync_threads(sender, [receiver], named, [rollout], version=version, port=port)
            assert run.error is None and run.versions == [version]
            for key, tensor in named:
                assert torch.equal(rollout.weights[key], tensor), key
        assert receiver._flip.serving == 0 and not sender._flip.memory
    finally:
        receiver.close()
        sender.close()


class _FailOnce(MemoryRollout):
    """A rollout whose first `load_weights` raises after reading one tensor."""

    failed = False

    def load_weights(self, named_tensors: Any) -> None:
        if not self.failed:
            self.failed = True
            next(iter(named_tensors))
            raise RuntimeError("rollout busy")
        super().load_weights(named_tensors)


def test_receivers_on_different_sets_are_refused_until_the_lagging_one_restarts() -> None:
    named = mixed_tensors()
    sender, ahead, behind = _flip(bucket_bytes=4096), _flip(bucket_bytes=4096), _flip(bucket_bytes=4096)
    rollouts = [MemoryRollout(), MemoryRollout()]
    port = free_port()
    try:
        assert sync_threads(sender, [ahead, behind], named, rollouts, version=1, port=port).versions == [1, 1]
        lagging = [MemoryRollout(), _FailOnce()]
        run = sync_threads(sender, [ahead, behind], named, lagging, version=2, port=port)
        assert run.versions == [2, None] and isinstance(run.error, EngineError)
        assert (ahead._flip.serving, behind._flip.serving) == (1, 0)
        run = sync_threads(sender, [ahead, behind], named, rollouts, version=3, port=port)
        assert isinstance(run.error, EngineError) and "serve different weight sets" in str(run.error)
        assert "rank 1 serves set 1" in str(run.error) and "rank 2 serves set 0" in str(run.error)
        behind.close()
        restarted = _flip(bucket_bytes=4096)
        run = sync_threads(sender, [ahead, restarted], named, rollouts, version=3, port=port)
        assert run.error is None and run.versions == [3, 3] and restarted._flip.serving == ahead._flip.serving == 0
        restarted.close()
    finally:
        ahead.close()
        behind.close()
        sender.close()


@pytest.mark.parametrize(("sender_apply", "receiver_apply"), [("flip", "atomic"), ("atomic", "flip"), ("streamed", "flip")])
def test_flip_on_one_side_only_is_refused_by_the_receiver(sender_apply: str, receiver_apply: str) -> None:
    sender, receiver = new_engine("shm", apply=sender_apply), new_engine("shm", apply=receiver_apply)
    run = sync_threads(sender, [receiver], mixed_tensors())
    sender.close()
    receiver.close()
    assert isinstance(run.error, EngineError) and isinstance(run.errors[0], EngineError)
    assert "set engine.apply to 'flip' on both sides or on neither" in str(run.errors[0])
    assert "refused the plan" in str(run.error)


class _Viewing(MemoryRollout):
    """A rollout that keeps the views it is handed, as an adopting one does: what a later sync
    writes into their set shows in them."""

    def load_weights(self, named_tensors: Any) -> None:
        self.calls.append("load_weights")
        self.weights = dict(named_tensors)


def _served(rollout: MemoryRollout) -> dict[str, torch.Tensor]:
    return {key: tensor.clone() for key, tensor in rollout.weights.items()}


def _unchanged(rollout: MemoryRollout, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(rollout.weights[key], value) for key, value in before.items())


def test_a_set_named_by_a_forged_store_is_refused_before_a_byte_of_it_is_written(monkeypatch: pytest.MonkeyPatch) -> None:
    import backends.engines.shared as shared

    sender, receiver = _flip(bucket_bytes=4096), _flip(bucket_bytes=4096)
    rollout, port = _Viewing(), free_port()
    try:
        assert sync_threads(sender, [receiver], mixed_tensors(0), [rollout], version=1, port=port).versions == [1]
        before = _served(rollout)
        monkeypatch.setattr(shared, "_pick", lambda asked: 0)  # the set rank 1 serves, as a forged target/1 says
        run = sync_threads(sender, [receiver], mixed_tensors(1), [rollout], version=2, port=port)
        assert isinstance(run.errors[0], EngineError) and "not the set 1 this receiver asked for" in str(run.errors[0])
        assert isinstance(run.error, EngineError) and "refused to take weight set 0" in str(run.error)
        assert _unchanged(rollout, before) and rollout.weights_version == 1 and receiver._flip.serving == 0
    finally:
        receiver.close()
        sender.close()


class _Respaced(CLASSES["shm"]):  # type: ignore[valid-type,misc]
    """A sender (or a store writer) that can publish the very same set files in other JSON."""

    respace = False
    corrupt: int | None = None

    def _publish(self) -> bytes:
        return json.dumps(self._paths, indent=1).encode() if self.respace else super()._publish()

    def _start_send(self, k: int, nbytes: int) -> Any:
        if k == self.corrupt:
            self.slots[k].data[5] ^= 0xFF
        return super()._start_send(k, nbytes)


@pytest.mark.parametrize("how", ["receiver closed and reopened", "same files published anew"])
def test_a_receiver_that_opens_the_same_sets_again_still_knows_which_one_it_serves(how: str) -> None:
    sender = _Respaced(apply="flip", bucket_bytes=4096, timeout_s=10)
    receiver, rollout, port = _flip(bucket_bytes=4096), _Viewing(), free_port()
    try:
        assert sync_threads(sender, [receiver], mixed_tensors(0), [rollout], version=1, port=port).versions == [1]
        before = _served(rollout)
        if how == "receiver closed and reopened":
            receiver.close()
        else:
            sender.respace = True
        sender.corrupt = 1
        run = sync_threads(sender, [receiver], mixed_tensors(1), [rollout], version=2, port=port)
        assert isinstance(run.errors[0], EngineError) and "failed its checksum" in str(run.errors[0])
        assert _unchanged(rollout, before) and receiver._flip.serving == 0
        sender.corrupt = None
        assert sync_threads(sender, [receiver], mixed_tensors(1), [rollout], version=2, port=port).versions == [2]
        assert receiver._flip.serving == 1 and _unchanged(rollout, dict(mixed_tensors(1)))
    finally:
        receiver.close()
        sender.close()


def test_the_sender_picks_the_one_set_the_receivers_agree_on() -> None:
    assert _pick({1: b"any", 2: b"any"}) == 0
    assert _pick({1: b"any", 2: b"1"}) == 1
    assert _pick({1: b"0", 2: b"0"}) == 0
    assert "serve different weight sets" in str(_pick({1: b"0", 2: b"1"}))
    for hostile in (b"2", b"", b"01", b"any ", b"\xff" * 100):
        reason = _pick({1: b"0", 2: hostile})
        assert isinstance(reason, str) and "asked for no weight set" in reason and len(reason) < 200


def test_an_engine_that_cannot_flip_refuses_it_when_built() -> None:
    with pytest.raises(EngineError, match="naive engine: does not take apply='flip'"):
        new_engine("naive", apply="flip")
    assert new_engine("shm", apply="flip").apply == new_engine("gloo", apply="flip").apply == "flip"


def test_new_shapes_get_new_sets_and_a_copying_rollout_takes_flip_too() -> None:
    sender, receiver = _flip(bucket_bytes=4096), _flip(bucket_bytes=4096)
    rollout, port = MemoryRollout(), free_port()
    try:
        for version, named in enumerate((mixed_tensors(), mixed_tensors(1)[:4], mixed_tensors(2)), start=1):
            run = sync_threads(sender, [receiver], named, [rollout], version=version, port=port)
            assert run.error is None and run.versions == [version]
            for name, tensor in named:
                assert torch.equal(rollout.weights[name], tensor), name
        assert receiver._flip.serving == 0, "the third sync mapped new sets, so it served none before it"
    finally:
        receiver.close()
        sender.close()


class _Three(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Parameter(torch.zeros(n)) for n in (16, 32, 16))
        self.register_buffer("d", torch.zeros(32), persistent=False)  # not a weight a sync must send


def test_a_sync_that_leaves_a_parameter_out_adopts_nothing_and_the_rollout_keeps_its_set() -> None:
    sender, receiver, port = _flip(bucket_bytes=4096), _flip(bucket_bytes=4096), free_port()
    rollout = AdoptingRollout(_Three())
    ones, twos = torch.ones(16), torch.full((16,), 2.0)
    try:
        named = [("a", ones), ("b", torch.ones(32)), ("c", ones)]
        assert sync_threads(sender, [receiver], named, [rollout], version=1, port=port).versions == [1]
        mapped = receiver._mapped_from
        run = sync_threads(sender, [receiver], [("a", twos), ("d", torch.ones(32)), ("c", twos)], [rollout],
                           version=2, port=port)
        assert receiver._mapped_from == mapped, "the same sets: only the served one's bookkeeping protects it"
        assert isinstance(run.errors[0], EngineError) and "leaves out 1 weight(s)" in str(run.errors[0])
        assert "'b'" in str(run.errors[0]) and torch.equal(rollout.model.a.data, ones)
        assert isinstance(run.error, EngineError) and "rank 1: the rollout's load_weights raised EngineError: " \
            "adopt_weights: the sync leaves out 1 weight(s)" in str(run.error), "the sender hears it too"
        assert receiver._flip.serving == 0, "its rollout read every tensor, then adopted none: it serves set 0"
        named = [("a", twos), ("b", torch.ones(32)), ("c", twos)]
        assert sync_threads(sender, [receiver], named, [rollout], version=3, port=port).versions == [3]
        assert receiver._flip.serving == 1 and torch.equal(rollout.model.a.data, twos)
    finally:
        receiver.close()
        sender.close()
    partial = _Three()
    assert adopt_weights(partial, [("a", ones)], complete=False) == 1 and torch.equal(partial.a.data, ones)


def test_adopt_weights_adopts_every_tensor_or_none() -> None:
    model = tiny_qwen2(0)
    where = {name: param.data_ptr() for name, param in model.named_parameters()}
    fresh = [(name, torch.zeros_like(param)) for name, param in model.named_parameters()]
    with pytest.raises(EngineError, match="'extra.weight'.*nothing was adopted"):
        adopt_weights(model, [*fresh, ("extra.weight", torch.zeros(1))])
    shapes = [*fresh[:-1], (fresh[-1][0], torch.zeros(3))]
    with pytest.raises(EngineError, match="arrives as \\(3,\\).*nothing was adopted"):
        adopt_weights(model, shapes)
    assert {name: param.data_ptr() for name, param in model.named_parameters()} == where
    assert adopt_weights(model, fresh) == len(fresh)
    assert all(not param.detach().any() for param in model.parameters())


def die_mid_flip(case_path: str) -> None:
    """A trainer process: one flip sync of a tiny Qwen2, a training step, then a second sync
    during which it SIGKILLs itself right after bucket 2 is written."""
    case = read_case(case_path)
    model, engine = tiny_qwen2(0), _flip(timeout_s=30)
    rdv = Rendezvous("127.0.0.1", case["port"])
    WeightSync(engine).sync(iter(list(model.named_parameters())), rdv, 1)
    train_step(model, 2)
    die_after = engine._start_send

    def send_or_die(k: int, nbytes: int) -> Any:
        handle = die_after(k, nbytes)
        if k == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return handle

    engine._start_send = send_or_die  # type: ignore[method-assign]
    WeightSync(engine).sync(iter(list(model.named_parameters())), rdv, 2)


def test_a_sender_killed_mid_flip_leaves_the_rollout_generating_from_its_old_set(tmp_path: Path) -> None:
    case = tmp_path / "case.json"
    case.write_text(json.dumps({"port": free_port()}), encoding="utf-8")
    sender = subprocess.Popen([sys.executable, "-c", "import sys; from tests.backends.engines.test_flip import "
                               "die_mid_flip; die_mid_flip(sys.argv[1])", str(case)], cwd=REPO)
    rollout, receiver = AdoptingRollout(tiny_qwen2(1)), _flip(timeout_s=30)
    rdv = Rendezvous("127.0.0.1", read_case(case)["port"])
    try:
        assert receive_into(receiver, rollout, rdv) == 1
        tokens, before = greedy(rollout.model), _state(rollout.model)
        where = {name: param.data_ptr() for name, param in rollout.model.named_parameters()}
        start = time.monotonic()
        with pytest.raises(EngineError):
            receive_into(receiver, rollout, rdv)
        assert time.monotonic() - start < HANG_GUARD_S
        assert sender.wait(timeout=HANG_GUARD_S) == -signal.SIGKILL
        assert rollout.stale and rollout.weights_version == 1
        assert {name: param.data_ptr() for name, param in rollout.model.named_parameters()} == where
        assert all(torch.equal(tensor, before[name]) for name, tensor in _state(rollout.model).items())
        assert greedy(rollout.model) == tokens
        trainer = tiny_qwen2(0)
        train_step(trainer, 2)
        restarted = _flip()
        run = sync_threads(restarted, [receiver], list(trainer.named_parameters()), [rollout], version=2)
        restarted.close()
        assert run.error is None and run.versions == [2] and greedy(rollout.model) == greedy(trainer)
        assert not [path for path in restarted.shm_dir.glob(f"*-{sender.pid}-*")], "the dead sender's sets are swept"
    finally:
        if sender.poll() is None:
            sender.kill()
        sender.wait()
        receiver.close()


def test_a_flattened_model_goes_into_the_set_with_one_copy_a_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    import backends.engines.sender as sender_module
    from backends.engines import flatten_parameters

    trainer, rollout = tiny_qwen2(0), AdoptingRollout(tiny_qwen2(1))
    flatten_parameters(trainer)
    train_step(trainer, 1)
    hashed: list[int] = []
    real = sender_module.xxh3_packed

    def spy(data: torch.Tensor, copied: Any) -> int:
        hashed.append(len(copied))
        return real(data, copied)

    monkeypatch.setattr(sender_module, "xxh3_packed", spy)
    sender, receiver = _flip(), _flip()
    try:
        run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [rollout])
        assert run.error is None and run.versions == [1]
        assert hashed == [1] * run.figures["buckets"]  # type: ignore[index]
        assert greedy(rollout.model) == greedy(trainer)
        for (name, mine), (_, theirs) in zip(rollout.model.named_parameters(), trainer.named_parameters()):
            assert torch.equal(mine, theirs), name
    finally:
        receiver.close()
        sender.close()


class _AdoptsThenFails(AdoptingRollout):
    fail = True

    def load_weights(self, named_tensors: Any) -> None:
        super().load_weights(named_tensors)
        if self.fail:
            raise RuntimeError("the rollout broke after adopting")


@pytest.mark.parametrize("name", FLIPPING)
def test_a_rollout_that_adopts_then_fails_serves_the_new_set_and_the_next_sync_leaves_it_alone(name: str) -> None:
    sender, receiver, port = _flip(name, bucket_bytes=4096), _flip(name, bucket_bytes=4096), free_port()
    rollout = _AdoptsThenFails(_Three())
    weights = [[("a", torch.full((16,), v)), ("b", torch.full((32,), v)), ("c", torch.full((16,), v))]
               for v in (1.0, 2.0, 3.0)]
    try:
        rollout.fail = False
        assert sync_threads(sender, [receiver], weights[0], [rollout], version=1, port=port).versions == [1]
        rollout.fail = True
        run = sync_threads(sender, [receiver], weights[1], [rollout], version=2, port=port)
        assert isinstance(run.errors[0], RuntimeError) and rollout.stale
        assert isinstance(run.error, EngineError) and "the rollout broke after adopting" in str(run.error)
        assert receiver._flip.serving == 1 and torch.equal(rollout.model.a.data, weights[1][0][1])
        rollout.fail = False
        adopted = rollout.model.a.data
        run = sync_threads(sender, [receiver], weights[2], [rollout], version=3, port=port)
        assert run.error is None and receiver._flip.serving == 0
        assert torch.equal(adopted, weights[1][0][1]), "the set the rollout served was not written"
        assert torch.equal(rollout.model.a.data, weights[2][0][1])
    finally:
        receiver.close()
        sender.close()


def test_a_shm_flip_sender_writes_every_bucket_before_it_waits_for_a_receiver() -> None:
    """Each bucket has its own place in the set, so no slot is refilled: the sender runs ahead
    of the receivers' checks instead of waiting for bucket k - 2 before writing bucket k."""
    order: list[str] = []

    class Recording(CLASSES["shm"]):  # type: ignore[valid-type,misc]
        def _start_send(self, k: int, nbytes: int) -> Any:
            order.append("write")
            return super()._start_send(k, nbytes)

        def _wait(self, handle: Any, what: str) -> None:
            if self.topology.is_sender:
                order.append("wait")
            super()._wait(handle, what)

    sender, receiver = Recording(apply="flip", bucket_bytes=4096, timeout_s=10), _flip(bucket_bytes=4096)
    try:
        run = sync_threads(sender, [receiver], mixed_tensors())
        assert run.error is None and run.errors == [None]
        count = run.figures["buckets"]  # type: ignore[index]
        assert count > 4
        assert order == ["write"] * count + ["wait"] * count
    finally:
        receiver.close()
        sender.close()


def _late_forger(name: str, receiver: Any) -> Any:
    class LateForger(CLASSES[name]):  # type: ignore[valid-type,misc]
        """An honest sender beside a store writer who forges two keys: `target` before the
        receiver reads it, naming the set the receiver asks for (so it confirms), then
        `target/1`, once it confirmed, naming the set its rollout serves."""

        forge = False

        def _send_layout(self, metas: Any) -> Any:
            layout = super()._send_layout(metas)
            if self.forge:
                asked = 1 - receiver._flip.serving
                self._control().set("target", f"{asked} {plan_id(receiver._own_sets)}" if self.rollout_owns_sets
                                    else str(asked))
            return layout

        def _bind(self, layout: Any) -> Any:
            if self.forge:
                self._control().wait(["bound/1"])
                self._control().set("target/1", str(receiver._flip.serving))
            return super()._bind(layout)

    return LateForger(apply="flip", bucket_bytes=4096, timeout_s=10)


@pytest.mark.parametrize("name", ["shm", "shm-rollout-sets"])
def test_a_confirmation_of_a_target_the_sender_did_not_write_is_refused_before_a_byte_is_written(name: str) -> None:
    """helper-60's race made deterministic: without the echo of what the receiver confirmed, the
    sender wrote the sync into the set the rollout serves."""
    receiver, rollout, port = _flip(name, bucket_bytes=4096), _Viewing(), free_port()
    sender = _late_forger(name, receiver)
    try:
        assert sync_threads(sender, [receiver], mixed_tensors(0), [rollout], version=1, port=port).versions == [1]
        before = _served(rollout)
        sender.forge = True
        run = sync_threads(sender, [receiver], mixed_tensors(1), [rollout], version=2, port=port)
        assert isinstance(run.error, EngineError) and "confirmed another weight set" in str(run.error)
        assert isinstance(run.errors[0], EngineError)
        assert _unchanged(rollout, before) and rollout.weights_version == 1 and receiver._flip.serving == 0
        sender.forge = False
        assert sync_threads(sender, [receiver], mixed_tensors(1), [rollout], version=2, port=port).versions == [2]
        assert _unchanged(rollout, dict(mixed_tensors(1)))
    finally:
        receiver.close()
        sender.close()


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.zeros(3))
        self.head = self.embed
        self.register_buffer("scale", torch.zeros(3))


def test_a_tied_weight_sent_under_both_its_names_is_refused_not_won_by_the_last() -> None:
    """Before, the rollout silently took the second name's values for both: an untied trainer's
    head became the rollout's embedding. Nothing is adopted."""
    model = _Tied()
    with pytest.raises(EngineError, match="sends 'embed' and 'head', which the rollout ties"):
        adopt_weights(model, [("embed", torch.ones(3)), ("head", torch.full((3,), 2.0)), ("scale", torch.ones(3))])
    assert torch.equal(model.embed.data, torch.zeros(3)) and torch.equal(model.scale, torch.zeros(3))


def test_a_sync_that_leaves_a_persistent_buffer_out_adopts_nothing() -> None:
    """A buffer left viewing the set it was adopted from changed without being sent two syncs
    later, when a flip wrote that set again: a buffer counts as a weight the sync must send."""
    model = _Tied()
    with pytest.raises(EngineError, match=r"leaves out 1 weight\(s\) of the rollout's _Tied: 'scale'"):
        adopt_weights(model, [("embed", torch.ones(3))])
    assert torch.equal(model.embed.data, torch.zeros(3))
    assert adopt_weights(model, [("embed", torch.ones(3)), ("scale", torch.ones(3))]) == 2


class _WithExtraState(_Tied):
    def get_extra_state(self) -> dict[str, int]:
        return {"scale": 2}

    def set_extra_state(self, state: Any) -> None:
        self.extra = state


def test_a_modules_extra_state_is_no_weight_a_sync_must_send() -> None:
    """`_extra_state` sits in the state dict but is neither a parameter nor a buffer: no sync
    can send it, so requiring it made every adoption fail."""
    model = _WithExtraState()
    assert adopt_weights(model, [("embed", torch.ones(3)), ("scale", torch.ones(3))]) == 2
