"""Processes that take what they start with them: each leads a process group, killed whole.

A rank of `lifecycle convert`, or of a multi-process test, may start processes of its own
(dist_checkpointing starts a multiprocessing manager in a rank that writes). Each rank leads a
process group, which they join; when the rank ends, or is ended because a peer failed, its
whole group is killed, so nothing it started outlives it. A rank whose parent died kills its
own group, watching the parent's pid its parent passed it (`lead_own_group`).
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import select
import signal
import threading
import time
from collections.abc import Callable


def lead_own_group(parent: int | None = None) -> None:
    """Lead a new process group (before starting anything), and end it once `parent` is gone: a
    rank orphaned by a killed parent would otherwise wait for its peers until the group's timeout,
    or run a whole conversion alone.

    `parent` is the pid of the process that started this one, passed in by it: read here, after
    a spawned process's imports (seconds), a parent killed meanwhile would be taken for the reaper
    that adopted this one. A process whose parent is no longer `parent` ends at once. Left out,
    the parent is the one this process has now.
    """
    if not hasattr(os, "setpgrp"):
        return
    os.setpgrp()
    parent = os.getppid() if parent is None else parent
    wait = _exit_of(parent)
    if os.getppid() != parent:
        os.killpg(0, signal.SIGKILL)

    def watch() -> None:
        wait()
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _exit_of(parent: int) -> Callable[[], object]:
    """A call that returns once `parent` has exited: a wait on its pidfd where the kernel has
    them, else a poll of getppid(). The pidfd is opened before the caller checks that `parent` is
    still its parent, so it names that process, not a later one given the same pid."""
    try:
        pidfd = os.pidfd_open(parent)
    except (AttributeError, OSError):  # not Linux 5.3+, or the parent is gone already
        return functools.partial(_poll_parent, parent)
    return functools.partial(select.select, [pidfd], [], [])


def _poll_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)


def exited(proc: mp.process.BaseProcess) -> bool | None:
    """True once `proc` has exited, False while it runs, None once it was reaped; reaps nothing itself.

    Until it is reaped, its pid, and so the id of the process group it leads, stays reserved.
    """
    if not hasattr(os, "waitid"):
        return None if not proc.is_alive() else False  # is_alive reaps: no group kill after it
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return None


def end_group(proc: mp.process.BaseProcess) -> None:
    """SIGKILL what is left of the process group `proc` leads (proc itself, a manager it started), then reap it."""
    if proc.pid is None:
        return
    if hasattr(os, "killpg") and exited(proc) is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # nothing left in it, or proc never got to lead one
    proc.kill()
    proc.join()
