"""The driver's machine: its table pinned pair by pair, and recovery as state sequences.

A fake job stands in for the Ray worker group (no Ray here): it fails on demand with the
`WorkerFailed` the worker group would raise, so each test pins the path through the table.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import pytest
from structlog.testing import capture_logs

from lifecycle import InvalidTransition
from lifecycle.errors import ConfigError, EngineError
from lifecycle.machine import DRIVER, DRIVER_TABLE, DriverState
from lifecycle.phase import Observer, Phase
from lifecycle.ray.controller import Controller
from lifecycle.ray.policy import FailureKind, FailurePolicy, RunFailed, WorkerFailed
from lifecycle.stateful import Stateful

D = DriverState
CONTRACT = {
    # trigger: (sources, working state, state after success, state after failure)
    "start": ({D.CREATED}, D.INITIALIZING, D.RUNNING, D.ERRORED),
    "recover": ({D.RUNNING}, D.RECOVERING, D.RUNNING, D.ERRORED),
    "finish": ({D.RUNNING}, D.FINISHING, D.FINISHED, D.ERRORED),
    "give_up": ({D.RUNNING}, None, D.ERRORED, None),
}
STABLE = [D.CREATED, D.RUNNING, D.FINISHED, D.ERRORED]
WORKING = {D.INITIALIZING: "start", D.RECOVERING: "recover", D.FINISHING: "finish"}


class Path(Observer):
    def __init__(self) -> None:
        self.states: list[Enum] = []

    def on_state_change(self, lc: Stateful[Any], src: Enum, dst: Enum, trigger: str) -> None:
        self.states += [src, dst] if not self.states else [dst]


def death(step: int, worker: str = "actor") -> WorkerFailed:
    return WorkerFailed(worker, "train", step, RuntimeError("ActorDiedError: the actor died"), FailureKind.DIED)


def raised(step: int, error: BaseException) -> WorkerFailed:
    return WorkerFailed("actor", "train", step, RuntimeError(f"RayTaskError({type(error).__name__})"),
                        FailureKind.RAISED, error)


class FakeJob(Controller):
    """Saves every 2 steps; `plan` maps (where, incarnation, step) to the error raised there once."""

    def __init__(self, policy: FailurePolicy, plan: dict[tuple[str, int, int], BaseException]) -> None:
        super().__init__(policy)
        self.plan = dict(plan)
        self.saved = 0
        self.log: list[str] = []
        self.path = Path()
        self.add_observer(self.path)

    def _maybe_fail(self, where: str, step: int) -> None:
        error = self.plan.pop((where, self.incarnation, step), None)
        if error is not None:
            raise error

    def _start_group(self) -> int:
        self.log.append(f"start{self.incarnation}")
        self._maybe_fail("start", self.saved)
        return self.saved

    def _run_step(self, step: int) -> None:
        self._maybe_fail("step", step)
        self.log.append(f"step{step}")
        if step % 2 == 0:
            self.saved = step

    def _close_group(self) -> None:
        self._maybe_fail("close", self.saved)
        self.log.append("close")

    def _stop_group(self) -> None:
        self.log.append("stop")


def run(plan: dict[tuple[str, int, int], BaseException], max_failures: int = 2, last: int = 5) -> FakeJob:
    job = FakeJob(FailurePolicy(max_failures=max_failures), plan)
    job._control(last)
    return job


def triggers(job: FakeJob) -> list[tuple[str, bool]]:
    return [(r.trigger, r.ok) for r in job.history]


def test_table_in_code_is_the_contract() -> None:
    assert {row.trigger: (set(row.sources), row.working, row.done, row.failed) for row in DRIVER_TABLE} == CONTRACT
    assert set(STABLE) | set(WORKING) == set(DriverState)
    assert DRIVER.terminal == {D.FINISHED, D.ERRORED} and all(s.terminal for s in DRIVER.terminal)


def _bare_to(state: DriverState) -> Controller:
    c = Controller(FailurePolicy())
    if state is not D.CREATED:
        with Phase(c, "start", None):
            pass
    if state is D.FINISHED:
        with Phase(c, "finish", 1):
            pass
    if state is D.ERRORED:
        with Phase(c, "give_up", 1):
            pass
    assert c.state is state
    return c


@pytest.mark.parametrize("state", STABLE)
@pytest.mark.parametrize("trigger", list(CONTRACT))
def test_trigger_from_stable_state_reaches_the_table_state_or_is_refused(state: DriverState, trigger: str) -> None:
    c = _bare_to(state)
    sources, working, done, _ = CONTRACT[trigger]
    path = Path()
    c.add_observer(path)
    if state in sources:
        with Phase(c, trigger, 1):
            pass
        assert path.states == ([state, working, done] if working else [state, done])
    else:
        with pytest.raises(InvalidTransition) as info:
            with Phase(c, trigger, 1):
                pass
        assert c.state is state and path.states == []
        assert info.value.allowed == DRIVER.allowed(state) and state.name in str(info.value)


@pytest.mark.parametrize("working", list(WORKING))
@pytest.mark.parametrize("trigger", list(CONTRACT))
def test_no_trigger_fires_while_the_driver_initializes_recovers_or_finishes(working: DriverState,
                                                                           trigger: str) -> None:
    c = _bare_to(D.CREATED if working is D.INITIALIZING else D.RUNNING)
    with Phase(c, WORKING[working], 1):
        with pytest.raises(InvalidTransition, match=f"from state {working.name}"):
            with Phase(c, trigger, 1):
                pass
        assert c.state is working


def test_a_run_without_failures_is_start_then_finish() -> None:
    job = run({})
    assert job.path.states == [D.CREATED, D.INITIALIZING, D.RUNNING, D.FINISHING, D.FINISHED]
    assert triggers(job) == [("start", True), ("finish", True)]
    assert job.log == ["start0", "step1", "step2", "step3", "step4", "step5", "close"]


def test_a_worker_death_is_recovering_then_running_from_the_last_save() -> None:
    job = run({("step", 0, 3): death(3)})
    assert job.path.states == [D.CREATED, D.INITIALIZING, D.RUNNING, D.RECOVERING, D.RUNNING, D.FINISHING,
                               D.FINISHED]
    assert triggers(job) == [("start", True), ("recover", True), ("finish", True)]
    assert job.log == ["start0", "step1", "step2", "stop", "start1", "step3", "step4", "step5", "close"]
    [failure] = job.summary.failures
    assert (failure.worker, failure.step, failure.resumed_at, failure.incarnation) == ("actor", 3, 2, 0)
    recover = job.history[1]
    assert recover.path == (D.RUNNING, D.RECOVERING, D.RUNNING)
    assert recover.figures == {"worker": "actor", "phase": "train", "kind": "died", "incarnation": 1,
                               "resumed_at": 2}


def test_a_worker_death_as_the_workers_close_is_recovered_like_one_in_a_step() -> None:
    """The last step's save may still be committing as the workers close: a death then is
    judged by the policy and recovered, never an unrecorded error of the finish."""
    job = run({("close", 0, 4): death(5)})
    assert triggers(job) == [("start", True), ("recover", True), ("finish", True)]
    assert job.log == ["start0", "step1", "step2", "step3", "step4", "step5", "stop", "start1", "step5", "close"]
    [failure] = job.summary.failures
    assert (failure.step, failure.resumed_at) == (5, 4)
    assert job.history[-1].path == (D.RUNNING, D.FINISHING, D.FINISHED)


def test_more_failures_than_max_failures_is_errored() -> None:
    job = FakeJob(FailurePolicy(max_failures=1), {("step", 0, 3): death(3), ("step", 1, 4): death(4, "critic")})
    with pytest.raises(RunFailed, match=r"giving up after 2 failures \(max_failures=1\)") as info:
        job._control(5)
    assert info.value.failure is not None and info.value.failure.worker == "critic"
    assert job.path.states[-3:] == [D.RECOVERING, D.RUNNING, D.ERRORED]
    assert triggers(job) == [("start", True), ("recover", True), ("give_up", False)]
    assert job.history[-1].path == (D.RUNNING, D.ERRORED) and job.state is D.ERRORED
    assert len(job.summary.failures) == 2 and job.incarnation == 1


def test_a_non_retryable_error_is_errored_without_a_restart() -> None:
    job = FakeJob(FailurePolicy(max_failures=3), {("step", 0, 2): raised(2, ConfigError("engine.backend", "bad"))})
    with capture_logs() as logs, pytest.raises(RunFailed, match="ConfigError is not retryable"):
        job._control(5)
    assert job.path.states == [D.CREATED, D.INITIALIZING, D.RUNNING, D.ERRORED]
    assert triggers(job) == [("start", True), ("give_up", False)]
    assert job.log == ["start0", "step1"] and job.incarnation == 0, "no stop, no rebuild"
    [failed] = [r for r in logs if r["event"] == "driver.worker_failed"]
    assert (failed["kind"], failed["decision"], failed["failures"]) == ("raised", "give_up", 1)


def test_a_failure_while_recovering_is_retried_inside_recovering() -> None:
    job = run({("step", 0, 3): death(3), ("start", 1, 2): death(2, "rollout0")}, max_failures=2)
    assert job.path.states == [D.CREATED, D.INITIALIZING, D.RUNNING, D.RECOVERING, D.RUNNING, D.FINISHING,
                               D.FINISHED]
    assert job.log[:6] == ["start0", "step1", "step2", "stop", "start1", "stop"]
    assert job.incarnation == 2 and [f.resumed_at for f in job.summary.failures] == [2, 2]


def test_a_failure_while_recovering_past_max_failures_fails_the_recovery() -> None:
    job = FakeJob(FailurePolicy(max_failures=1), {("step", 0, 3): death(3), ("start", 1, 2): death(2)})
    with pytest.raises(RunFailed, match="giving up after 2 failures"):
        job._control(5)
    assert job.path.states[-3:] == [D.RUNNING, D.RECOVERING, D.ERRORED]
    assert triggers(job) == [("start", True), ("recover", False)]


def test_a_failed_start_is_retried_inside_initializing_or_errored() -> None:
    job = run({("start", 0, 0): death(0)})
    assert job.path.states[:3] == [D.CREATED, D.INITIALIZING, D.RUNNING] and job.incarnation == 1
    assert job.log[:3] == ["start0", "stop", "start1"]
    refused = FakeJob(FailurePolicy(max_failures=0), {("start", 0, 0): death(0)})
    with pytest.raises(RunFailed):
        refused._control(5)
    assert refused.path.states == [D.CREATED, D.INITIALIZING, D.ERRORED]


@pytest.mark.parametrize("error", [EngineError("rollouts received versions [3], the policy sent v4"),
                                   KeyboardInterrupt()])
def test_the_drivers_own_error_gives_up_at_once_and_is_raised_as_is(error: BaseException) -> None:
    job = FakeJob(FailurePolicy(), {("step", 0, 2): error})
    with pytest.raises(type(error)) as info:
        job._control(5)
    assert info.value is error and job.state is D.ERRORED and triggers(job)[-1] == ("give_up", False)
    assert job.summary.failures == [], "no worker failed"


def test_each_driver_transition_is_one_lifecycle_transition_record_with_role_driver() -> None:
    with capture_logs() as logs:
        run({("step", 0, 3): death(3)})
    records = [r for r in logs if r["event"] == "lifecycle.transition"]
    assert [(r["trigger"], r["src"], r["dst"], r["role"], r["ok"]) for r in records] == [
        ("start", "CREATED", "RUNNING", "driver", True), ("recover", "RUNNING", "RUNNING", "driver", True),
        ("finish", "RUNNING", "FINISHED", "driver", True)]
    assert [r["trigger"] for r in logs if r["event"] == "lifecycle.phase_started"] == ["start", "recover", "finish"]


def test_hooks_are_told_of_start_failure_and_resume_in_order() -> None:
    calls: list[str] = []

    class Told(FakeJob):
        def _on_start(self, step: int) -> None:
            calls.append(f"start@{step}")

        def _on_failure(self, failure: Any) -> None:
            calls.append(f"failure@{failure.step}")

        def _on_resume(self, failure: Any) -> None:
            calls.append(f"resume@{failure.resumed_at}")

    Told(FailurePolicy(), {("step", 0, 3): death(3)})._control(4)
    assert calls == ["start@0", "failure@3", "resume@2"]


class Raising(FakeJob):
    """A job whose hook, policy or log call named by `where` raises `error` (once)."""

    def __init__(self, where: str, error: BaseException, plan: dict[tuple[str, int, int], BaseException]) -> None:
        where_, error_ = where, error

        class Policy(FailurePolicy):
            def retryable(self, failure: WorkerFailed) -> bool:
                if where_ == "retryable":
                    raise error_
                return super().retryable(failure)

        super().__init__(Policy(max_failures=3), plan)
        self.where, self.error = where, error
        if where == "log":
            self._log = _FailingLog(self._log, "driver.worker_failed", error)

    def _on_start(self, step: int) -> None:
        if self.where == "on_start":
            raise self.error

    def _on_failure(self, failure: Any) -> None:
        if self.where == "on_failure":
            raise self.error


class _FailingLog:
    """A logger whose `error(event)` raises for one event; every other call goes to `inner`."""

    def __init__(self, inner: Any, event: str, error: BaseException) -> None:
        self.inner, self.event, self.raised = inner, event, error

    def error(self, event: str, **fields: Any) -> None:
        if event == self.event:
            raise self.raised
        self.inner.error(event, **fields)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize(("where", "error"), [
    ("on_start", KeyboardInterrupt()), ("on_start", ValueError("hook broke")),
    ("on_failure", KeyboardInterrupt()), ("on_failure", ValueError("hook broke")),
    ("retryable", KeyboardInterrupt()), ("retryable", TypeError("policy broke")),
    ("log", OSError("log sink full")),
], ids=lambda v: v if isinstance(v, str) else type(v).__name__)
def test_anything_raised_while_running_gives_up_so_the_driver_never_ends_running(where: str,
                                                                                 error: BaseException) -> None:
    job = Raising(where, error, {("step", 0, 2): death(2)})
    with pytest.raises(type(error)) as info:
        job._control(5)
    assert info.value is error, "raised as is"
    assert job.state is D.ERRORED and job.path.states[-2:] == [D.RUNNING, D.ERRORED]
    give_up = job.history[-1]
    assert (give_up.trigger, give_up.ok, give_up.path) == ("give_up", False, (D.RUNNING, D.ERRORED))
    assert type(error).__name__ in (give_up.error or "")
    assert job.log[-1] != "close", "no finish after giving up"


def test_anything_raised_while_recovering_fails_the_recovery_into_errored() -> None:
    class RebuildHookRaises(FakeJob):
        """The hook of the first failure (judged RUNNING) passes; the one of a failure while the
        group is rebuilt (judged RECOVERING) raises."""

        def _on_failure(self, failure: Any) -> None:
            if failure.incarnation == 1:
                raise KeyboardInterrupt

    job = RebuildHookRaises(FailurePolicy(max_failures=3), {("step", 0, 3): death(3), ("start", 1, 2): death(2)})
    with pytest.raises(KeyboardInterrupt):
        job._control(5)
    assert job.state is D.ERRORED and job.path.states[-3:] == [D.RUNNING, D.RECOVERING, D.ERRORED]
    assert triggers(job) == [("start", True), ("recover", False)]
