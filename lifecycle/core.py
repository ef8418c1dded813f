"""`Lifecycle`: one worker's state machine and its triggers; each runs as a `phase.Phase`."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Iterable, Mapping, TypeVar

from lifecycle.boundary import check_step
from lifecycle.config import LifecycleConfig
from lifecycle.errors import CheckpointError, ConfigError, LifecycleError, shorten
from lifecycle.machine import TRAINER, State
from lifecycle.phase import GLOBAL_OBSERVERS, Observer, Phase
from lifecycle.records import guarded
from lifecycle.stateful import Stateful
from lifecycle.types import Checkpointer, Parts, Progress, SaveInfo, WeightSyncer, is_count, plain_digits
from lifecycle.watchdog import Emit, Watchdog

T = TypeVar("T")


class Lifecycle(Stateful[State]):
    """One worker's lifecycle: init-load, train, save, weight-sync and resume, as one machine.

    Every trigger runs as begin -> work -> undo stack -> done/fail, leaves one `TransitionRecord`
    in `history` and one `lifecycle.transition` log record. A trigger that the table does
    not allow from the current state raises `InvalidTransition` and changes nothing.
    """

    _global_observers = GLOBAL_OBSERVERS

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
        watchdog: Watchdog | None = None,
        on_overdue: Emit | None = None,
    ) -> None:
        """`watchdog`: the one that watches this lifecycle's budgeted phases (default: the process's);
        `on_overdue`: where its overdue reports go (default: the `lifecycle.phase_overdue` warning)."""
        self.config = LifecycleConfig.coerce(config)
        rank, self.world_size = _rank_and_size(rank, world_size)
        super().__init__(TRAINER, role=role, rank=rank, observers=observers, history_limit=history_limit,
                         watchdog=watchdog, on_overdue=on_overdue)
        _check_plugins(checkpointer, engine)
        if engine is None:
            _check_apply(self.config, model)
        self.parts = Parts(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, dataloader=dataloader)
        self.progress = Progress()
        if checkpointer is None:
            from lifecycle.checkpointer import check_parts

            check_parts(self.config, self.parts, self.world_size)
        self._checkpointer = checkpointer
        self._engine = engine
        self._trained = False

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
            loaded = self.checkpointer.load_initial(self.parts)
            phase.figures.update(_returned(loaded, Mapping, "checkpointer.load_initial"))

    def train_step(self, step: int) -> Phase:
        """READY -> TRAINING -> READY around the caller's step; an exception leaves FAILED. A step
        that no save could take (`check_step`) is refused before the machine moves."""
        return Phase(self, "train_step", self._step("train_step", step))

    def save(self, step: int | None = None) -> SaveInfo:
        """READY -> SAVING -> READY: write and commit a checkpoint; returns what was written."""
        number = check_step(self.progress.step if step is None else step)  # refused before the machine moves
        check_save = getattr(self.checkpointer, "check_save", None)
        if callable(check_save) and "save" in self.table.allowed(self.state):  # else the move refuses it
            check_save(number)  # a step behind a committed one: FAILED would lose the steps trained since
        with Phase(self, "save", number) as phase:
            if step is None:  # read again once the move shut other phases out (a train_step on another thread)
                number = phase.step = check_step(self.progress.step)
            self.progress.step = number
            info = _returned(self.checkpointer.save(number, self.parts, self.progress), SaveInfo, "checkpointer.save")
            phase.figures.update(info.figures())
        return info

    def sync_weights(self, target: Any) -> int:
        """READY -> SYNCING -> READY: push the model's weights to `target`; returns the version. A
        sync that cannot be done (no model, a target the engine cannot take) is refused before the
        machine moves, so the trainer stays READY."""
        model = self.parts.model
        if model is None:
            raise LifecycleError(f"sync_weights needs a model (role {self.role}, state {self.state.name})")
        check_target = getattr(self.engine, "check_target", None)
        if callable(check_target):
            check_target(target)
        with Phase(self, "sync_weights", self.progress.step) as phase:
            version = self.progress.weights_version + 1  # read once the move shut other phases out
            if getattr(model, "training", False):
                self.on_exit(_training_restorer(model))
                model.eval()
            from backends.engines.sources import state_weights

            figures = self.engine.sync(state_weights(model), target, version)
            phase.figures.update(_returned(figures, Mapping, "engine.sync"))
            phase.figures["version"] = version
            self.progress.weights_version = version
        return version

    def resume(self) -> int | None:
        """CREATED/FAILED -> RESUMING -> READY from the newest complete checkpoint.

        Returns the step resumed at, or None for a fresh start: init-load instead, when the
        checkpointer restores nothing (the disk checkpointer decides `resume.mode` and logs why).
        From FAILED after a train step, nothing restored is a `CheckpointError`: the optimizer,
        scheduler and data position are the failed run's, so that would be no fresh start.
        """
        moved_on = self.state is State.FAILED and self._trained  # a failed init_load or resume moved nothing
        with Phase(self, "resume", None) as phase:
            restored = _returned(self.checkpointer.resume(self.parts), (Progress, type(None)), "checkpointer.resume")
            if restored is None and moved_on:
                raise CheckpointError(f"resume (role {self.role}) from FAILED found no checkpoint to restore; a "
                                      "fresh start needs fresh objects (the model, optimizer, scheduler and data "
                                      "position are the failed run's): build a new Lifecycle over new ones")
            if restored is None:
                guarded(self._log.info, "lifecycle.resume_fallback", role=self.role, mode=self.config.resume.mode.value,
                               reason="the checkpointer restored nothing", action="init_load")
                loaded = _returned(self.checkpointer.load_initial(self.parts), Mapping, "checkpointer.load_initial")
                phase.figures.update(loaded, fallback="init_load")
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

    def _budget(self, trigger: str) -> float | None:
        return self.config.watchdog.budget(trigger)

    def _moved(self, src: State, dst: State) -> None:
        if dst is State.TRAINING:
            self._trained = True  # from here the objects may have moved: see `resume`

    def _ended(self, phase: Phase) -> None:
        if phase.trigger == "train_step":
            self.progress.step = phase.step  # type: ignore[assignment]


def _check_plugins(checkpointer: object, engine: object) -> None:
    """`ConfigError` naming a checkpointer or engine that lacks a method its phases call, which
    would otherwise fail the first init_load, save or sync instead of the construction."""
    for name, value, protocol in (("checkpointer", checkpointer, Checkpointer), ("engine", engine, WeightSyncer)):
        methods = sorted(key for key, attr in vars(protocol).items() if callable(attr) and not key.startswith("_"))
        if value is not None and not all(callable(getattr(value, method, None)) for method in methods):
            raise ConfigError(name, f"must be None or a {protocol.__name__} (an object with "
                                    f"{', '.join(f'{method}()' for method in methods)}), "
                                    f"got {shorten(value)} ({type(value).__name__})")


def _returned(value: T, kind: type | tuple[type, ...], method: str) -> T:
    """`value`, checked to be what the plugin's `method` must return (`lifecycle.types`): a wrong
    type is a `LifecycleError` naming the method, not a raw error from the code that reads it."""
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise LifecycleError(f"{method}() returned {shorten(value)} ({type(value).__name__}), not a {names}; "
                             "its work may be done, but this phase fails")
    return value


def _training_restorer(model: Any) -> Callable[[], None]:
    """What puts every module of `model` back in its own mode after `model.eval()`: `model.train()`
    would also switch on the submodules kept in eval (a frozen BatchNorm, a disabled Dropout)."""
    modules = getattr(model, "modules", None)
    if not callable(modules):
        return model.train  # type: ignore[no-any-return]
    modes = [(module, module.training) for module in modules()]

    def restore() -> None:
        for module, training in modes:
            module.training = training

    return restore


def _check_apply(config: LifecycleConfig, model: Any) -> None:
    """`ConfigError` naming `engine.apply` when the engine `auto` picks for the model's device
    does not take that mode (a named engine's config checks it already), or `engine.backend` when
    the engine it names cannot run here (`check_available`), which would otherwise fail the first
    sync (the engine is built then) instead of the construction."""
    from backends.engines.base import CheckpointEngine
    from backends.engines.options import AUTO
    from backends.engines.registry import CheckpointEngineRegistry as Engines
    from backends.engines.sync import device_type

    if config.engine.backend != AUTO:
        Engines.get(config.engine.backend)  # loads the class and runs its `check_available`
        return  # its config checked the mode
    if config.engine.apply in CheckpointEngine.applies():
        return  # the mode every engine takes: `auto` need not pick one yet
    name = Engines.resolve(AUTO, device_type(model))
    if problem := Engines.apply_problem(name, config.engine.apply):
        raise ConfigError("engine.apply", f"engine.backend 'auto' picks {name!r} for this model: {problem}")


def _rank_and_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit values first, then an initialised torch.distributed, then RANK/WORLD_SIZE."""
    if rank is None or world_size is None:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
    rank = _from_env("RANK", "0") if rank is None else rank
    world_size = _from_env("WORLD_SIZE", "1") if world_size is None else world_size
    for name, value, low in (("world_size", world_size, 1), ("rank", rank, 0)):
        if not is_count(value, low):
            raise ConfigError(name, f"must be an integer >= {low}, got {shorten(value)} ({type(value).__name__})")
    if rank >= world_size:
        raise ConfigError("rank", f"is {rank}, outside a world of {world_size} rank(s) (0..{world_size - 1})")
    return int(rank), int(world_size)


def _from_env(name: str, default: str) -> int:
    text = os.environ.get(name, default).strip()
    if (number := plain_digits(text, 9)) is None:
        raise ConfigError(name, f"the environment variable holds {shorten(text)}, not a rank number")
    return number


__all__ = ["Lifecycle"]
