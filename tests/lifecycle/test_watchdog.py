"""The hang watchdog and the phase-start record: what a phase that never ends leaves behind."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from lifecycle import Lifecycle
from lifecycle.config import LifecycleConfig
from lifecycle.errors import ConfigError
from lifecycle.testing import MemoryCheckpointer
from lifecycle.types import Parts, Progress, SaveInfo
from lifecycle.watchdog import WATCHDOG, Watchdog, _Watched
from tests.children import Child

HANG_GUARD_S = 30.0


def _lifecycle(**budgets: float | None) -> Lifecycle:
    lc = Lifecycle({"watchdog": budgets}, role="actor", rank=0, world_size=1, checkpointer=MemoryCheckpointer())
    lc.init_load()
    return lc


def _records(logs: list[dict], event: str) -> list[dict]:
    return [entry for entry in list(logs) if entry["event"] == event]


def _wait_for(logs: list[dict], event: str, count: int) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while len(_records(logs, event)) < count:
        assert time.monotonic() < deadline, f"no {count} x {event} within {HANG_GUARD_S} s"
        time.sleep(0.01)


def _stuck_in_collective(logs: list[dict], until: int) -> None:
    """Stands for a collective that does not return: waits until the watchdog has spoken."""
    _wait_for(logs, "lifecycle.phase_overdue", until)


def test_a_phase_past_its_budget_logs_exactly_one_overdue_record_naming_the_stuck_frame() -> None:
    lc = _lifecycle(train_step_s=1.0)
    with capture_logs() as logs:
        with lc.train_step(7):
            _stuck_in_collective(logs, 1)
        time.sleep(1.5)  # past the second multiple, had the phase still been watched
    overdue = _records(logs, "lifecycle.phase_overdue")
    assert len(overdue) == 1
    record = overdue[0]
    assert record["log_level"] == "warning"
    assert (record["trigger"], record["state"], record["role"], record["rank"], record["step"]) == \
        ("train_step", "TRAINING", "actor", 0, 7)
    assert record["budget_s"] == 1.0 and record["elapsed_s"] >= 1.0 and record["overdue"] == 1
    first_thread_stack = next(iter(record["stacks"].values()))
    assert "_stuck_in_collective" in first_thread_stack
    assert not any("lifecycle-watchdog" in name for name in record["stacks"]), list(record["stacks"])
    assert lc.history[-1].ok  # reported, never interrupted


class _SlowSave(MemoryCheckpointer):
    def __init__(self, logs: list[dict]) -> None:
        super().__init__()
        self.logs = logs

    def save(self, step: int, parts: Parts, progress: Progress) -> SaveInfo:
        _stuck_in_collective(self.logs, 3)
        return super().save(step, parts, progress)


def test_a_phase_keeps_reporting_once_per_budget_multiple() -> None:
    with capture_logs() as logs:
        lc = Lifecycle({"watchdog": {"save_s": 0.2}}, role="critic", rank=1, world_size=2,
                       checkpointer=_SlowSave(logs))
        lc.init_load()
        lc.save(4)
    overdue = _records(logs, "lifecycle.phase_overdue")
    assert [record["overdue"] for record in overdue][:3] == [1, 2, 3]
    assert {(r["trigger"], r["state"], r["role"], r["rank"], r["step"]) for r in overdue} == \
        {("save", "SAVING", "critic", 1, 4)}


def test_a_phase_within_its_budget_and_an_unbudgeted_phase_leave_no_overdue_record() -> None:
    lc = _lifecycle(train_step_s=5.0)
    with capture_logs() as logs:
        with lc.train_step(1):
            assert WATCHDOG.watching >= 1
        watched_while_saving: list[int] = []
        real_save = lc.checkpointer.save

        def save(*args: object) -> SaveInfo:
            watched_while_saving.append(WATCHDOG.watching)
            return real_save(*args)  # type: ignore[arg-type]

        lc.checkpointer.save = save  # type: ignore[method-assign]
        lc.save(1)  # no save budget: not watched at all
    assert watched_while_saving == [0]
    assert _records(logs, "lifecycle.phase_overdue") == []


def test_one_watchdog_thread_serves_every_phase_of_the_process_and_ends_when_none_runs() -> None:
    """(Other tests may build `Watchdog` objects of their own; the lifecycles add none.)"""
    def watchdogs() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "lifecycle-watchdog"}

    before = watchdogs()
    lives = [_lifecycle(train_step_s=5.0) for _ in range(3)]
    for step, lc in enumerate(lives):
        with lc.train_step(step):
            assert WATCHDOG.watching >= 1 and watchdogs() <= before | {WATCHDOG._thread}
    deadline = time.monotonic() + HANG_GUARD_S
    while WATCHDOG._thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert WATCHDOG._thread is None and WATCHDOG.watching == 0


def test_each_phase_reports_to_the_emitter_its_machine_names_through_the_one_process_thread() -> None:
    """Machines that report differently (a Ray worker keeps its reports for the driver) share the
    process's watchdog: the emitter is the phase's, not a watchdog's of its own."""
    reports: dict[str, list[dict]] = {"a": [], "b": []}

    def inbox(name: str) -> Callable[..., None]:
        return lambda event, **fields: reports[name].append({"event": event, **fields})

    lives = {name: Lifecycle({"watchdog": {"train_step_s": 0.05}}, role=name, rank=0, world_size=1,
                             checkpointer=MemoryCheckpointer(), on_overdue=inbox(name)) for name in reports}
    threads = {t for t in threading.enumerate() if t.name == "lifecycle-watchdog"}
    with capture_logs() as logs:
        for name, lc in lives.items():
            lc.init_load()
            with lc.train_step(1):
                deadline = time.monotonic() + HANG_GUARD_S
                while not reports[name]:
                    assert time.monotonic() < deadline, f"no overdue report for {name}"
                    time.sleep(0.01)
    assert {r["role"] for r in reports["a"]} == {"a"} and {r["role"] for r in reports["b"]} == {"b"}
    assert reports["a"][0]["event"] == "lifecycle.phase_overdue" and "stacks" in reports["a"][0]
    assert _records(logs, "lifecycle.phase_overdue") == [], "an emitter of its own replaces the log record"
    assert {t for t in threading.enumerate() if t.name == "lifecycle-watchdog"} <= threads | {WATCHDOG._thread}
    assert WATCHDOG.watching == 0


def test_phase_started_is_a_debug_record_with_trigger_src_state_role_rank_step() -> None:
    lc = _lifecycle()
    with capture_logs() as logs:
        with lc.train_step(3):
            started = _records(logs, "lifecycle.phase_started")
            assert len(started) == 1  # written when the phase begins, before its end record
            assert _records(logs, "lifecycle.transition") == []
    record = started[0]
    assert record["log_level"] == "debug"
    assert {k: record[k] for k in ("trigger", "src", "state", "role", "rank", "step")} == \
        {"trigger": "train_step", "src": "READY", "state": "TRAINING", "role": "actor", "rank": 0, "step": 3}


def test_budgets_default_to_syncs_only_and_bad_budgets_are_refused_naming_the_key() -> None:
    defaults = LifecycleConfig().watchdog
    assert defaults.sync_weights_s == 120.0
    assert [defaults.budget(t) for t in ("init_load", "train_step", "save", "resume", "close")] == [None] * 5
    for bad, key in (({"save_s": 0}, "watchdog.save_s"), ({"save_s": float("inf")}, "watchdog.save_s"),
                     ({"sync_weights": 3}, "watchdog.sync_weights")):
        with pytest.raises(ConfigError) as err:
            LifecycleConfig.from_dict({"watchdog": bad})
        assert err.value.key == key


def _probe(case: str, tmp_path: Path) -> tuple[str, str]:
    """(stdout, stderr) of `watchdog_probe.py case`, run in a child process."""
    err = tmp_path / "stderr.txt"
    child = Child.spawn([str(Path(__file__).with_name("watchdog_probe.py")), case], err, HANG_GUARD_S,
                        cwd=Path(__file__).parents[2], stdin=subprocess.DEVNULL)
    out, _ = child.proc.communicate(timeout=HANG_GUARD_S)
    assert child.proc.returncode == 0, err.read_text()
    return out, err.read_text()


def test_a_phase_stuck_holding_the_gil_leaves_every_stack_on_stderr_through_the_faulthandler_backstop(
        tmp_path: Path) -> None:
    """The watchdog's thread cannot run while native code holds the GIL; faulthandler's timer,
    armed past the deadline, writes the stacks from C."""
    out, err = _probe("gil", tmp_path)
    assert "phase ended" in out
    dump = err[err.index("Timeout ("):]
    assert "in stuck_holding_the_gil" in dump, err


def test_the_backstop_stays_silent_while_the_watchdog_thread_reports_and_after_the_phase_ends(
        tmp_path: Path) -> None:
    out, err = _probe("sleep", tmp_path)
    assert "phase ended" in out
    assert "lifecycle.phase_overdue" in out  # the thread's own records (structlog's default sink: stdout)
    assert "Timeout (" not in err, err


def test_a_child_forked_in_a_watched_phase_exits_through_finalization(tmp_path: Path) -> None:
    """faulthandler's timer does not survive a fork: a child that inherits it armed waits for its
    thread forever at exit; the watchdog stops it around each fork and starts it again after."""
    out, err = _probe("fork", tmp_path)
    assert "child exited" in out and "phase ended" in out, (out, err)
    assert "Timeout (" not in err, err


def test_the_backstop_takes_none_or_a_budget_and_refuses_anything_else() -> None:
    watchdog = Watchdog()
    assert watchdog.backstop_s is None and WATCHDOG.backstop_s is None  # a library leaves the timer alone
    watchdog.backstop_s = 2
    assert watchdog.backstop_s == 2.0
    for bad in (0, -1.0, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ConfigError, match="backstop_s"):
            watchdog.backstop_s = bad  # type: ignore[assignment]
    assert watchdog.backstop_s == 2.0


class _Timer:
    """Stands for `faulthandler`'s one timer: counts how often it is set and stopped."""

    def __init__(self) -> None:
        self.set: list[float] = []
        self.stopped = 0

    def dump_traceback_later(self, timeout: float, file: int) -> None:
        self.set.append(timeout)

    def cancel_dump_traceback_later(self) -> None:
        self.stopped += 1


def test_phase_after_phase_keeps_one_backstop_setting_and_the_thread_stops_it_once_none_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Moving faulthandler's timer stalls the interpreter (its thread is joined with the GIL
    held): fifty budgeted steps set it once, and it is stopped once, after the last."""
    import lifecycle.watchdog as watchdog_module

    _wait_for_the_thread_to_end()  # a real timer an earlier test left set is stopped first
    timer = _Timer()
    monkeypatch.setattr(watchdog_module, "faulthandler", timer)
    monkeypatch.setattr(WATCHDOG, "backstop_s", 5.0)
    lc = _lifecycle(train_step_s=100.0)
    for step in range(1, 51):
        with lc.train_step(step):
            pass
    _wait_for_the_thread_to_end()
    assert len(timer.set) == 1 and 100.0 < timer.set[0] <= 105.0
    assert timer.stopped == 1 and WATCHDOG._fires_at is None


def _wait_for_the_thread_to_end() -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while WATCHDOG._thread is not None:
        assert time.monotonic() < deadline, "the watchdog thread did not end"
        time.sleep(0.01)


def test_a_short_phase_ending_beside_a_long_one_moves_the_backstop_to_the_long_ones_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Left at the short phase's deadline, the timer would fire while the long phase is within
    its budget."""
    import lifecycle.watchdog as watchdog_module

    _wait_for_the_thread_to_end()
    timer = _Timer()
    monkeypatch.setattr(watchdog_module, "faulthandler", timer)
    monkeypatch.setattr(WATCHDOG, "backstop_s", 5.0)
    long, short = _lifecycle(save_s=100.0), _lifecycle(train_step_s=1.0)
    save = long.checkpointer.save
    long.checkpointer.save = lambda *args: (short_step(), save(*args))[1]  # type: ignore[method-assign]

    def short_step() -> None:
        with short.train_step(1):
            assert 5.0 < timer.set[-1] <= 6.0  # the short phase's deadline is the nearest
        assert 100.0 < timer.set[-1] <= 105.0  # ended: the long one's is

    long.save(1)
    assert long.history[-1].ok
    _wait_for_the_thread_to_end()


def test_a_child_forked_inside_a_phase_watches_none_of_its_parents_phases() -> None:
    """A data loader's worker forked inside a step never returns into it: kept, the child's
    thread reported the parent's step overdue for good."""
    import os

    lc = _lifecycle(train_step_s=100.0)
    with lc.train_step(1):
        assert WATCHDOG.watching == 1
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, str(WATCHDOG.watching).encode())
            os._exit(0)
        os.close(write)
        seen = os.read(read, 16)
        os.close(read)
        os.waitpid(pid, 0)
    assert seen == b"0"


def _sink_down(event: str, **fields: object) -> None:
    raise RuntimeError("sink down")


def _overdue(emit: Callable[..., object] | None) -> _Watched:
    """A save phase of 0.1 s, reported once overdue; `emit`: its machine's emitter."""
    return _Watched(0.1, 0.0, threading.get_ident(), {"trigger": "save", "role": "actor"}, emit, overdue=1)


@pytest.mark.parametrize("whose", ["phase", "watchdog"])
def test_an_overdue_report_whose_emitter_raises_goes_to_the_default_warning_with_its_error(whose: str) -> None:
    """The emitter's error was swallowed with the report: nothing was left of the overdue phase."""
    dog = Watchdog(emit=_sink_down if whose == "watchdog" else None)
    with capture_logs() as logs:
        dog._report(_overdue(_sink_down if whose == "phase" else None), 0.35)
    [record] = _records(logs, "lifecycle.phase_overdue")
    assert record["log_level"] == "warning" and (record["trigger"], record["overdue"]) == ("save", 1)
    assert record["emitter_error"] == "RuntimeError: sink down" and "_sink_down" in record["emitter"]
    assert record["elapsed_s"] == 0.35 and "stacks" in record


def test_a_lifecycle_whose_overdue_emitter_raises_still_leaves_the_overdue_record() -> None:
    lc = Lifecycle({"watchdog": {"train_step_s": 0.05}}, role="actor", rank=0, world_size=1,
                   checkpointer=MemoryCheckpointer(), on_overdue=_sink_down)
    lc.init_load()
    with capture_logs() as logs:
        with lc.train_step(2):
            _stuck_in_collective(logs, 1)
    record = _records(logs, "lifecycle.phase_overdue")[0]
    assert (record["trigger"], record["step"], record["emitter_error"]) == ("train_step", 2, "RuntimeError: sink down")
    assert lc.history[-1].ok


def test_an_overdue_report_the_default_loses_too_is_said_once_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    from lifecycle import records

    def broken(logger: object, method: str, event: dict[str, object]) -> dict[str, object]:
        raise BufferError("log sink full")

    records._UNHEARD.discard("BufferError")
    structlog.configure(processors=[broken], cache_logger_on_first_use=False)
    try:
        for _ in range(2):
            Watchdog()._report(_overdue(_sink_down), 0.35)  # never raises: the thread lives on
    finally:
        structlog.reset_defaults()
    assert capsys.readouterr().err.count("a log record was lost (BufferError: log sink full)") == 1


@pytest.mark.parametrize(("kwargs", "key"), [({"clock": 5}, "clock"), ({"clock": None}, "clock"),
                                             ({"emit": 5}, "emit"), ({"emit": "warning"}, "emit")])
def test_a_watchdog_built_from_an_argument_it_cannot_call_is_refused_naming_it(kwargs: dict[str, object],
                                                                               key: str) -> None:
    """`Watchdog(clock=5)` was taken, then its first watch() raised a raw TypeError."""
    with pytest.raises(ConfigError) as info:
        Watchdog(**kwargs)  # type: ignore[arg-type]
    assert info.value.key == key and str(info.value).startswith(f"{key}: ")


def test_an_emitter_that_blocks_silences_neither_the_other_machines_nor_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The one thread called each emitter inline: one whose driver no longer answered kept every
    other machine of the process from leaving a record of its hang."""
    import lifecycle.watchdog as watchdog

    monkeypatch.setattr(watchdog, "EMIT_WAIT_S", 0.05)
    release, called = threading.Event(), threading.Event()
    b_reports: list[dict] = []

    def stuck(event: str, **fields: object) -> None:
        called.set()
        release.wait(HANG_GUARD_S)

    dog = Watchdog()
    cfg = {"watchdog": {"train_step_s": 0.05}}
    a = Lifecycle(cfg, role="a", checkpointer=MemoryCheckpointer(), watchdog=dog, on_overdue=stuck)
    b = Lifecycle(cfg, role="b", checkpointer=MemoryCheckpointer(), watchdog=dog,
                  on_overdue=lambda event, **fields: b_reports.append(fields))
    a.init_load()
    b.init_load()
    try:
        with capture_logs() as logs:
            with a.train_step(1):
                assert called.wait(HANG_GUARD_S), "a's emitter was never called"
                with b.train_step(1):
                    deadline = time.monotonic() + HANG_GUARD_S
                    while not b_reports or not _fallbacks(logs, "a"):
                        assert time.monotonic() < deadline, "b's report or a's default warning never came"
                        time.sleep(0.01)
    finally:
        release.set()
    assert {r["role"] for r in b_reports} == {"b"}
    assert all(r["emitter_error"].startswith("busy") for r in _fallbacks(logs, "a"))
    assert a.history[-1].ok and b.history[-1].ok


def _fallbacks(logs: list[dict], role: str) -> list[dict]:
    """The overdue reports of `role` that went to the default warning instead of its emitter."""
    return [r for r in _records(logs, "lifecycle.phase_overdue") if r["role"] == role and "emitter_error" in r]


def test_a_watch_started_on_the_thread_already_inside_the_watchdog_gets_in_instead_of_deadlocking() -> None:
    """A signal handler that fires a budgeted trigger of a second machine while its thread is
    inside `watch` of the first (both on the process's shared watchdog) used to wait forever on
    the lock that thread held. Here the handler's place is taken by the watchdog's own backstop
    step, which calls `watch` again from inside the first one."""
    wd = Watchdog()
    keep = wd._keep_backstop
    nested: list[int] = []

    def reentering() -> None:
        if not nested:
            nested.append(2)
            wd.watch(2, 60.0, trigger="save")  # what the handler's trigger does
        keep()

    wd._keep_backstop = reentering  # type: ignore[method-assign]
    done = threading.Event()

    def first() -> None:
        wd.watch(1, 60.0, trigger="train_step")
        done.set()

    thread = threading.Thread(target=first, daemon=True)
    thread.start()
    assert done.wait(30), "watch() re-entered on its own thread deadlocked"
    assert wd.watching == 2
    wd.unwatch(1)
    wd.unwatch(2)
    assert wd.watching == 0
