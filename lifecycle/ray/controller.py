"""The driver's run as a machine (`lifecycle.machine.DRIVER_TABLE`), in the shape of Ray Train v2's controller.

CREATED -> INITIALIZING -> RUNNING, then RECOVERING and back after each failure the
`FailurePolicy` retries, FINISHING -> FINISHED at the end, ERRORED when it gives up. The state
changes in one place (`Stateful._move`); each trigger is a phase (`phase.Phase`) and leaves
one `lifecycle.transition` record with role `driver`, so the driver's history lines up with
its workers' in one trace. What follows a failure is the policy's decision, carried out here:
`recover` (tear the group down, build it again, resume) or `give_up` (raise `RunFailed`).

`Controller` is the mechanism; a subclass (`lifecycle.ray.Driver`) says what the job is: how a
group starts (`_start_group`), what a step is (`_run_step`), how the group closes and stops.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import NoReturn

from lifecycle.machine import DRIVER, DriverState
from lifecycle.phase import Observer, Phase
from lifecycle.ray.policy import (
    Decision,
    FailurePolicy,
    RunFailed,
    Verdict,
    WorkerFailed,
    plain,
)
from lifecycle.ray.run_report import Failure, RunSummary
from lifecycle.records import message
from lifecycle.stateful import Stateful


"""Terminal colour and cursor codes, which Ray writes into the text of a worker's error."""


class Controller(Stateful[DriverState]):
    """Runs a job's steps through the driver's machine; restarts as its `FailurePolicy` decides."""

    def __init__(self, policy: FailurePolicy, *, observers: Iterable[Observer] = ()) -> None:
        super().__init__(DRIVER, role="driver", rank=0, observers=observers)
        self.policy = policy
        self.incarnation = 0
        """How many times the worker group was rebuilt (0: the first group)."""
        self.summary = RunSummary()
        self.stopping_for: Failure | None = None
        """The failure the group is being stopped for (None when the run ends): `_stop_group` need
        not wait on a worker that hung."""

    def _control(self, last: int) -> None:
        """Start, run every step up to `last` and close the workers, through failures (a death as
        they close is recovered like one in a step), finish. Raises `RunFailed` when the policy
        gives up, and whatever the driver itself raised (both leave it ERRORED).

        It ends FINISHED or ERRORED, never RUNNING: a phase that fails ends ERRORED, and anything
        raised between phases or as one ends (a step, a hook, the policy, an observer, an
        interrupt) gives up."""
        step = None
        try:
            with Phase(self, "start", None) as phase:
                resumed = self._bring_up(None)
                phase.step = resumed
                phase.figures.update(incarnation=self.incarnation, resumed_at=resumed)
            step = resumed + 1
            self.summary.started_at = resumed
            self._on_start(resumed)
            while True:
                try:
                    if step <= last:
                        self._run_step(step)
                        step += 1
                        continue
                    self._close_group()  # still RUNNING: a death as the workers close is recovered too
                    break
                except WorkerFailed as failed:
                    step = self._recover(failed) + 1
            with Phase(self, "finish", last) as phase:  # inside: an interrupt before its move gives up
                phase.figures["incarnation"] = self.incarnation
        except BaseException as exc:  # the driver's own error, a hook's, the policy's or an interrupt
            if self.state is DriverState.RUNNING:
                self._give_up(step, exc)
            raise

    def _recover(self, failed: WorkerFailed) -> int:
        """RUNNING -> RECOVERING -> RUNNING, or `give_up` when the policy says so; the step resumed
        at. What `_judge` raises here (the policy, a hook) is left to `_control`, which gives up."""
        failure, verdict = self._judge(failed)
        if verdict.decision is Decision.GIVE_UP:
            self._give_up(failed.step, RunFailed(verdict.reason, failed), failed.cause)
        with Phase(self, "recover", failed.step) as phase:
            resumed = self._bring_up(failure)
            phase.figures.update(worker=failed.worker, phase=failed.phase, kind=failed.kind.value,
                                 incarnation=self.incarnation, resumed_at=resumed)
        return resumed

    def _bring_up(self, failure: Failure | None) -> int:
        """Build the group and resume it, again after each failure the policy retries (inside
        INITIALIZING or RECOVERING); the step resumed at. A refusal raises `RunFailed`. Every
        failure this recovery covered (the one it began with, and each while rebuilding) is
        resumed by the group that comes up: each gets `resumed_at` and its own `recovery_s`."""
        covered: list[tuple[Failure, float]] = [] if failure is None else [(failure, time.perf_counter())]
        while True:
            if failure is not None:
                self.stopping_for = failure
                try:
                    self._stop_group()
                finally:
                    self.stopping_for = None
                self.incarnation += 1
            try:
                resumed = self._start_group()
            except WorkerFailed as again:
                failure, verdict = self._judge(again)
                covered.append((failure, time.perf_counter()))
                if verdict.decision is Decision.GIVE_UP:
                    raise RunFailed(verdict.reason, again) from again.cause
                continue
            for each, since in covered:
                each.resumed_at, each.recovery_s = resumed, time.perf_counter() - since
            if failure is not None:
                self._on_resume(failure)
            return resumed

    def _judge(self, failed: WorkerFailed) -> tuple[Failure, Verdict]:
        """Record the failure, ask the policy, log both; tell the subclass of a failure it retries."""
        failure = Failure(step=failed.step, phase=failed.phase, worker=failed.worker,
                          error=f"{failed.cause_type}: {plain(message(failed.cause))}",
                          incarnation=self.incarnation, kind=failed.kind.value)
        self.summary.failures.append(failure)
        verdict = self.policy.decide(failed, len(self.summary.failures))
        failure.gave_up = verdict.decision is Decision.GIVE_UP
        self._log.error("driver.worker_failed", worker=failure.worker, step=failure.step, phase=failure.phase,
                        error=failure.error, kind=failed.kind.value, failures=len(self.summary.failures),
                        max_failures=self.policy.max_failures, decision=verdict.decision.value)
        if verdict.decision is Decision.RETRY:
            self._on_failure(failure)
        return failure, verdict

    def _give_up(self, step: int | None, error: BaseException, cause: BaseException | None = None) -> NoReturn:
        """RUNNING -> ERRORED; the `give_up` record carries the error, which is raised."""
        with Phase(self, "give_up", step) as phase:
            failed = error.failure if isinstance(error, RunFailed) else None
            if failed is not None:
                phase.figures.update(worker=failed.worker, phase=failed.phase, kind=failed.kind.value)
            if cause is not None:
                raise error from cause
            raise error

    def _start_group(self) -> int:
        """Build a worker group, resume it and make it ready to step; the step it resumed at."""
        raise NotImplementedError

    def _run_step(self, step: int) -> None:
        """One step; a worker's failure raises `WorkerFailed`."""
        raise NotImplementedError

    def _close_group(self) -> None:
        """After the last step: close the workers (pending saves commit)."""
        raise NotImplementedError

    def _stop_group(self) -> None:
        """Kill whatever is left of the group (before a rebuild, and when the run ends)."""
        raise NotImplementedError

    def _on_start(self, step: int) -> None:
        """The first group is up at `step`."""

    def _on_failure(self, failure: Failure) -> None:
        """A failure the policy retries, before the group is rebuilt."""

    def _on_resume(self, failure: Failure) -> None:
        """The group rebuilt after `failure` has resumed (`failure.resumed_at`, `.recovery_s`)."""


__all__ = ["Controller"]
