"""`BackgroundSaver`: the one thread an async save writes and commits on, what keeps its save in
flight safe when the process exits or forks, and `PendingSave`, the handle a caller waits on.

At most one save is in flight per saver. Its failure is raised once, by the next wait; a wait
interrupted by Ctrl-C leaves it in flight and known. A save still in flight when the interpreter
exits is committed first, and a forked child forgets its parent's (see `_drain_at_exit`,
`_forget_in_child`). A save begun while the interpreter exits (from an `atexit` hook), when no
thread may start, is written and committed in the calling thread.
"""

from __future__ import annotations

import math
import numbers
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Any

from lifecycle.checksum import submitted
from lifecycle.errors import CheckpointError, ConfigError, shorten
from lifecycle.records import described, say
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
            say("info", "checkpoint.async_save.drain_at_exit", role=saver.role, step=saver._pending[0])
            saver.wait(raise_failure=False)  # a failure was logged by the write itself


def _forget_in_child() -> None:
    for saver in list(_SAVERS):
        saver._pending, saver._pool = None, None


os.register_at_fork(after_in_child=_forget_in_child)


def _hook_exit() -> bool:
    """Register `_drain_at_exit` once, after `concurrent.futures`' own exit hook, so it runs before
    it; False when the interpreter is exiting already (threading takes no more exit hooks then)."""
    global _EXIT_HOOKED
    if not _EXIT_HOOKED:
        try:
            threading._register_atexit(_drain_at_exit)  # type: ignore[attr-defined]
        except RuntimeError:  # "can't register atexit after shutdown"
            return False
        _EXIT_HOOKED = True
    return True


@dataclass(kw_only=True, slots=True)
class PendingSave(SaveInfo):
    """What an async save returns at once: the step and path it will commit, and a handle to wait on.

    `bytes` are the host copy's, `seconds` the training loop's stall (waiting for the previous
    commit, writing `extra/`, the host copy); `wait()` returns the committed save's own figures.
    """

    committed: Future[SaveInfo] = field(repr=False, compare=False)
    """Resolves to the committed SaveInfo, or raises what the background write raised."""

    def wait(self, timeout: float | None = None) -> SaveInfo:
        """The committed save's figures. A failed background write is a `CheckpointError` naming
        the step (a collective's raw error included: a peer killed mid-write), a wait past
        `timeout` seconds a `CheckpointError` saying the save is still in flight, and a timeout
        that is no number of seconds a `ConfigError`, before anything waits."""
        seconds = _seconds(timeout)
        if not futures_wait([self.committed], seconds).done:
            raise CheckpointError(f"async save of step {self.step} is still in flight after {seconds:g} s; it goes "
                                  "on (wait again, or lc.close() to wait for it)")
        if self.committed.cancelled():
            raise CheckpointError(f"async save of step {self.step} was cancelled before its commit, so it was not "
                                  "published")
        failure = self.committed.exception()
        if failure is None:
            return self.committed.result()
        if isinstance(failure, CheckpointError):
            raise failure
        raise CheckpointError(f"async save of step {self.step} failed before its commit, so it was not "
                              f"published: {described(failure)}") from failure

    def figures(self) -> dict[str, Any]:
        return {**SaveInfo.figures(self), "async": True, "stall_s": round(self.seconds, 6)}


def _seconds(timeout: object) -> float | None:
    """`PendingSave.wait`'s timeout: None (no limit) or a finite real number of seconds, 0 or more;
    one past what a lock can wait (`threading.TIMEOUT_MAX`, about 292 years) waits without limit."""
    if timeout is None:
        return None
    try:
        ok = (isinstance(timeout, numbers.Real) and not isinstance(timeout, bool) and timeout >= 0
              and (isinstance(timeout, numbers.Integral) or math.isfinite(timeout)))
    except (TypeError, ValueError, OverflowError):  # a Real of another library that compares oddly
        ok = False
    if not ok:
        raise ConfigError("timeout", f"PendingSave.wait: must be None or a finite number of seconds, 0 or more; "
                                     f"got {shorten(timeout)} ({type(timeout).__name__})")
    return None if timeout > threading.TIMEOUT_MAX else float(timeout)  # type: ignore[operator, arg-type]


class BackgroundSaver:
    """One background thread per checkpointer, and at most one save in flight on it."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[int, Future[SaveInfo]] | None = None
        _SAVERS.add(self)

    def submit(self, step: int, work: Callable[[], SaveInfo]) -> Future[SaveInfo]:
        """Start `work` on the background thread; the returned future resolves when it is done.

        The future is known as in flight before the work is queued, and the work runs only once
        it claims the future (`set_running_or_notify_cancel`): a Ctrl-C anywhere in here either
        cancels work that never started (nothing in flight, the caller undoes what it prepared) or
        leaves the started save in flight and waited for (`in_flight`), never a write nobody waits for.
        """
        if self._pending is not None:
            raise CheckpointError(f"role {self.role}: step {self._pending[0]} is still being saved; wait() first")
        future: Future[SaveInfo] = Future()
        self._pending = (step, future)
        try:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"async-save-{self.role}")
            if not _hook_exit() or submitted(self._pool, self._claimed, future, step, work) is None:
                self._inline(future, step, work)  # exiting: a thread started now would never be waited for
        except BaseException:
            if future.cancel():  # never started, and now never will
                self._pending = None
            raise
        return future

    def in_flight(self) -> int | None:
        """The step of the save submitted and not yet waited for, if any."""
        return None if self._pending is None else self._pending[0]

    def _inline(self, future: Future[SaveInfo], step: int, work: Callable[[], SaveInfo]) -> None:
        """The save written and committed in the calling thread. The pool is dropped first, its
        queue cancelled: a submit that failed to start its thread left the work queued, and it
        must never run twice (the claim on `future` also sees to that)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._claimed(future, step, work)

    def _claimed(self, future: Future[SaveInfo], step: int, work: Callable[[], SaveInfo]) -> None:
        """`work()` into `future`, unless a submit interrupted before it started has cancelled it."""
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(self._run(step, work))
        except BaseException as exc:  # raised by the wait, as a background failure is
            future.set_exception(exc)
            if not isinstance(exc, Exception):  # Ctrl-C in a save written inline still stops the caller
                raise

    def _run(self, step: int, work: Callable[[], SaveInfo]) -> SaveInfo:
        """`work()`, and its record; a log sink that fails never fails the save (see `say`)."""
        started = time.perf_counter()
        try:
            info = work()
        except BaseException as exc:
            say("error", "checkpoint.async_save", role=self.role, step=step, ok=False,
                duration_s=round(time.perf_counter() - started, 6), error=described(exc))
            raise
        say("info", "checkpoint.async_save", role=self.role, step=step, ok=True,
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
                f"not published: {described(exc)}"
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


__all__ = ["BackgroundSaver", "PendingSave"]
