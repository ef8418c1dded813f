"""The driver of an RL job on Ray: one worker group, the training loop, and recovery from a death.

Each step: the policy trainer draws prompts, the rollouts generate, every trainer scores the
batch and then trains on it, the policy's new weights go to the rollouts, and every
`save_every` steps each trainer saves. When a worker dies (`RayActorError`) or a call fails,
the driver logs it, tears the whole group down, builds it again and has every trainer
resume from the newest step complete for all roles; the rollouts then receive the resumed
weights before they generate. After `max_failures` recoveries the next failure is raised.

Ray is imported inside `lifecycle.ray` only, and only when a driver starts or a worker asks
for its node.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from lifecycle.config import LifecycleConfig
from lifecycle.errors import ConfigError, EngineError, LifecycleError
from lifecycle.ray.run_report import Failure, RunSummary, StepRecord, fingerprint, merge_batches, merge_traces, split_batch
from lifecycle.ray.workers import ROLLOUT, RolloutWorker, TrainerWorker, WorkerSpec


@dataclass(kw_only=True, slots=True)
class DriverConfig:
    """How the driver runs the job; the lifecycle config of each worker is separate."""

    steps: int
    """Train until this step (counting the steps of a run this one resumes)."""
    save_every: int = 5
    """Every trainer saves after each step divisible by this, and after the last step."""
    max_failures: int = 3
    """Recoveries allowed; the failure after them is raised."""
    rollouts: int = 1
    """Rollout workers; the prompts of a step are split between them."""
    address: str | None = None
    """Ray cluster to join (`ray.init(address=...)`); None starts a local Ray for this driver."""
    num_cpus: int | None = None
    """CPUs of the local Ray; None lets Ray count them. Only without `address`."""
    work_dir: str | None = None
    """Folder for every worker's JSON logs (`logs/`) and the merged Chrome trace; None: none written."""
    threads: int | None = None
    """torch threads per worker process; None keeps Ray's OMP_NUM_THREADS."""
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Ray actor options per role (`actor`, `critic`, `rollout`), e.g. {"actor": {"num_gpus": 1}}."""
    call_timeout_s: float = 600.0
    """A worker call that takes longer counts as a failure."""
    ray_init: dict[str, Any] = field(default_factory=dict)
    """Further `ray.init` arguments (runtime_env, namespace, ...)."""

    def __post_init__(self) -> None:
        for key in ("steps", "save_every", "rollouts"):
            if getattr(self, key) < 1:
                raise ConfigError(f"driver.{key}", f"must be >= 1, got {getattr(self, key)}")
        if self.max_failures < 0:
            raise ConfigError("driver.max_failures", f"must be >= 0, got {self.max_failures}")
        if self.address is not None and self.num_cpus is not None:
            raise ConfigError("driver.num_cpus", "sizes a local Ray, but driver.address joins an existing cluster; "
                                                 "drop one of them")


class DriverHooks:
    """Callbacks from the loop; each does nothing unless overridden (progress, fault injection)."""

    def on_start(self, driver: Driver, step: int) -> None:
        """When the first worker group is up at `step` (0: init-loaded) and the rollouts are synced."""

    def on_phase(self, driver: Driver, phase: str, step: int) -> None:
        """Before each phase of a step: generate, score, train, sync, save."""

    def on_step(self, driver: Driver, record: StepRecord) -> None:
        """After a step has trained, synced and (when due) saved."""

    def on_failure(self, driver: Driver, failure: Failure) -> None:
        """When a failure was caught, before the group is rebuilt."""

    def on_resume(self, driver: Driver, failure: Failure) -> None:
        """When the rebuilt group has resumed and the rollouts hold the resumed weights."""


class WorkerFailed(LifecycleError):
    """A worker died or one of its calls failed; names the worker and the phase."""

    def __init__(self, worker: str, phase: str, step: int, cause: BaseException) -> None:
        self.worker, self.phase, self.step, self.cause = worker, phase, step, cause
        super().__init__(f"worker {worker} failed in {phase} of step {step}: {type(cause).__name__}: {cause}")


class Driver:
    """Runs a `Recipe` on a group of Ray actors; see the module docstring."""

    def __init__(
        self,
        recipe: Any,
        config: LifecycleConfig | Mapping[str, Any] | str | os.PathLike[str] | None,
        settings: DriverConfig,
        hooks: DriverHooks | None = None,
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """`config` is every worker's lifecycle config; `overrides` maps a role (or `rollout`) to
        keys that differ for it, such as its own `checkpoint.pre_load.path`."""
        self.recipe = recipe
        self.settings = settings
        self.hooks = hooks or DriverHooks()
        roles = [str(r) for r in recipe.roles]
        if not roles or ROLLOUT in roles:
            raise ConfigError("recipe.roles", f"needs at least one trainer role and not {ROLLOUT!r}, got {roles}")
        base = LifecycleConfig.coerce(config).to_dict()
        base["checkpoint"]["roles"] = roles
        unknown = sorted(set(overrides or {}) - {*roles, ROLLOUT})
        if unknown:
            raise ConfigError("overrides", f"roles {unknown} are not in the job; roles: {[*roles, ROLLOUT]}")
        self.configs = {role: LifecycleConfig.from_dict(_merged(base, (overrides or {}).get(role, {}))).to_dict()
                        for role in [*roles, ROLLOUT]}
        self.roles = roles
        self.workers: dict[str, Any] = {}
        self.pids: dict[str, int] = {}
        self.incarnation = 0
        self.version = 0
        self.summary = RunSummary()
        self._phase = ("start", 0)
        self._log = structlog.get_logger()
        self._owns_ray = False
        self._host = "127.0.0.1"

    @property
    def work_dir(self) -> Path | None:
        return None if self.settings.work_dir is None else Path(self.settings.work_dir)

    @property
    def rollout_names(self) -> list[str]:
        return [f"{ROLLOUT}{i}" for i in range(self.settings.rollouts)]

    def run(self) -> RunSummary:
        """Train to `settings.steps`, recovering from failures; returns what happened."""
        started = time.perf_counter()
        self._init_ray()
        try:
            step = self._start_group() + 1
            self.summary.started_at = step - 1
            self.hooks.on_start(self, step - 1)
            while step <= self.settings.steps:
                try:
                    self._step(step)
                    step += 1
                except WorkerFailed as failed:
                    step = self._recover(failed) + 1
            self.summary.saves = self._close_group()
        finally:
            self.summary.wall_s = time.perf_counter() - started
            self._teardown()
            if self.work_dir is not None:
                self.summary.trace = merge_traces(self.work_dir / "traces", self.work_dir / "trace.json",
                                                  self.summary.spans)
            if self._owns_ray:
                import ray

                ray.shutdown()
        return self.summary

    def kill(self, name: str) -> int:
        """SIGKILL a worker's process (`actor`, `critic`, `rollout0`...), as a crash would; returns its pid."""
        import ray

        pid = self.pids[name]
        if self._host == "127.0.0.1":
            os.kill(pid, signal.SIGKILL)
        else:
            ray.kill(self.workers[name], no_restart=True)
        self._log.warning("driver.kill", worker=name, pid=pid, step=self._phase[1], phase=self._phase[0])
        return pid

    def call(self, name: str, method: str, *args: Any) -> Any:
        """One worker call, waited for like the loop's own (for tests and hooks)."""
        return self._gather([(name, getattr(self.workers[name], method).remote(*args))])[0]

    def _init_ray(self) -> None:
        import ray

        if ray.is_initialized():
            return
        kwargs: dict[str, Any] = {"include_dashboard": False, **self.settings.ray_init}
        if self.settings.address is not None:
            kwargs["address"] = self.settings.address
        elif self.settings.num_cpus is not None:
            kwargs["num_cpus"] = self.settings.num_cpus
        ray.init(**kwargs)
        self._owns_ray = True

    def _spec(self, role: str, index: int = 0) -> WorkerSpec:
        work = self.work_dir
        return WorkerSpec(role=role, recipe=self.recipe, config=self.configs[role], incarnation=self.incarnation,
                          index=index, threads=self.settings.threads,
                          log_dir=None if work is None else str(work / "logs"),
                          trace_dir=None if work is None else str(work / "traces"))

    def _start_group(self) -> int:
        """Build every worker, resume or init-load the trainers, sync the rollouts; returns the step."""
        import ray

        with self._span("start", self._phase[1]):
            self.workers = {}
            for role in self.roles:
                self.workers[role] = self._actor(TrainerWorker, role, self._spec(role))
            for i, name in enumerate(self.rollout_names):
                self.workers[name] = self._actor(RolloutWorker, ROLLOUT, self._spec(ROLLOUT, i))
            self.pids = dict(zip(self.workers, self._gather([(n, w.pid.remote()) for n, w in self.workers.items()])))
            nodes = dict(zip(self.workers, self._gather([(n, w.node.remote()) for n, w in self.workers.items()])))
            here = ray.util.get_node_ip_address()
            self._host = "127.0.0.1" if set(nodes.values()) == {here} else nodes[self.roles[0]]
            steps = self._gather([(r, self.workers[r].start.remote()) for r in self.roles])
        if len(set(steps)) != 1:
            raise LifecycleError(f"trainers resumed at different steps {dict(zip(self.roles, steps))}; every role "
                                 f"must resume from the newest step complete for all of {self.roles}")
        resumed = steps[0] or 0
        progress = self._gather([(self.roles[0], self.workers[self.roles[0]].progress.remote())])[0]
        self.version = progress["weights_version"]
        self._sync(resumed)
        self._log.info("driver.started", step=resumed, incarnation=self.incarnation, pids=self.pids,
                       rendezvous_host=self._host, weights_version=self.version)
        return resumed

    def _actor(self, cls: type, role: str, spec: WorkerSpec) -> Any:
        import ray

        options: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0, "max_task_retries": 0,
                                   **self.settings.options.get(role, {})}
        return ray.remote(cls).options(**options).remote(spec)

    def _step(self, step: int) -> None:
        policy = self.roles[0]
        with self._in("generate", step):
            prompts = self._gather([(policy, self.workers[policy].prompts.remote(step))])[0]
            parts = split_batch(prompts, len(self.rollout_names))
            batch = merge_batches(self._gather([
                (n, self.workers[n].generate.remote(p, step, self.version)) for n, p in zip(self.rollout_names, parts)
            ]))
        with self._in("score", step):
            for scored in self._gather([(r, self.workers[r].score.remote(batch)) for r in self.roles]):
                batch.update(scored)
        with self._in("train", step):
            results = self._gather([(r, self.workers[r].train.remote(step, batch)) for r in self.roles])
        metrics = {f"{role}/{k}": v for role, m in zip(self.roles, results) for k, v in m.items()}
        record = StepRecord(step=step, incarnation=self.incarnation, weights_version=self.version,
                            prompts=fingerprint(prompts), metrics=metrics)
        self._sync(step)
        if step % self.settings.save_every == 0 or step == self.settings.steps:
            with self._in("save", step):
                saved = self._gather([(r, self.workers[r].save.remote(step)) for r in self.roles])
                record.saved = [{"role": role, **figures} for role, figures in zip(self.roles, saved)]
        self.summary.attempts.append(record)
        self.hooks.on_step(self, record)

    def _sync(self, step: int) -> None:
        """The policy's weights to every rollout, in one sync; the version is the policy's."""
        policy = self.roles[0]
        with self._in("sync", step):
            sender = self.workers[policy]
            rendezvous = self._gather([(policy, sender.rendezvous.remote(len(self.rollout_names), self._host))])[0]
            calls = [(policy, sender.sync.remote(rendezvous))] + [
                (n, self.workers[n].receive.remote(rendezvous, i + 1)) for i, n in enumerate(self.rollout_names)]
            figures, *versions = self._gather(calls)
        if any(v != figures["version"] for v in versions):
            raise EngineError(f"rollouts received versions {versions}, the policy sent v{figures['version']}")
        self.version = figures["version"]
        self.summary.syncs.append({"step": step, "incarnation": self.incarnation, **figures})

    def _gather(self, calls: Sequence[tuple[str, Any]]) -> list[Any]:
        """Results in order; the first failure is raised at once as `WorkerFailed`, naming a dead
        worker over one whose call failed because of it."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayError

        names = {ref: name for name, ref in calls}
        pending = [ref for _, ref in calls]
        results: dict[Any, Any] = {}
        deadline = time.monotonic() + self.settings.call_timeout_s
        phase, step = self._phase
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                stuck = GetTimeoutError(f"no answer within call_timeout_s={self.settings.call_timeout_s:g}")
                raise WorkerFailed(names[pending[0]], phase, step, stuck)
            try:
                results[ready[0]] = ray.get(ready[0])
            except RayError as exc:
                dead = self._dead_among(pending, names) if not isinstance(exc, RayActorError) else None
                raise WorkerFailed(dead or names[ready[0]], phase, step, exc) from exc
        return [results[ref] for _, ref in calls]

    def _dead_among(self, refs: list[Any], names: Mapping[Any, str], grace_s: float = 3.0) -> str | None:
        """A worker whose call is still out and turns out dead: the cause, when another call failed."""
        import ray
        from ray.exceptions import RayActorError, RayError

        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=grace_s)
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError:
                return names[ref]
            except RayError:
                continue
        return None

    def _recover(self, failed: WorkerFailed) -> int:
        """Rebuild the group and resume it; a failure while doing so counts as one more."""
        while True:
            failure = self._record(failed)
            started = time.perf_counter()
            self._teardown()
            self.incarnation += 1
            try:
                failure.resumed_at = self._start_group()
                break
            except WorkerFailed as again:
                failed = again
        failure.recovery_s = time.perf_counter() - started
        self._log.info("driver.resumed", step=failure.resumed_at, incarnation=self.incarnation,
                       after_failure_at=failure.step, lost_steps=failure.step - 1 - failure.resumed_at,
                       recovery_s=round(failure.recovery_s, 3), weights_version=self.version)
        self.hooks.on_resume(self, failure)
        return failure.resumed_at

    def _record(self, failed: WorkerFailed) -> Failure:
        failure = Failure(step=failed.step, phase=failed.phase, worker=failed.worker,
                          error=f"{type(failed.cause).__name__}: {failed.cause}", incarnation=self.incarnation)
        self.summary.failures.append(failure)
        self._log.error("driver.worker_failed", worker=failure.worker, step=failure.step, phase=failure.phase,
                        error=failure.error, failures=len(self.summary.failures),
                        max_failures=self.settings.max_failures)
        if len(self.summary.failures) > self.settings.max_failures:
            raise LifecycleError(f"giving up after {len(self.summary.failures)} failures "
                                 f"(max_failures={self.settings.max_failures}): {failed}") from failed.cause
        self.hooks.on_failure(self, failure)
        return failure

    def _close_group(self) -> list[dict[str, Any]]:
        """Close every trainer (waiting for async saves); the committed saves of this incarnation."""
        with self._in("close", self.settings.steps):
            results = self._gather([(r, self.workers[r].close.remote()) for r in self.roles])
        return [{"role": role, "incarnation": self.incarnation, **figures}
                for role, commits in zip(self.roles, results) for figures in commits]

    def _teardown(self) -> None:
        """Kill every worker of the group (a dead one is already gone; killing it again is harmless)."""
        import ray

        if not self.workers:
            return
        for handle in self.workers.values():
            ray.kill(handle, no_restart=True)
        self.workers = {}

    @contextmanager
    def _in(self, phase: str, step: int) -> Iterator[None]:
        self._phase = (phase, step)
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


def _merged(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `override`'s keys replacing its own, section by section."""
    out = dict(base)
    for key, value in override.items():
        out[key] = _merged(base[key], value) if isinstance(value, Mapping) and isinstance(base.get(key), Mapping) \
            else value
    return out


__all__ = ["Driver", "DriverConfig", "DriverHooks", "WorkerFailed"]
