"""The library's own exception types: every message names the state, key or file at fault."""

from __future__ import annotations

import re
import reprlib


class LifecycleError(Exception):
    """Base class of every error this library raises on purpose.

    Each one pickles as its class, its `args` and its fields, and is rebuilt without calling
    its `__init__` (`_rebuilt`), so it crosses a process boundary whole whatever arguments a
    subclass's `__init__` takes: a Ray driver reads a worker's `ConfigError` (or an
    application's subclass of it) as itself, not as an exception Ray could not rebuild.
    """

    def __reduce__(self) -> tuple[object, ...]:
        return _rebuilt, (type(self), self.args, dict(vars(self)))


def _rebuilt(cls: type[LifecycleError], args: tuple[object, ...], fields: dict[str, object]) -> LifecycleError:
    """A pickled `LifecycleError` as it was, its `__init__` not called (a subclass's may take
    other arguments than the ones it passed on)."""
    error = cls.__new__(cls)
    error.args = args
    vars(error).update(fields)
    return error


class InvalidTransition(LifecycleError):
    """A trigger was fired from a state where the transition table does not allow it."""

    def __init__(self, trigger: str, state: object, allowed: list[str], role: str = "") -> None:
        self.trigger = trigger
        self.state = state
        self.allowed = allowed
        self.role = role
        who = f" (role {role})" if role else ""
        name = getattr(state, "name", state)
        final = name in ("CLOSED", "FINISHED", "ERRORED")  # the machines' final states
        choices = ", ".join(allowed) if allowed else f"none: {name} is final" if final else \
            "none until the running phase ends"
        super().__init__(
            f"cannot {trigger!r} from state {name}{who}; "
            f"allowed from there: {choices}"
        )


class ConfigError(LifecycleError, ValueError):
    """A config key is unknown, has a bad value, or conflicts with another key."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}" if key else message)


def check_callable(key: str, value: object, signature: str, *, optional: bool = True) -> None:
    """`ConfigError` naming `key` unless `value` can be called (or is None, when `optional`):
    an argument the machine calls later is refused when it is given, not when first called."""
    if not (callable(value) or (optional and value is None)):
        raise ConfigError(key, f"must be {'None or ' if optional else ''}a callable {signature}, got "
                               f"{shorten(value)} ({type(value).__name__})")


class CheckpointError(LifecycleError):
    """A checkpoint is missing, incomplete, corrupt, or does not match the model."""


class DamagedCheckpoint(CheckpointError):
    """Files of a committed step are missing, short, unreadable or fail their checksums
    (as opposed to a step that is intact but does not fit the model or the config)."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        self.problems = list(problems or [message])
        super().__init__(message)


class EngineError(LifecycleError):
    """A weight transfer failed, timed out, or delivered data that did not verify."""


class _Short(reprlib.Repr):
    """`reprlib` with tight limits, so a quoted value cannot recurse (deep nesting), explode (a
    YAML alias bomb, a list of a million items) or fail (`repr` of an integer past 4300 digits
    raises `ValueError`)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother, self.maxlong = 3, limit, limit, max(limit // 2, 8)

    def repr_int(self, x: int, level: int) -> str:
        bits = x.bit_length()
        return f"<integer of {bits} bits>" if bits > 2000 else super().repr_int(x, level)


def shorten(value: object, limit: int = 80) -> str:
    """A bounded `repr` of any value, for messages: each string or other leaf quoted at most
    `limit` characters, containers a few items and three levels deep. It never raises and never
    builds the full `repr` of a large value first."""
    return _Short(limit).repr(value)


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
"""Characters a terminal acts on rather than shows (escape sequences, line breaks, bidi overrides)."""


def printable(text: str) -> str:
    """`text` with every character a terminal would act on written as its escape (`\\x1b`, `\\n`):
    a name in a checkpoint root cannot move the cursor, recolour, set the clipboard or forge a line."""
    return _CONTROL.sub(lambda found: found.group().encode("unicode_escape").decode("ascii"), text)
