"""`Lifecycle`: one worker's state machine and its triggers; each runs as a `phase.Phase`."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, TypeVar

import structlog
from transitions import MachineError

from lifecycle.boundary import check_step
from lifecycle.config import LifecycleConfig
from lifecycle.errors import InvalidTransition, LifecycleError
from lifecycle.machine import NAMES, ROWS, MachineModel, State, allowed_triggers, build_machine
from lifecycle.phase import GLOBAL_OBSERVERS, Observer, Phase, Temporary, TransitionRecord
from lifecycle.types import Checkpointer, Parts, Progress, SaveInfo, WeightSyncer

F = TypeVar("F", bound=Callable[[], object])


class Lifecycle:
    """One worker's lifecycle: init-load, train, save, weight-sync and resume, as one machine.

    Every trigger runs as begin -> work -> undo stack -> done/fail, leaves one `TransitionRecord`
    in `history` and one `lifecycle.transition` log record. A trigger that the table does
    not allow from the current state raises `InvalidTransition` and changes nothing.
    """

    def __init__(
        self,
        config: LifecycleConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
        *,
        role: str = "actor",
        model: Any = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        dataloader: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
        checkpointer: Checkpointer | None = None,
        engine: WeightSyncer | None = None,
        observers: Iterable[Observer] = (),
        history_limit: int = 10_000,
    ) -> None:
        self.config = LifecycleConfig.coerce(config)
        self.role = role
        self.rank, self.world_size = _rank_and_size(rank, world_size)
        self.parts = Parts(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, dataloader=dataloader)
        self.progress = Progress()
        self.observers: list[Observer] = list(observers)
        self._history: deque[TransitionRecord] = deque(maxlen=history_limit)
        if checkpointer is None:
            from lifecycle.checkpointer import check_parts

            check_parts(self.config, self.parts, self.world_size)
        self._checkpointer = checkpointer
        self._engine = engine
        self._phase: Phase | None = None
        self._lock = threading.Lock()
        self._model = MachineModel()
        self._machine = build_machine(self._model)
        self._log = structlog.get_logger()

    @property
    def state(self) -> State:
        return self._model.state

    @property
    def history(self) -> list[TransitionRecord]:
        return list(self._history)

    @property
    def checkpointer(self) -> Checkpointer:
        if self._checkpointer is None:
            from lifecycle.checkpointer import DiskCheckpointer

            self._checkpointer = DiskCheckpointer(
                self.config, role=self.role, rank=self.rank, world_size=self.world_size
            )
        return self._checkpointer

    @property
    def engine(self) -> WeightSyncer:
        """The `engine=` given, else the checkpoint engine `config.engine` names, built on first use."""
        if self._engine is None:
            from backends.engines.sync import WeightSync

            self._engine = WeightSync.from_config(self.config.engine, self.parts.model)
        return self._engine

    def init_load(self) -> None:
        """CREATED -> LOADING -> READY: the first load of weights (pre_load)."""
        with Phase(self, "init_load", None) as phase:
            phase.figures.update(self.checkpointer.load_initial(self.parts))

    def train_step(self, step: int) -> Phase:
        """READY -> TRAINING -> READY around the caller's step; an exception leaves FAILED."""
        return Phase(self, "train_step", step)

    def save(self, step: int | None = None) -> SaveInfo:
        """READY -> SAVING -> READY: write and commit a checkpoint; returns what was written."""
        step = check_step(self.progress.step if step is None else step)  # before the machine moves
        with Phase(self, "save", step) as phase:
            self.progress.step = step
            info = self.checkpointer.save(step, self.parts, self.progress)
            phase.figures.update(info.figures())
        return info

    def sync_weights(self, target: Any) -> int:
        """READY -> SYNCING -> READY: push the model's weights to `target`; returns the version."""
        version = self.progress.weights_version + 1
        with Phase(self, "sync_weights", self.progress.step) as phase:
            model = self.parts.model
            if model is None:
                raise LifecycleError(f"sync_weights needs a model (role {self.role})")
            if getattr(model, "training", False):
                model.eval()
                self.on_exit(model.train)
            phase.figures.update(self.engine.sync(_named_tensors(model), target, version))
            phase.figures["version"] = version
            self.progress.weights_version = version
        return version

    def resume(self) -> int | None:
        """CREATED/FAILED -> RESUMING -> READY from the newest complete checkpoint.

        Returns the step resumed at, or None for a fresh start: init-load instead, when the
        checkpointer restores nothing (the disk checkpointer decides `resume.mode` and logs why).
        """
        with Phase(self, "resume", None) as phase:
            restored = self.checkpointer.resume(self.parts)
            if restored is None:
                self._log.info("lifecycle.resume_fallback", role=self.role, mode=self.config.resume.mode.value,
                               reason="the checkpointer restored nothing", action="init_load")
                phase.figures.update(self.checkpointer.load_initial(self.parts), fallback="init_load")
                self.progress = Progress()
                return None
            self.progress = restored
            phase.step = restored.step
            phase.figures["resumed_step"] = restored.step
            return restored.step

    def close(self) -> None:
        """CREATED/READY/FAILED -> CLOSED; releases the engine and waits for pending saves."""
        with Phase(self, "close", self.progress.step):
            for resource in (self._engine, self._checkpointer):
                closer = getattr(resource, "close", None)
                if closer is not None:
                    self.on_exit(closer)
            wait = getattr(self._checkpointer, "wait", None)
            if wait is not None:
                wait()  # an async save's failure is this close's error, not a failed undo

    def temporarily(self, obj: object, **attrs: Any) -> Temporary:
        """Set (or, with `DELETE`, remove) attributes of `obj` until the running phase ends."""
        phase = self._running("temporarily")
        change = Temporary(obj, attrs)
        phase.undos.append(change.restore)
        return change

    def on_exit(self, undo: F) -> F:
        """Run `undo` when the running phase ends, whether its work succeeded or raised."""
        self._running("on_exit").undos.append(undo)
        return undo

    def add_observer(self, observer: Observer) -> None:
        self.observers.append(observer)

    def remove_observer(self, observer: Observer) -> None:
        self.observers.remove(observer)

    def export_chrome_trace(self, path: str | os.PathLike[str]) -> Path:
        """The history as a Chrome trace; the writer (and the checkpoint I/O it uses) loads on first use."""
        from lifecycle.trace import write_chrome_trace

        return write_chrome_trace(self._history, path, role=self.role, rank=self.rank)

    def _running(self, what: str) -> Phase:
        phase = self._phase
        if phase is None:
            raise LifecycleError(
                f"{what}() needs a running phase to undo it in; state is {self.state.name} "
                f"(role {self.role}): call it from inside init_load/train_step/save/sync/resume work"
            )
        return phase

    def _move(self, trigger: str) -> None:
        with self._lock:
            src = self._model.state
            try:
                getattr(self._model, trigger)()
            except MachineError:
                raise InvalidTransition(trigger, src, allowed_triggers(src), self.role) from None
        if self.observers or GLOBAL_OBSERVERS:
            dst = self._model.state
            for observer in (*self.observers, *GLOBAL_OBSERVERS):
                observer.on_state_change(self, src, dst, trigger)

    def _record(self, phase: Phase, error: BaseException | None) -> None:
        """The one history entry and the one `lifecycle.transition` record of a trigger."""
        start, t0 = phase.started
        duration = time.perf_counter() - t0
        dst = self._model.state
        message = None if error is None else f"{type(error).__name__}: {error}"
        working = ROWS[phase.trigger].working
        path = (phase.src, dst) if working is None else (phase.src, working, dst)
        record = TransitionRecord(phase.trigger, phase.src, dst, phase.step, start, duration,
                                  error is None, message, path, phase.figures)
        self._history.append(record)
        emit = self._log.info if error is None else partial(self._log.error, error=message)
        emit("lifecycle.transition", trigger=phase.trigger, src=NAMES[phase.src], dst=NAMES[dst],
             role=self.role, rank=self.rank, step=phase.step, duration_s=round(duration, 6),
             ok=error is None, **phase.figures)
        if self.observers or GLOBAL_OBSERVERS:
            for observer in (*self.observers, *GLOBAL_OBSERVERS):
                observer.on_transition(self, record)

    def __repr__(self) -> str:
        return f"Lifecycle(role={self.role!r}, rank={self.rank}, state={self.state.name})"


def _rank_and_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit values first, then an initialised torch.distributed, then RANK/WORLD_SIZE."""
    if rank is None or world_size is None:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    return rank, world_size


def _named_tensors(model: Any) -> Iterator[tuple[str, Any]]:
    """Weights to sync: the state dict, tied tensors once (the receiver re-ties by name)."""
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        key = tensor.data_ptr() if hasattr(tensor, "data_ptr") else id(tensor)
        if key in seen:
            continue
        seen.add(key)
        yield name, tensor


__all__ = ["Lifecycle"]
