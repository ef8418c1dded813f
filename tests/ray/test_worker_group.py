"""`WorkerGroup.stop` and `kill` signal a worker's own process only: through a pidfd opened while
its pid and start time still named it, never by pid. Real processes stand in for the workers (a
`sleep` titled as Ray titles its workers); no Ray cluster is started."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import pytest
from structlog.testing import capture_logs

from lifecycle.ray.worker_group import WorkerGroup
from lifecycle.ray.workers import process_start

ray = pytest.importorskip("ray")  # `stop` asks Ray to kill the handles first (there are none here)
pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open") or process_start() is None,
                                reason="needs pidfd_open and /proc")


@pytest.fixture
def titled() -> Iterator[subprocess.Popen[bytes]]:
    """A process titled `ray::IDLE`, as an idle Ray worker is; killed at the end if still there."""
    process = subprocess.Popen(["ray::IDLE", "60"], executable="/bin/sleep")
    yield process
    if process.poll() is None:
        process.kill()
    process.wait()


def group() -> WorkerGroup:
    return WorkerGroup(call_timeout_s=5, poll_s=1, options={}, on_overdue=lambda name, report: None)


def test_a_process_at_a_recorded_pid_that_started_at_another_time_is_never_signalled(
        titled: subprocess.Popen[bytes]) -> None:
    """Another job's worker, or a pid reused since: its title is a Ray worker's, its start time is not ours."""
    workers = group()
    workers.pids = {"rollout0": titled.pid}
    with capture_logs() as logs:
        assert workers.track("rollout0", titled.pid, process_start(titled.pid) + 1) is False  # type: ignore[operator]
    [left] = [r for r in logs if r["event"] == "driver.worker_left_to_ray"]
    assert (left["worker"], left["pid"]) == ("rollout0", titled.pid) and "did not start" in left["reason"]
    workers.stop(grace_s=0.2)
    time.sleep(0.2)
    assert titled.poll() is None, "still running"


def test_a_worker_process_still_there_after_the_grace_period_is_killed_through_its_pidfd(
        titled: subprocess.Popen[bytes]) -> None:
    workers = group()
    workers.pids = {"actor": titled.pid}
    assert workers.track("actor", titled.pid, process_start(titled.pid))
    [fd] = workers._pidfds.values()
    started = time.monotonic()
    workers.stop(grace_s=0.3)
    assert titled.wait(5) == -9 and time.monotonic() - started >= 0.3
    assert workers._pidfds == {} and workers.pids == {}
    with pytest.raises(OSError):
        os.fstat(fd)  # closed


def test_stop_returns_as_soon_as_the_workers_have_exited(titled: subprocess.Popen[bytes]) -> None:
    workers = group()
    assert workers.track("actor", titled.pid, process_start(titled.pid))
    titled.terminate()
    started = time.monotonic()
    workers.stop(grace_s=30)
    assert time.monotonic() - started < 5 and titled.wait(5) == -15


def test_kill_sends_sigkill_through_the_pidfd(titled: subprocess.Popen[bytes]) -> None:
    workers = group()
    workers.pids = {"critic": titled.pid}
    assert workers.track("critic", titled.pid, process_start(titled.pid))
    assert workers.kill("critic") == titled.pid and titled.wait(5) == -9
    workers.stop(grace_s=0.1)


@pytest.mark.parametrize("why", ["no start time", "no pidfd"])
def test_without_a_start_time_or_pidfds_a_worker_is_left_to_ray(titled: subprocess.Popen[bytes], why: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    started = process_start(titled.pid)
    if why == "no pidfd":
        monkeypatch.delattr(os, "pidfd_open")
    else:
        started = None
    workers = group()
    with capture_logs() as logs:
        assert workers.track("actor", titled.pid, started) is False
    assert [r["worker"] for r in logs if r["event"] == "driver.worker_left_to_ray"] == ["actor"]
    workers.stop(grace_s=0.1)
    assert titled.poll() is None


def test_the_pidfds_are_closed_when_stop_fails(titled: subprocess.Popen[bytes],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    workers = group()
    assert workers.track("actor", titled.pid, process_start(titled.pid))
    [fd] = workers._pidfds.values()
    workers.handles = {"actor": object()}

    def refuses(handle: object, no_restart: bool) -> None:
        raise RuntimeError("Ray is shutting down")

    monkeypatch.setattr(ray, "kill", refuses)
    with pytest.raises(RuntimeError, match="shutting down"):
        workers.stop(grace_s=0.1)
    assert workers._pidfds == {}
    with pytest.raises(OSError):
        os.fstat(fd)
