"""A testing kit for workers that embed a Lifecycle: in-memory stand-ins that fail on demand.

    from lifecycle.testing import MemoryCheckpointer, capture_transitions
    ckpt = MemoryCheckpointer(fail_at={"save"})
    lc = Lifecycle(role="actor", model=model, checkpointer=ckpt)
    with capture_transitions(lc) as cap:
        lc.init_load()
        with pytest.raises(InjectedFailure):
            lc.save(1)
    cap.assert_path([State.CREATED, State.LOADING, State.READY, State.SAVING, State.FAILED])
"""

from __future__ import annotations

import copy
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from collections.abc import Sequence
from enum import Enum
from typing import Any, ClassVar, Iterable, Iterator

from lifecycle.errors import ConfigError, EngineError, shorten
from lifecycle.jsontree import decode
from lifecycle.phase import GLOBAL_OBSERVERS, Observer, TransitionRecord
from lifecycle.stateful import Stateful
from lifecycle.types import Parts, Progress, SaveInfo, rollouts_problem, updating


class InjectedFailure(RuntimeError):
    """Raised by the in-memory stand-ins at the phase they were told to fail in."""


class _FailureSwitch:
    """Where a stand-in fails: always at `fail_at` phases, once at phases given to `fail_next`.

    Each phase named must be one of the stand-in's `PHASES`: a misspelt one would never fire,
    and the test meant to see the failure would pass without it."""

    PHASES: ClassVar[tuple[str, ...]] = ()

    def __init__(self, fail_at: Iterable[str] = ()) -> None:
        if isinstance(fail_at, str):  # set("save") would be {'s', 'a', 'v', 'e'}
            raise ConfigError("fail_at", f"fail_at takes a collection of phase names, got the string {fail_at!r}: "
                                         f"write fail_at={{{fail_at!r}}}")
        self.fail_at = {self._phase("fail_at", phase) for phase in fail_at}
        self._once: set[str] = set()
        self.calls: list[tuple[str, Any]] = []

    def _phase(self, key: str, phase: object) -> str:
        if not isinstance(phase, str) or phase not in self.PHASES:
            raise ConfigError(key, f"{type(self).__name__} has no phase {shorten(phase)}; "
                                   f"its phases are {', '.join(self.PHASES)}")
        return phase

    def fail_next(self, phase: str) -> None:
        self._once.add(self._phase("fail_next", phase))

    def hit(self, phase: str, arg: Any = None) -> None:
        self.calls.append((phase, arg))
        if phase in self.fail_at or phase in self._once:
            self._once.discard(phase)
            raise InjectedFailure(f"injected failure at {phase!r}")


def _snapshot(obj: Any) -> Any:
    return None if obj is None or not hasattr(obj, "state_dict") else copy.deepcopy(obj.state_dict())


_PARTS = ("model", "optimizer", "lr_scheduler", "dataloader")
"""What a memory checkpoint keeps (each one's `state_dict()`): the data position too, so a test
of resume sees the batch a disk checkpoint would restore. RNG states are not kept."""


def _holder(parts: Parts, name: str) -> Any:
    """What holds a part's state: a DataLoader's sampler, as on disk (`extra.stateful_loader`)."""
    from lifecycle.extra import stateful_loader

    part = getattr(parts, name)
    return stateful_loader(part) if name == "dataloader" else part


def _as_on_disk(progress: Progress, where: str) -> Progress:
    """`progress` through the checks and the encoding of a disk checkpoint's extra.json: what a
    disk save refuses fails here too, and `user` comes back as a resume from disk gives it."""
    from lifecycle.extra import checked_user

    return replace(progress, user=decode(checked_user(progress, where), where=where))


class MemoryCheckpointer(_FailureSwitch):
    """A Checkpointer holding checkpoints in memory; phases: load_initial, save, commit, resume.

    A failure at `commit` happens after the state was copied but before it is kept, like a
    crash between write and commit on disk: the previous checkpoint stays the newest.
    `Progress` is refused where a disk checkpoint refuses it, and kept as one would read it back.
    """

    PHASES = ("load_initial", "save", "commit", "resume")

    def __init__(self, *, fail_at: Iterable[str] = (), initial: dict[str, Any] | None = None) -> None:
        super().__init__(fail_at)
        self.initial = initial
        self.saved: dict[int, dict[str, Any]] = {}

    def load_initial(self, parts: Parts) -> dict[str, Any]:
        self.hit("load_initial")
        if self.initial is not None and parts.model is not None:
            parts.model.load_state_dict(self.initial)
        return {"backend": "memory"}

    def save(self, step: int, parts: Parts, progress: Progress) -> SaveInfo:
        self.hit("save", step)
        snapshot = {name: _snapshot(_holder(parts, name)) for name in _PARTS}
        snapshot["progress"] = _as_on_disk(progress, f"memory/global_step_{step}")
        self.hit("commit", step)
        self.saved[step] = snapshot
        return SaveInfo(step=step, path=Path(f"memory/global_step_{step}"), contents=["model"], backend="memory")

    def resume(self, parts: Parts) -> Progress | None:
        self.hit("resume")
        if not self.saved:
            return None
        snapshot = self.saved[max(self.saved)]
        for name in _PARTS:
            target, state = _holder(parts, name), snapshot[name]
            if target is not None and state is not None:
                target.load_state_dict(copy.deepcopy(state))
        progress: Progress = snapshot["progress"]
        return replace(progress, user=copy.deepcopy(progress.user))


class MemoryRollout:
    """A rollout target in the same process; refuses to serve weights marked stale."""

    def __init__(self) -> None:
        self.weights: dict[str, Any] = {}
        self.weights_version = 0
        self.paused = False
        self.stale = False
        self.calls: list[str] = []

    def pause(self) -> None:
        self.calls.append("pause")
        self.paused = True

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Keeps each tensor as it arrives, so a sync failing part-way leaves what it handed out."""
        self.calls.append("load_weights")
        for name, tensor in named_tensors:
            self.weights[name] = tensor.detach().clone()

    def resume(self) -> None:
        self.calls.append("resume")
        self.paused = False

    def mark_stale(self) -> None:
        self.stale = True

    def serve(self) -> dict[str, Any]:
        if self.stale or self.paused:
            raise RuntimeError(f"rollout weights v{self.weights_version} are {'stale' if self.stale else 'paused'}")
        return self.weights


class MemoryEngine(_FailureSwitch):
    """A WeightSyncer that copies in process; phases: pause, transfer, apply, resume (each once
    per rollout). Takes what the `naive` engine takes: a rollout or a list (or tuple) of them,
    updated one after the other; none at all, a rollout without `load_weights` (before any is paused), or one
    whose pause fails, is an `EngineError` saying so, and is left untouched."""

    PHASES = ("pause", "transfer", "apply", "resume")

    def check_target(self, target: Any) -> None:
        """What `sync` would refuse of `target`, before any rollout is paused: `Lifecycle.sync_weights`
        calls it before its machine moves, as it does a real engine's."""
        problem = rollouts_problem("memory", target)
        if problem is not None:  # before any rollout is paused
            raise EngineError(problem)

    def sync(self, named_tensors: Iterator[tuple[str, Any]], target: Any, version: int) -> dict[str, Any]:
        self.check_target(target)
        rollouts = list(target) if isinstance(target, (list, tuple)) else [target]
        received: list[tuple[str, Any]] | None = None
        for rollout in rollouts:
            self.hit("pause", version)
            with ExitStack() as bracket:
                try:
                    landed = bracket.enter_context(updating(rollout))
                except Exception as exc:  # noqa: BLE001 - the rollout's own error, named in ours
                    raise EngineError(f"memory engine: the rollout could not be paused for the sync: "
                                      f"{type(exc).__name__}: {exc}") from exc
                self.hit("transfer", version)
                if received is None:  # the weights are read once, whatever the number of rollouts
                    received = [(name, tensor.detach().clone()) for name, tensor in named_tensors]
                self.hit("apply", version)
                rollout.load_weights(received)
                landed(version)
            self.hit("resume", version)
        sent = received or []
        return {"backend": "memory", "bytes": sum(t.numel() * t.element_size() for _, t in sent),
                "receivers": len(rollouts)}


class Capture(Observer):
    """What `capture_transitions` saw: every record and the states visited, in order."""

    def __init__(self, only: Stateful[Any] | None) -> None:
        self.only = only
        self.records: list[TransitionRecord] = []
        self.path: list[Enum] = []

    def on_state_change(self, lc: Stateful[Any], src: Any, dst: Any, trigger: str) -> None:
        if self.only is None or lc is self.only:
            if not self.path:
                self.path.append(src)
            self.path.append(dst)

    def on_transition(self, lc: Stateful[Any], record: TransitionRecord) -> None:
        if self.only is None or lc is self.only:
            self.records.append(record)

    @property
    def triggers(self) -> list[str]:
        return [record.trigger for record in self.records]

    def assert_path(self, expected: Sequence[Enum]) -> None:
        if self.path != list(expected):
            raise AssertionError(
                "lifecycle path differs:\n  expected " + " -> ".join(s.name for s in expected)
                + "\n  actual   " + " -> ".join(s.name for s in self.path)
            )


@contextmanager
def capture_transitions(lc: Stateful[Any] | None = None) -> Iterator[Capture]:
    """Record the transitions of `lc` (a `Lifecycle`, a `RolloutWeights`, any machine), or of every
    Lifecycle in the process when none is given."""
    capture = Capture(lc)
    observers = GLOBAL_OBSERVERS if lc is None else lc.observers
    observers.append(capture)
    try:
        yield capture
    finally:
        observers.remove(capture)
