"""The Ray actors of one incarnation of the job: started, called, checked and stopped here.

Every call the driver makes to its workers goes through `WorkerGroup.gather`: results in
order, the first failure raised at once as a `WorkerFailed` whose `FailureKind` the
`FailurePolicy` reads (Ray's exception types are known here and nowhere above). While it
waits, the group asks the workers it waits on for phases past their watchdog budget, through
`overdue_reports`, a method of the `watch` concurrency group: it runs on a thread of the
worker's own, so it answers while the worker is still busy inside the phase.

Ray is imported inside the methods only.
"""

from __future__ import annotations

import functools
import math
import os
import select
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog

from lifecycle.errors import ConfigError
from lifecycle.ray.policy import FailureKind, WorkerFailed
from lifecycle.ray.workers import WorkerSpec, process_start

WATCH = "watch"
"""The concurrency group of `overdue_reports`: one thread beside the worker's own."""
OverdueSink = Callable[[str, Mapping[str, Any]], None]
"""Called with the worker's name and each report it handed over."""


class WorkerGroup:
    """Starts, calls, checks and stops the job's Ray actors (one group per incarnation)."""

    def __init__(self, *, call_timeout_s: float, poll_s: float, options: Mapping[str, Mapping[str, Any]],
                 on_overdue: OverdueSink) -> None:
        self.call_timeout_s = call_timeout_s
        self.poll_s = poll_s
        self.options = options
        self.on_overdue = on_overdue
        self.handles: dict[str, Any] = {}
        self.pids: dict[str, int] = {}
        self.host = "127.0.0.1"
        """Where a trainer's rendezvous is reachable: loopback when every worker shares the driver's node."""
        self.at: tuple[str, int] = ("start", 0)
        """The driver's loop phase and step the calls belong to; names a failure."""
        self._polls: dict[str, Any] = {}
        self._pidfds: dict[str, int] = {}
        """A pidfd per worker on the driver's node whose process it could name for sure (`track`)."""

    def __getitem__(self, name: str) -> Any:
        return self.handles[name]

    def start(self, workers: Sequence[tuple[str, type, str, WorkerSpec]]) -> None:
        """Create one actor per (name, class, role, spec); learn each one's pid and node."""
        import ray

        actors = []  # every role's options checked before any actor starts
        for name, cls, role, spec in workers:
            options: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0, "max_task_retries": 0,
                                       **self.options.get(role, {})}
            try:
                actors.append((name, ray.remote(concurrency_groups={WATCH: 1})(deferred(cls)).options(**options), spec))
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"driver.options.{role}", f"Ray refused these actor options: {exc}") from None
        for name, actor, spec in actors:
            self.handles[name] = actor.remote(spec)
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
        fd = _pidfd(pid, started)
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

        pid = self.pids[name]
        fd = self._pidfds.get(name)
        if fd is None:
            ray.kill(self.handles[name], no_restart=True)
            return pid
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass  # gone already
        return pid

    def stop(self, grace_s: float = 5.0) -> None:
        """Kill every actor of the group (a dead one is already gone; killing it again is harmless).

        For each worker whose pidfd it holds (`track`), also wait until its process is gone, and
        SIGKILL it through the pidfd if still there after `grace_s`: an actor that Ray lets exit
        gracefully waits for its non-daemon threads (a background save's writer), and a rebuilt
        group must not start beside it. No process is signalled by pid. The handles are held
        until then, so Ray sees a kill, not handles going out of scope; the pidfds are closed
        whatever happens.
        """
        import ray

        try:
            for handle in self.handles.values():
                ray.kill(handle, no_restart=True)
            _reap(list(self._pidfds.values()), grace_s)
        finally:
            for fd in self._pidfds.values():
                os.close(fd)
            self.handles, self.pids, self._polls, self._pidfds = {}, {}, {}, {}

    def gather(self, calls: Sequence[tuple[str, Any]]) -> list[Any]:
        """Results in order; the first failure is raised at once as `WorkerFailed`, naming a dead
        worker over one whose call failed because of it. Overdue phases are asked for meanwhile."""
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        names = {ref: name for name, ref in calls}
        pending = [ref for _, ref in calls]
        results: dict[Any, Any] = {}
        deadline = time.monotonic() + self.call_timeout_s
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
        return [results[ref] for _, ref in calls]

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
        system error of Ray's) is DIED; a call that raised is RAISED with the worker's own error
        (or, when it could not be unpickled, Ray's `UnserializableException` in its place),
        unless a worker still waited on turns out dead, which is then the one named."""
        import ray.exceptions
        from ray.exceptions import RayActorError, RayTaskError

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
        if isinstance(exc, unpicklable):
            return WorkerFailed(name, phase, step, exc, FailureKind.RAISED)
        return WorkerFailed(name, phase, step, exc, FailureKind.DIED)

    def _dead_among(self, refs: list[Any], names: Mapping[Any, str],
                    grace_s: float = 3.0) -> tuple[str, BaseException] | None:
        """A worker whose call is still out and turns out dead: the cause, when another call failed."""
        import ray
        from ray.exceptions import RayActorError, RayError

        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=grace_s)
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError as exc:
                return names[ref], exc
            except RayError:
                continue
        return None


@functools.cache
def deferred(cls: type) -> type:
    """`cls` as a Ray actor builds it: constructed in a first call, `build()`, not in Ray's creation
    task. An error there reaches the driver as itself (a `ConfigError` ends the run, as
    `FailurePolicy.fatal` says), where one raised by the creation task kills the actor and
    reaches it as a death carrying only the error's text, which the policy retries. The pid and
    node are asked for before the build, so a build that hangs can be killed."""

    class Deferred(cls):  # type: ignore[valid-type,misc]
        def __init__(self, spec: WorkerSpec) -> None:  # noqa: D107 - the build comes later
            self._spec = spec

        def build(self) -> None:
            cls.__init__(self, self._spec)

    Deferred.__name__, Deferred.__qualname__ = cls.__name__, cls.__qualname__
    return Deferred


def _pidfd(pid: int, started: int | None) -> int | str:
    """A pidfd of the process at `pid` if it started at `started`; else why none is held."""
    if started is None:
        return "the worker could not read its start time (no /proc there)"
    if not hasattr(os, "pidfd_open") or not hasattr(signal, "pidfd_send_signal"):
        return "no pidfd_open or pidfd_send_signal here"
    try:
        fd = os.pidfd_open(pid)
    except OSError as exc:
        return f"pidfd_open({pid}) failed: {exc.strerror}"
    if process_start(pid) != started:
        os.close(fd)
        return "the process at that pid here did not start when the worker did (another pid namespace, or gone)"
    return fd


def _reap(pidfds: Sequence[int], grace_s: float, killed_s: float = 1.0) -> None:
    """Wait up to `grace_s` for the processes of `pidfds` to exit (a pidfd turns readable when its
    process has), SIGKILL the rest through their pidfds, and wait up to `killed_s` for those."""
    alive = _wait_exit(pidfds, grace_s)
    for fd in alive:
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass  # exited since
    _wait_exit(alive, killed_s)


def _wait_exit(pidfds: Sequence[int], timeout_s: float) -> list[int]:
    """The pidfds whose processes are still running after up to `timeout_s`."""
    poller = select.poll()
    for fd in pidfds:
        poller.register(fd, select.POLLIN)
    alive = set(pidfds)
    deadline = time.monotonic() + timeout_s
    while alive:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for fd, _ in poller.poll(math.ceil(left * 1000)):
            alive.discard(fd)
            poller.unregister(fd)
    return [fd for fd in pidfds if fd in alive]


__all__ = ["WATCH", "OverdueSink", "WorkerGroup", "deferred"]
