"""`Stateful`: the one code path every machine of the library runs its triggers through.

A subclass gives its table (`lifecycle.machine`), its role and rank; the base owns the
`transitions` machine, the lock, the history, the observers and the running phase, and is
what `phase.Phase` drives: begin trigger, work, undos, done or fail, one record. The trainer's
`Lifecycle`, a rollout's `RolloutWeights` and the Ray driver each get from this same code the
`lifecycle.transition` record, the `lifecycle.phase_started` debug record, the watchdog
budget, the undo stack, the history, the observers and the Chrome trace.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import structlog
from transitions import MachineError

from lifecycle.boundary import check_step
from lifecycle.errors import CheckpointError, ConfigError, InvalidTransition, LifecycleError, check_callable, shorten
from lifecycle.phase import Observer, Phase, Temporary, TransitionRecord, refusal
from lifecycle.records import described, guarded
from lifecycle.table import Table
from lifecycle.types import is_count
from lifecycle.watchdog import WATCHDOG, Emit, Watchdog

S = TypeVar("S", bound=Enum)
F = TypeVar("F", bound=Callable[[], object])


class Stateful(Generic[S]):
    """A machine built from one table whose triggers run as phases (`Phase(self, trigger, step)`).

    A trigger the table does not allow from the current state raises `InvalidTransition`
    naming the state, the trigger and the allowed ones, and changes nothing. The state changes
    in one place only, `_move`.
    """

    _global_observers: ClassVar[Sequence[Observer]] = ()
    """Observers of every machine of a class (the `Lifecycle` uses `phase.GLOBAL_OBSERVERS`)."""

    def __init__(self, table: Table[S], *, role: str, rank: int, observers: Iterable[Observer] = (),
                 history_limit: int = 10_000, watchdog: Watchdog | None = None,
                 on_overdue: Emit | None = None) -> None:
        _check_identity(role, rank, history_limit, observers)
        _check_watching(watchdog, on_overdue)
        self.role = role
        self.rank = rank
        self.observers: list[Observer] = list(observers)
        for observer in self.observers:
            _check_observer("observers", observer)
        self._table = table
        self._history: deque[TransitionRecord] = deque(maxlen=history_limit)
        self._phase: Phase | None = None
        self._lock = threading.RLock()
        """Reentrant only so that a trigger fired again on the thread inside `_move` (a signal
        handler) gets in to be refused (`_moving`) instead of waiting forever; other threads wait."""
        self._moving = False
        self._model = table.model()
        self._machine = table.build(self._model)
        self._watchdog = WATCHDOG if watchdog is None else watchdog
        """Watches budgeted phases; the process's own unless the machine was given one."""
        self._on_overdue = on_overdue
        """Where the watchdog reports this machine's overdue phases (`emit(event, **fields)`); None:
        the watchdog's own (a `lifecycle.phase_overdue` warning). A Ray worker keeps them for its driver."""
        self._log = structlog.get_logger()

    @property
    def state(self) -> S:
        return self._model.state  # type: ignore[no-any-return]

    @property
    def history(self) -> list[TransitionRecord]:
        return list(self._history)

    @property
    def table(self) -> Table[S]:
        return self._table

    def temporarily(self, obj: object, **attrs: Any) -> Temporary:
        """Set (or, with `DELETE`, remove) attributes of `obj` until the running phase ends."""
        phase = self._running("temporarily")
        change = Temporary(obj, attrs)
        phase.undos.append(change.restore)
        return change

    def on_exit(self, undo: F) -> F:
        """Run `undo` when the running phase ends, whether its work succeeded or raised."""
        self._running("on_exit").undos.append(undo)
        return undo

    def add_observer(self, observer: Observer) -> None:
        _check_observer("observer", observer)
        self.observers.append(observer)

    def remove_observer(self, observer: Observer) -> None:
        """Stop telling `observer`; one this machine does not tell is a `LifecycleError`."""
        try:
            self.observers.remove(observer)
        except ValueError:
            raise LifecycleError(f"{self!r}: remove_observer({shorten(observer)}): not one of its observers") from None

    def export_chrome_trace(self, path: str | os.PathLike[str]) -> Path:
        """The history as a Chrome trace; the writer (and the checkpoint I/O it uses) loads on first use."""
        from lifecycle.trace import write_chrome_trace

        return write_chrome_trace(self._history, path, role=self.role, rank=self.rank)

    def _step(self, what: str, step: object) -> int:
        """`step` as a phase's step number (`boundary.check_step`, what a save is named by); else a
        `LifecycleError` naming the call, the role and the state, raised before the machine moves."""
        try:
            return check_step(step)
        except CheckpointError as exc:
            raise LifecycleError(f"{what}({shorten(step)}) (role {self.role}, state {self.state.name}): "
                                 f"{exc}") from None

    def _budget(self, trigger: str) -> float | None:
        """The watchdog budget of `trigger`'s phase in seconds; None: not watched."""
        return None

    def _moved(self, src: S, dst: S) -> None:
        """Called under the lock right after each move: state that must change with it changes here.
        If it raises (an interrupt at its call included), the state goes back: the move did not happen."""

    def _ended(self, phase: Phase) -> None:
        """Called when a phase's work and undos succeeded, before the machine moves out of its
        working state: what it sets (a train step's progress) is in place before another phase
        can start."""

    def _running(self, what: str) -> Phase:
        phase = self._phase
        if phase is None:
            phases = "/".join(row.trigger for row in self._table.rows if row.working is not None)
            raise LifecycleError(
                f"{what}() needs a running phase to undo it in; state is {self.state.name} "
                f"(role {self.role}): call it from inside {phases} work"
            )
        return phase

    def _move(self, trigger: str, made: list[tuple[S, S] | None] | None = None) -> tuple[S, S]:
        """Fire `trigger`; the source and destination, both read under the lock, so a record
        built from them names the move this call made even while other threads fire triggers.
        `made[0]`, when given, is set to them just before the state changes (and back to None
        should the move be undone), so a caller whose call an interrupt (Ctrl-C) cut short learns
        whether the state changed: the caller's own list, which a trigger fired from a signal
        handler meanwhile cannot touch.

        The table's own edges (`Table.moves`, the edges the `transitions` machine is built from)
        set the state directly: the machine's edges carry no callbacks, so its trigger dispatch
        would only reach the same destination dearer. Any other name goes to the machine.
        """
        with self._lock:
            if self._moving:
                raise refusal(trigger, self._model.state, self.role, "fired on the thread that is moving the machine "
                              "(from a signal handler?); nothing changed, fire it again once the move is over")
            self._moving = True
            try:
                return self._move_locked(trigger, [None] if made is None else made)
            finally:
                self._moving = False

    def _move_locked(self, trigger: str, made: list[tuple[S, S] | None]) -> tuple[S, S]:
        edges = self._table.moves.get(trigger)
        src = self._model.state
        if edges is not None:
            dst = edges.get(src._name_)
            if dst is None:
                raise InvalidTransition(trigger, src, self._table.allowed(src), self.role)
            made[0] = (src, dst)  # no call between these two lines: no signal handler runs there
            self._model.state = dst
        else:
            try:
                getattr(self._model, trigger)()
            except MachineError:
                raise InvalidTransition(trigger, src, self._table.allowed(src), self.role) from None
            dst = self._model.state
            made[0] = (src, dst)
        try:
            self._moved(src, dst)
        except BaseException:  # the state and what changes with it change together, or neither does
            self._model.state, made[0] = src, None
            raise
        return src, dst

    def _tell(self, src: S, dst: S, trigger: str) -> None:
        """Every observer's `on_state_change` of a move `_move` made (`Phase` calls it once the
        move is the phase's own)."""
        if self.observers or self._global_observers:
            self._notify("on_state_change", src, dst, trigger)

    def _notify(self, hook: str, *args: Any) -> None:
        """`hook` of every observer, each whatever the others raised: an observer's error is
        logged (`lifecycle.observer_failed`) and goes no further, since the machine has moved
        and the phase's outcome is not the observer's to change; an interrupt is raised once
        every observer was told."""
        interrupt: BaseException | None = None
        for observer in (*self.observers, *self._global_observers):
            try:
                getattr(observer, hook)(self, *args)
            except Exception as exc:  # noqa: BLE001 - logged; the other observers still hear
                guarded(self._log.error, "lifecycle.observer_failed", observer=shorten(observer), hook=hook,
                        role=self.role, rank=self.rank, error=described(exc))
            except BaseException as exc:  # noqa: BLE001 - raised below, after the others heard
                interrupt = interrupt or exc
        if interrupt is not None:
            raise interrupt

    def _record(self, phase: Phase, error: BaseException | None) -> None:
        """The one history entry and the one `lifecycle.transition` record of a trigger. The
        history always gets it; a log sink that fails (a closed pipe, a full disk) or a figure
        the renderer cannot write loses the log line alone, and observers hear it regardless."""
        start, t0 = phase.started
        duration = time.perf_counter() - t0
        dst = phase.dst
        message = None if error is None else described(error)
        working = self._table.by_trigger[phase.trigger].working
        path = (phase.src, dst) if working is None else (phase.src, working, dst)
        record = TransitionRecord(phase.trigger, phase.src, dst, phase.step, start, duration,
                                  error is None, message, path, phase.figures)
        phase.recorded = True  # with the append, no call between: an interrupt after it leaves no second record
        self._history.append(record)
        fields = {"trigger": phase.trigger, "src": phase.src._name_, "dst": dst._name_, "role": self.role,
                  "rank": self.rank, "step": phase.step, "duration_s": round(duration, 6), "ok": error is None}
        if phase.figures:
            fields |= _figure_fields(phase.figures, fields)
        if error is None:
            guarded(self._log.info, "lifecycle.transition", **fields)
        else:
            guarded(self._log.error, "lifecycle.transition", error=message, **fields)
        if self.observers or self._global_observers:
            self._notify("on_transition", record)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(role={self.role!r}, rank={self.rank}, state={self.state.name})"


_MOST_RECORDS = 2**62
"""The largest `history_limit` (a deque's maxlen must fit a C ssize_t)."""


def _check_identity(role: object, rank: object, history_limit: object, observers: object) -> None:
    """`ConfigError` naming the argument a machine cannot be built from: its records, errors and
    folders name it by role and rank."""
    if not isinstance(role, str) or not role:
        raise ConfigError("role", f"must be a non-empty string, got {shorten(role)}")
    for name, value, high in (("rank", rank, None), ("history_limit", history_limit, _MOST_RECORDS)):
        if not is_count(value) or (high is not None and value > high):
            raise ConfigError(name, f"must be an integer >= 0{'' if high is None else f' and <= {high}'}, "
                                    f"got {shorten(value)} ({type(value).__name__})")
    if isinstance(observers, (str, bytes)) or not isinstance(observers, Iterable):
        raise ConfigError("observers", f"must be an iterable of Observer, got {shorten(observers)}")


def _check_observer(key: str, observer: object) -> None:
    """`ConfigError` naming an observer without both hooks: it would be accepted, then fail on every
    move (logged as `lifecycle.observer_failed`) and never hear one."""
    hooks = ("on_state_change", "on_transition")
    if not all(callable(getattr(observer, hook, None)) for hook in hooks):
        raise ConfigError(key, f"takes Observer objects (with on_state_change() and on_transition(); subclass "
                               f"lifecycle.Observer), got {shorten(observer)} ({type(observer).__name__})")


def _check_watching(watchdog: object, on_overdue: object) -> None:
    """`ConfigError` naming a watchdog or an overdue emitter that would otherwise fail the first
    budgeted phase, or lose its report, instead of the construction."""
    if watchdog is not None and not all(callable(getattr(watchdog, name, None)) for name in ("watch", "unwatch")):
        raise ConfigError("watchdog", "must be None or a Watchdog (an object with watch() and unwatch() methods), "
                                      f"got {shorten(watchdog)} ({type(watchdog).__name__})")
    check_callable("on_overdue", on_overdue, "emit(event, **fields)")


def _figure_fields(figures: dict[Any, Any], fixed: dict[str, Any]) -> dict[str, Any]:
    """A phase's figures as log fields: a figure named like a field every record has (`step`,
    `rank`, `error`...) goes as `figure_<name>`, so it neither replaces that field nor fails the
    call; a key that is no string goes as its bounded repr."""
    out: dict[str, Any] = {}
    for key, value in figures.items():
        name = key if isinstance(key, str) else shorten(key)
        out[f"figure_{name}" if name in fixed or name in ("error", "event") else name] = value
    return out


__all__ = ["Stateful"]
