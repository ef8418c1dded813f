"""Stand-ins that run a probe inside each phase's work, to fire triggers from working states."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from lifecycle import Lifecycle, State
from lifecycle.testing import InjectedFailure, MemoryCheckpointer, MemoryEngine, MemoryRollout
from lifecycle.types import Parts, Progress, SaveInfo


class ProbeCheckpointer(MemoryCheckpointer):
    """A MemoryCheckpointer that runs `probe()` inside each phase's work."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.probe: Callable[[], None] = lambda: None

    def load_initial(self, parts: Parts) -> dict[str, Any]:
        self.probe()
        return super().load_initial(parts)

    def save(self, step: int, parts: Parts, progress: Progress) -> SaveInfo:
        self.probe()
        return super().save(step, parts, progress)

    def resume(self, parts: Parts) -> Progress | None:
        self.probe()
        return super().resume(parts)


class ProbeEngine(MemoryEngine):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.probe: Callable[[], None] = lambda: None

    def sync(self, named_tensors: Any, target: Any, version: int) -> dict[str, Any]:
        self.probe()
        return super().sync(named_tensors, target, version)


def make_lifecycle(**kwargs: Any) -> Lifecycle:
    kwargs.setdefault("model", torch.nn.Linear(3, 2))
    kwargs.setdefault("checkpointer", ProbeCheckpointer())
    kwargs.setdefault("engine", ProbeEngine())
    return Lifecycle(role="actor", **kwargs)


def drive_to(state: State, lc: Lifecycle) -> None:
    """Bring a new lifecycle to a stable state: CREATED, READY, FAILED or CLOSED."""
    if state is State.READY:
        lc.init_load()
    elif state is State.FAILED:  # with a step saved: a failed worker resumes from one (or is built anew)
        lc.init_load()
        lc.save(1)
        lc.checkpointer.fail_next("save")  # type: ignore[attr-defined]
        with pytest.raises(InjectedFailure):
            lc.save(2)
    elif state is State.CLOSED:
        lc.close()
    if lc.state is not state:
        raise RuntimeError(f"could not drive to {state}")


def fire(lc: Lifecycle, trigger: str) -> Any:
    """Fire a table trigger the way a user would."""
    if trigger == "train_step":
        with lc.train_step(lc.progress.step + 1):
            return None
    if trigger == "sync_weights":
        return lc.sync_weights(MemoryRollout())
    return getattr(lc, trigger)()
