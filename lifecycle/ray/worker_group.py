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

import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lifecycle.ray.policy import FailureKind, WorkerFailed
from lifecycle.ray.workers import WorkerSpec

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

    def __getitem__(self, name: str) -> Any:
        return self.handles[name]

    def start(self, workers: Sequence[tuple[str, type, str, WorkerSpec]]) -> None:
        """Create one actor per (name, class, role, spec); learn each one's pid and node."""
        import ray

        for name, cls, role, spec in workers:
            options: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0, "max_task_retries": 0,
                                       **self.options.get(role, {})}
            self.handles[name] = ray.remote(concurrency_groups={WATCH: 1})(cls).options(**options).remote(spec)
        names = list(self.handles)
        self.pids = dict(zip(names, self.gather([(n, self.handles[n].pid.remote()) for n in names])))
        nodes = dict(zip(names, self.gather([(n, self.handles[n].node.remote()) for n in names])))
        here = ray.util.get_node_ip_address()
        self.host = "127.0.0.1" if set(nodes.values()) == {here} else nodes[names[0]]

    def kill(self, name: str) -> int:
        """SIGKILL a worker's process, as a crash would (`ray.kill` when the group spans nodes); its pid."""
        import ray

        pid = self.pids[name]
        if self.host == "127.0.0.1":
            os.kill(pid, signal.SIGKILL)
        else:
            ray.kill(self.handles[name], no_restart=True)
        return pid

    def stop(self, grace_s: float = 5.0) -> None:
        """Kill every actor of the group (a dead one is already gone; killing it again is harmless).

        On one node, also wait until their processes are gone, and SIGKILL any still there after
        `grace_s`: an actor that Ray lets exit gracefully waits for its non-daemon threads (a
        background save's writer), and a rebuilt group must not start beside it. The handles
        are held until then, so Ray sees a kill, not handles going out of scope.
        """
        import ray

        for handle in self.handles.values():
            ray.kill(handle, no_restart=True)
        if self.host == "127.0.0.1":
            _reap(list(self.pids.values()), grace_s)
        self.handles, self.pids, self._polls = {}, {}, {}

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


def _reap(pids: list[int], grace_s: float) -> None:
    """Wait for `pids` to exit; SIGKILL the ones still running Ray workers after `grace_s`."""
    deadline = time.monotonic() + grace_s
    alive = [pid for pid in pids if _is_ray_worker(pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid in alive if _is_ray_worker(pid)]
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _is_ray_worker(pid: int) -> bool:
    """Whether `pid` still runs a Ray worker (its title starts `ray::`; a zombie's is empty), so a
    pid the system gave to another process since is never killed. Where there is no /proc, any live pid."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read(5) == b"ray::"
    except FileNotFoundError:
        if os.path.isdir("/proc"):
            return False
    except OSError:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    return True


__all__ = ["WATCH", "OverdueSink", "WorkerGroup"]
