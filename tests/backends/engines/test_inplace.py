"""`receive_weights(into=...)`: a streamed group-engine receive lands every bucket straight in
the rollout's own flattened storage; a plan that storage cannot take is refused before a byte
moves, and the sender is told."""

from __future__ import annotations

import mmap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from backends.engines import flatten_parameters
from backends.engines.inplace import landing_slots
from backends.engines.plan import Piece, Plan, PlanRefused, TensorMeta, make_plan
from lifecycle.errors import EngineError
from tests.backends.engines.kit import (
    ModelRollout, corrupting, greedy, mixed_tensors, new_engine, sync_threads, tiny_qwen2, train_step,
)

BUCKET = 1 << 16


class _Noting(ModelRollout):
    """A rollout that notes where every tensor it is handed lies, then copies it by name."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.handed: list[tuple[int, int]] = []

    def load_weights(self, named_tensors: Any) -> None:
        def noted() -> Any:
            for name, tensor in named_tensors:
                self.handed.append((tensor.data_ptr(), tensor.nbytes))
                yield name, tensor
        super().load_weights(noted())


def _flat_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    trainer, rollout = tiny_qwen2(0), tiny_qwen2(1)
    flatten_parameters(trainer)
    flatten_parameters(rollout)
    train_step(trainer, 1)
    return trainer, rollout


def _storage(model: torch.nn.Module) -> tuple[int, int]:
    storage = next(model.parameters()).untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def test_a_flattened_rollout_takes_every_bucket_in_its_own_storage_bit_identical_to_a_copying_one() -> None:
    trainer, model = _flat_pair()
    landing, copying = _Noting(model), ModelRollout(tiny_qwen2(1))
    where = {name: param.data_ptr() for name, param in model.named_parameters()}
    sender = new_engine("gloo", bucket_bytes=BUCKET)
    receivers = [new_engine("gloo", bucket_bytes=BUCKET, apply="streamed") for _ in range(2)]
    try:
        run = sync_threads(sender, receivers, list(trainer.named_parameters()), [landing, copying],
                           into=[model, None])
        assert run.error is None and run.errors == [None, None] and run.versions == [1, 1]
        assert run.figures["buckets"] > 2  # type: ignore[index]
        low, high = _storage(model)
        assert landing.handed and all(low <= at and at + n <= high for at, n in landing.handed)
        assert {name: param.data_ptr() for name, param in model.named_parameters()} == where
        assert receivers[0].slots == []  # no later receive lands in the rollout's storage
        for (name, mine), theirs in zip(model.named_parameters(), copying.model.parameters()):
            assert torch.equal(mine, theirs), name
        assert greedy(model) == greedy(trainer)
    finally:
        for engine in (*receivers, sender):
            engine.close()


def test_a_rollout_laid_out_otherwise_refuses_the_plan_and_both_sides_say_why() -> None:
    trainer, _ = _flat_pair()
    rollout = ModelRollout(tiny_qwen2(1))  # not flattened
    before = {name: param.detach().clone() for name, param in rollout.model.named_parameters()}
    sender, receiver = new_engine("gloo", bucket_bytes=BUCKET), new_engine("gloo", bucket_bytes=BUCKET, apply="streamed")
    try:
        run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [rollout], into=[rollout.model])
        assert isinstance(run.error, EngineError) and isinstance(run.errors[0], EngineError)
        for error in (run.error, run.errors[0]):
            assert "does not lie in one storage of the rollout" in str(error)
        assert rollout.stale
        for name, param in rollout.model.named_parameters():
            assert torch.equal(param, before[name]), name
    finally:
        receiver.close()
        sender.close()


@pytest.mark.parametrize(("name", "apply"), [("gloo", "atomic"), ("gloo", "flip"), ("shm", "streamed")])
def test_into_takes_a_streamed_group_engine_and_anything_else_is_refused_before_a_byte_moves(name: str,
                                                                                           apply: str) -> None:
    named = mixed_tensors()
    into = {key: torch.zeros_like(tensor) for key, tensor in named}
    sender = new_engine(name, apply="flip" if apply == "flip" else "atomic")
    receiver = new_engine(name, apply=apply)
    try:
        run = sync_threads(sender, [receiver], named, into=[into])
        assert isinstance(run.error, EngineError) and isinstance(run.errors[0], EngineError)
        assert "into= lands every bucket" in str(run.errors[0]) and "into= lands every bucket" in str(run.error)
        assert all(not tensor.any() for tensor in into.values())
    finally:
        receiver.close()
        sender.close()


def test_a_bad_bucket_landed_in_place_overwrites_its_weights_and_leaves_the_rollout_stale_until_a_sync_completes(
) -> None:
    trainer, model = _flat_pair()
    rollout = ModelRollout(model)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    metas = [TensorMeta(name, param.dtype, tuple(param.shape)) for name, param in trainer.named_parameters()]
    buckets = [{metas[p.index].name for p in bucket} for bucket in make_plan(metas, BUCKET, True).buckets]
    sender = corrupting("gloo", bucket=1, bucket_bytes=BUCKET)
    receiver = new_engine("gloo", bucket_bytes=BUCKET, apply="streamed")
    try:
        run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [rollout], into=[model])
        assert isinstance(run.errors[0], EngineError) and "bucket 1 of" in str(run.errors[0])
        assert rollout.stale and rollout.weights_version == 0
        changed = {name for name, param in model.named_parameters() if not torch.equal(param, before[name])}
        assert changed & buckets[1]  # the failed bucket's bytes landed where the rollout serves from
        assert len(buckets) > 4
        landed = set().union(*buckets[:3])  # those before the bad one, the bad one, the one posted after it
        assert changed <= landed  # the rest drained into a buffer of the engine's
        assert "its bytes landed in the rollout's weights (into=)" in str(run.errors[0])
        sender.corrupt = None  # type: ignore[attr-defined]
        run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [rollout], into=[model], version=2)
        assert run.error is None and run.versions == [2] and not rollout.stale
        assert greedy(model) == greedy(trainer)
    finally:
        receiver.close()
        sender.close()


def _plan(*pieces: Piece) -> Plan:
    metas = [TensorMeta("a", torch.uint8, (60,)), TensorMeta("b", torch.uint8, (64,))]
    return Plan(4096, True, metas, [list(pieces)])


def test_a_piece_away_from_the_end_of_the_one_before_is_refused() -> None:
    buffer = torch.zeros(256, dtype=torch.uint8)
    into = {"a": buffer[:60], "b": buffer[128:192]}
    with pytest.raises(PlanRefused, match="bucket 0 piece 1 sits at offset 128, not at 64"):
        landing_slots(_plan(Piece(0, 0, 0, 60), Piece(1, 128, 0, 64)), into, torch.device("cpu"))


def test_a_tensor_the_plan_does_not_send_inside_a_bucket_range_is_refused() -> None:
    buffer = torch.zeros(128, dtype=torch.uint8)
    assert buffer.data_ptr() % 64 == 0
    into = {"a": buffer[:60], "x": buffer[60:64], "b": buffer[64:128]}
    plan = _plan(Piece(0, 0, 0, 60), Piece(1, 64, 0, 64))
    with pytest.raises(PlanRefused, match="would land on 'x'"):
        landing_slots(plan, into, torch.device("cpu"))
    del into["x"]
    slots = landing_slots(plan, into, torch.device("cpu"))
    assert slots[0].data.data_ptr() == buffer.data_ptr() and slots[0].data.numel() == 128


def test_a_plan_naming_a_tensor_the_rollout_lacks_or_holds_otherwise_is_refused() -> None:
    flat = torch.nn.Linear(8, 8)
    flatten_parameters(flat)
    metas = [TensorMeta("weight", torch.float32, (8, 8)), TensorMeta("bias", torch.float32, (8,))]
    with pytest.raises(PlanRefused, match="'bias' as torch.float32 \\[8\\]; the rollout holds torch.float32 \\[4\\]"):
        landing_slots(make_plan(metas, 4096, True), {"weight": flat.weight, "bias": flat.bias[:4]}, torch.device("cpu"))
    with pytest.raises(PlanRefused, match="which the rollout's tensors \\(into=\\) do not hold"):
        landing_slots(make_plan(metas, 4096, True), {"weight": flat.weight}, torch.device("cpu"))
    slots = landing_slots(make_plan(metas, 4096, True), flat, torch.device("cpu"))
    assert slots[0].data.data_ptr() == flat.weight.data_ptr()


def test_the_landing_layout_is_kept_while_the_rollout_stays_put_worked_out_again_when_it_moves_and_dropped_on_close(
) -> None:
    trainer, model = _flat_pair()
    rollout = ModelRollout(model)
    sender = new_engine("gloo", bucket_bytes=BUCKET)
    receiver = new_engine("gloo", bucket_bytes=BUCKET, apply="streamed")
    port = None
    try:
        layouts = []
        for version in (1, 2):
            run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [rollout], into=[model],
                               version=version, port=port)
            assert run.error is None and run.versions == [version]
            layouts.append(receiver._landing.layout)  # type: ignore[attr-defined]
        assert layouts[0] is layouts[1]
        first_storage = _storage(model)
        for param in model.parameters():  # the rollout moves its weights: the kept ranges are no longer its
            param.data = param.data.clone()
        flatten_parameters(model)
        assert _storage(model) != first_storage
        train_step(trainer, 3)
        run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [rollout], into=[model], version=3)
        assert run.error is None and run.versions == [3]
        assert receiver._landing.layout is not layouts[0]  # type: ignore[attr-defined]
        low, high = _storage(model)
        kept = receiver._landing.layout.slots  # type: ignore[attr-defined]
        assert all(low <= slot.data.data_ptr() < high for slot in kept if slot.data.numel())
        assert greedy(model) == greedy(trainer)
        receiver.close()
        assert receiver._landing.layout is None  # type: ignore[attr-defined]  # close lets the storage go
    finally:
        receiver.close()
        sender.close()


class _Tied(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(64, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight


@pytest.mark.parametrize("how", ["module", "state_dict", "pairs"])
def test_a_tied_rollout_lands_its_tied_weight_once_given_as_a_module_a_state_dict_or_pairs(how: str) -> None:
    trainer, model = _Tied(0), _Tied(1)
    flatten_parameters(trainer)
    flatten_parameters(model)
    sender, receiver = new_engine("gloo"), new_engine("gloo", apply="streamed")
    try:
        into = {"module": model, "state_dict": model.state_dict(), "pairs": iter(model.named_parameters())}[how]
        run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [ModelRollout(model)], into=[into])
        assert run.error is None and run.errors == [None]
        for (name, mine), theirs in zip(model.named_parameters(), trainer.parameters()):
            assert torch.equal(mine, theirs), name
        assert model.head.weight is model.embed.weight
    finally:
        receiver.close()
        sender.close()


def test_a_plan_that_sends_both_names_of_a_tied_weight_is_refused_naming_them() -> None:
    flat = _Tied(0)
    flatten_parameters(flat)
    metas = [TensorMeta(name, p.dtype, tuple(p.shape)) for name, p in flat.named_parameters(remove_duplicate=False)]
    with pytest.raises(PlanRefused, match="it sends 'embed.weight' and 'head.weight', which the rollout ties"):
        landing_slots(make_plan(metas, 4096, True), flat, torch.device("cpu"))


class _BufferInPadding(torch.nn.Module):
    """Parameters `a` (15 floats) and `b` and a buffer `x` in a's alignment padding: one
    hand-built storage that flattening leaves as it is."""

    def __init__(self) -> None:
        super().__init__()
        store = torch.ones(32)
        self.a = torch.nn.Parameter(store[0:15])
        self.register_buffer("x", store[15:16])
        self.b = torch.nn.Parameter(store[16:32])


def test_a_modules_buffer_inside_a_bucket_range_is_refused() -> None:
    model = _BufferInPadding()
    assert model.a.data_ptr() % 64 == 0
    metas = [TensorMeta("a", torch.float32, (15,)), TensorMeta("b", torch.float32, (16,))]
    with pytest.raises(PlanRefused, match="would land on 'buffer x'"):
        landing_slots(make_plan(metas, 4096, True), model, torch.device("cpu"))


def test_a_buffer_moved_into_a_bucket_range_after_a_landing_was_kept_is_refused_on_the_next_sync() -> None:
    """The kept landing layout is reused while the rollout's tensors stay put; a module's buffers
    beside them are part of what must stay put, or a buffer moved into a landing range would
    be written over by the next sync."""
    from backends.engines.inplace import Landing

    model = _BufferInPadding()
    model.register_buffer("x", torch.ones(1))  # apart, for now
    plan = make_plan([TensorMeta("a", torch.float32, (15,)), TensorMeta("b", torch.float32, (16,))], 4096, True)
    landing = Landing()
    kept = landing.layout_for(plan, plan.to_bytes(), model, torch.device("cpu"))
    assert landing.layout_for(plan, plan.to_bytes(), model, torch.device("cpu")) is kept
    model.register_buffer("x", model.a.data.new_empty(0).set_(model.a.untyped_storage(), 15, (1,)))
    with pytest.raises(PlanRefused, match="would land on 'buffer x'"):
        landing.layout_for(plan, plan.to_bytes(), model, torch.device("cpu"))


@pytest.mark.parametrize("unsent", ["buffer", "state dict entry"])
def test_a_strided_tensor_whose_new_strides_reach_into_a_kept_landing_is_refused_on_the_next_sync(
        unsent: str) -> None:
    """Its address, shape and contiguity stay as they were: only its strides say it now reads
    bytes a bucket lands on, so they are part of what the kept landing checks."""
    from backends.engines.inplace import Landing

    store = torch.zeros(64)
    x = store.as_strided((2,), (2,), 0)  # store[0] and store[2]: before a's range
    model = torch.nn.Module()
    model.a, model.b = torch.nn.Parameter(store[16:31]), torch.nn.Parameter(store[32:48])
    into: Any = model
    if unsent == "buffer":
        model.register_buffer("x", x)
    else:
        into = {"a": model.a, "b": model.b, "x": x}
    assert model.a.data_ptr() % 64 == 0
    plan = make_plan([TensorMeta("a", torch.float32, (15,)), TensorMeta("b", torch.float32, (16,))], 4096, True)
    landing = Landing()
    kept = landing.layout_for(plan, plan.to_bytes(), into, torch.device("cpu"))
    assert landing.layout_for(plan, plan.to_bytes(), into, torch.device("cpu")) is kept
    x.as_strided_((2,), (20,), 0)  # x[1] is now store[20], a[4]: same address, shape, not contiguous either way
    with pytest.raises(PlanRefused, match="would land on '(buffer )?x'"):
        landing.layout_for(plan, plan.to_bytes(), into, torch.device("cpu"))
    assert x.tolist() == [0.0, 0.0]


def test_an_unsent_name_tied_to_a_sent_weight_through_other_size_1_strides_is_landed_as_a_kept_landing_would() -> None:
    """The same bytes at the same address, viewed with another stride on a size-1 dimension, are
    the same weight (`sources.place`): a fresh landing takes it as the kept one does."""
    from backends.engines.inplace import Landing

    w = torch.zeros(64)[:16].view(1, 16)
    odd = w.as_strided((1, 16), (999, 1))
    plan = make_plan([TensorMeta("w", torch.float32, (1, 16))], 4096, True)
    for tied in (w.view(1, 16), odd):
        layout = Landing().layout_for(plan, plan.to_bytes(), [("w", w), ("tied", tied)], torch.device("cpu"))
        assert layout.slots[0].data.data_ptr() == w.data_ptr()


def test_a_rollout_tensor_whose_storage_was_freed_after_a_landing_was_kept_is_refused_naming_it() -> None:
    """The landing would write into memory the rollout gave back (FSDP frees unsharded
    parameters with `untyped_storage().resize_(0)`): a receiver refuses the plan, naming it."""
    from backends.engines.inplace import Landing

    model = _BufferInPadding()
    model.register_buffer("x", torch.ones(1))  # apart
    plan = make_plan([TensorMeta("a", torch.float32, (15,)), TensorMeta("b", torch.float32, (16,))], 4096, True)
    landing = Landing()
    kept = landing.layout_for(plan, plan.to_bytes(), model, torch.device("cpu"))
    assert landing.layout_for(plan, plan.to_bytes(), model, torch.device("cpu")) is kept
    model.a.untyped_storage().resize_(0)
    with pytest.raises(PlanRefused, match="into= holds 'a', whose storage holds 0 bytes, fewer than it reads"):
        landing.layout_for(plan, plan.to_bytes(), model, torch.device("cpu"))


def test_a_rollout_on_read_only_memory_is_refused_naming_the_tensor_not_left_to_time_out(tmp_path: Path) -> None:
    """gloo's receive into memory mapped read-only fails inside gloo (EFAULT): both sides waited
    the whole timeout_s."""
    torch.manual_seed(0)
    trainer, model = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
    flatten_parameters(model)
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(model.weight.untyped_storage()))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with path.open("rb") as file, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the buffer is not writable: the point here
        memory = torch.frombuffer(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ), dtype=torch.float32)
    model.weight.data, model.bias.data = memory[:256].view(16, 16), memory[256:272]
    sender, receiver = new_engine("gloo", timeout_s=60), new_engine("gloo", apply="streamed", timeout_s=60)
    try:
        run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [ModelRollout(model)], into=[model],
                           deadline_s=10)
    finally:
        receiver.close()
        sender.close()
    assert run.seconds < 10
    assert isinstance(run.errors[0], EngineError)
    assert "bucket 0 would land on 'weight', whose memory cannot be written" in str(run.errors[0])
    assert isinstance(run.error, EngineError) and "refused the plan" in str(run.error)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


@pytest.mark.parametrize(("into", "reason"), [
    ({"w": torch.eye(3).to_sparse()}, "into= holds 'w', which is not a strided tensor"),
    ([("w", torch.zeros(3)), ("w", torch.zeros(3))], "into= holds 'w', which is named twice"),
    ([1, 2], "into= is no module, state dict or \\(name, tensor\\) pairs"),
    ({"w": "zeros"}, "into= holds 'w', which is a str, not a tensor"),
])
def test_an_into_that_cannot_be_landed_in_is_refused_saying_why(into: Any, reason: str) -> None:
    with pytest.raises(PlanRefused, match=reason):
        landing_slots(make_plan([TensorMeta("w", torch.float32, (3,))], 4096, True), into, torch.device("cpu"))
