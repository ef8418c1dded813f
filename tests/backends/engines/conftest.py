"""Engines a test leaves unclosed are collected between tests, not in the middle of the next one.

An unclosed engine keeps its rendezvous `TCPStore` until the garbage collector frees it, and
tracebacks of failed syncs hold engines in reference cycles. Freed by a collection that
happened to run inside the next test's rendezvous, such a store stalled that rendezvous for
about 5 s (seen only in this test module's back-to-back syncs; engines that are closed free
their store at once).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _collect_engines_between_tests() -> Iterator[None]:
    yield
    gc.collect()
