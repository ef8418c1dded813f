"""`BackgroundSaver`: the one thread an async save writes and commits on, and what keeps its
save in flight safe when the process exits or forks.

At most one save is in flight per saver. Its failure is raised once, by the next wait; a wait
interrupted by Ctrl-C leaves it in flight and known. A save still in flight when the interpreter
exits is committed first, and a forked child forgets its parent's (see `_drain_at_exit`,
`_forget_in_child`).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import structlog

from lifecycle.errors import CheckpointError
from lifecycle.types import SaveInfo

_SAVERS: weakref.WeakSet[BackgroundSaver] = weakref.WeakSet()
"""Every saver of this process: each one's save in flight is committed before the interpreter
exits, and forgotten in a forked child (whose copy of it has no thread to finish it)."""
_EXIT_HOOKED = False


def _drain_at_exit() -> None:
    """Commit every save in flight as the interpreter exits (a script that ends, or calls
    `sys.exit`, right after `save()`): run from threading's exit hooks, before those of
    `concurrent.futures`, which would refuse the thread pools the write and its hashing use."""
    for saver in list(_SAVERS):
        if saver._pending is not None:
            structlog.get_logger().info("checkpoint.async_save.drain_at_exit", role=saver.role,
                                        step=saver._pending[0])
            saver.wait(raise_failure=False)  # a failure was logged by the write itself


def _forget_in_child() -> None:
    for saver in list(_SAVERS):
        saver._pending, saver._pool = None, None


os.register_at_fork(after_in_child=_forget_in_child)


class BackgroundSaver:
    """One background thread per checkpointer, and at most one save in flight on it."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[int, Future[SaveInfo]] | None = None
        _SAVERS.add(self)

    def submit(self, step: int, work: Callable[[], SaveInfo]) -> Future[SaveInfo]:
        global _EXIT_HOOKED
        if self._pending is not None:
            raise CheckpointError(f"role {self.role}: step {self._pending[0]} is still being saved; wait() first")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"async-save-{self.role}")
        if not _EXIT_HOOKED:  # registered after concurrent.futures' own hook, so it runs before it
            threading._register_atexit(_drain_at_exit)  # type: ignore[attr-defined]
            _EXIT_HOOKED = True
        future = self._pool.submit(self._run, step, work)
        self._pending = (step, future)
        return future

    def _run(self, step: int, work: Callable[[], SaveInfo]) -> SaveInfo:
        started = time.perf_counter()
        log = structlog.get_logger()
        try:
            info = work()
        except BaseException as exc:
            log.error("checkpoint.async_save", role=self.role, step=step, ok=False,
                      duration_s=round(time.perf_counter() - started, 6), error=f"{type(exc).__name__}: {exc}")
            raise
        log.info("checkpoint.async_save", role=self.role, step=step, ok=True,
                 duration_s=round(time.perf_counter() - started, 6), **info.figures())
        return info

    def wait(self, *, raise_failure: bool = True) -> SaveInfo | None:
        """Block until the save in flight has committed; its failure is raised once, here."""
        if self._pending is None:
            return None
        step, future = self._pending
        try:
            return future.result()
        except Exception as exc:
            if not raise_failure:
                return None
            raise CheckpointError(
                f"async save of step {step} (role {self.role}) failed before its commit, so it was "
                f"not published: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            if future.done():  # an interrupted wait (Ctrl-C) leaves the save in flight, and known
                self._pending = None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


__all__ = ["BackgroundSaver"]
