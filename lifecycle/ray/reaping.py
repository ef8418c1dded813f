"""Signalling a worker's own process, and no other: through a pidfd opened while its pid and start
time still named it, never by a bare pid (`lifecycle.ray.worker_group` holds one per worker)."""

from __future__ import annotations

import math
import os
import select
import signal
import time
from collections.abc import Sequence

from lifecycle.ray.workers import process_start


def pidfd(pid: int, started: int | None) -> int | str:
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


def reap(pidfds: Sequence[int], grace_s: float, killed_s: float = 1.0) -> None:
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


__all__ = ["pidfd", "reap"]
