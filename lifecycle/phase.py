"""What a phase leaves and undoes: the history entry, temporary attribute changes, the undo run."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Callable, NamedTuple

import structlog

from lifecycle.machine import State


class _Delete:
    """Sentinel: `lc.temporarily(obj, attr=DELETE)` removes `attr` for the phase."""

    _instance: _Delete | None = None

    def __new__(cls) -> _Delete:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "DELETE"


DELETE = _Delete()
_MISSING = object()


class Transition(NamedTuple):
    """One entry of `lc.history`: a whole trigger, from its source to where it ended."""

    trigger: str
    src: State
    dst: State
    step: int | None
    start: float
    """Wall-clock start, seconds since the epoch (for traces)."""
    duration_s: float
    ok: bool
    error: str | None
    path: tuple[State, ...]
    """Every state visited, source first: (READY, SAVING, READY)."""
    figures: dict[str, Any]
    """The operation's own figures (backend, path, bytes, gbps, version...)."""


class Temporary:
    """Attributes changed for the rest of a phase; also a context manager to restore sooner."""

    __slots__ = ("_obj", "_saved", "_restored")

    def __init__(self, obj: object, attrs: dict[str, Any]) -> None:
        self._obj = obj
        self._saved: list[tuple[str, Any]] = []
        self._restored = False
        try:
            for name, value in attrs.items():
                self._saved.append((name, getattr(obj, name, _MISSING)))
                if value is DELETE:
                    if hasattr(obj, name):
                        delattr(obj, name)
                else:
                    setattr(obj, name, value)
        except BaseException:
            self.restore()
            raise

    def restore(self) -> None:
        """Put every attribute back as it was, last changed first; idempotent."""
        if self._restored:
            return
        self._restored = True
        for name, old in reversed(self._saved):
            if old is _MISSING:
                if hasattr(self._obj, name):
                    delattr(self._obj, name)
            else:
                setattr(self._obj, name, old)

    def __repr__(self) -> str:
        names = ", ".join(name for name, _ in self._saved)
        return f"restore {type(self._obj).__name__}.{{{names}}}"

    def __enter__(self) -> Temporary:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


RUNNING_UNDOS: ContextVar[list[Callable[[], object]] | None] = ContextVar("lifecycle_undos", default=None)
"""The undo stack of the phase running in this context; set by `Phase`, read by `temporarily`."""


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
    """Run a phase's undos last-in-first-out; a failing undo is logged and never stops the rest."""
    errors: list[BaseException] = []
    while undos:
        undo = undos.pop()
        try:
            undo()
        except Exception as exc:  # noqa: BLE001 - every undo must get its turn
            errors.append(exc)
            structlog.get_logger().error(
                "lifecycle.undo_failed", trigger=trigger, undo=repr(undo), error=repr(exc)
            )
    return errors
