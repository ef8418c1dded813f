"""A child process a test started and must end: killed if still running, reaped, pipes closed.

Every `Child` a test registers in `STARTED` is ended by `tests/conftest.py` after the test,
however it ends (a failed assert between a child's start and its kill included).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest


@dataclass
class Child:
    proc: subprocess.Popen[str]
    err: Path
    committed: list[int] = field(default_factory=list)
    watchdog: threading.Timer | None = None

    @classmethod
    def spawn(cls, args: list[str], err: Path, timeout_s: float, *, cwd: Path, env: dict[str, str] | None = None,
              stdin: int | None = subprocess.PIPE) -> Child:
        """`python *args` with stdout piped and stderr to `err`, killed after `timeout_s` (a hang
        guard), and registered in `STARTED` so it ends with the test."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(err, "w") as err_file:
            proc = subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdin=stdin,
                                    stdout=subprocess.PIPE, stderr=err_file, text=True)
        watchdog = threading.Timer(timeout_s, proc.kill)
        watchdog.daemon = True
        watchdog.start()
        child = cls(proc, err, watchdog=watchdog)
        STARTED.append(child)
        return child

    def go(self) -> None:
        """Start saving: the child was started early, so its imports overlap the previous trial."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def read_commits(self, count: int) -> None:
        """Block until `count` commit lines arrived (the child keeps saving meanwhile)."""
        assert self.proc.stdout is not None
        while len(self.committed) < count:
            line = self.proc.stdout.readline()
            if not line:
                self.fail(f"child ended after {self.committed} before {count} commits")
            self._take(line)

    def finish(self) -> int:
        """Wait for the (killed) child; collect the commit lines still in the pipe."""
        assert self.proc.stdout is not None
        rest = self.proc.stdout.read()
        code = self.proc.wait()
        if self.watchdog is not None:
            self.watchdog.cancel()
        for line in rest.splitlines():
            self._take(line)
        return code

    def _take(self, line: str) -> None:
        word, _, number = line.strip().partition(" ")
        if word == "committed":
            self.committed.append(int(number))
        elif word == "done":
            self.fail("child finished every step before it was killed; give it more steps")

    def fail(self, message: str) -> None:
        self.end()
        pytest.fail(f"{message}\nchild stderr:\n{self.err.read_text()[-3000:]}")

    def end(self) -> None:
        """Kill the child if it still runs, reap it, and close its pipes."""
        if self.watchdog is not None:
            self.watchdog.cancel()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


STARTED: list[Child] = []
"""Every child the current test started; ended after the test by `end_started`."""


def end_started() -> None:
    while STARTED:
        STARTED.pop().end()
