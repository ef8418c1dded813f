"""Ctrl-C while a phase moves the machine in or out of its working state. CPython runs a signal
handler where a Python function is called (and after a call into C returns), so an interrupt can
land between any two of those steps. Each test raises `KeyboardInterrupt` once, deterministically,
at one such call (or return) through `sys.settrace`, and checks that the machine is not left in
a working state, that the trigger left one record, and that a label says what is held."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from types import FrameType
from typing import Any

import pytest

from lifecycle import State
from lifecycle.machine import DriverState
from lifecycle.machine import RolloutState as R
from lifecycle.phase import Observer, Phase
from lifecycle.ray.controller import Controller
from lifecycle.ray.policy import FailureKind, FailurePolicy, WorkerFailed
from lifecycle.rollout import RolloutWeights
from lifecycle.watchdog import Watchdog
from tests.lifecycle.probes import make_lifecycle


@contextmanager
def interrupt_once(event: str, function: str, **where: Any) -> Iterator[list[bool]]:
    """Raise `KeyboardInterrupt` at the first `event` ("call" or "return") of a function named
    `function` whose locals hold `where`; the list it yields holds True once it did."""
    fired: list[bool] = []

    def tracer(frame: FrameType, what: str, arg: object) -> Callable[..., object] | None:
        if fired or frame.f_code.co_name != function:
            return None
        if what == event and all(frame.f_locals.get(k) == v for k, v in where.items()):
            fired.append(True)
            raise KeyboardInterrupt
        return tracer

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield fired
    finally:
        sys.settrace(old)


def _saving_lifecycle() -> tuple[Any, Watchdog]:
    watchdog = Watchdog()
    lc = make_lifecycle(config={"watchdog": {"save_s": 1000.0}}, watchdog=watchdog)
    lc.init_load()
    return lc, watchdog


def _settled(lc: Any, watchdog: Watchdog) -> None:
    """Nothing runs: no working state, no phase, no watched budget, and the next triggers run."""
    assert not lc.state.working and lc._phase is None and watchdog.watching == 0
    if lc.state is State.FAILED:
        lc.resume()
    lc.save(7)
    lc.close()
    assert lc.state is State.CLOSED


BEGIN_POINTS_NOTHING_MOVED = [
    ("call", "_move", {"trigger": "save"}),
    ("call", "_move_locked", {"trigger": "save"}),
    ("call", "_moved", {"dst": State.SAVING}),
    ("return", "_moved", {"dst": State.SAVING}),
]


@pytest.mark.parametrize(("event", "function", "where"), BEGIN_POINTS_NOTHING_MOVED,
                         ids=[f"{e}-{f}" for e, f, _ in BEGIN_POINTS_NOTHING_MOVED])
def test_ctrl_c_before_the_begin_move_finished_changes_nothing_and_leaves_no_record(
        event: str, function: str, where: dict[str, Any]) -> None:
    lc, watchdog = _saving_lifecycle()
    before = lc.history
    with interrupt_once(event, function, **where) as fired, pytest.raises(KeyboardInterrupt):
        lc.save(1)
    assert fired and lc.state is State.READY and lc.history == before
    _settled(lc, watchdog)


BEGIN_POINTS_MOVED = [
    ("return", "_move_locked", {"trigger": "save"}),  # the state moved, the lock is being let go
    ("return", "_move", {"trigger": "save"}),  # the lock is let go, the move is not yet the phase's
    ("call", "watch", {}),
    ("call", "_keep_backstop", {}),  # the budget is stored, its thread not started
    ("call", "_tell", {"trigger": "save"}),
]


@pytest.mark.parametrize(("event", "function", "where"), BEGIN_POINTS_MOVED,
                         ids=[f"{e}-{f}" for e, f, _ in BEGIN_POINTS_MOVED])
def test_ctrl_c_once_the_begin_move_changed_the_state_fails_the_phase_with_one_record_and_no_watched_budget(
        event: str, function: str, where: dict[str, Any]) -> None:
    """The machine stayed in SAVING for good (save, resume and close refused, "none until the
    running phase ends"), and an interrupt inside `watch` left the budget reported overdue forever."""
    lc, watchdog = _saving_lifecycle()
    with interrupt_once(event, function, **where) as fired, pytest.raises(KeyboardInterrupt):
        lc.save(1)
    assert fired and lc.state is State.FAILED
    assert [(r.trigger, r.ok, r.dst) for r in lc.history] == [("init_load", True, State.READY),
                                                             ("save", False, State.FAILED)]
    assert "KeyboardInterrupt" in str(lc.history[-1].error)
    _settled(lc, watchdog)


END_POINTS = [  # where, and whether the machine had left SAVING for READY when the interrupt came
    ("call", "run_undos", {}, False),
    ("call", "_outcome", {}, False),
    ("call", "_ended", {}, False),
    ("call", "_unwatch", {}, False),
    ("call", "_reset", {}, False),
    ("call", "_move", {"trigger": "done"}, False),
    ("call", "_moved", {"dst": State.READY}, False),
    ("return", "_moved", {"dst": State.READY}, False),
    ("return", "_move_locked", {"trigger": "done"}, True),
    ("return", "_move", {"trigger": "done"}, True),
    ("call", "_tell", {"trigger": "done"}, True),
    ("call", "_record", {}, True),
]


@pytest.mark.parametrize(("event", "function", "where", "moved"), END_POINTS,
                         ids=[f"{e}-{f}" for e, f, _, _ in END_POINTS])
def test_ctrl_c_anywhere_in_a_phases_end_leaves_the_working_state_with_one_record_saying_how_it_ended(
        event: str, function: str, where: dict[str, Any], moved: bool) -> None:
    """Before the move out, the interrupt fails the phase (FAILED); after it, the phase stays done
    (READY) and the interrupt is raised once the record is made. Either way the undo ran, one
    record says how the phase ended, and no budget stays watched."""
    lc, watchdog = _saving_lifecycle()
    undone: list[int] = []
    with ExitStack() as stack, pytest.raises(KeyboardInterrupt):
        with Phase(lc, "save", 1):
            lc.on_exit(lambda: undone.append(1))
            fired = stack.enter_context(interrupt_once(event, function, **where))
    assert fired and undone == [1]
    assert lc.state is (State.READY if moved else State.FAILED)
    assert [(r.trigger, r.ok, r.dst) for r in lc.history[1:]] == [("save", moved, lc.state)]
    _settled(lc, watchdog)


class _Moves(Observer):
    """Every move an observer hears, as (src, dst) pairs."""

    def __init__(self) -> None:
        self.heard: list[tuple[Any, Any]] = []

    def on_state_change(self, lc: Any, src: Any, dst: Any, trigger: str) -> None:
        self.heard.append((src, dst))


MOVE_POINTS = [(e, f, w, True) for e, f, w in BEGIN_POINTS_MOVED] + [(e, f, w, False) for e, f, w, _ in END_POINTS]


@pytest.mark.parametrize(("event", "function", "where", "begin"), MOVE_POINTS,
                         ids=[f"{'begin' if b else 'end'}-{e}-{f}" for e, f, _, b in MOVE_POINTS])
def test_ctrl_c_as_a_phase_moves_leaves_observers_the_chain_of_moves_from_ready_to_the_state_it_ended_in(
        event: str, function: str, where: dict[str, Any], begin: bool) -> None:
    """Observers heard the move out without the move in when Ctrl-C landed between the begin
    move and its telling, and missed the move out when it landed as that one was told."""
    lc, watchdog = _saving_lifecycle()
    moves = _Moves()
    lc.add_observer(moves)
    with ExitStack() as stack, pytest.raises(KeyboardInterrupt):
        if begin:
            stack.enter_context(interrupt_once(event, function, **where))
        with Phase(lc, "save", 1):
            lc.on_exit(lambda: None)
            stack.enter_context(interrupt_once(event, function, **where))
    assert moves.heard == [(State.READY, State.SAVING), (State.SAVING, lc.state)]
    _settled(lc, watchdog)


def test_ctrl_c_at_the_end_of_a_receive_fails_it_stale_so_no_label_names_weights_it_does_not_serve() -> None:
    """The machine reached SERVING but its hook never took the landed version: SERVING v1 while the
    model held v2, generations recorded as v1, and a record saying the receive ended ok in RECEIVING."""
    model = {"v": 0}
    rw = RolloutWeights(lambda named: model.update(named))
    with rw.receiving() as landed:
        rw.load_weights([("v", 1)])
        landed(1)
    with ExitStack() as stack, pytest.raises(KeyboardInterrupt):
        with rw.receiving() as landed:
            rw.load_weights([("v", 2)])
            landed(2)
            stack.enter_context(interrupt_once("call", "_moved", dst=R.SERVING))
    record = rw.history[-1]
    assert (rw.state, record.trigger, record.ok, record.dst) == (R.STALE, "receive_weights", False, R.STALE)
    assert len(rw.history) == 2
    with rw.receiving() as landed:
        rw.load_weights([("v", 3)])
        landed(3)
    assert (rw.state, rw.weights_version, model["v"]) == (R.SERVING, 3, 3)


def test_ctrl_c_as_a_receive_finished_moving_leaves_it_serving_the_version_it_landed() -> None:
    model = {"v": 0}
    rw = RolloutWeights(lambda named: model.update(named))
    with ExitStack() as stack, pytest.raises(KeyboardInterrupt):
        with rw.receiving() as landed:
            rw.load_weights([("v", 2)])
            landed(2)
            stack.enter_context(interrupt_once("return", "_move", trigger="done"))
    record = rw.history[-1]
    assert (rw.state, rw.weights_version, record.ok, record.dst) == (R.SERVING, 2, True, R.SERVING)


class _Job(Controller):
    """The driver over a fake worker group (as in tests/ray): step 3 dies once, so it recovers."""

    def _start_group(self) -> int:
        return 0

    def _run_step(self, step: int) -> None:
        if step == 3 and self.incarnation == 0:
            raise WorkerFailed("actor", "train", step, RuntimeError("died"), FailureKind.DIED)

    def _close_group(self) -> None:
        pass

    def _stop_group(self) -> None:
        pass


DRIVER_POINTS = [("return", "_move", {"trigger": "recover"}), ("call", "_moved", {"src": DriverState.RECOVERING}),
                 ("return", "_move_locked", {"src": DriverState.RECOVERING})]


@pytest.mark.parametrize(("event", "function", "where"), DRIVER_POINTS,
                         ids=[f"{e}-{f}-{w}" for e, f, w in DRIVER_POINTS])
def test_ctrl_c_as_the_driver_moves_in_or_out_of_recovering_ends_it_errored_with_no_recover_record_saying_ok(
        event: str, function: str, where: dict[str, Any]) -> None:
    """The driver stayed RECOVERING, its history saying the recover succeeded, though the README
    says it always ends FINISHED or ERRORED."""
    job = _Job(FailurePolicy(max_failures=2))
    with interrupt_once(event, function, **where) as fired, pytest.raises(KeyboardInterrupt):
        job._control(5)
    assert fired and job.state is DriverState.ERRORED
    recovers = [r for r in job.history if r.trigger == "recover"]
    assert len(recovers) == 1 and recovers[0].dst is (DriverState.RUNNING if recovers[0].ok else DriverState.ERRORED)


class _Figured(Phase):
    def _begun(self) -> None:
        raise KeyboardInterrupt  # as Ctrl-C reading a figure once the machine is in the working state


def test_an_interrupt_in_a_phase_subclasss_own_begin_fails_the_phase_instead_of_leaving_it_running() -> None:
    lc, watchdog = _saving_lifecycle()
    with pytest.raises(KeyboardInterrupt):
        with _Figured(lc, "save", 1):
            pytest.fail("the work ran")
    assert lc.state is State.FAILED and [(r.trigger, r.ok) for r in lc.history[1:]] == [("save", False)]
    _settled(lc, watchdog)


def test_ctrl_c_as_generate_reads_its_version_figure_fails_the_phase_and_leaves_the_rollout_serving() -> None:
    """`_Generation` read its figure after `Phase.__enter__` returned: an interrupt there left the
    rollout GENERATING for good."""
    rw = RolloutWeights(lambda named: None)
    with rw.receiving() as landed:
        rw.load_weights([("v", 1)])
        landed(1)
    with interrupt_once("call", "_begun") as fired, pytest.raises(KeyboardInterrupt):
        with rw.generating():
            pytest.fail("the work ran")
    assert fired and rw.state is R.SERVING and (rw.history[-1].trigger, rw.history[-1].ok) == ("generate", False)
    with rw.generating():
        pass
    assert rw.state is R.SERVING


def test_ctrl_c_before_the_drivers_finish_move_gives_up_and_ends_it_errored() -> None:
    """The finish phase sat outside the `try` that gives up: an interrupt before its move left the
    driver RUNNING."""
    job = _Job(FailurePolicy(max_failures=2))
    with interrupt_once("call", "_move", trigger="finish") as fired, pytest.raises(KeyboardInterrupt):
        job._control(5)
    assert fired and job.state is DriverState.ERRORED and job.history[-1].trigger == "give_up"


def test_a_trigger_a_signal_handler_fires_inside_the_begin_move_fails_the_outer_phase_instead_of_stranding_it() -> None:
    """The nested phase cleared the machine's shared record of the move being made, so the outer
    phase, whose move had changed the state, took the handler's refusal for "nothing changed" and
    left the machine SAVING with no phase, refusing every trigger after."""
    lc, watchdog = _saving_lifecycle()
    fired: list[bool] = []

    def tracer(frame: FrameType, what: str, arg: object) -> Callable[..., object] | None:
        if frame.f_code.co_name == "_move_locked" and what == "return" and frame.f_locals.get("trigger") == "save" \
                and not fired:
            fired.append(True)
            lc.save(2)  # as a SIGTERM handler saving would: refused, the move is in progress
        return tracer if frame.f_code.co_name == "_move_locked" else None

    sys.settrace(tracer)
    try:
        with pytest.raises(Exception, match="fired on the thread that is moving the machine"):
            lc.save(1)
    finally:
        sys.settrace(None)
    assert fired and lc.state is State.FAILED and lc._phase is None
    assert [(r.trigger, r.ok) for r in lc.history[1:]] == [("save", False)]
    _settled(lc, watchdog)


class _AlwaysInterrupting(Observer):
    """An observer that raises KeyboardInterrupt at every move it hears, as often as it is told."""

    def __init__(self) -> None:
        self.told = 0

    def on_state_change(self, lc: Any, src: Any, dst: Any, trigger: str) -> None:
        self.told += 1
        raise KeyboardInterrupt


def test_an_observer_interrupting_every_telling_is_told_each_move_at_most_twice_and_the_phase_still_ends_failed() -> None:
    lc, watchdog = _saving_lifecycle()
    observer = _AlwaysInterrupting()
    lc.add_observer(observer)
    with pytest.raises(KeyboardInterrupt):
        lc.save(1)
    assert lc.state is State.FAILED and observer.told <= 4
    assert [(r.trigger, r.ok) for r in lc.history[1:]] == [("save", False)]
    lc.remove_observer(observer)
    _settled(lc, watchdog)
