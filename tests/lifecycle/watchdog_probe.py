"""Run by `test_watchdog.py` in a child process: a phase stuck in a way the watchdog's Python
thread cannot or can report, with the backstop on, 1 s after the deadline.

    python watchdog_probe.py gil      # stuck in native code holding the GIL for 3 s
    python watchdog_probe.py sleep    # stuck 1.5 s with the GIL free: the thread reports
    python watchdog_probe.py fork     # forks in the phase; the child exits through finalization
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

from lifecycle import Lifecycle
from lifecycle.testing import MemoryCheckpointer
from lifecycle.watchdog import WATCHDOG


def stuck_holding_the_gil() -> None:
    ctypes.PyDLL(None).sleep(3)  # a PyDLL call keeps the GIL: no Python thread runs meanwhile


def stuck_with_the_gil_free() -> None:
    time.sleep(1.5)


def fork_and_reap() -> None:
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # finalization cancels the backstop's timer: it waited forever on a timer thread it lacked
    deadline = time.monotonic() + 20
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            print("child hung at exit", flush=True)
            return
        time.sleep(0.01)
    print("child exited", flush=True)


def main(case: str) -> None:
    WATCHDOG.backstop_s = 1.0
    lc = Lifecycle({"watchdog": {"train_step_s": 0.2}}, role="actor", rank=0, world_size=1,
                   checkpointer=MemoryCheckpointer())
    lc.init_load()
    work = {"gil": stuck_holding_the_gil, "sleep": stuck_with_the_gil_free, "fork": fork_and_reap}[case]
    with lc.train_step(1):
        work()
    time.sleep(1.5)  # past the backstop, had it stayed set after the phase
    print("phase ended", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
