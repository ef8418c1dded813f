"""The library's errors cross process boundaries whole (a Ray driver reads a worker's error by type)."""

from __future__ import annotations

import pickle

import pytest

from lifecycle.errors import CheckpointError, ConfigError, DamagedCheckpoint, EngineError, InvalidTransition
from lifecycle.machine import State


@pytest.mark.parametrize("error", [
    ConfigError("engine.backend", "unknown backend 'x'"), ConfigError("", "no key"),
    InvalidTransition("save", State.READY, ["close"], "actor"), DamagedCheckpoint("step 3 is short", ["a", "b"]),
    CheckpointError("disk full"), EngineError("peer lost"),
], ids=lambda e: type(e).__name__)
def test_each_error_pickles_with_its_message_and_fields(error: Exception) -> None:
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error) and vars(back) == vars(error)
