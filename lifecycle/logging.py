"""Logging set-up for applications. The library itself only ever calls `structlog.get_logger()`."""

from __future__ import annotations

import errno
import io
import json as _json
import logging
import math
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import structlog

from lifecycle.boundary import kind
from lifecycle.errors import ConfigError, LifecycleError, shorten

_INT64 = range(-(2**63), 2**63)
"""Integers a reader's JSON parser keeps exact (and far inside Python's 4300-digit limit)."""
_DEPTH = 64
"""Levels `jsonable` follows; deeper (or a value that contains itself) is quoted bounded."""


def jsonable(value: Any, default: Callable[[Any], Any] | None = None, depth: int = 0,
             path: frozenset[int] = frozenset()) -> Any:
    """`value` as strict JSON can carry it: a NaN or infinite float as `"nan"`, `"inf"` or
    `"-inf"` (Perfetto's `JSON.parse` refuses the bare tokens), an integer outside int64 as its
    bounded text (`json` raises past 4300 digits), dict keys likewise; a value of another type
    through `default`. A container met again inside itself (`path`: the ids above it) is quoted
    bounded, so a value that holds itself twice costs its size, not 2**depth."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value in _INT64 else shorten(value)
    if value is None or isinstance(value, (str, bool)):
        return value
    if depth >= _DEPTH or id(value) in path:
        return shorten(value)
    inner = path | {id(value)}
    if isinstance(value, dict):
        return {jsonable(k) if isinstance(k, (int, float)) else k: jsonable(v, default, depth + 1, inner)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item, default, depth + 1, inner) for item in value]
    return value if default is None else jsonable(default(value), default, depth + 1, inner)


def dumps(value: Any, default: Callable[[Any], Any]) -> str:
    """Strict JSON of `value` (see `jsonable`): one pass when it holds nothing JSON lacks a token
    for, a second over its `jsonable` copy when it does."""
    try:
        return _json.dumps(value, default=default, allow_nan=False)
    except ValueError:
        return _json.dumps(jsonable(value, default), default=default, allow_nan=False)


_ENCODER = _json.JSONEncoder(default=str, allow_nan=False)


def _dumps(obj: Any, **_: Any) -> str:
    """One encoder for every record: `json.dumps` with a `default` builds a new one per call."""
    try:
        return _ENCODER.encode(obj)
    except ValueError:
        return _ENCODER.encode(jsonable(obj))


_WHY = {errno.ENXIO: "a FIFO (or device) with no reader; a log appends to a regular file",
        errno.ELOOP: "a symlink; refusing to follow it", errno.EISDIR: "a folder, not a regular file"}
"""What `os.open` failing with these errnos says about the path, in words."""


def open_log(path: str | os.PathLike[str], *, buffering: int = -1) -> TextIO:
    """`path` opened to append text, created if missing: a regular file only. It never blocks
    (a FIFO with no reader is refused, not waited on), never follows a symlink, and every
    failure is a `LifecycleError` naming the file."""
    if not isinstance(path, (str, os.PathLike)):
        raise LifecycleError(f"a log path must be a str or os.PathLike, got {shorten(path)}")
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, flags, 0o666)
    except (OSError, ValueError) as exc:
        why = _WHY.get(getattr(exc, "errno", None), str(exc))
        raise LifecycleError(f"{os.fsdecode(path)}: cannot open the log to append: {why}") from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise LifecycleError(f"{os.fsdecode(path)}: a {kind(mode)}, not a regular file; a log appends to a file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "a", buffering=buffering, encoding="utf-8")
    except BaseException:
        os.close(fd)
        raise


_LEVELS = {"critical": 50, "error": 40, "warning": 30, "warn": 30, "info": 20, "debug": 10, "notset": 0}
"""The levels `structlog.make_filtering_bound_logger` has a logger for, by name."""


def _check(json: object, level: object, file: object) -> int:
    """`ConfigError` naming the argument `configure` cannot use; the level as a number."""
    if json is not None and not isinstance(json, bool):
        raise ConfigError("json", f"must be None (JSON unless a terminal), True or False, got {shorten(json)}")
    number = _LEVELS.get(level.lower()) if isinstance(level, str) else level
    if isinstance(number, bool) or not isinstance(number, int) or number not in _LEVELS.values():
        raise ConfigError("level", f"must be one of {sorted(set(_LEVELS.values()))} (logging.DEBUG, ...) or a "
                                   f"name ({', '.join(_LEVELS)}), got {shorten(level)}")
    if file is None:
        return number
    writable = getattr(file, "writable", None)
    if isinstance(file, (io.RawIOBase, io.BufferedIOBase)) or not all(
            callable(getattr(file, name, None)) for name in ("write", "flush", "isatty")):
        raise ConfigError("file", f"must be None (stderr) or an open text stream, got {shorten(file)} "
                                  f"({type(file).__name__}); open a path first (`open_log`)")
    if getattr(file, "closed", False) or (callable(writable) and not writable()):
        raise ConfigError("file", f"{shorten(file)} is closed or not open for writing")
    return number


def configure(json: bool | None = None, *, level: int | str = logging.INFO, file: TextIO | None = None) -> None:
    """Console lines on a terminal, JSON lines otherwise (or as `json` says).

    Context bound with `structlog.contextvars` (role, rank, step of the running phase)
    is merged into every record, so backends' records carry it too. JSON records carry
    `timestamp` as Unix seconds: cheap to stamp on every transition, exact to sort and join on.
    JSON records are strict JSON: a NaN or infinite value is written `"nan"`, `"inf"`, `"-inf"`.
    An argument it cannot use (a closed file, a level no logger has) is a `ConfigError` naming it.
    """
    number = _check(json, level, file)
    stream = file if file is not None else sys.stderr
    as_json = not stream.isatty() if json is None else json
    processors: list[Any] = [structlog.contextvars.merge_contextvars, structlog.processors.add_log_level]
    if as_json:
        processors += [structlog.processors.TimeStamper(), structlog.processors.dict_tracebacks,
                       structlog.processors.JSONRenderer(serializer=_dumps)]
    else:
        processors += [structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False), structlog.dev.set_exc_info,
                       structlog.dev.ConsoleRenderer(colors=stream.isatty())]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(number),
        logger_factory=structlog.WriteLoggerFactory(stream),
        cache_logger_on_first_use=True,
    )
