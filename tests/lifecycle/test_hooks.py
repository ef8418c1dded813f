"""Finally hooks: every temporary change a phase makes is undone, whatever the work did."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from lifecycle import DELETE, Lifecycle, LifecycleError, State
from lifecycle.testing import InjectedFailure


class Config:
    def __init__(self) -> None:
        self.hidden_size = 64
        self.init_method = lambda: None
        self.flag = False


def _in_phase(lc: Lifecycle, work) -> None:  # type: ignore[no-untyped-def]
    lc.checkpointer.probe = work  # type: ignore[attr-defined]
    lc.save(1)


def test_temporarily_sets_now_and_restores_after_a_successful_phase(lc: Lifecycle) -> None:
    cfg = Config()
    lc.init_load()
    seen = {}

    def work() -> None:
        lc.temporarily(cfg, hidden_size=128, flag=True)
        seen.update(hidden=cfg.hidden_size, flag=cfg.flag)

    _in_phase(lc, work)
    assert seen == {"hidden": 128, "flag": True}
    assert (cfg.hidden_size, cfg.flag) == (64, False)


def test_temporarily_deletes_an_attribute_and_puts_it_back_even_when_the_work_raises(lc: Lifecycle) -> None:
    cfg = Config()
    original = cfg.init_method
    lc.init_load()

    def work() -> None:
        lc.temporarily(cfg, init_method=DELETE)
        assert not hasattr(cfg, "init_method")
        raise InjectedFailure("json write failed")

    with pytest.raises(InjectedFailure):
        _in_phase(lc, work)
    assert cfg.init_method is original
    assert lc.state is State.FAILED


def test_an_attribute_that_did_not_exist_is_removed_again(lc: Lifecycle) -> None:
    cfg = Config()
    lc.init_load()
    _in_phase(lc, lambda: lc.temporarily(cfg, brand_new=1))
    assert not hasattr(cfg, "brand_new")


def test_temporarily_as_a_context_manager_restores_at_block_end(lc: Lifecycle) -> None:
    cfg = Config()
    lc.init_load()
    inside_after_block = {}

    def work() -> None:
        with lc.temporarily(cfg, hidden_size=1):
            assert cfg.hidden_size == 1
        inside_after_block["hidden"] = cfg.hidden_size

    _in_phase(lc, work)
    assert inside_after_block == {"hidden": 64} and cfg.hidden_size == 64


def test_undos_run_last_in_first_out(lc: Lifecycle) -> None:
    order: list[int] = []
    cfg = Config()
    lc.init_load()

    def work() -> None:
        lc.on_exit(lambda: order.append(1))
        lc.temporarily(cfg, hidden_size=1)
        lc.temporarily(cfg, hidden_size=2)
        lc.on_exit(lambda: order.append(3))

    _in_phase(lc, work)
    assert order == [3, 1]
    assert cfg.hidden_size == 64


def test_a_failing_undo_is_logged_the_others_run_and_the_original_error_wins(lc: Lifecycle) -> None:
    cfg = Config()
    ran: list[str] = []
    lc.init_load()

    def bad_undo() -> None:
        raise OSError("undo broke")

    def work() -> None:
        lc.on_exit(lambda: ran.append("first"))
        lc.on_exit(bad_undo)
        lc.temporarily(cfg, hidden_size=3)
        raise InjectedFailure("original")

    with capture_logs() as logs, pytest.raises(InjectedFailure, match="original"):
        _in_phase(lc, work)
    assert ran == ["first"] and cfg.hidden_size == 64
    failed = [e for e in logs if e["event"] == "lifecycle.undo_failed"]
    assert len(failed) == 1 and "undo broke" in failed[0]["error"] and failed[0]["trigger"] == "save"
    assert lc.state is State.FAILED


def test_a_failing_undo_after_successful_work_fails_the_phase(lc: Lifecycle) -> None:
    lc.init_load()

    def bad_undo() -> None:
        raise OSError("cannot restore")

    with pytest.raises(LifecycleError, match="undo") as info:
        _in_phase(lc, lambda: lc.on_exit(bad_undo))
    assert isinstance(info.value.__cause__, OSError)
    assert lc.state is State.FAILED
    assert lc.history[-1].ok is False


def test_undos_run_before_the_state_leaves_the_phase(lc: Lifecycle) -> None:
    states: list[State] = []
    lc.init_load()
    _in_phase(lc, lambda: lc.on_exit(lambda: states.append(lc.state)))
    assert states == [State.SAVING]


@pytest.mark.parametrize("call", ["temporarily", "on_exit"])
def test_hooks_outside_a_phase_raise_a_clear_error(lc: Lifecycle, call: str) -> None:
    lc.init_load()
    with pytest.raises(LifecycleError, match=f"{call}\\(\\) needs a running phase.*state is READY"):
        if call == "temporarily":
            lc.temporarily(Config(), hidden_size=1)
        else:
            lc.on_exit(lambda: None)


def test_a_failed_temporarily_call_leaves_nothing_changed(lc: Lifecycle) -> None:
    class Frozen:
        __slots__ = ("a",)

        def __init__(self) -> None:
            self.a = 1

    obj = Frozen()
    lc.init_load()

    def work() -> None:
        lc.temporarily(obj, a=2, not_a_slot=3)

    with pytest.raises(AttributeError):
        _in_phase(lc, work)
    assert obj.a == 1


def test_sync_puts_the_model_in_eval_mode_and_back(lc: Lifecycle) -> None:
    from lifecycle.testing import MemoryRollout

    modes: list[bool] = []
    lc.init_load()
    lc.parts.model.train()
    lc.engine.probe = lambda: modes.append(lc.parts.model.training)  # type: ignore[attr-defined]
    lc.sync_weights(MemoryRollout())
    assert modes == [False] and lc.parts.model.training is True


def test_module_level_temporarily_joins_the_running_phase_and_is_undone_when_the_work_raises(
    lc: Lifecycle,
) -> None:
    from lifecycle.phase import temporarily

    cfg = Config()
    lc.init_load()

    def work() -> None:
        temporarily(cfg, hidden_size=7)
        raise InjectedFailure("inside a backend")

    with pytest.raises(InjectedFailure):
        _in_phase(lc, work)
    assert cfg.hidden_size == 64
    assert lc.state is State.FAILED


def test_module_level_temporarily_outside_a_phase_restores_at_the_end_of_its_with_block() -> None:
    from lifecycle.phase import temporarily

    cfg = Config()
    with pytest.raises(InjectedFailure), temporarily(cfg, flag=True, init_method=DELETE):
        assert cfg.flag and not hasattr(cfg, "init_method")
        raise InjectedFailure("converter")
    assert cfg.flag is False and callable(cfg.init_method)
