"""The driver of an RL job on Ray: one worker group, the training loop, and recovery from a death.

Each step: the policy trainer draws prompts, the rollouts generate, every trainer scores the
batch and then trains on it, the policy's new weights go to the rollouts, and every
`save_every` steps each trainer saves. The run is a machine (`controller.Controller`, table
`lifecycle.machine.DRIVER_TABLE`): when a worker dies (`RayActorError`) or a call fails, the
`FailurePolicy` (`policy.py`) decides; a restart lets the trainers' async saves in flight
commit (`DriverConfig.save_grace_s`), tears the whole group down, builds it again
(`worker_group.WorkerGroup`) and has every trainer resume from the newest step complete for
all roles; the rollouts then receive the resumed weights before they generate. When the
policy gives up, the run ends ERRORED and raises `RunFailed`.

While it waits on workers, the driver asks them for phases past their watchdog budget and
reports each (`driver.worker_overdue`, `DriverHooks.on_overdue`, the run summary).

Ray is imported inside `lifecycle.ray` only, and only when a driver starts or a worker asks
for its node.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from lifecycle.config import LifecycleConfig
from lifecycle.errors import ConfigError, EngineError, LifecycleError, shorten
from lifecycle.machine import DriverState
from lifecycle.ray.batches import add_scores
from lifecycle.ray.controller import Controller
from lifecycle.ray.policy import FailureKind, FailurePolicy, RunFailed, WorkerFailed
from lifecycle.ray.run_report import (
    Failure,
    Overdue,
    RunSummary,
    StepRecord,
    fingerprint,
    merge_batches,
    merge_traces,
    split_batch,
)
from lifecycle.ray.settings import (
    DriverConfig,
    check_options,
    check_shared,
    merged,
    overrides_of,
    reachable,
    shortest_budget,
    trainer_roles,
)
from lifecycle.ray.worker_group import WorkerGroup
from lifecycle.ray.workers import ROLLOUT, RolloutWorker, TrainerWorker, WorkerSpec
from lifecycle.records import described


class DriverHooks:
    """Callbacks from the loop; each does nothing unless overridden (progress, fault injection)."""

    def on_start(self, driver: Driver, step: int) -> None:
        """When the first worker group is up at `step` (0: init-loaded) and the rollouts are synced."""

    def on_phase(self, driver: Driver, phase: str, step: int) -> None:
        """Before each phase of a step: generate, score, train, sync, save."""

    def on_step(self, driver: Driver, record: StepRecord) -> None:
        """After a step has trained, synced and (when due) saved."""

    def on_failure(self, driver: Driver, failure: Failure) -> None:
        """When a failure the policy retries was caught, before the group is rebuilt."""

    def on_resume(self, driver: Driver, failure: Failure) -> None:
        """When the rebuilt group has resumed and the rollouts hold the resumed weights."""

    def on_overdue(self, driver: Driver, overdue: Overdue) -> None:
        """When a worker the driver waits on reports a phase past its watchdog budget (the phase goes on)."""


class Driver(Controller):
    """Runs a `Recipe` on a group of Ray actors; see the module docstring. `state` is its
    `DriverState`, `history` its transitions (role `driver`)."""

    def __init__(
        self,
        recipe: Any,
        config: LifecycleConfig | Mapping[str, Any] | str | os.PathLike[str] | None,
        settings: DriverConfig,
        hooks: DriverHooks | None = None,
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """`config` is every worker's lifecycle config; `overrides` maps a role (or `rollout`) to
        keys that differ for it, such as its own `checkpoint.pre_load.path`. Keys the roles
        must share cannot differ: `checkpoint.root` and `checkpoint.roles` between trainers (a
        resume reads one step complete for all of them) and `engine.backend` between the policy
        and the rollouts (the two ends of a sync)."""
        if not isinstance(settings, DriverConfig):
            raise ConfigError("settings", f"must be a DriverConfig, got {shorten(settings)}")
        if hooks is not None and not isinstance(hooks, DriverHooks):
            raise ConfigError("hooks", f"must be None or a DriverHooks, got {shorten(hooks)}")
        super().__init__(settings.policy)
        self.recipe = recipe
        self.settings = settings
        self.hooks = hooks or DriverHooks()
        roles = trainer_roles(getattr(recipe, "roles", None))
        base = LifecycleConfig.coerce(config).to_dict()
        base["checkpoint"]["roles"] = roles
        overrides = overrides_of(overrides, [*roles, ROLLOUT])
        check_options(settings.options, roles, settings.rollouts)
        self.configs = {role: LifecycleConfig.from_dict(merged(base, overrides.get(role, {}))).to_dict()
                        for role in [*roles, ROLLOUT]}
        check_shared(self.configs, roles)
        self.roles = roles
        self.group = WorkerGroup(call_timeout_s=settings.call_timeout_s, poll_s=settings.poll_s,
                                 options=settings.options, on_overdue=self._overdue,
                                 overdue_after_s=shortest_budget(self.configs))
        self.version = 0
        self._owns_ray = False

    @property
    def workers(self) -> dict[str, Any]:
        """The Ray actor handles of the current group, by worker name."""
        return self.group.handles

    @property
    def pids(self) -> dict[str, int]:
        return self.group.pids

    @property
    def work_dir(self) -> Path | None:
        return None if self.settings.work_dir is None else Path(self.settings.work_dir)

    @property
    def rollout_names(self) -> list[str]:
        return [f"{ROLLOUT}{i}" for i in range(self.settings.rollouts)]

    def run(self) -> RunSummary:
        """Train to `settings.steps`, recovering as the policy allows; returns what happened.
        Raises `RunFailed` when the policy gives up (the driver is then ERRORED)."""
        started = time.perf_counter()
        try:
            self._control(self.settings.steps)
        finally:
            self.summary.wall_s = time.perf_counter() - started
            try:  # each step of the cleanup whatever the one before raised; none replaces the run's error
                self._tidy("stopping the worker group", self._stop_group)
                self._tidy("writing the trace", self._merge_traces)
            finally:
                if self._owns_ray:
                    import ray

                    ray.shutdown()
        return self.summary

    def _merge_traces(self) -> None:
        work = self.work_dir
        if work is not None:
            self.summary.trace = merge_traces(work / "traces", work / "trace.json", self.summary.spans, self.history,
                                              self.summary.overdue)

    def _tidy(self, what: str, step: Callable[[], object]) -> None:
        """One step of the run's cleanup; what it raises is logged (`driver.cleanup_failed`), since
        the run's outcome (its summary, or the error it raised) is already settled."""
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - logged; the cleanup goes on
            self._log.warning("driver.cleanup_failed", step=what, error=described(exc))

    def kill(self, name: str) -> int:
        """SIGKILL a worker's process (`actor`, `critic`, `rollout0`...), as a crash would; returns its pid.
        A name the group does not have (or no group running) is a `LifecycleError` naming its workers."""
        pid = self.group.kill(name)
        phase, step = self.group.at
        self._log.warning("driver.kill", worker=name, pid=pid, step=step, phase=phase)
        return pid

    def call(self, name: str, method: str, *args: Any) -> Any:
        """One worker call, waited for like the loop's own (for tests and hooks). A worker the group
        does not have, or a method the worker lacks, is a `LifecycleError` naming it."""
        return self.group.call(name, method, *args)

    def _init_ray(self) -> None:
        import ray

        if ray.is_initialized():
            return
        kwargs: dict[str, Any] = {"include_dashboard": False, **self.settings.ray_init}
        if self.settings.address is not None:
            kwargs["address"] = self.settings.address
            reachable(self.settings.address)
        elif self.settings.num_cpus is not None:
            kwargs["num_cpus"] = self.settings.num_cpus
        try:
            ray.init(**kwargs)
        except (ValueError, TypeError, RuntimeError, ConnectionError) as exc:
            raise ConfigError("driver.ray_init" if self.settings.ray_init or not self.settings.address
                              else "driver.address",
                              f"ray.init({', '.join(f'{k}={shorten(v)}' for k, v in kwargs.items())}) failed: "
                              f"{type(exc).__name__}: {shorten(str(exc), 300)}") from exc
        self._owns_ray = True

    def _spec(self, role: str, index: int = 0) -> WorkerSpec:
        work = self.work_dir
        return WorkerSpec(role=role, recipe=self.recipe, config=self.configs[role], incarnation=self.incarnation,
                          index=index, threads=self.settings.threads,
                          log_dir=None if work is None else str(work / "logs"),
                          trace_dir=None if work is None else str(work / "traces"))

    def _start_group(self) -> int:
        """Build every worker, resume or init-load the trainers, sync the rollouts; returns the step."""
        self._init_ray()
        group = self.group
        group.at = ("recover" if self.state is DriverState.RECOVERING else "start", group.at[1])
        with self._span("start", group.at[1]):
            group.start([(role, TrainerWorker, role, self._spec(role)) for role in self.roles]
                        + [(n, RolloutWorker, ROLLOUT, self._spec(ROLLOUT, i)) for i, n in enumerate(self.rollout_names)])
            steps = group.gather([(r, group[r].start.remote()) for r in self.roles])
        if len(set(steps)) != 1:
            raise LifecycleError(f"trainers resumed at different steps {dict(zip(self.roles, steps))}; every role "
                                 f"must resume from the newest step complete for all of {self.roles}")
        resumed = steps[0] or 0
        progress = group.gather([(self.roles[0], group[self.roles[0]].progress.remote())])[0]
        self.version = progress["weights_version"]
        self._sync(resumed)
        self._log.info("driver.started", step=resumed, incarnation=self.incarnation, pids=group.pids,
                       rendezvous_host=group.host, weights_version=self.version)
        return resumed

    def _run_step(self, step: int) -> None:
        policy, group = self.roles[0], self.group
        with self._in("generate", step):
            prompts = group.gather([(policy, group[policy].prompts.remote(step))])[0]
            parts = split_batch(prompts, len(self.rollout_names))
            names = self.rollout_names[:len(parts)]
            sizes = [len(p) for p in parts] if len(parts) > 1 else None  # one rollout: the prompts whole, of any kind
            batch = merge_batches(group.gather([
                (n, group[n].generate.remote(p, step, self.version)) for n, p in zip(names, parts)
            ]), names, sizes)
        with self._in("score", step):
            batch = add_scores(batch, group.gather([(r, group[r].score.remote(batch)) for r in self.roles]), self.roles)
        with self._in("train", step):
            results = group.gather([(r, group[r].train.remote(step, batch)) for r in self.roles])
        metrics = {f"{role}/{k}": v for role, m in zip(self.roles, results) for k, v in m.items()}
        record = StepRecord(step=step, incarnation=self.incarnation, weights_version=self.version,
                            prompts=fingerprint(prompts), metrics=metrics)
        self._sync(step)
        if step % self.settings.save_every == 0 or step == self.settings.steps:
            with self._in("save", step):
                saved = group.gather([(r, group[r].save.remote(step)) for r in self.roles])
                record.saved = [{"role": role, **figures} for role, figures in zip(self.roles, saved)]
        self.summary.attempts.append(record)
        self.hooks.on_step(self, record)

    def _sync(self, step: int) -> None:
        """The policy's weights to every rollout, in one sync; the version is the policy's."""
        policy, group = self.roles[0], self.group
        with self._in("sync", step):
            sender = group[policy]
            rendezvous = group.gather([(policy, sender.rendezvous.remote(len(self.rollout_names), group.host))])[0]
            calls = [(policy, sender.sync.remote(rendezvous))] + [
                (n, group[n].receive.remote(rendezvous, i + 1)) for i, n in enumerate(self.rollout_names)]
            figures, *versions = group.gather(calls)
        if any(v != figures["version"] for v in versions):
            raise EngineError(f"rollouts received versions {versions}, the policy sent v{figures['version']}")
        self.version = figures["version"]
        self.summary.syncs.append({"step": step, "incarnation": self.incarnation, **figures})

    def _close_group(self) -> None:
        """Close every trainer (waiting for async saves); keeps the committed saves of this incarnation."""
        with self._in("close", self.settings.steps):
            results = self.group.gather([(r, self.group[r].close.remote()) for r in self.roles])
        self.summary.saves = [{"role": role, "incarnation": self.incarnation, **figures}
                              for role, commits in zip(self.roles, results) for figures in commits]

    def _stop_group(self) -> None:
        """Let the trainers' async saves in flight commit (`save_grace_s`) and collect the overdue
        reports the workers still hold, then kill the group; it is killed whatever those raised."""
        group = self.group
        if not group.handles:
            return
        with ExitStack() as stack:
            stack.callback(group.stop)
            stack.callback(group.drain_overdue, list(group.handles))
            failed = self.stopping_for
            hung = [failed.worker] if failed is not None and failed.kind == FailureKind.TIMED_OUT.value else []
            group.settle_saves(self.settings.save_grace_s, skip=hung)

    def _on_start(self, step: int) -> None:
        self.hooks.on_start(self, step)

    def _on_failure(self, failure: Failure) -> None:
        self.hooks.on_failure(self, failure)

    def _on_resume(self, failure: Failure) -> None:
        resumed = failure.resumed_at or 0
        self._log.info("driver.resumed", step=resumed, incarnation=self.incarnation, after_failure_at=failure.step,
                       lost_steps=max(0, failure.step - 1 - resumed), recovery_s=round(failure.recovery_s, 3),
                       weights_version=self.version)
        self.hooks.on_resume(self, failure)

    def _overdue(self, worker: str, report: Mapping[str, Any]) -> None:
        """A worker's phase past its budget, handed over while the driver waited on it."""
        phase, step = self.group.at
        overdue = Overdue.from_report({**report, "worker": worker}, phase)
        self.summary.overdue.append(overdue)
        self._log.warning("driver.worker_overdue", worker=worker, trigger=overdue.trigger, state=overdue.state,
                          step=overdue.step, elapsed_s=overdue.elapsed_s, budget_s=overdue.budget_s,
                          overdue=overdue.overdue, where=overdue.where, driver_phase=phase, driver_step=step)
        self.hooks.on_overdue(self, overdue)

    @contextmanager
    def _in(self, phase: str, step: int) -> Iterator[None]:
        self.group.at = (phase, step)
        self.hooks.on_phase(self, phase, step)
        with self._span(phase, step):
            yield

    @contextmanager
    def _span(self, name: str, step: int) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.summary.spans.append({"name": name, "step": step, "start": start, "end": time.time(),
                                       "incarnation": self.incarnation})


__all__ = ["Driver", "DriverConfig", "DriverHooks", "FailurePolicy", "RunFailed", "WorkerFailed"]
