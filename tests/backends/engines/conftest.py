"""Engines a test leaves unclosed are collected between tests, not in the middle of the next one.

An unclosed engine keeps its rendezvous `TCPStore` until the garbage collector frees it, and
tracebacks of failed syncs hold engines in reference cycles. Freed by a collection that
happened to run inside the next test's rendezvous, such a store stalled that rendezvous for
about 5 s (seen only in this test module's back-to-back syncs; engines that are closed free
their store at once).

A receiver waiting on its sender first blocks in one store call of up to `control._BLOCK_S`
(1 s) and only then starts checking whether the sender gave up (`ControlStore.wait`). Dozens
of these tests have the sender refuse within milliseconds, so each waited out that second;
here the first call lasts 0.2 s (`_first_wait_short`). The receiver hears of the refusal either
way, only sooner; tests that run an engine in a process of its own keep the 1 s.

`packed` is the fixture of the tests that a sync packs no bucket (test_contiguous, test_nccl).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from backends.engines import control
from backends.engines.buckets import Layout


@pytest.fixture(autouse=True)
def _collect_engines_between_tests() -> Iterator[None]:
    yield
    gc.collect()


@pytest.fixture(autouse=True)
def _first_wait_short(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control, "_BLOCK_S", 0.2)


@pytest.fixture
def packed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The buckets `Layout.pack` packs, in order, on either side of every sync of the test."""
    calls: list[int] = []
    pack = Layout.pack

    def counted(self: Layout, k: int, tensors: Any, copied: Any = None) -> None:
        calls.append(k)
        pack(self, k, tensors, copied)

    monkeypatch.setattr(Layout, "pack", counted)
    return calls
