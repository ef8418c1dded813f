"""Logging set-up for applications. The library itself only ever calls `structlog.get_logger()`."""

from __future__ import annotations

import json as _json
import logging
import sys
from typing import Any, TextIO

import structlog

_ENCODER = _json.JSONEncoder(default=str)


def _dumps(obj: Any, **_: Any) -> str:
    """One encoder for every record: `json.dumps` with a `default` builds a new one per call."""
    return _ENCODER.encode(obj)


def configure(json: bool | None = None, *, level: int = logging.INFO, file: TextIO | None = None) -> None:
    """Console lines on a terminal, JSON lines otherwise (or as `json` says).

    Context bound with `structlog.contextvars` (role, rank, step of the running phase)
    is merged into every record, so backends' records carry it too. JSON records carry
    `timestamp` as Unix seconds: cheap to stamp on every transition, exact to sort and join on.
    """
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
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.WriteLoggerFactory(stream),
        cache_logger_on_first_use=True,
    )
