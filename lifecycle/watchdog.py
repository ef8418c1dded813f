"""The hang watchdog: one daemon thread per process that notices phases running past their budget.

A phase with a budget (`watchdog.<trigger>_s`) is registered when it begins and dropped when it
ends. When one overruns, the thread logs `lifecycle.phase_overdue` at warning level with the
phase, the time it has run and every thread's stack, then again at each further multiple of the
budget (a phase whose machine names an emitter hands the record to it instead: a Ray worker
logs it and keeps a copy for its driver). It never interrupts the work: a hung collective is
for the engine's own timeout or the driver to end; the record is what tells a person where it
hung.

The thread starts with the first budgeted phase and sleeps until the nearest deadline, so a
phase without a budget costs nothing and one with a budget costs a lock and a dict entry.
"""

from __future__ import annotations

import numbers
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from lifecycle.errors import LifecycleError, shorten

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


class Watchdog:
    """Budgets of running phases, checked by one daemon thread started on first use.

    Each phase may name where its reports go (`watch(..., emit=...)`), so machines that report
    differently (a Ray worker keeps its reports for the driver) share the process's one thread;
    `emit` given here is the default for phases that name none.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, emit: Emit | None = None) -> None:
        self._clock = clock
        self._emit = emit
        self._cond = threading.Condition(threading.Lock())
        self._watched: dict[int, _Watched] = {}
        self._thread: threading.Thread | None = None

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
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="lifecycle-watchdog", daemon=True)
                self._thread.start()
            else:
                self._cond.notify()

    def unwatch(self, key: int) -> None:
        with self._cond:
            self._watched.pop(key, None)
            if not self._watched:
                self._cond.notify()  # the thread ends now, not at its next deadline

    @property
    def watching(self) -> int:
        with self._cond:
            return len(self._watched)

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._watched:  # nothing to watch: the thread ends (`watch` starts another)
                    self._thread = None
                    return
                now = self._clock()
                due = [(key, entry) for key, entry in self._watched.items() if entry.deadline <= now]
                for _, entry in due:  # a late wake-up reports once, at the multiple reached
                    entry.overdue = int((now - entry.start) // entry.budget_s)
                if not due:
                    nearest = min(entry.deadline for entry in self._watched.values())
                    self._cond.wait(min(max(nearest - now, 0.0), _LONGEST_WAIT_S))
                    continue
            for _, entry in due:
                self._report(entry, now)

    def _report(self, entry: _Watched, now: float) -> None:
        elapsed = now - entry.start
        emit = entry.emit or self._emit or structlog.get_logger().warning
        try:
            emit("lifecycle.phase_overdue", **entry.fields, elapsed_s=round(elapsed, 3),
                 budget_s=entry.budget_s, overdue=entry.overdue,
                 stacks=thread_stacks(skip=threading.get_ident(), first=entry.thread))
        except Exception:  # noqa: BLE001 - a broken log sink must not kill the watchdog
            pass


WATCHDOG = Watchdog()
"""The process's watchdog, used by every `Phase` with a budget."""
