"""The library's own log records, which never fail the work that writes them: a log sink that
raises, or a logger factory with a bug, loses its record (said once on stderr), not a committed
save. A leaf: the modules that log, backends among them, import these from here."""

from __future__ import annotations

import sys
from typing import Any, Callable

import structlog

from lifecycle.errors import shorten


def guarded(call: Callable[..., object], *args: Any, **kwargs: Any) -> BaseException | None:
    """`call(*args, **kwargs)`, a log call; what it raised (an `Exception`), or None: a log sink
    that fails must not leave the machine half-moved (`_unheard` says so once on stderr)."""
    try:
        call(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - handed back to the caller, and said once on stderr
        _unheard(exc)
        return exc
    return None


def say(level: str, event: str, **fields: Any) -> BaseException | None:
    """One record of `event` at `level` (`info`, `warning`, `error`...) on structlog's logger, through
    `guarded`: the logger is looked up inside the guard too (binding it runs the application's
    logger factory), so no failure to log can fail the work that logs, a committed save or a
    finished load included."""
    return guarded(_emit, level, event, fields)


def _emit(level: str, event: str, fields: dict[str, Any]) -> None:
    getattr(structlog.get_logger(), level)(event, **fields)


_UNHEARD: set[str] = set()


def _unheard(exc: Exception) -> None:
    """The first failure of each kind to log (a sink that raises, a processor with a bug) goes to
    stderr once, so records that vanish leave a trace of why."""
    kind = type(exc).__name__
    if kind not in _UNHEARD:
        _UNHEARD.add(kind)
        try:
            sys.stderr.write(f"trainer-lifecycle: a log record was lost ({described(exc)}); further "
                             f"{kind} failures of logging are not shown\n")
        except Exception:  # noqa: BLE001 - stderr is gone too: nothing left to tell
            pass


def message(error: BaseException) -> str:
    """An error's message, bounded; never raises, even when its `__str__` does."""
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - an error whose __str__ fails still gets its record
        text = f"<unprintable {shorten(error, 200)}>"
    if len(text) > _MESSAGE_CHARS:
        text = f"{text[:_MESSAGE_CHARS]}... [{len(text)} characters in all]"
    return text


def described(error: BaseException) -> str:
    """`TypeName: message` of an error, for a record (`message`)."""
    return f"{type(error).__name__}: {message(error)}"


_MESSAGE_CHARS = 4000
"""The most characters of an error's message a record carries."""
