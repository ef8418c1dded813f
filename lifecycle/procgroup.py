"""Processes that take what they start with them: each leads a process group, killed whole.

A rank of `lifecycle convert`, or of a multi-process test, may start processes of its own
(dist_checkpointing starts a multiprocessing manager in a rank that writes). Each rank leads a
process group, which they join; when the rank ends, or is ended because a peer failed, its
whole group is killed, so nothing it started outlives it. A rank whose parent died kills its
own group.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time


def lead_own_group() -> None:
    """Lead a new process group (before starting anything), and end it if the parent dies: a rank
    orphaned by a killed parent would otherwise wait for its peers until the group's timeout."""
    if not hasattr(os, "setpgrp"):
        return
    os.setpgrp()
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


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
