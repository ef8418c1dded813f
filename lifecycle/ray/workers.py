"""The workers of an RL job: trainers (actor, critic, ...) and rollouts, each embedding a Lifecycle.

They are plain classes: `lifecycle.ray.driver` runs each as a Ray actor, and tests can drive one
in process. The algorithm itself comes from a `Recipe`, one picklable object shipped to every
worker, so a worker group can be torn down and rebuilt from it after a failure.

The policy trainer (the recipe's first role) also owns the prompt stream: its dataloader's
position is part of its checkpoint, so a resumed run draws the very prompts it would have.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from lifecycle.core import Lifecycle
from lifecycle.errors import EngineError, LifecycleError
from lifecycle.trace import EventLog, TraceFile
from lifecycle.types import Parts, SaveInfo

if TYPE_CHECKING:
    from backends.engines import WeightSync

ROLLOUT = "rollout"


class Recipe(Protocol):
    """An RL algorithm as the workers see it; every method runs inside one worker process."""

    roles: Sequence[str]
    """Trainer roles; the first is the policy whose weights the rollouts serve."""

    def build(self, role: str) -> Parts:
        """Fresh objects for a trainer role, or the model of a rollout (role `rollout`)."""

    def prompts(self, parts: Parts, step: int) -> Any:
        """On the policy trainer: the prompts of `step`, drawn from `parts.dataloader`."""

    def generate(self, model: Any, prompts: Any, step: int) -> dict[str, Any]:
        """On a rollout: responses (and rewards) for `prompts`, from the rollout's own weights."""

    def score(self, role: str, parts: Parts, batch: Mapping[str, Any]) -> dict[str, Any]:
        """On every trainer, before any update: what the others need (values, old log-probs)."""

    def update(self, role: str, parts: Parts, batch: Mapping[str, Any], step: int) -> dict[str, float]:
        """One training step of `role` on `batch`, inside the lifecycle's train_step phase."""


@dataclass(kw_only=True, slots=True)
class WorkerSpec:
    """Everything a worker process needs to build itself, picklable."""

    role: str
    """A trainer role of the recipe, or `rollout`."""
    recipe: Any
    """The `Recipe`."""
    config: dict[str, Any]
    """The worker's `LifecycleConfig`, as a plain dict."""
    incarnation: int = 0
    """How many times the worker group was rebuilt before this worker: names its files."""
    index: int = 0
    """Which rollout this is (0 for trainers)."""
    log_dir: str | None = None
    """JSON-lines log file folder for this worker; None leaves logging as the process has it."""
    trace_dir: str | None = None
    """Folder for this worker's trace events (`{file_stem}.jsonl`, one appended per event); None: no file."""
    threads: int | None = None
    """torch intra-op threads; None keeps what the process has (Ray sets OMP_NUM_THREADS)."""

    @property
    def name(self) -> str:
        suffix = f"{self.index}" if self.role == ROLLOUT else ""
        return f"{self.role}{suffix}"

    @property
    def file_stem(self) -> str:
        return f"{self.name}-{self.incarnation}-pid{os.getpid()}"


class _Worker:
    """What trainers and rollouts share: process set-up, the lifecycle, the trace file."""

    def __init__(self, spec: WorkerSpec, parts: Parts) -> None:
        self.spec = spec
        self.lc = Lifecycle(spec.config, role=spec.role, model=parts.model, optimizer=parts.optimizer,
                            lr_scheduler=parts.lr_scheduler, dataloader=parts.dataloader, rank=0,
                            world_size=1)
        self.trace: TraceFile | None = None
        if spec.trace_dir is not None:
            log = EventLog(Path(spec.trace_dir) / f"{spec.file_stem}.jsonl", role=spec.role, rank=0)
            self.trace = TraceFile(log)
            self.lc.add_observer(self.trace)

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The IP address of this worker's Ray node (where a rendezvous it hosts is reachable)."""
        import ray

        return str(ray.util.get_node_ip_address())

    def state(self) -> str:
        return self.lc.state.name

    def close(self) -> Any:
        """Close the lifecycle (waits for a save in flight) and the trace log."""
        self.lc.close()
        if self.trace is not None:
            self.trace.log.close()

    def _span(self, name: str, start: float, **args: Any) -> None:
        """A trace event for work that is not a lifecycle transition (generate, receive)."""
        if self.trace is not None:
            self.trace.log.append({"ph": "X", "name": name, "cat": "worker", "pid": 0, "tid": 0,
                                   "ts": round(start * 1e6, 3), "dur": round((time.time() - start) * 1e6, 3),
                                   "args": args})


def setup_process(spec: WorkerSpec) -> None:
    """Threads and logging of a worker process: the application's choices, made by its entry point."""
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    if spec.log_dir is not None:
        from lifecycle.logging import configure

        Path(spec.log_dir).mkdir(parents=True, exist_ok=True)
        configure(json=True, file=open(Path(spec.log_dir) / f"{spec.file_stem}.jsonl", "a", buffering=1))


class TrainerWorker(_Worker):
    """One trainer role; the policy role also sends weights and draws the prompts."""

    def __init__(self, spec: WorkerSpec) -> None:
        setup_process(spec)
        recipe = spec.recipe
        self.policy = spec.role == recipe.roles[0]
        super().__init__(spec, recipe.build(spec.role))
        if self.policy:
            self.lc.engine  # noqa: B018 - built now, so a bad engine config fails at start-up
        self._commits: list[dict[str, Any]] = []
        self._address: tuple[str, int] | None = None

    def start(self) -> int | None:
        """Resume from the newest complete step, or init-load when there is none."""
        return self.lc.resume()

    def progress(self) -> dict[str, Any]:
        p = self.lc.progress
        return {"step": p.step, "weights_version": p.weights_version, "state": self.lc.state.name}

    def prompts(self, step: int) -> Any:
        if not self.policy:
            raise LifecycleError(f"role {self.spec.role} is not the policy role {self.spec.recipe.roles[0]!r}: "
                                 "only the policy trainer draws prompts")
        return self.spec.recipe.prompts(self.lc.parts, step)

    def score(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        return self.spec.recipe.score(self.spec.role, self.lc.parts, batch)

    def train(self, step: int, batch: Mapping[str, Any]) -> dict[str, float]:
        with self.lc.train_step(step):
            metrics = self.spec.recipe.update(self.spec.role, self.lc.parts, batch, step)
        return dict(metrics)

    def save(self, step: int) -> dict[str, Any]:
        """Save `step`; an async save reports its host copy now and its commit to `commits()`."""
        from lifecycle.async_save import PendingSave

        info = self.lc.save(step)
        if isinstance(info, PendingSave):
            info.committed.add_done_callback(self._committed)
        else:
            self._commits.append(_save_figures(info))
        return _save_figures(info)

    def _committed(self, done: Future[SaveInfo]) -> None:
        if done.exception() is None:
            self._commits.append(_save_figures(done.result()))

    def rendezvous(self, receivers: int, host: str) -> Any:
        """Where the receivers meet this sender: `host` and a port that was free on it when first
        asked; the same for every sync of this worker, so the engine keeps its store open."""
        from backends.base import free_port
        from backends.engines import Rendezvous

        if self._address is None or self._address[0] != host:
            self._address = (host, free_port(host))
        return Rendezvous(host, self._address[1], receivers)

    def sync(self, target: Any) -> dict[str, Any]:
        version = self.lc.sync_weights(target)
        return {**self.lc.history[-1].figures, "version": version}

    def close(self) -> list[dict[str, Any]]:
        """Close the lifecycle (waits for a save in flight); returns the committed saves' figures."""
        super().close()
        return list(self._commits)


def _save_figures(info: SaveInfo) -> dict[str, Any]:
    return {"step": info.step, "seconds": info.seconds, **info.figures()}


class RolloutWorker(_Worker):
    """Serves the policy's weights: generates only with weights it received whole.

    It is the rollout side of a sync (`pause`, `load_weights`, `resume`, `weights_version`):
    a sync that fails part-way marks it stale, and a stale or out-of-date rollout refuses
    to generate until the next sync has landed.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        setup_process(spec)
        parts = spec.recipe.build(ROLLOUT)
        super().__init__(spec, Parts(model=parts.model))
        sync = cast("WeightSync", self.lc.engine)
        self.engine, self.profile_dir = sync.engine, sync.profile_dir
        self.weights_version = 0
        self.stale = True
        """A new rollout holds no policy weights yet: it must be synced before it generates."""
        self.paused = False
        self.lc.init_load()

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def mark_stale(self) -> None:
        self.stale = True

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each tensor into the model by name; tied names are written once, through their alias."""
        own = self.lc.parts.model.state_dict()
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = own.get(name)
                if target is None:
                    raise EngineError(f"rollout {self.spec.index}: received tensor {name!r}, which its model "
                                      f"does not have")
                if target.shape != tensor.shape:
                    raise EngineError(f"rollout {self.spec.index}: tensor {name!r} is {list(tensor.shape)}, "
                                      f"the model's is {list(target.shape)}")
                target.copy_(tensor)

    def receive(self, rendezvous: Any, rank: int, version: int | None = None) -> int:
        """This rollout's side of one sync; marks itself stale if it fails part-way."""
        from backends.engines import receive_into

        start = time.time()
        try:
            return receive_into(self.engine, self, rendezvous, rank=rank, version=version,
                                profile_dir=self.profile_dir)
        finally:
            self._span("receive_weights", start, version=self.weights_version, stale=self.stale)

    def status(self) -> dict[str, Any]:
        return {"weights_version": self.weights_version, "stale": self.stale, "paused": self.paused}

    def generate(self, prompts: Any, step: int, expect_version: int) -> dict[str, Any]:
        """Responses from the policy weights `expect_version`; refuses stale or older weights."""
        if self.stale or self.paused or self.weights_version != expect_version:
            why = "stale (a sync failed part-way or none has landed yet)" if self.stale else (
                "paused by a sync" if self.paused else f"v{self.weights_version}")
            raise EngineError(f"rollout {self.spec.index} will not generate step {step}: its weights are {why}, "
                              f"the policy's are v{expect_version}; sync first")
        start = time.time()
        batch = self.spec.recipe.generate(self.lc.parts.model, prompts, step)
        self._span("generate", start, step=step, version=self.weights_version)
        return batch


__all__ = ["ROLLOUT", "Recipe", "RolloutWorker", "TraceFile", "TrainerWorker", "WorkerSpec", "setup_process"]
