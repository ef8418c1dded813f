"""A phase and what it leaves: the bracket every trigger's work runs in, its undo stack, its record.

Everything a phase is lives here, below the machines that start one (the trainer's
`Lifecycle`, a rollout's `RolloutWeights`, the Ray driver: each a `lifecycle.stateful.Stateful`),
so code deep in a backend can join the running phase's undo stack (`temporarily`, `DELETE`) by
importing this leaf module alone, and observers and traces read the record without importing
the core.
"""

from __future__ import annotations

import sys
import time
from contextvars import ContextVar, Token
from enum import Enum
from functools import cache
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, NoReturn

import structlog
from structlog.contextvars import bind_contextvars, reset_contextvars

from lifecycle.errors import InvalidTransition, LifecycleError, shorten
from lifecycle.records import described, guarded, say
from lifecycle.table import DONE, FAIL, Table
from lifecycle.temporary import DELETE, Temporary

if TYPE_CHECKING:
    from lifecycle.stateful import Stateful


class TransitionRecord(NamedTuple):
    """One entry of a machine's `history`: a whole trigger, from its source to where it ended.

    `src`, `dst` and `path` hold the machine's own states (`State` for a `Lifecycle`,
    `RolloutState`, `DriverState`). Named apart from `transitions.Transition` (an edge of a
    machine), which `lifecycle.table` subclasses: a record is what happened, an edge what may
    happen.
    """

    trigger: str
    src: Enum
    dst: Enum
    step: int | None
    start: float
    """Wall-clock start, seconds since the epoch (for traces)."""
    duration_s: float
    ok: bool
    error: str | None
    path: tuple[Enum, ...]
    """Every state visited, source first: (READY, SAVING, READY)."""
    figures: dict[str, Any]
    """The operation's own figures (backend, path, bytes, gbps, version...)."""


class Observer:
    """Hooks called as a machine moves; each does nothing unless overridden. `lc` is the machine:
    a `Lifecycle`, a `RolloutWeights` or the Ray driver."""

    def on_state_change(self, lc: Stateful, src: Enum, dst: Enum, trigger: str) -> None:
        """Called on every move of the machine, phase begin and phase end alike."""

    def on_transition(self, lc: Stateful, record: TransitionRecord) -> None:
        """Called once per trigger, when its record is final."""


GLOBAL_OBSERVERS: list[Observer] = []
"""Observers of every Lifecycle in the process (what `testing.capture_transitions()` uses)."""


RUNNING_UNDOS: ContextVar[list[Callable[[], object]] | None] = ContextVar("lifecycle_undos", default=None)
"""The undo stack of the phase running in this context; set by `Phase`, read by `temporarily`.
Reset as the undos start to run: a change made inside an undo joins no stack."""


def temporarily(obj: object, **attrs: Any) -> Temporary:
    """`lc.temporarily` for code that holds no Lifecycle, such as a backend inside a phase.

    The change joins the running phase's undo stack, so it is undone even if the caller's own
    restore never runs; used as a `with` block it is undone at the block's end as well, which
    also makes it safe outside any phase (the converter CLI, a direct backend call).
    """
    change = Temporary(obj, attrs)
    undos = RUNNING_UNDOS.get()
    if undos is not None:
        undos.append(change.restore)
    return change


def run_undos(undos: list[Callable[[], object]], trigger: str) -> list[BaseException]:
    """Run a phase's undos last-in-first-out; a failing undo is logged and never stops the rest,
    an interrupt (`KeyboardInterrupt`, `SystemExit`) included, even one raised while its failure
    is logged: each is handed back, never raised, for the caller to raise after."""
    errors: list[BaseException] = []
    while undos:
        undo = undos[-1]  # taken and dropped with no call between (`pop` is one): an interrupt loses no undo
        del undos[-1]
        try:
            undo()
        except BaseException as exc:  # noqa: BLE001 - every undo must get its turn
            errors.append(exc)
            try:
                guarded(structlog.get_logger().error, "lifecycle.undo_failed", trigger=trigger,
                        undo=shorten(undo, 200), error=shorten(exc, 500))
            except BaseException as lost:  # noqa: BLE001 - Ctrl-C while the line is written: raised after the rest
                errors.append(lost)
    return errors


@cache
def _context_vars() -> tuple[ContextVar[Any], ...]:
    """structlog's own context variables for role, rank and step, learnt once from the tokens
    `bind_contextvars` returns: a phase sets and resets them itself, the same binding as
    `bind_contextvars` / `reset_contextvars` without their per-call key building."""
    tokens = bind_contextvars(role=None, rank=None, step=None)
    reset_contextvars(**tokens)
    return tuple(token.var for token in tokens.values())


class Phase:
    """The context every phase's work runs in: begin trigger, work, undos, done or fail.

    The machine (`lc`, any `Stateful`) owns the table, the history and the watchdog; a phase
    only moves it through them (`_move`, `_record`), so the order begin -> work -> undos ->
    done/fail -> record is written once, here, for every table.
    """

    __slots__ = ("lc", "trigger", "step", "src", "dst", "figures", "undos", "recorded", "_start", "_t0", "_tokens",
                 "_undo_token", "_watched", "_entered", "_untold")

    _tokens: tuple[Token[Any], ...]

    def __init__(self, lc: Stateful, trigger: str, step: int | None) -> None:
        try:
            known = trigger in lc._table.by_trigger
        except (AttributeError, TypeError):  # no machine, or a trigger that cannot be a name
            known = False
        if not known:
            raise LifecycleError(_unknown(lc, trigger))
        self.lc = lc
        self.trigger = trigger
        self.step = step
        self.figures: dict[str, Any] = {}
        self.undos: list[Callable[[], object]] = []
        self.recorded = False
        """Whether the machine holds its record: set by `Stateful._record` as it appends it."""
        self._entered = False
        self._untold: tuple[Enum, Enum, str] | None = None
        """The last move the phase made that its observers have not all heard (Ctrl-C cut its
        telling short): told once more (`_retell`)."""

    def __del__(self) -> None:
        """A phase made and dropped unentered (`lc.train_step(n)` without `with`) moved nothing and
        counted no step: said once, as a warning, since the caller believes the step was taken."""
        if getattr(self, "_entered", True) or sys.is_finalizing():  # entered, refused by `__init__`, or at exit
            return
        say("warning", "lifecycle.phase_never_entered", trigger=self.trigger, step=self.step,
            role=getattr(self.lc, "role", None), rank=getattr(self.lc, "rank", None),
            hint=f"run it as `with lc.{self.trigger}(...):`; nothing moved and no step was counted")

    @property
    def started(self) -> tuple[float, float]:
        """Wall-clock start (for traces) and the perf-counter start (for the duration)."""
        return self._start, self._t0

    def __enter__(self) -> Phase:
        lc = self.lc
        if self._entered:  # its fields are the running or ended phase's: touch none of them
            raise refusal(self.trigger, lc.state, lc.role, "this Phase was entered already; a phase runs once, "
                          f"so fire the trigger again for a new one (lc.{self.trigger}(...))")
        self._entered = True
        self._start = time.time()
        self._t0 = time.perf_counter()
        self._undo_token, self._tokens, self._watched = None, (), False
        made: list[Any] = [None]
        try:
            self.src, self.dst = src, dst = lc._move(self.trigger, made)
        except BaseException as exc:
            if made[0] is None:  # refused, or interrupted before the state changed: nothing changed
                raise
            self.src, self.dst = src, dst = made[0]  # moved, then interrupted (Ctrl-C): the phase fails
            self._untold = (src, dst, self.trigger)
            self._fail(exc)
        self._untold = (src, dst, self.trigger)
        try:  # moved: whatever fails from here fails the phase, which ends like any other
            lc._phase = self
            self._undo_token = RUNNING_UNDOS.set(self.undos)
            role_var, rank_var, step_var = _context_vars()
            self._tokens = (role_var.set(lc.role), rank_var.set(lc.rank), step_var.set(self.step))
            guarded(lc._log.debug, "lifecycle.phase_started", src=src._name_, trigger=self.trigger,
                    state=dst._name_, role=lc.role, rank=lc.rank, step=self.step)
            budget = lc._budget(self.trigger)
            if budget is not None:
                self._watched = True  # first: an interrupt inside `watch` may leave its entry, which the end drops
                lc._watchdog.watch(id(self), budget, emit=lc._on_overdue, trigger=self.trigger, state=dst._name_,
                                   role=lc.role, rank=lc.rank, step=self.step)
            lc._tell(src, dst, self.trigger)
            self._untold = None
            self._begun()
        except BaseException as exc:
            self._fail(exc)
        return self

    def _begun(self) -> None:
        """A subclass's own begin (a figure to read), inside the begin's `try`: what it raises fails
        the phase, where after `__enter__` an interrupt would leave no phase to end the working state."""

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        """Undos, then done or fail, then the record, each whatever the one before raised. What
        leaves the phase: the work's own error, unless an undo was interrupted (Ctrl-C stops the
        caller even when the work failed too), or, for work that succeeded, an undo's failure.

        A signal handler runs where a function is called, so Ctrl-C can land between any two
        steps: before the machine left the working state it fails the phase, the undos not yet run
        still run and the steps on the way out run again (`_settle`); after, it is raised once the
        record is made. Only one landing at this method's first instruction, before any `try`, is
        beyond reach.

        The machine lets go of the phase before its undos run, so an undo that registers another
        (`on_exit`, `temporarily`) is refused like a call outside any phase: it could never end."""
        error, late, tries = exc, None, _SETTLE_TRIES
        try:
            error = self._finish(exc)
        except BaseException as cut:  # noqa: BLE001 - interrupted between those steps: the phase fails with it
            error = cut
            self._let_go()
            error = _outcome(self, _worse(exc, cut), run_undos(self.undos, self.trigger))
        finally:  # nothing is called outside the `try` below: an interrupt there would skip the move out
            while tries:
                tries -= 1
                try:
                    late = self._settle(error) or late
                    break
                except BaseException as cut:  # noqa: BLE001 - Ctrl-C on the way out: the steps not done run again
                    late = late or cut
                    if self.dst._name_ in self.lc._table.working_names:  # not out yet: out by fail
                        error = _worse(error, cut)
        if late is not None and late is not error:
            raise late  # an interrupt or failure after the work: its own error, if any, is the context
        if error is not None and error is not exc:
            raise error

    def _fail(self, exc: BaseException) -> NoReturn:
        """End the phase that `exc` stopped as it began, and raise."""
        try:
            self.__exit__(type(exc), exc, exc.__traceback__)
        except BaseException as raised:
            raise raised from exc
        raise exc

    def _finish(self, exc: BaseException | None) -> BaseException | None:
        """Let go of the phase, run its undos, then the machine's `_ended` if all went well: the
        error the phase ends with (`_outcome`)."""
        self._let_go()
        undo_errors = run_undos(self.undos, self.trigger) if self.undos else []
        error = _outcome(self, exc, undo_errors)
        if error is None:  # before the move out: no other phase may start and read the progress meanwhile
            self.lc._ended(self)
        return error

    def _let_go(self) -> None:
        lc = self.lc
        if lc._phase is self:  # an instant phase's machine may be another thread's phase's already
            lc._phase = None
        _reset(self._undo_token)

    def _settle(self, error: BaseException | None) -> BaseException | None:
        """Drop the budget, move out of the working state (done, or fail with `error`), record; each
        step once, so `__exit__` may run it again after an interrupt. The watchdog's interrupt is handed back."""
        lc = self.lc
        interrupt = self._unwatch()
        _reset(*self._tokens)
        if self._untold is not None:  # a move (in, or out on a retry) whose telling Ctrl-C cut short
            self._retell()
        if self.dst._name_ in lc._table.working_names:
            working, trigger = self.dst, FAIL if error is not None else DONE
            try:
                src, self.dst = lc._move(trigger)
            except BaseException:
                if lc.state is not working:  # moved, interrupted after: only this phase leaves its working state
                    self.dst = lc._table.moves[trigger][working._name_]
                    self._untold = (working, self.dst, trigger)
                raise
            self._untold = (src, self.dst, trigger)
            lc._tell(src, self.dst, trigger)
            self._untold = None
        if not self.recorded:
            lc._record(self, error)
        return interrupt

    def _retell(self) -> None:
        """Tell observers again, whole, the move whose telling Ctrl-C cut short (an observer that
        heard it before the cut hears it twice). Once: an observer that raises an interrupt every
        time cannot keep the phase from ending."""
        untold, self._untold = self._untold, None
        if untold is not None:
            self.lc._tell(*untold)

    def _unwatch(self) -> BaseException | None:
        """Drop the phase's budget. A watchdog that raises is an observer's error: logged
        (`lifecycle.watchdog_failed`), never the phase's outcome; an interrupt, its own or the
        log line's, is handed back to be raised once the machine has left the working state. An
        interrupt may land before the entry is dropped, so the watchdog is asked once more."""
        lc, interrupt = self.lc, None
        for _ in range(2 if self._watched else 0):
            try:
                try:
                    lc._watchdog.unwatch(id(self))
                except Exception as exc:  # noqa: BLE001 - logged; the phase ends as its work did
                    guarded(lc._log.error, "lifecycle.watchdog_failed", trigger=self.trigger, role=lc.role,
                            rank=lc.rank, step=self.step, error=described(exc))
                self._watched = False
                break
            except BaseException as exc:  # noqa: BLE001 - raised by `__exit__` once the machine is settled
                interrupt = interrupt or exc
        return interrupt


_SETTLE_TRIES = 5
"""How often a phase's end tries to leave the working state and record when interrupted on the
way: three steps (move, tell, record), and a retold move in and move out."""


def refusal(trigger: str, state: Enum, role: str, why: str) -> InvalidTransition:
    """An `InvalidTransition` of `trigger` refused for `why` rather than by the table: it changed
    nothing, and is caught wherever a refused trigger is."""
    error = InvalidTransition(trigger, state, [], role)
    error.args = (f"cannot {trigger!r} from state {state._name_} (role {role}): {why}",)
    return error


def _outcome(phase: Phase, exc: BaseException | None, undo_errors: list[BaseException]) -> BaseException | None:
    """The error a phase ends with (see `Phase.__exit__`)."""
    interrupt = next((e for e in undo_errors if not isinstance(e, Exception)), None)
    if interrupt is not None and (exc is None or isinstance(exc, Exception)):
        return interrupt
    if exc is None and undo_errors:
        error = LifecycleError(
            f"{phase.trigger!r} finished but {len(undo_errors)} undo(s) failed, so the worker's objects are not "
            f"as they were (role {phase.lc.role}); first: {shorten(undo_errors[0], 500)}")
        error.__cause__ = undo_errors[0]
        return error
    return exc


def _worse(exc: BaseException | None, cut: BaseException) -> BaseException:
    """The error a phase ends with when `cut` was raised after its work's own `exc`: an interrupt
    stops the caller even when the work failed too; otherwise the work's own error stands."""
    if exc is None or (isinstance(exc, Exception) and not isinstance(cut, Exception)):
        return cut
    return exc


def _reset(*tokens: Token[Any] | None) -> None:
    """Context variables back as they were; a phase ended in another context than it began in
    (another asyncio task) cannot reset them there, and still ends."""
    for token in tokens:
        try:
            if token is not None:
                token.var.reset(token)
        except (ValueError, RuntimeError):  # "created in a different Context", or used already
            pass


def _unknown(lc: object, trigger: object) -> str:
    """Why `Phase(lc, trigger, ...)` cannot run: `lc` is no machine, or `trigger` no row of its table
    (`done` and `fail` are the phase's own, fired by its end)."""
    table = getattr(lc, "_table", None)
    if not isinstance(table, Table):
        return (f"Phase({shorten(lc)}, {shorten(trigger)}): a phase runs on a machine (a Lifecycle, "
                f"RolloutWeights or the Ray driver), got {type(lc).__name__}")
    return (f"Phase({shorten(trigger)}) (role {getattr(lc, 'role', '?')}): not a trigger of the {table.name} "
            f"machine; its triggers: {', '.join(table.by_trigger)}")


__all__ = [
    "DELETE", "GLOBAL_OBSERVERS", "RUNNING_UNDOS", "Observer", "Phase", "Temporary", "TransitionRecord",
    "refusal", "run_undos", "temporarily",
]
