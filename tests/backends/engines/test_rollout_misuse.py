"""Syncs to rollouts used in ways the happy path never tries: a model with extra state, a log
sink that fails while weights land, and the testing kit's `MemoryEngine` handed what the real
in-process engine takes (a list of rollouts) or refuses (a rollout that cannot be paused)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import structlog
import torch

from backends.engines import shm
from backends.engines.pipeline import BucketEngine
from backends.engines.receiver import Receiver
from backends.engines.sources import state_weights
from lifecycle import Lifecycle, State
from lifecycle.errors import EngineError
from lifecycle.rollout import RolloutState, RolloutWeights
from lifecycle.testing import MemoryCheckpointer, MemoryEngine, MemoryRollout


class _DictExtraState(torch.nn.Linear):
    """Extra state as most modules keep it: any object, here a dict."""

    def get_extra_state(self) -> dict[str, float]:
        return {"fp8_scale": 1.0}

    def set_extra_state(self, state: Any) -> None:
        self.extra = state


class _TensorExtraState(torch.nn.Linear):
    """Extra state as TransformerEngine keeps it: a tensor of serialized bytes, still no weight."""

    def get_extra_state(self) -> torch.Tensor:
        return torch.zeros(4, dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        self.extra = state


def _naive(model: torch.nn.Module, engine: Any = None) -> Lifecycle:
    lc = Lifecycle({"engine": {"backend": "naive"}}, model=model, checkpointer=MemoryCheckpointer(), engine=engine)
    lc.init_load()
    return lc


# 1. extra state


def test_state_weights_leaves_out_the_extra_state_of_the_root_and_of_nested_modules_tensor_or_not() -> None:
    model = torch.nn.Sequential(_DictExtraState(2, 2), torch.nn.Sequential(_TensorExtraState(2, 3)))
    assert "0._extra_state" in model.state_dict() and "1.0._extra_state" in model.state_dict()
    assert [name for name, _ in state_weights(model)] == ["0.weight", "0.bias", "1.0.weight", "1.0.bias"]
    assert [name for name, _ in state_weights(_DictExtraState(2, 2))] == ["weight", "bias"]


def test_state_weights_still_sends_a_tied_tensor_once_beside_extra_state() -> None:
    model = torch.nn.Sequential(_DictExtraState(2, 2), _DictExtraState(2, 2))
    model[1].weight = model[0].weight
    assert [name for name, _ in state_weights(model)] == ["0.weight", "0.bias", "1.bias"]


@pytest.mark.parametrize("cls", [_DictExtraState, _TensorExtraState])
def test_a_model_with_extra_state_syncs_its_parameters_and_buffers_through_the_naive_engine(cls: type) -> None:
    lc = _naive(cls(2, 2))
    with lc.train_step(1):
        pass
    rollout = MemoryRollout()
    assert lc.sync_weights(rollout) == 1
    assert lc.state is State.READY
    assert sorted(rollout.weights) == ["bias", "weight"] and rollout.weights_version == 1


# 2. a failing log sink


class _BrokenSink:
    """A log sink that raises like a closed pipe."""

    def msg(self, *args: Any, **kwargs: Any) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    log = debug = info = warning = error = critical = msg


@pytest.fixture
def broken_log() -> Iterator[None]:
    saved = structlog.get_config()
    structlog.configure(logger_factory=lambda *args: _BrokenSink(), cache_logger_on_first_use=False)
    try:
        yield
    finally:
        structlog.configure(**saved)


def test_a_receive_that_goes_back_a_version_lands_even_when_the_log_sink_fails(broken_log: None) -> None:
    weights = RolloutWeights(lambda named: list(named))
    for version in (5, 3):  # a resumed trainer goes back: its warning must cost the line only
        with weights.receiving() as landed:
            weights.load_weights([("w", 0)])
            landed(version)
        assert weights.state is RolloutState.SERVING and weights.weights_version == version


def _unfinished_receiver(drain: Any) -> Receiver:
    """A receiver whose receive failed part-way, with `drain` as its inbox's drain."""
    receiver = object.__new__(Receiver)
    receiver.engine = SimpleNamespace(name="gloo", _landed=False)
    receiver.rank, receiver.error, receiver.finished, receiver.link_failed = 1, "bucket 0 failed", False, False
    receiver.incoming = SimpleNamespace(complete=False, stop_reason=None, tensors=0, held=False)
    receiver.plan = SimpleNamespace(tensors=[])
    receiver.inbox = SimpleNamespace(drain=drain)
    return receiver


def test_receiver_finish_never_raises_when_the_drain_fails_and_the_log_sink_fails_too(broken_log: None) -> None:
    def drain() -> None:
        raise EngineError("gloo engine: the link dropped while draining")

    receiver = _unfinished_receiver(drain)
    receiver.finish()
    assert receiver.finished


def test_receiver_drain_aside_without_a_buffer_drains_in_place_when_the_log_sink_fails(broken_log: None) -> None:
    def allocate(sizes: list[int], device: Any) -> Any:
        raise EngineError("gloo engine: no memory for a drain buffer")

    receiver = _unfinished_receiver(lambda: None)
    receiver.engine = SimpleNamespace(name="gloo", _landed=True, device="cpu", _allocate=allocate)
    receiver.plan = SimpleNamespace(bucket_bytes=64, tensors=[])
    receiver._drain_aside()


def test_an_answer_lost_with_its_link_is_not_raised_when_the_log_sink_fails(broken_log: None) -> None:
    def control() -> Any:
        raise EngineError("gloo engine: the rendezvous store is gone")

    BucketEngine._answer(SimpleNamespace(name="gloo", _control=control), "status/1", None)  # type: ignore[arg-type]


def test_shm_housekeeping_that_cannot_remove_a_file_never_raises_when_the_log_sink_fails(
        broken_log: None, tmp_path: Path) -> None:
    (tmp_path / "a_folder").mkdir()
    shm._unlink([str(tmp_path / "a_folder")])  # unlinking a folder is an OSError: logged, not raised
    shm._remove_orphans(tmp_path / "no_such_folder")  # listing it fails: the sweep is skipped


# 3. MemoryEngine as the real in-process engine


class _NoPause:
    """A rollout with load_weights and nothing else."""

    def __init__(self) -> None:
        self.loaded: list[str] = []

    def load_weights(self, named: Iterable[tuple[str, Any]]) -> None:
        self.loaded = [name for name, _ in named]


@pytest.mark.parametrize("engine", [None, MemoryEngine()], ids=["naive", "memory"])
def test_a_list_of_rollouts_each_gets_the_weights_and_the_version(engine: Any) -> None:
    lc = _naive(torch.nn.Linear(2, 2), engine)
    rollouts = [MemoryRollout(), MemoryRollout()]
    assert lc.sync_weights(rollouts) == 1
    for rollout in rollouts:
        assert sorted(rollout.weights) == ["bias", "weight"] and rollout.weights_version == 1
        assert rollout.calls == ["pause", "load_weights", "resume"] and not rollout.stale


@pytest.mark.parametrize("engine", [None, MemoryEngine()], ids=["naive", "memory"])
def test_a_rollout_without_pause_is_refused_before_the_move_naming_pause_and_left_untouched(engine: Any) -> None:
    lc = _naive(torch.nn.Linear(2, 2), engine)
    rollout = _NoPause()
    with pytest.raises(EngineError, match=r"has no pause / resume, which a sync calls"):
        lc.sync_weights(rollout)
    assert rollout.loaded == [] and lc.state is State.READY


@pytest.mark.parametrize("engine", [None, MemoryEngine()], ids=["naive", "memory"])
def test_a_rollout_without_load_weights_is_an_engine_error_naming_load_weights(engine: Any) -> None:
    lc = _naive(torch.nn.Linear(2, 2), engine)
    with pytest.raises(EngineError, match="has no load_weights"):
        lc.sync_weights(object())


def test_memory_engine_refuses_a_list_with_a_rollout_without_load_weights_before_pausing_any() -> None:
    lc = _naive(torch.nn.Linear(2, 2), MemoryEngine())
    first = MemoryRollout()
    with pytest.raises(EngineError, match=r"memory engine: rollout 1 \(.*\) has no load_weights"):
        lc.sync_weights([first, object()])
    assert first.calls == [] and first.weights == {}


@pytest.mark.parametrize("empty", [[], ()])
def test_memory_engine_refuses_an_empty_list_of_rollouts_as_the_naive_engine_does(empty: Any) -> None:
    with pytest.raises(EngineError, match="memory engine: no rollout to sync"):
        MemoryEngine().sync(iter([("w", torch.ones(2))]), empty, 1)


def test_a_model_that_is_no_module_leaves_every_extra_state_key_of_its_chunks_behind() -> None:
    """A MegatronModel's kind: its state dict names its chunks' TransformerEngine extra state."""
    class Chunked:
        def state_dict(self) -> dict[str, Any]:
            return {"chunk0.layer.weight": torch.ones(2), "chunk0.layer._extra_state": torch.zeros(3, dtype=torch.uint8),
                    "_extra_state": {"fp8": 1}}

    assert [name for name, _ in state_weights(Chunked())] == ["chunk0.layer.weight"]
