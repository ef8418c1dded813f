"""The rollout's weights machine: its table is a contract, pinned pair by pair, and the version
changes only on the edge into SERVING."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable
from unittest.mock import MagicMock

import pytest
import torch
from structlog.testing import capture_logs

from lifecycle import InvalidTransition
from lifecycle.errors import ConfigError, EngineError, LifecycleError
from lifecycle.machine import ROLLOUT, ROLLOUT_TABLE, RolloutState
from lifecycle.phase import Observer, TransitionRecord
from lifecycle.rollout import RolloutWeights
from lifecycle.stateful import Stateful
from lifecycle.testing import MemoryRollout
from lifecycle.types import updating

R = RolloutState
CONTRACT = {
    # trigger: (sources, working state, state after success, state after failure)
    "receive_weights": ({R.EMPTY, R.SERVING, R.STALE}, R.RECEIVING, R.SERVING, R.STALE),
    "generate": ({R.SERVING}, R.GENERATING, R.SERVING, R.SERVING),
    "mark_stale": ({R.EMPTY, R.SERVING, R.STALE}, None, R.STALE, None),
    "close": ({R.EMPTY, R.SERVING, R.STALE}, None, R.CLOSED, None),
}
STABLE = [R.EMPTY, R.SERVING, R.STALE, R.CLOSED]
WORKING = {R.RECEIVING: "receive_weights", R.GENERATING: "generate"}


class Model:
    """A rollout's model: a dict of tensors, written one by one as they land."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def load(self, named: Any) -> None:
        for name, tensor in named:
            self.weights[name] = tensor.clone()


class Visited(Observer):
    """The states a machine visits, with the version held at each."""

    def __init__(self) -> None:
        self.seen: list[tuple[RolloutState, int]] = []

    def on_state_change(self, lc: Stateful[Any], src: Any, dst: Any, trigger: str) -> None:
        assert isinstance(lc, RolloutWeights)
        if not self.seen:
            self.seen.append((src, lc.weights_version))
        self.seen.append((dst, lc.weights_version))


def weights(**kwargs: Any) -> tuple[RolloutWeights, Model]:
    model = Model()
    return RolloutWeights(model.load, **kwargs), model


def receive(w: RolloutWeights, version: int, tensors: int = 2, fail_after: int | None = None) -> None:
    """One update through `types.updating`, as `backends.engines.receive_into` runs it."""
    with updating(w) as landed:
        w.load_weights((f"t{i}", torch.full((2,), float(version))) for i in range(tensors))
        if fail_after is not None:
            raise EngineError(f"peer lost after {fail_after} tensors")
        landed(version)


def drive_to(state: RolloutState, w: RolloutWeights) -> None:
    if state is R.SERVING:
        receive(w, 1)
    elif state is R.STALE:
        with pytest.raises(EngineError):
            receive(w, 1, fail_after=1)
    elif state is R.CLOSED:
        w.close()
    assert w.state is state


def fire(w: RolloutWeights, trigger: str, work: Callable[[], None] = lambda: None) -> None:
    if trigger == "receive_weights":
        with w.receiving() as landed:
            work()
            landed(7)
    elif trigger == "generate":
        with w.generating(1):
            work()
    else:
        getattr(w, trigger)()


def test_table_in_code_is_the_contract() -> None:
    assert {row.trigger: (set(row.sources), row.working, row.done, row.failed) for row in ROLLOUT_TABLE} == CONTRACT
    assert set(STABLE) | set(WORKING) == set(RolloutState)
    assert ROLLOUT.terminal == {R.CLOSED} and [s for s in RolloutState if s.serves] == [R.SERVING]


@pytest.mark.parametrize("state", STABLE)
@pytest.mark.parametrize("trigger", list(CONTRACT))
def test_trigger_from_stable_state_reaches_the_table_state_or_is_refused(state: RolloutState, trigger: str) -> None:
    w, _ = weights()
    drive_to(state, w)
    before = w.weights_version
    sources, working, done, _ = CONTRACT[trigger]
    path = Visited()
    w.add_observer(path)
    if state in sources:
        fire(w, trigger)
        assert [s for s, _ in path.seen] == ([state, working, done] if working else [state, done])
        assert w.history[-1].trigger == trigger and w.history[-1].ok
    else:
        with pytest.raises(InvalidTransition) as info:
            fire(w, trigger)
        assert w.state is state and w.weights_version == before and path.seen == []
        assert info.value.state is state and info.value.trigger == trigger
        assert info.value.allowed == ROLLOUT.allowed(state) and state.name in str(info.value)


@pytest.mark.parametrize("working", list(WORKING))
@pytest.mark.parametrize("trigger", list(CONTRACT))
def test_no_trigger_fires_while_a_receive_or_a_generation_runs(working: RolloutState, trigger: str) -> None:
    w, _ = weights()
    drive_to(R.SERVING, w)
    refused: list[RolloutState] = []

    def probe() -> None:
        with pytest.raises(InvalidTransition, match=f"from state {working.name}"):
            fire(w, trigger)
        refused.append(w.state)

    fire(w, WORKING[working], probe)
    assert refused == [working] and w.state is R.SERVING


def test_a_receive_that_fails_mid_way_lands_in_stale_with_the_old_version_and_refuses_generation() -> None:
    w, model = weights()
    receive(w, 1)
    path = Visited()
    w.add_observer(path)
    with pytest.raises(EngineError, match="peer lost"):
        receive(w, 2, fail_after=1)
    assert w.state is R.STALE and w.stale and w.weights_version == 1
    assert torch.equal(model.weights["t0"], torch.full((2,), 2.0)), "the half that landed is in the model"
    assert path.seen == [(R.SERVING, 1), (R.RECEIVING, 1), (R.STALE, 1)]
    record = w.history[-1]
    assert (record.trigger, record.ok, record.path) == ("receive_weights", False, (R.SERVING, R.RECEIVING, R.STALE))
    assert "peer lost" in (record.error or "") and record.figures["version"] == 1
    with pytest.raises(InvalidTransition, match="cannot 'generate' from state STALE"):
        with w.generating(3):
            pass
    receive(w, 3)
    assert (w.state, w.weights_version, w.stale) == (R.SERVING, 3, False)


def test_the_version_changes_only_on_the_edge_into_serving() -> None:
    w, _ = weights()
    path = Visited()
    w.add_observer(path)
    receive(w, 4)
    with w.generating(1):
        pass
    w.mark_stale()
    receive(w, 5)
    changes = [(a, b) for (a, va), (b, vb) in zip(path.seen, path.seen[1:]) if va != vb]
    assert changes == [(R.RECEIVING, R.SERVING), (R.RECEIVING, R.SERVING)]
    assert [v for s, v in path.seen if s is R.SERVING] == [4, 4, 5]


def test_a_receive_that_ends_before_its_weights_landed_is_stale() -> None:
    w, _ = weights()
    with pytest.raises(EngineError, match="ended before its last tensor landed"):
        with w.receiving():
            pass
    assert w.state is R.STALE and w.weights_version == 0


def test_a_failed_generation_leaves_the_weights_serving() -> None:
    w, _ = weights()
    receive(w, 2)
    with pytest.raises(ZeroDivisionError):
        with w.generating(5):
            raise ZeroDivisionError("bad prompt")
    assert (w.state, w.weights_version) == (R.SERVING, 2)
    assert w.history[-1].path == (R.SERVING, R.GENERATING, R.SERVING) and w.history[-1].ok is False


def test_weights_land_only_inside_a_receive() -> None:
    w, _ = weights()
    with pytest.raises(LifecycleError, match="outside a receive"):
        w.load_weights([("t0", torch.zeros(1))])


def test_each_rollout_phase_logs_one_transition_record_and_a_phase_started() -> None:
    w, _ = weights(rank=2)
    with capture_logs() as logs:
        receive(w, 1)
        with w.generating(9):
            pass
    started = [r for r in logs if r["event"] == "lifecycle.phase_started"]
    records = [r for r in logs if r["event"] == "lifecycle.transition"]
    assert [(r["trigger"], r["state"], r["log_level"]) for r in started] == [
        ("receive_weights", "RECEIVING", "debug"), ("generate", "GENERATING", "debug")]
    assert [(r["trigger"], r["src"], r["dst"], r["role"], r["rank"], r["step"], r["version"]) for r in records] == [
        ("receive_weights", "EMPTY", "SERVING", "rollout", 2, None, 1),
        ("generate", "SERVING", "SERVING", "rollout", 2, 9, 1)]


def test_a_receive_past_its_budget_is_reported_to_the_machines_own_emitter_by_the_process_watchdog() -> None:
    reports: list[dict[str, Any]] = []
    w, _ = weights(budget={"receive_weights": 0.05}.get,
                   on_overdue=lambda event, **fields: reports.append({"event": event, **fields}))
    with w.receiving() as landed:
        deadline = time.monotonic() + 10
        while not reports and time.monotonic() < deadline:
            time.sleep(0.01)
        landed(1)
    [report] = reports[:1]
    assert (report["event"], report["trigger"], report["state"], report["role"]) == (
        "lifecycle.phase_overdue", "receive_weights", "RECEIVING", "rollout")
    assert w.state is R.SERVING


def test_a_version_going_backwards_is_taken_and_logged() -> None:
    w, _ = weights(rank=1)
    receive(w, 5)
    with capture_logs() as logs:
        receive(w, 2)
    assert (w.state, w.weights_version) == (R.SERVING, 2), "a resumed policy may send an older version"
    [warning] = [r for r in logs if r["event"] == "rollout.version_backwards"]
    assert (warning["log_level"], warning["old"], warning["new"], warning["rank"]) == ("warning", 5, 2, 1)
    with capture_logs() as logs:
        receive(w, 2)
        receive(w, 3)
    assert not [r for r in logs if r["event"] == "rollout.version_backwards"]


def test_only_the_receiving_thread_lands_its_update() -> None:
    w, _ = weights(rank=1)
    refused: list[BaseException] = []

    def land_from_elsewhere(landed: Callable[[int], None]) -> None:
        try:
            landed(42)
        except LifecycleError as exc:
            refused.append(exc)

    with w.receiving() as landed:
        other = threading.Thread(target=land_from_elsewhere, args=(landed,), name="intruder")
        other.start()
        other.join()
        landed(3)
    [error] = refused
    assert "rollout 1: landed(v42) from thread 'intruder' during another thread's receive" in str(error)
    assert (w.state, w.weights_version) == (R.SERVING, 3)


def test_a_generation_racing_a_receive_records_the_move_it_made_and_the_version_it_served() -> None:
    """The generation is asked for while a receive runs and moves once it has ended: its record
    starts where its own move started (SERVING), and names the version it generated from."""
    w, _ = weights()
    receive(w, 1)
    asked, ended, move = threading.Event(), threading.Event(), w._move
    records: list[TransitionRecord] = []

    def slow_move(trigger: str, made: Any = None) -> tuple[RolloutState, RolloutState]:
        if trigger == "generate":
            asked.set()
            ended.wait(10)
        return move(trigger, made)

    def generate() -> None:
        with w.generating(7):
            pass
        records.append(w.history[-1])

    w._move = slow_move  # type: ignore[method-assign]
    with w.receiving() as landed:
        generation = threading.Thread(target=generate)
        generation.start()
        asked.wait(10)
        landed(2)
    ended.set()
    generation.join(10)
    [record] = records
    assert (record.src, record.path, record.dst) == (R.SERVING, (R.SERVING, R.GENERATING, R.SERVING), R.SERVING)
    assert record.figures["version"] == 2


def test_a_record_names_the_state_its_own_move_reached_though_another_thread_moved_on() -> None:
    """`mark_stale` has no working state: its record's destination is where its move went (STALE),
    not where the machine is by the time the record is written (RECEIVING, another thread's)."""
    w, _ = weights()
    receive(w, 1)
    receiving, release = threading.Event(), threading.Event()

    def receive_meanwhile() -> None:
        with w.receiving() as landed:
            receiving.set()
            release.wait(10)
            landed(2)

    class MovesOn(Observer):
        def on_state_change(self, lc: Stateful[Any], src: Any, dst: Any, trigger: str) -> None:
            if trigger == "mark_stale":
                other.start()
                receiving.wait(10)

    other = threading.Thread(target=receive_meanwhile)
    w.add_observer(MovesOn())
    w.mark_stale()
    stale = w.history[-1]
    release.set()
    other.join(10)
    assert (stale.trigger, stale.src, stale.dst, stale.path) == ("mark_stale", R.SERVING, R.STALE,
                                                                  (R.SERVING, R.STALE))


def test_updating_brackets_a_stand_in_that_answers_every_attribute_as_a_rollout_target() -> None:
    rollout = MagicMock(weights_version=0, stale=True)
    with updating(rollout) as landed:
        landed(7)
    rollout.pause.assert_called_once_with()
    rollout.resume.assert_called_once_with()
    rollout.receiving.assert_not_called()
    assert (rollout.weights_version, rollout.stale) == (7, False)
    failing = MagicMock(weights_version=0, stale=False)
    with pytest.raises(EngineError):
        with updating(failing):
            raise EngineError("peer lost")
    failing.mark_stale.assert_called_once_with()
    failing.resume.assert_called_once_with()


def test_a_rollout_whose_mark_stale_raises_after_a_failed_update_says_both_and_is_still_resumed() -> None:
    broken = MagicMock(weights_version=0, stale=False)
    broken.mark_stale.side_effect = AttributeError("read-only")
    with pytest.raises(EngineError, match="a weight update failed \\(EngineError: peer lost\\) and the rollout's "
                                          "mark_stale raised AttributeError: read-only") as caught:
        with updating(broken):
            raise EngineError("peer lost")
    assert str(caught.value.__cause__) == "peer lost"
    broken.resume.assert_called_once_with()


def test_receive_into_drives_the_machine_and_a_plain_rollout_target_still_works() -> None:
    from backends.engines import CheckpointEngineRegistry, receive_into

    named = [("w", torch.arange(4.0))]
    for target in (weights()[0], MemoryRollout()):
        engine = CheckpointEngineRegistry.new("naive")
        with engine.session(None, rank=0):
            engine.send_weights(iter(named), 3)
            assert receive_into(engine, target, version=3) == 3
        assert target.weights_version == 3 and not target.stale
        if isinstance(target, RolloutWeights):
            assert [(r.trigger, r.ok) for r in target.history] == [("receive_weights", True)]


def test_history_records_hold_rollout_states() -> None:
    w, _ = weights()
    receive(w, 1)
    w.close()
    assert [(r.trigger, r.src, r.dst) for r in w.history] == [
        ("receive_weights", R.EMPTY, R.SERVING), ("close", R.SERVING, R.CLOSED)]
    assert all(isinstance(r, TransitionRecord) for r in w.history)


@pytest.mark.parametrize("version", [True, 2.5, float("nan"), "5", None, [1], -3, 10**19, 10**5000],
                         ids=["bool", "float", "nan", "str", "none", "list", "negative", "10**19", "5000-digits"])
def test_a_version_that_is_no_int_in_range_is_refused_and_the_rollout_keeps_its_own(version: Any) -> None:
    w, _ = weights(rank=1)
    receive(w, 4)
    with pytest.raises(EngineError, match=r"rollout 1: landed\(.*\): a weights version is an int in 0\.\.") as info:
        with w.receiving() as landed:
            landed(version)
    assert len(str(info.value)) < 300
    assert (w.state, w.weights_version) == (R.STALE, 4)
    receive(w, 5)
    assert (w.state, w.weights_version) == (R.SERVING, 5)


def test_an_instant_phase_ending_on_one_thread_leaves_the_phase_another_thread_started_running() -> None:
    """`mark_stale` moves at once and ends after its observers: ending, it cleared the running
    phase of a receive another thread had started meanwhile, whose `on_exit` was then refused."""
    moved, started, stale_done = threading.Event(), threading.Event(), threading.Event()

    class Slow(Observer):
        def on_state_change(self, lc: Any, src: Any, dst: Any, trigger: str) -> None:
            if trigger == "mark_stale" and threading.current_thread().name == "stale":
                moved.set()
                started.wait(10)

    weights, undone = RolloutWeights(lambda ts: None, observers=[Slow()]), []

    def mark() -> None:
        weights.mark_stale()
        stale_done.set()

    marker = threading.Thread(target=mark, name="stale", daemon=True)
    marker.start()
    assert moved.wait(10)
    with weights.receiving() as landed:
        started.set()
        assert stale_done.wait(10)
        weights.on_exit(lambda: undone.append(1))
        landed(1)
    marker.join(10)
    assert undone == [1] and weights.state is RolloutState.SERVING and weights.weights_version == 1


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"load": 5}, "load"), ({"load": None}, "load"), ({"budget": 5}, "budget"),
    ({"budget": {"generate": 1.0}}, "budget"),
    ({"watchdog": 5}, "watchdog"), ({"on_overdue": 5}, "on_overdue"),
])
def test_a_rollout_built_from_an_argument_it_cannot_use_is_refused_naming_it(kwargs: dict[str, Any], key: str) -> None:
    """Each was taken, then failed the first budgeted phase (left STALE) with a raw TypeError or
    AttributeError."""
    with pytest.raises(ConfigError) as info:
        RolloutWeights(**{"load": Model().load, **kwargs})
    assert info.value.key == key and str(info.value).startswith(f"{key}: ")


@pytest.mark.parametrize("step", ["notastep", 2.0, True, -1, 10**30, [1]])
def test_a_generation_step_that_is_no_train_step_is_refused_before_the_machine_moves(step: Any) -> None:
    w, _ = weights()
    receive(w, 1)
    before = w.history
    with pytest.raises(LifecycleError, match=r"generating\(.*\) \(role rollout, state SERVING\): step must be"):
        w.generating(step)
    assert w.state is R.SERVING and w.history == before
    with w.generating(3):  # an int step is taken and recorded
        pass
    assert w.history[-1].step == 3
