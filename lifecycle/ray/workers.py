"""The workers of an RL job: trainers (actor, critic, ...) and rollouts, each embedding a Lifecycle.

They are plain classes: `lifecycle.ray.driver` runs each as a Ray actor, and tests can drive one
in process. The algorithm itself comes from a `Recipe` (`lifecycle.ray.recipe`), one picklable
object shipped to every worker, so a worker group can be torn down and rebuilt from it after a
failure.

The policy trainer (the recipe's first role) also owns the prompt stream: its dataloader's
position is part of its checkpoint, so a resumed run draws the very prompts it would have.

Each worker's phases are watched by the process's watchdog (one thread however many workers
share the process), which hands their `lifecycle.phase_overdue` records to the worker's
`OverdueInbox`: it logs each and keeps a copy for the driver, which collects them with
`overdue_reports()`, a method of the `watch` concurrency group that answers while the worker
is still busy inside the phase.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterable, Mapping
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import structlog
import torch

from lifecycle.core import Lifecycle
from lifecycle.errors import EngineError, LifecycleError, shorten
from lifecycle.machine import RolloutState
from lifecycle.ray.recipe import ROLLOUT, Recipe, WorkerSpec, built
from lifecycle.records import described, guarded
from lifecycle.rollout import RolloutWeights
from lifecycle.trace import EventLog, TraceFile
from lifecycle.types import Parts, SaveInfo
from lifecycle.watchdog import BACKSTOP_S, WATCHDOG

if TYPE_CHECKING:
    from backends.engines import WeightSync


class OverdueInbox:
    """A worker's watchdog emitter: logs `lifecycle.phase_overdue` as the process's watchdog
    would, and keeps a short copy (no stacks but the phase's innermost frame) for the driver."""

    def __init__(self, worker: str, keep: int = 64) -> None:
        self.worker = worker
        self._reports: deque[dict[str, Any]] = deque(maxlen=keep)

    def __call__(self, event: str, **fields: Any) -> None:
        """Keep the driver's copy first, then log: a log sink that fails (a full disk) costs the
        line, not the report."""
        stacks: dict[str, str] = fields.get("stacks", {})
        frames = next(iter(stacks.values()), "").rstrip().splitlines()  # the phase's own thread comes first
        where = next((line.strip() for line in reversed(frames) if line.lstrip().startswith("File ")), "")
        kept = {key: value for key, value in fields.items() if key != "stacks"}
        self._reports.append({"worker": self.worker, **kept, "where": where, "at": time.time()})
        guarded(structlog.get_logger().warning, event, **fields)

    def drain(self) -> list[dict[str, Any]]:
        """The reports since the last call, oldest first (thread-safe: deque pops are atomic)."""
        out: list[dict[str, Any]] = []
        while True:
            try:
                out.append(self._reports.popleft())
            except IndexError:
                return out


class _Worker:
    """What trainers and rollouts share: process set-up, the lifecycle, the watchdog, the trace file."""

    def __init__(self, spec: WorkerSpec, parts: Parts) -> None:
        self.spec = spec
        self.inbox = OverdueInbox(spec.name)
        self.watchdog = WATCHDOG
        """The process's watchdog: its one thread reports this worker's phases to `inbox`."""
        self.lc = Lifecycle(spec.config, role=spec.role, model=parts.model, optimizer=parts.optimizer,
                            lr_scheduler=parts.lr_scheduler, dataloader=parts.dataloader, rank=0,
                            world_size=1, on_overdue=self.inbox)
        self.trace: TraceFile | None = None
        if spec.trace_dir is not None:
            log = EventLog(Path(spec.trace_dir) / f"{spec.file_stem}.jsonl", role=spec.role, rank=0)
            self.trace = TraceFile(log)
            self.lc.add_observer(self.trace)

    def pid(self) -> int:
        return os.getpid()

    def process(self) -> tuple[int, int | None]:
        """This process's pid and start time (`process_start`): together they name it, where a
        pid alone may name another process by the time the driver acts on it."""
        return os.getpid(), process_start()

    def node(self) -> str:
        """The IP address of this worker's Ray node (where a rendezvous it hosts is reachable)."""
        import ray

        return str(ray.util.get_node_ip_address())

    def state(self) -> str:
        return self.lc.state.name

    def overdue_reports(self) -> list[dict[str, Any]]:
        """This worker's phases past their watchdog budget since the last call. The driver calls
        it in the `watch` concurrency group: it runs on a thread of its own, beside the phase."""
        inbox: OverdueInbox | None = self.__dict__.get("inbox")  # None while the worker builds (`deferred`)
        return [] if inbox is None else inbox.drain()

    def settle_saves(self, timeout_s: float) -> dict[str, Any] | None:
        """The async save in flight, given up to `timeout_s` to commit before the driver stops this
        worker; None when none is in flight (a rollout never has one). Called in the `watch`
        concurrency group, so it answers while a phase runs."""
        return None

    def close(self) -> Any:
        """Close the lifecycle (waits for a save in flight) and the trace log."""
        self.lc.close()
        if self.trace is not None:
            self.trace.log.close()


def setup_process(spec: WorkerSpec) -> None:
    """Threads and logging of a worker process: the application's choices, made by its entry point."""
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    WATCHDOG.backstop_s = BACKSTOP_S  # a phase stuck holding the GIL leaves its stacks in the worker's stderr
    if spec.log_dir is not None:
        from lifecycle.logging import configure, open_log

        configure(json=True, file=open_log(Path(spec.log_dir) / f"{spec.file_stem}.jsonl", buffering=1))


def process_start(pid: int | None = None) -> int | None:
    """When process `pid` (this one by default) started, in clock ticks since boot: field 22 of
    `/proc/<pid>/stat`. None where there is no /proc, or no such process."""
    try:
        with open(f"/proc/{'self' if pid is None else pid}/stat", "rb") as stat:
            raw = stat.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 1:].split()  # field 2, the name in parentheses, may hold either
    try:
        return int(fields[22 - 3])
    except (IndexError, ValueError):
        return None


class TrainerWorker(_Worker):
    """One trainer role; the policy role also sends weights and draws the prompts."""

    def __init__(self, spec: WorkerSpec) -> None:
        setup_process(spec)
        recipe = spec.recipe
        self.policy = spec.role == recipe.roles[0]
        super().__init__(spec, built(recipe, spec.role))
        if self.policy:
            self.lc.engine  # noqa: B018 - built now, so a bad engine config fails at start-up
        self._commits: list[dict[str, Any]] = []
        self._address: tuple[str, int] | None = None
        self._in_flight: Future[SaveInfo] | None = None
        self._in_flight_step = 0

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
        with self.lc.train_step(step):  # a wrong return fails the phase: the step is not recorded as trained
            metrics = self.spec.recipe.update(self.spec.role, self.lc.parts, batch, step)
            if not isinstance(metrics, Mapping):
                raise LifecycleError(f"recipe.update({self.spec.role!r}, step {step}) returned {shorten(metrics)} "
                                     f"({type(metrics).__name__}), not a dict of metrics; the train_step fails")
        return dict(metrics)

    def save(self, step: int) -> dict[str, Any]:
        """Save `step`; an async save reports its host copy now and its commit to `commits()`."""
        from lifecycle.async_save import PendingSave

        info = self.lc.save(step)
        if isinstance(info, PendingSave):
            self._in_flight, self._in_flight_step = info.committed, step
            info.committed.add_done_callback(self._committed)
        else:
            self._commits.append(_save_figures(info))
        return _save_figures(info)

    def _committed(self, done: Future[SaveInfo]) -> None:
        if done.exception() is None:
            self._commits.append(_save_figures(done.result()))

    def settle_saves(self, timeout_s: float) -> dict[str, Any] | None:
        """Wait up to `timeout_s` for the async save in flight to commit: its step, whether it
        committed (`error` when its write failed), and how long it was waited for. A save that
        commits after the driver's recovery killed this worker would be lost, and every role
        would resume from an older step than the one its peers committed."""
        pending: Future[SaveInfo] | None = self.__dict__.get("_in_flight")  # None before the build (`deferred`)
        if pending is None or pending.done():
            return None
        started = time.perf_counter()
        done, _ = futures.wait([pending], timeout=timeout_s)
        report: dict[str, Any] = {"step": self._in_flight_step, "committed": False,
                                  "waited_s": round(time.perf_counter() - started, 3)}
        if done:
            failed = pending.exception()
            report["committed"] = failed is None
            if failed is not None:
                report["error"] = described(failed)
        return report

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

    Its weights are a machine (`self.weights`, a `lifecycle.rollout.RolloutWeights`): a sync is
    its `receive_weights` phase, a generation its `generate` phase. A sync that fails part-way
    leaves it STALE with the old version, and it refuses to generate from any state but
    SERVING, or with a version other than the policy's, until the next sync has landed.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        setup_process(spec)
        parts = built(spec.recipe, ROLLOUT)
        super().__init__(spec, Parts(model=parts.model))
        sync = cast("WeightSync", self.lc.engine)
        self.engine, self.profile_dir = sync.engine, sync.profile_dir
        # load_weights is looked up on each receive, so a subclass or a test may replace it
        self.weights = RolloutWeights(lambda named: self.load_weights(named), role=ROLLOUT, rank=spec.index,
                                      budget=self.lc.config.watchdog.budget, on_overdue=self.inbox)
        if self.trace is not None:
            self.weights.add_observer(self.trace)
        self.lc.init_load()

    @property
    def weights_version(self) -> int:
        return self.weights.weights_version

    @property
    def stale(self) -> bool:
        return self.weights.stale

    @property
    def paused(self) -> bool:
        """Whether a sync is landing (RECEIVING); read-only, as the weights machine pauses itself."""
        return self.weights.state is RolloutState.RECEIVING

    def mark_stale(self) -> None:
        self.weights.mark_stale()

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
        """This rollout's side of one sync: the weights machine's `receive_weights` phase. A sync that
        leaves out a weight of its model (a tied one is sent once) is refused, not served at its init value."""
        from backends.engines import receive_into
        from backends.engines.sources import state_weights

        expected = [name for name, _ in state_weights(self.lc.parts.model)]
        return receive_into(self.engine, self.weights, rendezvous, rank=rank, version=version, expected=expected,
                            profile_dir=self.profile_dir)

    def status(self) -> dict[str, Any]:
        return {"weights_version": self.weights.weights_version, "stale": self.weights.stale,
                "paused": self.paused}

    def generate(self, prompts: Any, step: int, expect_version: int) -> dict[str, Any]:
        """Responses from the policy weights `expect_version`; refuses stale or older weights."""
        weights = self.weights
        if not weights.serves or weights.weights_version != expect_version:
            state = weights.state
            why = f"v{weights.weights_version}" if weights.serves else (
                "paused by a sync" if state is RolloutState.RECEIVING else
                f"stale (a sync failed part-way or none has landed yet; state {state.name})")
            raise EngineError(f"rollout {self.spec.index} will not generate step {step}: its weights are {why}, "
                              f"the policy's are v{expect_version}; sync first")
        with weights.generating(step):
            batch: dict[str, Any] = self.spec.recipe.generate(self.lc.parts.model, prompts, step)
        return batch

    def close(self) -> Any:
        """Close the weights machine (unless a phase of it runs), then the lifecycle and the trace log."""
        if self.weights.table.allows("close", self.weights.state):
            self.weights.close()
        return super().close()


__all__ = ["ROLLOUT", "OverdueInbox", "Recipe", "RolloutWorker", "TraceFile", "TrainerWorker", "WorkerSpec",
           "process_start", "setup_process"]
