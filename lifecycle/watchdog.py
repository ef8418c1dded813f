"""The hang watchdog: one daemon thread per process that notices phases running past their budget.

A phase with a budget (`watchdog.<trigger>_s`) is registered when it begins and dropped when it
ends. When one overruns, the thread logs `lifecycle.phase_overdue` at warning level with the
phase, the time it has run and every thread's stack, then again at each further multiple of the
budget (a phase whose machine names an emitter hands the record to it instead: a Ray worker
logs it and keeps a copy for its driver). It never interrupts the work: a hung collective is
for the engine's own timeout or the driver to end; the record is what tells a person where it
hung.

An emitter runs on a daemon thread of its own for each report, and the thread waits for it at
most `EMIT_WAIT_S`: one that blocks (a driver that no longer answers) cannot silence the
reports of the other machines of the process. Until it returns, that emitter is busy: its
machine's reports go to the default warning instead, as they do when an emitter raises.

The thread starts with the first budgeted phase and sleeps until the nearest deadline, so a
phase without a budget costs nothing and one with a budget costs a lock and a dict entry.

The thread is Python and needs the GIL to report. A phase stuck in native code that holds the
GIL (a C extension spinning or blocked without releasing it) would silence it, so the process's
`faulthandler` timer is the backstop: armed for `backstop_s` after the nearest deadline and
moved on whenever the thread reports, it fires when the thread could not, and writes every
thread's stack to stderr from C. It is the process's one `faulthandler.dump_traceback_later`
timer, so it is off until the application turns it on (`WATCHDOG.backstop_s = BACKSTOP_S`; the
Ray workers do), where nothing else (pytest's `faulthandler_timeout`) uses that timer.
"""

from __future__ import annotations

import faulthandler
import numbers
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from lifecycle.errors import ConfigError, LifecycleError, check_callable, shorten
from lifecycle.records import described, guarded

__all__ = ["WATCHDOG", "Emit", "Watchdog", "thread_stacks"]


Emit = Callable[..., object]
"""`emit(event, **fields)`: where an overdue report goes (structlog's `warning` by default)."""


@dataclass(slots=True)
class _Watched:
    budget_s: float
    start: float
    thread: int
    fields: Mapping[str, Any]
    emit: Emit | None
    overdue: int = field(default=0)
    """How many budget multiples have been reported."""

    @property
    def deadline(self) -> float:
        return self.start + self.budget_s * (self.overdue + 1)


def thread_stacks(skip: int | None = None, first: int | None = None) -> dict[str, str]:
    """Every live thread's stack, `name (ident)` -> formatted frames; `first`'s thread leads."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    frames = sys._current_frames()
    order = sorted(frames, key=lambda ident: ident != first)
    return {f"{names.get(ident, '?')} ({ident})": "".join(traceback.format_stack(frames[ident]))
            for ident in order if ident != skip}


MIN_BUDGET_S = 0.001
"""The shortest budget: below it a phase is reported thousands of times a second, stacks and all."""
MAX_BUDGET_S = 10.0**7
"""The longest budget (about 116 days): past it the deadline is no time the thread can wait for."""
_LONGEST_WAIT_S = 3600.0
"""The thread wakes at least hourly (a wait longer than the platform's limit raises)."""
BACKSTOP_S = 5.0
"""How long after a deadline the thread has to report before `faulthandler` dumps the stacks."""
EMIT_WAIT_S = 1.0
"""How long the thread waits for an emitter before it reports the other phases due."""
_LINGER_S = 1.0
"""How long the thread outlives the last phase it watched (at most half the backstop), so that
phase after phase keeps one timer setting."""


class Watchdog:
    """Budgets of running phases, checked by one daemon thread started on first use.

    Each phase may name where its reports go (`watch(..., emit=...)`), so machines that report
    differently (a Ray worker keeps its reports for the driver) share the process's one thread;
    `emit` given here is the default for phases that name none.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, emit: Emit | None = None,
                 backstop_s: float | None = None) -> None:
        check_callable("clock", clock, "clock() -> seconds", optional=False)
        check_callable("emit", emit, "emit(event, **fields)")
        self._clock = clock
        self._emit = emit
        self._cond = threading.Condition(threading.RLock())
        """Reentrant: a signal handler firing a budgeted trigger (of another machine sharing this
        watchdog) while this thread is inside `watch` or `unwatch` gets in instead of waiting
        forever on the lock its own thread holds."""
        self._watched: dict[int, _Watched] = {}
        self._busy: dict[int, Emit] = {}
        """The emitters still running a report, by id (held, so no other callable takes that id)."""
        self._thread: threading.Thread | None = None
        self._fires_at: float | None = None
        """When the backstop's timer is set to fire (this watchdog's clock); None: not set."""
        self._backstop_s: float | None = None
        self.backstop_s = backstop_s
        _INSTANCES.add(self)

    @property
    def backstop_s(self) -> float | None:
        """Seconds past the nearest deadline at which `faulthandler` dumps every stack unless the
        thread has reported by then (see the module's docstring); None: no backstop. One watchdog
        of a process may have one (the process's `WATCHDOG` has)."""
        return self._backstop_s

    @backstop_s.setter
    def backstop_s(self, seconds: float | None) -> None:
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, numbers.Real)
                                    or not MIN_BUDGET_S <= seconds <= MAX_BUDGET_S):
            raise ConfigError("backstop_s", f"must be None or a number of seconds in {MIN_BUDGET_S}..{MAX_BUDGET_S:g}, "
                                            f"got {shorten(seconds)}")
        with self._cond:
            self._backstop_s = None if seconds is None else float(seconds)
            self._set_backstop(self._backstop_due())

    def watch(self, key: int, budget_s: float, emit: Emit | None = None, **fields: Any) -> None:
        """Start the budget of the phase `key` (its id) running on the calling thread; its
        reports go to `emit`, else to this watchdog's own. A budget that is no finite number of
        seconds above 0 is refused (`LifecycleError`): the one thread serves every phase."""
        if (isinstance(budget_s, bool) or not isinstance(budget_s, numbers.Real)
                or not MIN_BUDGET_S <= budget_s <= MAX_BUDGET_S):
            raise LifecycleError(f"a watchdog budget is a number of seconds in {MIN_BUDGET_S}..{MAX_BUDGET_S:g}, got "
                                 f"{shorten(budget_s)}"
                                 + (f" for {fields['trigger']!r}" if isinstance(fields.get("trigger"), str) else ""))
        entry = _Watched(float(budget_s), self._clock(), threading.get_ident(), fields, emit)
        with self._cond:
            self._watched[key] = entry
            self._keep_backstop()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="lifecycle-watchdog", daemon=True)
                self._thread.start()
            else:
                self._cond.notify()

    def unwatch(self, key: int) -> None:
        """Stop watching the phase `key`. The backstop moves only if it would now fire before
        the nearest deadline of the phases left (`_keep_backstop`); when none is left, the thread
        stops it after a moment (at least a backstop before it could fire)."""
        with self._cond:
            self._watched.pop(key, None)
            self._keep_backstop()
            if not self._watched:
                self._cond.notify()  # the thread lingers a moment, stops the backstop and ends

    @property
    def watching(self) -> int:
        with self._cond:
            return len(self._watched)

    def _backstop_due(self) -> float | None:
        """When the backstop should fire: `backstop_s` past the nearest deadline; None when nothing
        is watched or there is no backstop."""
        if self._backstop_s is None or not self._watched:
            return None
        return min(entry.deadline for entry in self._watched.values()) + self._backstop_s

    def _keep_backstop(self) -> None:
        """Move the timer (with the lock held) only where it is wrong: unset while a phase is
        watched, set to fire before the nearest deadline (a dump with no phase overdue), or more
        than a backstop late. Moving it stalls the interpreter about half a millisecond (the
        timer's thread is joined with the GIL held), so phase after phase reuses one setting and
        the thread moves it on as it comes near (`_run`); stopping it is the thread's too."""
        due, fires_at, backstop = self._backstop_due(), self._fires_at, self._backstop_s
        if due is not None and backstop is not None and (
                fires_at is None or not due - backstop <= fires_at <= due + backstop):
            self._set_backstop(due)

    def _set_backstop(self, fires_at: float | None) -> None:
        """Set the timer to fire at `fires_at`, or stop it (None); with the lock held. A process
        whose standard error has no descriptor goes without it."""
        try:
            if fires_at is not None:  # never sooner than a backstop from now: the thread gets its time to report
                now, backstop = self._clock(), self._backstop_s or MIN_BUDGET_S
                fires_at = max(fires_at, now + backstop)
                faulthandler.dump_traceback_later(fires_at - now, file=_STDERR_FD)
            elif self._fires_at is not None:
                faulthandler.cancel_dump_traceback_later()
            self._fires_at = fires_at
        except (OSError, ValueError, RuntimeError, OverflowError):
            self._fires_at = None

    def _before_fork(self) -> None:
        """Hold the lock and stop the backstop's timer across a fork: a child would inherit the
        timer as running without its thread, and its exit (or its own cancel) would wait for it
        forever."""
        self._cond.acquire()
        try:
            self._set_backstop(None)
        except BaseException:
            self._cond.release()
            raise

    def _after_fork_in_parent(self) -> None:
        try:
            self._keep_backstop()
        finally:
            self._cond.release()

    def _after_fork_in_child(self) -> None:
        """The child watches nothing of its parent's: a worker forked inside a phase (a data
        loader's, a writer's) never returns into it, and its own thread would report it overdue
        for good. It starts a thread of its own when it next watches."""
        self._cond = threading.Condition(threading.RLock())
        self._watched, self._busy = {}, {}
        self._thread, self._fires_at = None, None

    def _run(self) -> None:
        idle_since: float | None = None
        while True:
            with self._cond:
                now, backstop = self._clock(), self._backstop_s
                if not self._watched:  # nothing to watch: after a moment (a next phase reuses the timer), the end
                    idle_since = now if idle_since is None else idle_since
                    linger = 0.0 if self._fires_at is None or backstop is None else min(_LINGER_S, backstop / 2)
                    if now - idle_since >= linger:
                        self._set_backstop(None)
                        self._thread = None
                        return
                    self._cond.wait(linger - (now - idle_since))
                    continue
                idle_since = None
                due = [(key, entry) for key, entry in self._watched.items() if entry.deadline <= now]
                for _, entry in due:  # a late wake-up reports once, at the multiple reached
                    entry.overdue = int((now - entry.start) // entry.budget_s)
                if not due:
                    wake = min(entry.deadline for entry in self._watched.values())
                    if self._fires_at is not None and backstop is not None:  # move the timer on before it fires
                        if now >= self._fires_at - backstop / 2:
                            self._set_backstop(self._backstop_due())
                        if self._fires_at is not None:
                            wake = min(wake, self._fires_at - backstop / 2)
                    self._cond.wait(min(max(wake - now, 0.0), _LONGEST_WAIT_S))
                    continue
            for _, entry in due:
                self._report(entry, now)
            with self._cond:  # reported: the backstop moves on to the next deadline
                self._set_backstop(self._backstop_due())

    def _report(self, entry: _Watched, now: float) -> None:
        """Hand the report to the phase's emitter, else this watchdog's; one that raises, is busy
        or does not return in time hands it, with why, to the default warning; a failing default
        says once on stderr that a record was lost (`records.guarded`). None of them may kill the
        thread."""
        fields = {**entry.fields, "elapsed_s": round(now - entry.start, 3), "budget_s": entry.budget_s,
                  "overdue": entry.overdue, "stacks": thread_stacks(skip=threading.get_ident(), first=entry.thread)}
        emit = entry.emit or self._emit
        if emit is not None:
            failed = self._hand(emit, fields)
            if failed is None:
                return
            fields = {**fields, "emitter": shorten(emit), "emitter_error": failed}  # new: a late emitter reads its own
        guarded(structlog.get_logger().warning, "lifecycle.phase_overdue", **fields)

    def _hand(self, emit: Emit, fields: dict[str, Any]) -> str | None:
        """Run `emit` on a thread of its own, waiting `EMIT_WAIT_S` at most; why the report did
        not reach it (its error, or it is busy), or None."""
        with self._cond:
            if id(emit) in self._busy:
                return "busy: it has not returned from an earlier report"
            self._busy[id(emit)] = emit
        failed: list[str] = []
        done = threading.Event()

        def call() -> None:
            try:
                emit("lifecycle.phase_overdue", **fields)
            except BaseException as exc:  # noqa: BLE001 - the report goes to the default warning instead
                failed.append(described(exc))
            finally:
                with self._cond:
                    self._busy.pop(id(emit), None)
                done.set()

        try:
            threading.Thread(target=call, name="lifecycle-overdue-emitter", daemon=True).start()
        except RuntimeError as exc:  # no thread to be had ("can't start new thread")
            with self._cond:
                self._busy.pop(id(emit), None)
            return described(exc)
        if not done.wait(EMIT_WAIT_S):
            return f"busy: it has not returned within {EMIT_WAIT_S:g} s"
        return failed[0] if failed else None


_INSTANCES: weakref.WeakSet[Watchdog] = weakref.WeakSet()


def _each(method: Callable[[Watchdog], None]) -> Callable[[], None]:
    def hook() -> None:
        for watchdog in list(_INSTANCES):
            method(watchdog)
    return hook


os.register_at_fork(before=_each(Watchdog._before_fork), after_in_parent=_each(Watchdog._after_fork_in_parent),
                    after_in_child=_each(Watchdog._after_fork_in_child))

_STDERR_FD = 2
"""Where the backstop writes: the process's standard error, whatever `sys.stderr` is now."""

WATCHDOG = Watchdog()
"""The process's watchdog, used by every `Phase` with a budget. Its `faulthandler` backstop is
off: a library does not take the process's one timer; an application turns it on
(`WATCHDOG.backstop_s = BACKSTOP_S`, as the Ray workers do)."""
