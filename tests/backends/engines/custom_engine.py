"""An engine from outside the package, reached by import path or entry point in the tests."""

from __future__ import annotations

from backends.engines.naive import NaiveEngine


class OutsideEngine(NaiveEngine):
    """The naive engine under another name: enough to prove the way in works."""


NOT_AN_ENGINE = object()
