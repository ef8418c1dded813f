"""Logging set-up for applications. The library itself only ever calls `structlog.get_logger()`."""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog


def configure(json: bool | None = None, *, level: int = logging.INFO, file: TextIO | None = None) -> None:
    """Console lines on a terminal, JSON lines otherwise (or as `json` says).

    Context bound with `structlog.contextvars` (role, rank, step of the running phase)
    is merged into every record, so backends' records carry it too.
    """
    stream = file if file is not None else sys.stderr
    as_json = not stream.isatty() if json is None else json
    renderer: Any = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks if as_json else structlog.dev.set_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=True,
    )
