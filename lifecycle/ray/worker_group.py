"""The Ray actors of one incarnation of the job: started, called, checked and stopped here.

Every call the driver makes to its workers goes through `WorkerGroup.gather`: results in
order, the first failure raised at once as a `WorkerFailed` whose `FailureKind` the
`FailurePolicy` reads (Ray's exception types are known here and nowhere above). While it
waits, and once more when a call took half the shortest watchdog budget, the group asks
the workers it waits on for phases past their budget, through `overdue_reports`, a method of
the `watch` concurrency group: it runs on a thread of the worker's own, so it answers while
the worker is still busy inside the phase. Before the group is stopped, `settle_saves` (of the
same group) gives each trainer's async save in flight time to commit.

Ray is imported inside the methods only.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog

from lifecycle.errors import ConfigError, LifecycleError, shorten
from lifecycle.ray.actors import WATCH, deferred
from lifecycle.ray.policy import FailureKind, StandIn, WorkerFailed
from lifecycle.ray.preflight import check_feasible, check_picklable
from lifecycle.ray.reaping import pidfd, reap
from lifecycle.ray.recipe import WorkerSpec
from lifecycle.records import message

OverdueSink = Callable[[str, Mapping[str, Any]], None]
"""Called with the worker's name and each report it handed over."""
ANSWER_S = 3.0
"""How long the group waits for workers to say whether they have a save in flight, and past a
worker's own wait for its answer (`settle_saves`)."""


class WorkerGroup:
    """Starts, calls, checks and stops the job's Ray actors (one group per incarnation)."""

    def __init__(self, *, call_timeout_s: float, poll_s: float, options: Mapping[str, Mapping[str, Any]],
                 on_overdue: OverdueSink, overdue_after_s: float | None = None) -> None:
        """`overdue_after_s`: the shortest watchdog budget of any worker; a call that took half as
        long may have had a phase past its budget (the calls were sent a moment before the wait
        began), so its workers are asked once more when it has returned: a phase that ended
        before the first poll would be missed. None: no budgets, nothing is ever overdue."""
        self.call_timeout_s = call_timeout_s
        self.poll_s = poll_s
        self.options = options
        self.on_overdue = on_overdue
        self.overdue_after_s = overdue_after_s
        self.handles: dict[str, Any] = {}
        self.pids: dict[str, int] = {}
        self.host = "127.0.0.1"
        """Where a trainer's rendezvous is reachable: loopback when every worker shares the driver's node."""
        self.at: tuple[str, int] = ("start", 0)
        """The driver's loop phase and step the calls belong to; names a failure."""
        self._polls: dict[str, Any] = {}
        self._pidfds: dict[str, int] = {}
        """A pidfd per worker on the driver's node whose process it could name for sure (`track`)."""
        self._sized = False
        """Whether the actor options were checked against the cluster's size (the first `start`)."""

    def __getitem__(self, name: str) -> Any:
        """Worker `name`'s actor handle; a `LifecycleError` naming the group's workers when it has none."""
        if name not in self.handles:
            raise self._unknown(name)
        return self.handles[name]

    def _unknown(self, name: str) -> LifecycleError:
        known = ", ".join(self.handles)
        return LifecycleError(f"no worker {name!r} in the group; its workers: {known}" if known else
                              f"no worker group is running (none before the run starts it or after it ended): "
                              f"no worker {name!r} to reach")

    def call(self, name: str, method: str, *args: Any) -> Any:
        """One call of worker `name`'s `method`, waited for like the driver's own (`gather`)."""
        try:
            bound = getattr(self[name], method)
        except AttributeError:
            raise LifecycleError(f"worker {name!r} has no method {method!r}") from None
        try:
            ref = bound.remote(*args)  # Ray binds the arguments to the method's signature here
        except TypeError as exc:
            raise LifecycleError(f"worker {name!r}: {method}() cannot take arguments {shorten(args)}: {exc}") from None
        return self.gather([(name, ref)])[0]

    def start(self, workers: Sequence[tuple[str, type, str, WorkerSpec]]) -> None:
        """Create one actor per (name, class, role, spec); learn each one's pid and node. Every
        role's options and every recipe are checked before any actor starts; what Ray refuses as
        an actor is created is a `ConfigError` naming the role's options (the actors created so
        far are kept, for `stop`). The options are checked against the cluster's size at the
        group's first start only: a rebuild after a node was lost would find it no longer counted,
        and its actors wait for a node to come back rather than the run ending."""
        import ray

        actors = []
        for name, cls, role, spec in workers:
            options: dict[str, Any] = {"num_cpus": 0, **self.options.get(role, {}), "max_restarts": 0,
                                       "max_task_retries": 0}  # the driver restarts workers, never Ray
            try:
                actors.append((name, role, ray.remote(concurrency_groups={WATCH: 1})(deferred(cls)).options(**options),
                               spec))
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"driver.options.{role}", f"Ray refused these actor options: {exc}") from None
        if not self._sized:
            for role in dict.fromkeys(role for _, _, role, _ in workers):
                check_feasible(role, self.options.get(role, {}))
            self._sized = True
        for recipe in {id(spec.recipe): spec.recipe for _, _, _, spec in workers}.values():
            check_picklable(recipe)
        for name, role, actor, spec in actors:
            try:
                self.handles[name] = actor.remote(spec)
            except (ValueError, TypeError) as exc:  # a name taken (ActorAlreadyExistsError), a runtime_env
                raise ConfigError(f"driver.options.{role}", f"Ray refused to create worker {name}: "
                                                            f"{type(exc).__name__}: {shorten(str(exc), 300)}") from None
        names = list(self.handles)
        processes = dict(zip(names, self.gather([(n, self.handles[n].process.remote()) for n in names])))
        self.pids = {name: pid for name, (pid, _) in processes.items()}
        nodes = dict(zip(names, self.gather([(n, self.handles[n].node.remote()) for n in names])))
        here = ray.util.get_node_ip_address()
        self.host = "127.0.0.1" if set(nodes.values()) == {here} else nodes[names[0]]
        for name, (pid, started) in processes.items():
            if nodes[name] == here:
                self.track(name, pid, started)
        self.gather([(n, self.handles[n].build.remote()) for n in names])

    def track(self, name: str, pid: int, started: int | None) -> bool:
        """Hold a pidfd of worker `name`'s process (`pid`, which started at `started`, as the worker
        reported), so `stop` and `kill` signal that process and no other, even once its pid is
        reused or when the pid is of another pid namespace. The pidfd is opened first and kept only
        if the process at `pid` here still started at `started`: then it was that process already
        when the pidfd was opened. Where that cannot be made sure (no pidfd, no /proc), nothing is
        held and the process is left to Ray's kill. Whether a pidfd is held."""
        fd = pidfd(pid, started)
        if isinstance(fd, str):
            structlog.get_logger().info("driver.worker_left_to_ray", worker=name, pid=pid, reason=fd)
            return False
        old = self._pidfds.pop(name, None)
        if old is not None:
            os.close(old)
        self._pidfds[name] = fd
        return True

    def kill(self, name: str) -> int:
        """SIGKILL a worker's process, as a crash would, through its pidfd (`ray.kill` where none is
        held: a worker on another node, or no pidfd here); its pid."""
        import ray

        pid = self.pids.get(name)
        if pid is None:
            raise self._unknown(name) if name not in self.handles else LifecycleError(
                f"worker {name!r} has not reported its process yet: the group is still starting")
        fd = self._pidfds.get(name)
        if fd is None:
            ray.kill(self[name], no_restart=True)
            return pid
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass  # gone already
        return pid

    def settle_saves(self, timeout_s: float, skip: Sequence[str] = ()) -> None:
        """Give each trainer's async save in flight up to `timeout_s` to commit, before the group is
        stopped: a healthy trainer killed mid-commit loses a step its peers may have committed, and
        every role then resumes from an older one. The workers are asked first which of them has a
        save in flight (`ANSWER_S` for the answers: one on a lost node never answers), then only
        those are waited for; each waits on its own thread (`watch` group). A save that did not
        commit, or a worker that did not answer, is logged (`driver.save_unsettled`). `skip`: the
        workers not asked (one that hung in its call: the failure being recovered)."""
        names = [name for name in self.handles if name not in skip]
        if timeout_s <= 0 or not names:
            return
        first, silent = self._settle(names, 0.0, ANSWER_S)
        writing = [name for name, report in first.items() if report is not None and not report["committed"]]
        final, late = self._settle(writing, timeout_s, timeout_s + ANSWER_S)
        log = structlog.get_logger()
        phase, step = self.at
        for name, report in final.items():
            if report is not None and report["committed"]:
                log.info("driver.save_settled", worker=name, driver_phase=phase, driver_step=step, **report)
            elif report is not None:
                log.warning("driver.save_unsettled", worker=name, driver_phase=phase, driver_step=step, **report)
        for name, waited in [(name, ANSWER_S) for name in silent] + [(name, timeout_s + ANSWER_S) for name in late]:
            log.warning("driver.save_unsettled", worker=name, driver_phase=phase, driver_step=step,
                        reason=f"no answer within {waited:g} s")

    def _settle(self, names: Sequence[str], timeout_s: float, wait_s: float) -> tuple[dict[str, Any], list[str]]:
        """`settle_saves(timeout_s)` of each of `names`, in the `watch` group, waited for up to
        `wait_s`: {name: report} of those that answered (a dead worker's failed call left out),
        and the names of those that did not answer in time."""
        import ray
        from ray.exceptions import RayError

        asked = {name: self.handles[name].settle_saves.options(concurrency_group=WATCH).remote(timeout_s)
                 for name in names if name in self.handles}
        if not asked:
            return {}, []
        ready, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=wait_s)
        answers: dict[str, Any] = {}
        for name, ref in asked.items():
            if ref in ready:
                try:
                    answers[name] = ray.get(ref)
                except RayError:
                    continue  # dead: nothing of it to wait for
        return answers, [name for name, ref in asked.items() if ref not in ready]

    def stop(self, grace_s: float = 5.0) -> None:
        """Kill every actor of the group (a dead one is already gone; killing it again is harmless).

        For each worker whose pidfd it holds (`track`), also wait until its process is gone, and
        SIGKILL it through the pidfd if still there after `grace_s`: an actor that Ray lets exit
        gracefully waits for its non-daemon threads (a background save's writer), and a rebuilt
        group must not start beside it. No process is signalled by pid. The handles are held
        until then, so Ray sees a kill, not handles going out of scope; the pidfds are closed
        whatever happens. Saves in flight are `settle_saves`'s to wait for, before this.
        """
        import ray

        try:
            for handle in self.handles.values():
                ray.kill(handle, no_restart=True)
            reap(list(self._pidfds.values()), grace_s)
        finally:
            for fd in self._pidfds.values():
                os.close(fd)
            self.handles, self.pids, self._polls, self._pidfds = {}, {}, {}, {}

    def gather(self, calls: Sequence[tuple[str, Any]]) -> list[Any]:
        """Results in order; the first failure is raised at once as `WorkerFailed`, naming a dead
        worker over one whose call failed because of it. Overdue phases are asked for meanwhile,
        and once more when the calls have returned, if they took half the shortest budget."""
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        names = {ref: name for name, ref in calls}
        pending = [ref for _, ref in calls]
        results: dict[Any, Any] = {}
        started = time.monotonic()
        deadline = started + self.call_timeout_s
        phase, step = self.at
        while pending:
            left = deadline - time.monotonic()
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, min(left, self.poll_s)))
            if not ready:
                if left <= self.poll_s:
                    stuck = GetTimeoutError(f"no answer within call_timeout_s={self.call_timeout_s:g}")
                    raise WorkerFailed(names[pending[0]], phase, step, stuck, FailureKind.TIMED_OUT)
                self.poll_overdue([names[ref] for ref in pending])
                continue
            try:
                results[ready[0]] = ray.get(ready[0])
            except RayError as exc:
                raise self._failure(exc, names[ready[0]], pending, names) from exc
        if self.overdue_after_s is not None and time.monotonic() - started >= self.overdue_after_s / 2:
            self.drain_overdue(list(dict.fromkeys(names.values())))
        return [results[ref] for _, ref in calls]

    def drain_overdue(self, names: Sequence[str]) -> None:
        """Collect what `names` still hold of overdue reports (after their calls returned, before
        the group stops): a poll still out from the wait is read first, and its worker asked once
        more, for reports that came after it had answered."""
        out = [name for name in names if name in self._polls]
        self.poll_overdue(names)
        again = [name for name in out if name not in self._polls]
        if again:
            self.poll_overdue(again)

    def poll_overdue(self, busy: Sequence[str]) -> None:
        """Ask each busy worker for its overdue reports; hand each to `on_overdue`. An answer not
        back within the wait is kept and read on a later poll, so no report is lost."""
        import ray
        from ray.exceptions import RayError

        for name in busy:
            if name not in self._polls and name in self.handles:
                self._polls[name] = self.handles[name].overdue_reports.options(concurrency_group=WATCH).remote()
        if not self._polls:
            return
        refs = list(self._polls.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=min(0.5, self.poll_s))
        for name, ref in list(self._polls.items()):
            if ref not in ready:
                continue
            del self._polls[name]
            try:
                reports = ray.get(ref)
            except RayError:
                continue  # a dead worker: the call the driver waits on reports the death
            for report in reports:
                self.on_overdue(name, report)

    def _failure(self, exc: BaseException, name: str, pending: list[Any], names: Mapping[Any, str]) -> WorkerFailed:
        """Ray's exception as a `WorkerFailed`: a dead worker (Ray's `RayActorError`, or another
        error of Ray's) is DIED, but a `RaySystemError` (a result that would not unpickle here)
        from a worker that still answers is RAISED; a call that raised is RAISED with its own error,
        unless a worker still waited on turns out dead, which is then the one named. An error the
        driver could not unpickle (Ray's `UnserializableException`: its class cannot be imported
        or rebuilt here) is RAISED too, as a `StandIn` of the type name and message Ray kept in
        its text: the policy retries it as any raised error it does not know to be fatal, since
        no class of it can be matched, and the run's failure record names the worker's error."""
        import ray.exceptions
        from ray.exceptions import RayActorError, RaySystemError, RayTaskError

        unpicklable = getattr(ray.exceptions, "UnserializableException", ())  # not in every Ray release
        phase, step = self.at
        if isinstance(exc, RayActorError):
            return WorkerFailed(name, phase, step, exc, FailureKind.DIED)
        dead = self._dead_among(pending, names)
        if dead is not None:
            return WorkerFailed(dead[0], phase, step, dead[1], FailureKind.DIED)
        if isinstance(exc, RayTaskError):
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            return WorkerFailed(name, phase, step, exc, FailureKind.RAISED, cause)
        if isinstance(exc, RaySystemError) and self._answers(name):  # alive: only its result did not unpickle here
            structlog.get_logger().warning("driver.worker_result_unreadable", worker=name, driver_phase=phase,
                                           driver_step=step, error=shorten(str(exc), 4000))
            return WorkerFailed(name, phase, step, exc, FailureKind.RAISED)
        if isinstance(exc, unpicklable):
            text = str(getattr(exc, "_original_stack_trace", "") or "")
            structlog.get_logger().warning("driver.worker_error_unreadable", worker=name, driver_phase=phase,
                                           driver_step=step, traceback=shorten(text, 4000))
            return WorkerFailed(name, phase, step, _stand_in(text, exc), FailureKind.RAISED)
        return WorkerFailed(name, phase, step, exc, FailureKind.DIED)

    def _answers(self, name: str, timeout_s: float = ANSWER_S) -> bool:
        """Whether worker `name` answers `overdue_reports` within `timeout_s` (the reports are handed on)."""
        import ray
        from ray.exceptions import RayError

        if name not in self.handles:
            return False
        ref = self.handles[name].overdue_reports.options(concurrency_group=WATCH).remote()
        ready, _ = ray.wait([ref], timeout=timeout_s)
        try:
            reports = ray.get(ready[0]) if ready else None
        except RayError:
            return False
        for report in reports or ():
            self.on_overdue(name, report)
        return reports is not None

    def _dead_among(self, refs: list[Any], names: Mapping[Any, str],
                    grace_s: float = 3.0) -> tuple[str, BaseException] | None:
        """A worker whose call is still out and turns out dead: the cause, when another call failed."""
        import ray
        from ray.exceptions import RayActorError, RayError

        if not refs:
            return None
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=grace_s)
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError as exc:
                return names[ref], exc
            except RayError:
                continue
        return None


def _stand_in(text: str, error: BaseException) -> StandIn:
    """The error a worker raised, as Ray's text of it names it: the first line at the margin after
    the last frame of its traceback reads `Type: message` (message lines may follow)."""
    lines = text.splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    start = next((i for i in range(frames[-1] + 1, len(lines)) if lines[i][:1].strip()), None) if frames else None
    if start is not None:
        kind, _, said = "\n".join(lines[start:]).strip().partition(": ")
        kind = kind.rpartition(".")[2]
        if kind.isidentifier():
            return StandIn(kind, said)
    return StandIn(type(error).__name__, message(error))


__all__ = ["WATCH", "OverdueSink", "WorkerGroup", "deferred"]
