"""The hang watchdog and the phase-start record: what a phase that never ends leaves behind."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from structlog.testing import capture_logs

from lifecycle import Lifecycle
from lifecycle.config import LifecycleConfig
from lifecycle.errors import ConfigError
from lifecycle.testing import MemoryCheckpointer
from lifecycle.types import Parts, Progress, SaveInfo
from lifecycle.watchdog import WATCHDOG

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
