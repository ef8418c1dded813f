"""Misuse of the machine that must be refused or survived without harm: a trigger fired again
on the thread that is moving the machine (a signal handler), a phase entered twice or never,
plugins and observers of the wrong shape, a sync that cannot be done, and scoped changes of
attributes a class owns."""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from lifecycle import DELETE, ConfigError, Lifecycle, LifecycleError, Observer, State
from lifecycle.errors import EngineError, InvalidTransition
from lifecycle.testing import MemoryCheckpointer, MemoryRollout
from lifecycle.types import SaveInfo


def _lifecycle(config: Any = None, **kwargs: Any) -> Lifecycle:
    kwargs.setdefault("model", torch.nn.Linear(2, 2))
    kwargs.setdefault("checkpointer", MemoryCheckpointer())
    return Lifecycle(config, **kwargs)


def _naive(**kwargs: Any) -> Lifecycle:
    return _lifecycle({"engine": {"backend": "naive"}}, **kwargs)


# 1. a trigger fired on the thread that holds the machine's lock


def test_trigger_fired_inside_the_move_on_the_same_thread_is_refused_instead_of_deadlocking() -> None:
    lc = _lifecycle()
    lc.init_load()
    outcome: list[BaseException | None] = []
    moved = lc._moved

    def handler_lands_here(src: Any, dst: Any) -> None:  # where a SIGUSR1 handler can run lc.save()
        moved(src, dst)
        if dst is State.TRAINING and not outcome:
            try:
                lc.save()
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - inspected below
                outcome.append(exc)

    lc._moved = handler_lands_here  # type: ignore[method-assign]

    def steps() -> None:
        with lc.train_step(1):
            pass

    worker = threading.Thread(target=steps, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "the nested trigger waited forever on the machine's own lock"
    assert len(outcome) == 1 and isinstance(outcome[0], InvalidTransition)
    assert "'save'" in str(outcome[0]) and "state TRAINING" in str(outcome[0])
    assert lc.state is State.READY and lc.progress.step == 1


def test_trigger_from_another_thread_still_waits_for_the_move_and_then_runs() -> None:
    lc = _lifecycle()
    lc.init_load()
    with lc._lock:
        other = threading.Thread(target=lc.save, args=(0,), daemon=True)
        other.start()
        other.join(timeout=0.3)
        assert other.is_alive()  # waiting, not refused
    other.join(timeout=10)
    assert not other.is_alive() and lc.history[-1].trigger == "save" and lc.history[-1].ok


# 2. sync_weights puts each module's own mode back


def test_sync_weights_restores_each_submodules_own_training_flag() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.BatchNorm1d(4))
    model.train()
    model[1].eval()
    model[2].eval()
    before = {name: module.training for name, module in model.named_modules()}
    lc = _naive(model=model)
    lc.init_load()
    lc.sync_weights(MemoryRollout())
    assert {name: module.training for name, module in model.named_modules()} == before


# 3. a rollout that writes into the trainer's tensors


class _ScalingRollout(MemoryRollout):
    def load_weights(self, named_tensors: Any) -> None:
        for name, tensor in named_tensors:
            self.weights[name] = tensor.mul_(0.5).clone()


def test_naive_sync_raises_engine_error_naming_the_tensor_a_rollout_wrote_into_the_trainers_weights() -> None:
    lc = _naive()
    lc.init_load()
    second = MemoryRollout()
    with pytest.raises(EngineError, match="weight"):
        lc.sync_weights([_ScalingRollout(), second])
    assert second.weights_version == 0  # the next rollout never got the changed weights


def test_naive_sync_whose_rollout_copies_the_weights_still_succeeds() -> None:
    lc = _naive()
    lc.init_load()
    assert lc.sync_weights([MemoryRollout(), MemoryRollout()]) == 1


# 4. a sync that cannot be done is refused before the machine moves


def test_sync_weights_to_a_rollout_object_with_a_process_crossing_engine_is_refused_before_the_move() -> None:
    lc = _lifecycle({"engine": {"backend": "gloo"}})
    lc.init_load()
    with pytest.raises(EngineError, match="Rendezvous"):
        lc.sync_weights(MemoryRollout())
    assert lc.state is State.READY and [r.trigger for r in lc.history] == ["init_load"]


@pytest.mark.parametrize("target", [[], ()])
def test_sync_weights_to_an_empty_list_of_rollouts_is_refused_before_the_move(target: Any) -> None:
    lc = _naive()
    lc.init_load()
    with pytest.raises(EngineError, match="no rollout to sync"):
        lc.sync_weights(target)
    assert lc.state is State.READY and lc.progress.weights_version == 0 and len(lc.history) == 1


def test_sync_weights_to_a_rollout_without_load_weights_is_refused_before_the_move() -> None:
    lc = _naive()
    lc.init_load()
    with pytest.raises(EngineError, match="load_weights"):
        lc.sync_weights([MemoryRollout(), object()])
    assert lc.state is State.READY and len(lc.history) == 1


def test_sync_weights_without_a_model_is_refused_before_the_move() -> None:
    lc = _lifecycle(model=None)
    lc.init_load()
    with pytest.raises(LifecycleError, match="needs a model"):
        lc.sync_weights(MemoryRollout())
    assert lc.state is State.READY and len(lc.history) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="nccl can run here")
def test_lifecycle_naming_an_engine_that_cannot_run_here_is_refused_at_construction() -> None:
    with pytest.raises(ConfigError, match="engine.backend"):
        _lifecycle({"engine": {"backend": "nccl"}})


# 5. a train step counts as trained only once it moved; an unentered one says so


def test_refused_train_step_does_not_count_as_trained_for_resume_after_a_failed_init_load() -> None:
    ckpt = MemoryCheckpointer()
    ckpt.fail_next("load_initial")
    lc = _lifecycle(checkpointer=ckpt)
    with pytest.raises(InvalidTransition):
        with lc.train_step(1):
            pass
    with pytest.raises(Exception):
        lc.init_load()
    assert lc.state is State.FAILED
    assert lc.resume() is None and lc.state is State.READY  # a fresh start, as without the refused step


def test_train_step_never_entered_logs_a_warning_naming_the_trigger_and_step() -> None:
    lc = _lifecycle()
    lc.init_load()
    with capture_logs() as logs:
        lc.train_step(7)
        gc.collect()
    warned = [entry for entry in logs if entry["event"] == "lifecycle.phase_never_entered"]
    assert len(warned) == 1 and warned[0]["trigger"] == "train_step" and warned[0]["step"] == 7
    assert warned[0]["log_level"] == "warning"


def test_train_step_entered_logs_no_never_entered_warning() -> None:
    lc = _lifecycle()
    lc.init_load()
    with capture_logs() as logs:
        with lc.train_step(1):
            pass
        gc.collect()
    assert not [entry for entry in logs if entry["event"] == "lifecycle.phase_never_entered"]


# 6. a phase is entered once


def test_entering_a_running_phase_again_is_refused_and_leaves_its_bookkeeping_intact() -> None:
    lc = _lifecycle()
    lc.init_load()
    phase = lc.train_step(1)
    with phase:
        started = phase.started
        with pytest.raises(InvalidTransition, match="train_step"):
            with phase:
                pass
        assert phase.started == started and lc._phase is phase and lc.state is State.TRAINING
    assert lc.state is State.READY and [r.ok for r in lc.history] == [True, True]


def test_entering_an_ended_phase_again_is_refused_and_its_record_keeps_its_figures() -> None:
    lc = _lifecycle()
    lc.init_load()
    phase = lc.train_step(1)
    with phase:
        phase.figures["loss"] = 1.0
    with pytest.raises(InvalidTransition, match="train_step"):
        with phase:
            phase.figures["loss"] = 0.5
    assert lc.state is State.READY and len(lc.history) == 2 and lc.history[-1].figures == {"loss": 1.0}


# 7. what plugins return is checked


class _SilentLoad(MemoryCheckpointer):
    def load_initial(self, parts: Any) -> Any:
        super().load_initial(parts)


class _FiguresSave(MemoryCheckpointer):
    def save(self, step: int, parts: Any, progress: Any) -> Any:
        super().save(step, parts, progress)
        return {"step": step}


class _NoFiguresEngine:
    def sync(self, named: Any, target: Any, version: int) -> Any:
        return None


def test_load_initial_returning_no_mapping_raises_lifecycle_error_naming_the_method_and_type() -> None:
    lc = _lifecycle(checkpointer=_SilentLoad())
    with pytest.raises(LifecycleError, match=r"load_initial\(\).*NoneType"):
        lc.init_load()


def test_save_returning_no_save_info_raises_lifecycle_error_naming_the_method_and_type() -> None:
    lc = _lifecycle(checkpointer=_FiguresSave())
    lc.init_load()
    with pytest.raises(LifecycleError, match=r"save\(\).*dict"):
        lc.save(1)


def test_engine_sync_returning_no_mapping_raises_lifecycle_error_naming_the_method_and_type() -> None:
    lc = _lifecycle(engine=_NoFiguresEngine())
    lc.init_load()
    with pytest.raises(LifecycleError, match=r"sync\(\).*NoneType"):
        lc.sync_weights(MemoryRollout())


def test_plugins_returning_what_the_protocols_say_pass_the_checks() -> None:
    lc = _naive()
    lc.init_load()
    assert isinstance(lc.save(1), SaveInfo)
    assert lc.sync_weights([MemoryRollout()]) == 1 and lc.state is State.READY


# 8. observers are checked when given


def test_observer_that_is_a_plain_function_is_refused_at_construction() -> None:
    def on_transition(lc: Any, record: Any) -> None: ...

    with pytest.raises(ConfigError, match="observers"):
        _lifecycle(observers=[on_transition])


def test_add_observer_refuses_an_object_without_the_observer_hooks() -> None:
    lc = _lifecycle()
    with pytest.raises(ConfigError, match="observer"):
        lc.add_observer("not an observer")  # type: ignore[arg-type]
    assert lc.observers == []


def test_observers_given_as_a_generator_are_checked_and_kept() -> None:
    observer = Observer()
    lc = _lifecycle(observers=(o for o in [observer]))
    assert lc.observers == [observer]


# 9. temporarily and class attributes


class _Cfg:
    use_cache = True


def test_temporarily_restoring_a_class_attribute_leaves_no_instance_attribute() -> None:
    cfg = _Cfg()
    lc = _lifecycle()
    lc.init_load()
    with lc.train_step(1):
        lc.temporarily(cfg, use_cache=False)
        assert cfg.use_cache is False
    assert vars(cfg) == {} and cfg.use_cache is True


def test_temporarily_deleting_a_class_attribute_is_refused_with_lifecycle_error_and_changes_nothing() -> None:
    cfg = _Cfg()
    lc = _lifecycle()
    lc.init_load()
    with pytest.raises(LifecycleError, match="use_cache"):
        with lc.train_step(1):
            lc.temporarily(cfg, use_cache=DELETE)
    assert vars(cfg) == {}


def test_temporarily_deleting_and_restoring_an_instance_attribute_still_works() -> None:
    cfg = _Cfg()
    cfg.use_cache = False
    lc = _lifecycle()
    lc.init_load()
    with lc.train_step(1):
        lc.temporarily(cfg, use_cache=DELETE)
        assert cfg.use_cache is True  # the class's shows through
    assert vars(cfg) == {"use_cache": False}


def test_temporarily_setting_a_property_restores_through_its_setter() -> None:
    class Box:
        def __init__(self) -> None:
            self._value = 1

        @property
        def value(self) -> int:
            return self._value

        @value.setter
        def value(self, new: int) -> None:
            self._value = new

    box = Box()
    lc = _lifecycle()
    lc.init_load()
    with lc.train_step(1):
        lc.temporarily(box, value=5)
        assert box.value == 5
    assert box.value == 1

