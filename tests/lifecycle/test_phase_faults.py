"""A phase ends whatever its surroundings raise: an observer, the log sink, an undo, a budget,
an error that cannot print itself. Each case leaves the machine in the table's failure or done
state with one history record, never in a working state it cannot leave."""

from __future__ import annotations

import io
import math
import time
from contextlib import nullcontext
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from lifecycle import ConfigError, LifecycleError, Observer, State
from lifecycle.phase import temporarily
from lifecycle.watchdog import Watchdog
from tests.lifecycle.probes import make_lifecycle


class Raising(Observer):
    """An observer whose hook named `hook` raises `error` for moves of `trigger`."""

    def __init__(self, hook: str, trigger: str, error: BaseException) -> None:
        self.hook, self.trigger, self.error = hook, trigger, error
        self.heard: list[str] = []

    def on_state_change(self, lc: Any, src: Any, dst: Any, trigger: str) -> None:
        if self.hook == "on_state_change" and trigger == self.trigger:
            raise self.error

    def on_transition(self, lc: Any, record: Any) -> None:
        self.heard.append(record.trigger)
        if self.hook == "on_transition" and record.trigger == self.trigger:
            raise self.error


class Listening(Observer):
    def __init__(self) -> None:
        self.heard: list[tuple[str, bool]] = []

    def on_transition(self, lc: Any, record: Any) -> None:
        self.heard.append((record.trigger, record.ok))


@pytest.mark.parametrize("hook", ["on_state_change", "on_transition"])
def test_an_observer_that_raises_is_logged_and_changes_nothing_the_others_hear(hook: str) -> None:
    listening = Listening()
    lc = make_lifecycle(observers=[Raising(hook, "train_step", RuntimeError("observer broke")), listening])
    lc.init_load()
    with capture_logs() as logs:
        with lc.train_step(1):
            pass
    assert lc.state is State.READY and lc.history[-1].ok
    assert listening.heard == [("init_load", True), ("train_step", True)]
    failed = [r for r in logs if r["event"] == "lifecycle.observer_failed"]
    assert failed and failed[0]["hook"] == hook and "observer broke" in failed[0]["error"]


def test_an_interrupt_in_an_observer_at_the_begin_move_fails_the_phase_and_is_raised() -> None:
    lc = make_lifecycle(observers=[Raising("on_state_change", "train_step", KeyboardInterrupt())])
    lc.init_load()
    lc.save(0)
    ran = []
    with pytest.raises(KeyboardInterrupt):
        with lc.train_step(1):
            ran.append(1)
    assert ran == [] and lc.state is State.FAILED
    assert [(r.trigger, r.ok) for r in lc.history] == [("init_load", True), ("save", True), ("train_step", False)]
    assert lc.resume() == 0  # FAILED is left as the table says
    assert lc.state is State.READY


class _BrokenSink:
    """A log sink that raises like a closed pipe."""

    def msg(self, message: str) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    log = debug = info = warning = error = critical = msg


def test_a_log_sink_that_raises_costs_the_lines_not_the_phases() -> None:
    structlog.configure(logger_factory=lambda *args: _BrokenSink(), cache_logger_on_first_use=False)
    try:
        lc = make_lifecycle()
        lc.init_load()
        with lc.train_step(1):
            pass
        lc.save(1)
        lc.close()
    finally:
        structlog.reset_defaults()
    assert lc.state is State.CLOSED
    assert [(r.trigger, r.ok) for r in lc.history] == [("init_load", True), ("train_step", True), ("save", True),
                                                       ("close", True)]


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ exploded")


def test_an_error_that_cannot_print_itself_is_raised_as_is_and_recorded() -> None:
    lc = make_lifecycle()
    lc.init_load()
    error = _Unprintable()
    with pytest.raises(_Unprintable) as info:
        with lc.train_step(1):
            raise error
    assert info.value is error and lc.state is State.FAILED
    assert lc.history[-1].error.startswith("_Unprintable: <unprintable")  # type: ignore[union-attr]


def test_a_huge_error_message_is_cut_in_the_record() -> None:
    lc = make_lifecycle()
    lc.init_load()
    with pytest.raises(ValueError):
        with lc.train_step(1):
            raise ValueError("x" * 100_000)
    message = lc.history[-1].error or ""
    assert len(message) < 5000 and message.endswith("[100000 characters in all]")


@pytest.mark.parametrize("key", ["step", "rank", "ok", "error", "event", 7])
def test_a_figure_named_like_a_record_field_is_logged_apart_and_the_phase_succeeds(key: Any) -> None:
    lc = make_lifecycle()
    lc.init_load()
    with capture_logs() as logs:
        with lc.train_step(1) as phase:
            phase.figures[key] = "mine"
    assert lc.state is State.READY and lc.history[-1].ok and lc.history[-1].figures[key] == "mine"
    [record] = [r for r in logs if r["event"] == "lifecycle.transition"]
    assert record["step"] == 1 and record["ok"] is True
    assert record[f"figure_{key}" if isinstance(key, str) else "7"] == "mine"


def test_a_figure_the_renderer_cannot_write_loses_its_line_not_the_phase() -> None:
    out = io.StringIO()
    structlog.configure(processors=[structlog.processors.JSONRenderer()],
                        logger_factory=structlog.WriteLoggerFactory(out), cache_logger_on_first_use=False)
    try:
        lc = make_lifecycle()
        lc.init_load()
        with lc.train_step(1) as phase:
            phase.figures["huge"] = 10**5000  # json.dumps refuses an int past 4300 digits
    finally:
        structlog.reset_defaults()
    assert lc.state is State.READY and lc.history[-1].ok


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupted_undo_lets_every_other_undo_run_fails_the_phase_and_is_raised(interrupt: type) -> None:
    class Flags:
        first = second = "orig"

    flags = Flags()
    lc = make_lifecycle()
    lc.init_load()

    def interrupted() -> None:
        raise interrupt()

    with pytest.raises(interrupt):
        with lc.train_step(1):
            lc.temporarily(flags, first="changed")
            lc.on_exit(interrupted)
            lc.temporarily(flags, second="changed")
    assert (flags.first, flags.second) == ("orig", "orig")
    assert lc.state is State.FAILED and not lc.history[-1].ok
    assert interrupt.__name__ in (lc.history[-1].error or "")


def test_a_change_restored_early_settles_the_changes_made_on_top_of_it() -> None:
    class Cfg:
        lr = 0.1

    cfg = Cfg()
    lc = make_lifecycle()
    lc.init_load()
    with lc.train_step(1):
        with lc.temporarily(cfg, lr=0.5):
            lc.temporarily(cfg, lr=0.01)  # for the rest of the phase, made inside the block
            assert cfg.lr == 0.01
        assert cfg.lr == 0.1
    assert cfg.lr == 0.1, "the phase's end puts back nothing set in between"


def test_changes_restored_in_order_each_put_back_what_they_found() -> None:
    class Cfg:
        lr = 0.1

    cfg = Cfg()
    with temporarily(cfg, lr=0.5):
        with temporarily(cfg, lr=0.01):
            assert cfg.lr == 0.01
        assert cfg.lr == 0.5
    assert cfg.lr == 0.1


def test_an_attribute_whose_restore_fails_does_not_stop_the_others_of_its_change() -> None:
    class Frozen:
        a = "orig-a"

        def __init__(self) -> None:
            self._b, self.frozen = "orig-b", False

        @property
        def b(self) -> str:
            return self._b

        @b.setter
        def b(self, value: str) -> None:
            if self.frozen:
                raise AttributeError("b is frozen")
            self._b = value

    obj = Frozen()
    lc = make_lifecycle()
    lc.init_load()
    with pytest.raises(LifecycleError, match="undo"):
        with lc.train_step(1):
            lc.temporarily(obj, a="tmp-a", b="tmp-b")
            obj.frozen = True
    assert obj.a == "orig-a" and lc.state is State.FAILED


@pytest.mark.parametrize("budget", [0, -1.0, math.inf, math.nan, "1", True, 5e-324, 1e-6, 1e300])
def test_a_budget_outside_a_millisecond_to_ten_million_seconds_is_refused_and_the_watchdog_lives(budget: Any) -> None:
    """5e-324 and 1e300 killed the one thread with an OverflowError (every other phase then went
    unwatched); 1e-6 reported 17,000 times in half a second. Budgets are 1 ms to 10^7 s."""
    reports: list[str] = []
    dog = Watchdog(emit=lambda event, **fields: reports.append(event))
    with pytest.raises(LifecycleError, match="budget"):
        dog.watch(1, budget)
    assert dog.watching == 0
    dog.watch(2, 0.05)  # the thread still reports
    deadline = time.monotonic() + 10
    while not reports and time.monotonic() < deadline:
        time.sleep(0.01)
    dog.unwatch(2)
    assert reports and reports[0] == "lifecycle.phase_overdue"


def test_a_rollout_budget_callable_that_raises_fails_the_phase_and_leaves_no_context_behind() -> None:
    from lifecycle.phase import RUNNING_UNDOS
    from lifecycle.rollout import RolloutState, RolloutWeights

    def budget(trigger: str) -> float:
        raise RuntimeError("budget broke")

    rollout = RolloutWeights(lambda named: None, budget=budget)
    with pytest.raises(RuntimeError, match="budget broke"):
        with rollout.receiving():
            pass
    assert rollout.state is not RolloutState.RECEIVING and RUNNING_UNDOS.get() is None
    assert not rollout.history[-1].ok


class _NoUnwatch:
    def watch(self, key: int, budget_s: float, emit: Any = None, **fields: Any) -> None:
        pass


class _LoadOnly:
    def load_initial(self, parts: Any) -> dict[str, Any]:
        return {}


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"rank": "0"}, "rank"), ({"rank": -1}, "rank"), ({"rank": True}, "rank"), ({"rank": 2, "world_size": 2}, "rank"),
    ({"world_size": 0}, "world_size"), ({"world_size": 1.0}, "world_size"), ({"role": None}, "role"),
    ({"role": ""}, "role"), ({"history_limit": 2.5}, "history_limit"), ({"history_limit": -1}, "history_limit"),
    ({"observers": None}, "observers"), ({"watchdog": 5}, "watchdog"), ({"watchdog": _NoUnwatch()}, "watchdog"),
    ({"on_overdue": 5}, "on_overdue"), ({"checkpointer": 5}, "checkpointer"),
    ({"checkpointer": _LoadOnly()}, "checkpointer"), ({"engine": 5}, "engine"), ({"engine": object()}, "engine"),
])
def test_a_lifecycle_built_from_an_argument_it_cannot_use_is_refused_naming_it(kwargs: dict[str, Any],
                                                                               key: str) -> None:
    from lifecycle import Lifecycle
    from lifecycle.testing import MemoryCheckpointer

    with pytest.raises(ConfigError) as info:
        Lifecycle(**{"role": "actor", "checkpointer": MemoryCheckpointer(), **kwargs})
    assert info.value.key == key and str(info.value).startswith(f"{key}: ")


def test_a_rank_from_the_environment_that_is_no_number_is_refused_naming_the_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ConfigError) as info:
        make_lifecycle()
    assert info.value.key == "RANK"


@pytest.mark.parametrize("step", ["7", None, 2.0, True, -1, 10**30])
def test_a_train_step_that_no_save_could_take_is_refused_before_the_machine_moves(step: Any) -> None:
    lc = make_lifecycle()
    lc.init_load()
    with pytest.raises(LifecycleError, match="step must be an integer"):
        with lc.train_step(step):
            pass
    assert lc.state is State.READY and [r.trigger for r in lc.history] == ["init_load"]


def test_an_interrupted_undo_is_raised_even_when_the_work_failed_too() -> None:
    lc = make_lifecycle()
    lc.init_load()

    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as info:
        with lc.train_step(1):
            lc.on_exit(interrupted)
            raise ValueError("the step failed")
    assert isinstance(info.value.__context__, ValueError), "the work's error rides along"
    assert lc.state is State.FAILED and "KeyboardInterrupt" in (lc.history[-1].error or "")


def test_a_phase_ended_in_another_asyncio_task_still_ends_and_records() -> None:
    import asyncio

    lc = make_lifecycle()
    lc.init_load()

    async def main() -> None:
        phase = lc.train_step(1)
        await asyncio.create_task(_enter(phase))
        await asyncio.create_task(_exit(phase))

    async def _enter(phase: Any) -> None:
        phase.__enter__()

    async def _exit(phase: Any) -> None:
        phase.__exit__(None, None, None)

    asyncio.run(main())
    assert lc.state is State.READY and [(r.trigger, r.ok) for r in lc.history][-1] == ("train_step", True)
    assert lc._phase is None


def test_a_numpy_budget_is_taken_like_a_float() -> None:
    import numpy as np

    from lifecycle.rollout import RolloutWeights

    rollout = RolloutWeights(lambda named: None, budget=lambda trigger: np.float32(5.0))
    rollout.mark_stale()
    assert rollout.history[-1].ok


def test_changes_restored_from_two_threads_leave_what_the_first_found_and_pin_nothing() -> None:
    import gc
    import threading
    import weakref

    class Box:
        x = 0

    for _ in range(200):
        box = Box()
        outer = temporarily(box, x=1)
        inner = temporarily(box, x=2)
        threads = [threading.Thread(target=inner.restore), threading.Thread(target=outer.restore)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert box.x == 0
    dropped = Box()
    temporarily(dropped, x=5)  # outside a phase, without `with`: a permanent change
    ref = weakref.ref(dropped)
    del dropped
    gc.collect()
    assert ref() is None, "an unrestored change does not keep its object alive"


def test_a_log_processor_that_raises_is_said_once_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    from lifecycle import records

    def broken(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
        raise LookupError("processor bug")

    records._UNHEARD.discard("LookupError")
    structlog.configure(processors=[broken], cache_logger_on_first_use=False)
    try:
        lc = make_lifecycle()
        lc.init_load()
        with lc.train_step(1):
            pass
    finally:
        structlog.reset_defaults()
    err = capsys.readouterr().err
    assert err.count("a log record was lost (LookupError: processor bug)") == 1
    assert lc.state is State.READY


def test_the_watchdog_thread_ends_once_nothing_is_watched_so_watchdogs_leak_no_threads() -> None:
    """Each `Watchdog` kept a daemon thread for good: 20 closed lifecycles left 20 threads."""
    dogs = [Watchdog(emit=lambda event, **fields: None) for _ in range(5)]
    for n, dog in enumerate(dogs):
        dog.watch(n, 60.0)
        dog.unwatch(n)
    deadline = time.monotonic() + 10
    while any(dog._thread is not None for dog in dogs) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(dog._thread is None for dog in dogs)
    dogs[0].watch(9, 60.0)  # and a later phase is watched again, by a thread of its own
    assert dogs[0]._thread is not None and dogs[0]._thread.is_alive()
    dogs[0].unwatch(9)


def test_ctrl_c_while_an_undos_failure_is_logged_lets_the_other_undos_run_then_fails_the_phase_and_is_raised(
) -> None:
    """The interrupt left run_undos from its log line: the other undos were skipped and the
    machine stayed in TRAINING with no record."""
    def interrupt_on_undo_failed(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
        if event["event"] == "lifecycle.undo_failed":
            raise KeyboardInterrupt("Ctrl-C while writing the line")
        raise structlog.DropEvent

    lc = make_lifecycle()
    lc.init_load()
    ran: list[str] = []
    structlog.configure(processors=[interrupt_on_undo_failed], cache_logger_on_first_use=False)
    try:
        with pytest.raises(KeyboardInterrupt):
            with lc.train_step(1):
                lc.on_exit(lambda: ran.append("first registered"))
                lc.on_exit(lambda: 1 / 0)  # runs first, fails, and its line is interrupted
    finally:
        structlog.reset_defaults()
    assert ran == ["first registered"] and lc.state is State.FAILED and lc._phase is None
    assert [(r.trigger, r.ok) for r in lc.history] == [("init_load", True), ("train_step", False)]
    assert "KeyboardInterrupt" in (lc.history[-1].error or "")


class _UnwatchRaises(Watchdog):
    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error

    def unwatch(self, key: int) -> None:
        super().unwatch(key)
        raise self.error


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("unwatch broke")], ids=repr)
def test_a_watchdog_whose_unwatch_raises_leaves_the_phase_done_with_its_record(error: BaseException) -> None:
    """The machine stayed in TRAINING for good: every later trigger, close included, was refused.
    Like an observer's, the watchdog's error is logged and its interrupt raised once settled."""
    lc = make_lifecycle(config={"watchdog": {"train_step_s": 60}}, watchdog=_UnwatchRaises(error))
    lc.init_load()
    with capture_logs() as logs:
        with pytest.raises(KeyboardInterrupt) if isinstance(error, KeyboardInterrupt) else nullcontext():
            with lc.train_step(1):
                pass
    assert lc.state is State.READY and lc._phase is None
    assert [(r.trigger, r.ok) for r in lc.history] == [("init_load", True), ("train_step", True)]
    failed = [r for r in logs if r["event"] == "lifecycle.watchdog_failed"]
    assert len(failed) == (0 if isinstance(error, KeyboardInterrupt) else 1)
    assert all("unwatch broke" in r["error"] and r["trigger"] == "train_step" for r in failed)
    lc.close()
    assert lc.state is State.CLOSED


def test_an_undo_that_registers_another_undo_is_refused_naming_the_state() -> None:
    """An undo that called `on_exit` from inside itself was run too: re-registering itself, forever."""
    lc = make_lifecycle()
    lc.init_load()
    runs: list[int] = []

    def again() -> None:
        runs.append(1)
        if len(runs) < 3:  # bounded, so that the old code ran it thrice instead of hanging the test
            lc.on_exit(again)

    with pytest.raises(LifecycleError, match="undo") as info:
        with lc.train_step(1):
            lc.on_exit(again)
    assert runs == [1] and lc.state is State.FAILED
    cause = info.value.__cause__
    assert isinstance(cause, LifecycleError) and "on_exit()" in str(cause) and "state is TRAINING" in str(cause)
