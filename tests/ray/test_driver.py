"""The driver on a local Ray: workers really killed (SIGKILL of the actor's process), the run recovers.

One Ray for the module; a few steps each, on tiny Qwen2 models in the first test and on the
digits recipe's bigrams (`BigramRecipe`: no worker imports transformers) in the others. Kills
happen at exact points of the loop (a phase hook, or a recipe that makes a worker kill itself
at a given moment), so nothing depends on timing.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
from structlog.testing import capture_logs

from lifecycle.errors import ConfigError
from lifecycle.machine import DriverState
from lifecycle.manifest import MANIFEST
from lifecycle.ray.driver import Driver, DriverConfig, DriverHooks
from lifecycle.ray.policy import RunFailed
from lifecycle.ray.run_report import Overdue, RunSummary, render_summary
from lifecycle.store import CheckpointStore
from lifecycle.trace import read_events
from lifecycle.types import Parts
from tests.ray.recipe import BigramRecipe, DigitsRecipe

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow
ROLES = ["actor", "critic"]


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


class KillAt(DriverHooks):
    """Kill `worker` just before `phase` of `step`, in the first worker group only."""

    def __init__(self, worker: str, phase: str, step: int, check: Any = None) -> None:
        self.where = (worker, phase, step)
        self.check = check

    def on_phase(self, driver: Driver, phase: str, step: int) -> None:
        worker, at_phase, at_step = self.where
        if driver.incarnation == 0 and (phase, step) == (at_phase, at_step):
            if self.check is not None:
                self.check()
            driver.kill(worker)


def driver(tmp_path: Path, recipe: Any, hooks: DriverHooks, *, steps: int, save_every: int = 3,
           watchdog: dict[str, float] | None = None, poll_s: float = 1.0, **checkpoint: Any) -> Driver:
    config = {"checkpoint": {"root": str(tmp_path / "ckpt"), "keep_last": 2, **checkpoint},
              "engine": {"bucket_bytes": 4 << 20, "timeout_s": 30}, "watchdog": watchdog or {}}
    settings = DriverConfig(steps=steps, save_every=save_every, max_failures=1, work_dir=str(tmp_path / "work"),
                            poll_s=poll_s)
    return Driver(recipe, config, settings, hooks)


def run(tmp_path: Path, recipe: Any, hooks: DriverHooks, *, steps: int, save_every: int = 3,
        **checkpoint: Any) -> RunSummary:
    return driver(tmp_path, recipe, hooks, steps=steps, save_every=save_every, **checkpoint).run()


def assert_every_step_once(summary: RunSummary, steps: int) -> None:
    assert [r.step for r in summary.steps] == list(range(1, steps + 1))
    assert CheckpointStore(summary_root(summary)).newest_complete(ROLES) == steps


def summary_root(summary: RunSummary) -> Path:
    assert summary.trace is not None
    return summary.trace.parent.parent / "ckpt"


def test_actor_killed_mid_run_finishes_every_step_resumed_from_the_last_complete_step(tmp_path: Path) -> None:
    job = driver(tmp_path, DigitsRecipe(), KillAt("actor", "train", 5), steps=7)
    with capture_logs() as logs:
        summary = job.run()
    assert_every_step_once(summary, 7)
    assert [(r.trigger, r.src, r.dst, r.ok) for r in job.history] == [
        ("start", DriverState.CREATED, DriverState.RUNNING, True),
        ("recover", DriverState.RUNNING, DriverState.RUNNING, True),
        ("finish", DriverState.RUNNING, DriverState.FINISHED, True)]
    assert job.history[1].path == (DriverState.RUNNING, DriverState.RECOVERING, DriverState.RUNNING)
    assert summary.trace is not None
    merged = json.loads(summary.trace.read_text())["traceEvents"]
    machine = [e["name"] for e in merged if e.get("pid") == 0 and e.get("tid") == 1 and e["ph"] == "X"]
    assert machine == ["start", "recover", "finish"], "the driver's transitions, on the workers' time line"
    assert {e["name"] for e in merged if e.get("pid", 0) > 0 and e["ph"] == "X"} >= {
        "resume", "train_step", "save", "sync_weights", "receive_weights", "generate"}
    [failure] = summary.failures
    assert (failure.worker, failure.phase, failure.step, failure.resumed_at) == ("actor", "train", 5, 3)
    assert "ActorDiedError" in failure.error
    events = {r["event"]: r for r in logs if r["event"].startswith("driver.")}
    assert events["driver.worker_failed"]["worker"] == "actor" and events["driver.resumed"]["step"] == 3

    runs = {(r.step, r.incarnation): r for r in summary.attempts}
    before, again = runs[(4, 0)], runs[(4, 1)]
    assert again.prompts == before.prompts, "the data position continues from the checkpoint"
    assert again.metrics == before.metrics, "weights, lr schedule, RNG and data all continue exactly"
    assert runs[(5, 1)].prompts != before.prompts
    lrs = summary.metric("actor/lr")
    assert lrs == sorted(lrs, reverse=True) and len(set(lrs)) == 7, "one lr per step: none run twice or skipped"
    saved_version = runs[(3, 0)].weights_version + 1
    first_sync_after = next(s for s in summary.syncs if s["incarnation"] == 1)
    assert first_sync_after["version"] == saved_version + 1, "weights version continues from the checkpoint"
    assert summary.trace is not None and summary.trace.is_file()


@dataclass
class Sabotaged(BigramRecipe):
    """Patches code inside the process of `role` when it builds, to misbehave once (`marker`)."""

    marker: str = ""
    role: str = "actor"

    def build(self, role: str) -> Parts:
        if role == self.role:
            self.sabotage(Path(self.marker))
        return super().build(role)

    def sabotage(self, marker: Path) -> None:
        raise NotImplementedError


@dataclass
class SlowActorSave(Sabotaged):
    """The actor's background write of `slow_step` hangs (once), so a kill lands before its commit."""

    slow_step: int = 6

    def sabotage(self, marker: Path) -> None:
        from backends.hf import HFBackend

        real, step = HFBackend.save_model, self.slow_step

        def hanging(backend: Any, model: Any, folder: Path) -> None:
            if folder.parent.parent.name == f"global_step_{step}" and not marker.exists():
                marker.touch()
                time.sleep(120)
            real(backend, model, folder)

        HFBackend.save_model = hanging  # type: ignore[method-assign]


def test_trainer_killed_during_an_async_save_resumes_the_previous_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    marker = tmp_path / "slow-save-started"

    def write_in_flight() -> None:
        deadline = time.monotonic() + 30  # the background write starts on its own thread, soon after save() returns
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the actor's background write of step 6 has started"
        assert not (root / "global_step_6" / "actor" / MANIFEST).exists()
        assert CheckpointStore(root).newest_complete(ROLES) == 3

    recipe = SlowActorSave(marker=str(marker))
    summary = run(tmp_path, recipe, KillAt("actor", "generate", 7, check=write_in_flight), steps=8,
                  save={"async": True})
    [failure] = summary.failures
    assert (failure.worker, failure.step, failure.resumed_at) == ("actor", 7, 3)
    saved_at_6 = next(r for r in summary.attempts if r.step == 6 and r.incarnation == 0).saved
    assert all(s["async"] for s in saved_at_6), "the save returned before its commit"
    assert_every_step_once(summary, 8)
    assert {s["step"] for s in summary.saves if s["role"] == "actor"} == {6, 8}


@dataclass
class RolloutDiesMidSync(Sabotaged):
    """The rollout kills its own process after the first tensor of weights `version` (once)."""

    version: int = 5

    def sabotage(self, marker: Path) -> None:
        from backends.engines import Incoming

        real, version = Incoming.__next__, self.version

        def dying(incoming: Incoming) -> Any:
            if incoming.version == version and incoming.tensors == 1 and not marker.exists():
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
            return real(incoming)

        Incoming.__next__ = dying  # type: ignore[method-assign]


def rollout_events(work: Path, incarnation: int) -> list[dict[str, Any]]:
    """The rollout's receive and generate phases, as its weights machine traced them."""
    [trace] = (work / "traces").glob(f"rollout0-{incarnation}-pid*.jsonl")
    events = read_events(trace)
    return [e for e in events if e.get("name") in ("receive_weights", "generate")]


def test_rollout_killed_mid_sync_is_replaced_and_synced_before_it_generates(tmp_path: Path) -> None:
    recipe = RolloutDiesMidSync(marker=str(tmp_path / "died"), role="rollout")
    summary = run(tmp_path, recipe, DriverHooks(), steps=6)
    [failure] = summary.failures
    assert (failure.worker, failure.phase, failure.step, failure.resumed_at) == ("rollout0", "sync", 4, 3)
    assert_every_step_once(summary, 6)

    replacement = rollout_events(tmp_path / "work", 1)
    assert replacement[0]["name"] == "receive_weights" and replacement[0]["args"]["dst"] == "SERVING"
    assert replacement[0]["args"]["path"] == "EMPTY -> RECEIVING -> SERVING"
    version = None
    for event in replacement:
        if event["name"] == "receive_weights":
            version = event["args"]["version"]
        else:
            assert event["args"]["version"] == version, "generates only with the weights it last received"
    dead = rollout_events(tmp_path / "work", 0)
    assert dead[-1]["name"] == "generate" and dead[-1]["args"]["step"] == 4, "it died inside the next sync"


@dataclass
class StallsInTraining(BigramRecipe):
    """The actor's update of step `step` sleeps `stall_s`, as a hung collective would (in the first group only)."""

    step: int = 1
    stall_s: float = 2.5

    def update(self, role: str, parts: Parts, batch: Any, step: int) -> dict[str, float]:
        if role == "actor" and step == self.step:
            time.sleep(self.stall_s)
        return super().update(role, parts, batch, step)


class Watching(DriverHooks):
    def __init__(self) -> None:
        self.told: list[tuple[float, Overdue]] = []

    def on_overdue(self, driver: Driver, overdue: Overdue) -> None:
        self.told.append((time.time(), overdue))


def test_a_worker_phase_past_its_budget_shows_in_the_driver_output_while_the_worker_is_busy(tmp_path: Path) -> None:
    hooks = Watching()
    job = driver(tmp_path, StallsInTraining(), hooks, steps=1, save_every=1, watchdog={"train_step_s": 0.5},
                 poll_s=0.2)
    with capture_logs() as logs:
        summary = job.run()
    reported = [r for r in logs if r["event"] == "driver.worker_overdue"]
    assert reported and reported[0]["log_level"] == "warning"
    first = reported[0]
    assert (first["worker"], first["trigger"], first["state"], first["step"], first["driver_phase"]) == (
        "actor", "train_step", "TRAINING", 1, "train")
    assert first["elapsed_s"] >= 0.5 and first["budget_s"] == 0.5 and "in update" in first["where"]
    train_end = next(span["end"] for span in summary.spans if span["name"] == "train")
    assert hooks.told and hooks.told[0][0] < train_end, "the driver learnt it while the actor was still training"
    assert [o for _, o in hooks.told] == summary.overdue and {o.worker for o in summary.overdue} == {"actor"}
    assert "actor overdue in train_step of step 1" in render_summary(summary, "actor/reward")


@dataclass
class BadConfigInUpdate(BigramRecipe):
    """The critic's update raises a ConfigError: no rebuilt group would get past it."""

    def update(self, role: str, parts: Parts, batch: Any, step: int) -> dict[str, float]:
        if role == "critic":
            raise ConfigError("recipe.lr", "must be > 0, got -1")
        return super().update(role, parts, batch, step)


def test_a_config_error_in_a_worker_ends_the_run_errored_without_a_restart(tmp_path: Path) -> None:
    job = driver(tmp_path, BadConfigInUpdate(), DriverHooks(), steps=3)
    with capture_logs() as logs, pytest.raises(RunFailed, match="ConfigError is not retryable") as info:
        job.run()
    assert job.state is DriverState.ERRORED and job.incarnation == 0
    assert [(r.trigger, r.ok) for r in job.history] == [("start", True), ("give_up", False)]
    assert info.value.failure is not None and isinstance(info.value.failure.error, ConfigError)
    [failed] = [r for r in logs if r["event"] == "driver.worker_failed"]
    assert (failed["worker"], failed["kind"], failed["decision"]) == ("critic", "raised", "give_up")
    assert not [r for r in logs if r["event"] == "driver.started" and r["incarnation"] > 0]



class BadConfigInBuild(BigramRecipe):
    def build(self, role: str) -> Parts:
        if role == "critic":
            raise ConfigError("recipe.critic_width", "must be > 0, got 0")
        return super().build(role)


def test_a_config_error_while_a_worker_builds_ends_the_run_without_a_restart(tmp_path: Path) -> None:
    """Ray's creation task passes on only an error's text, as a death, which was retried to the
    limit; the worker builds in its first call, so the ConfigError itself reaches the policy."""
    job = driver(tmp_path, BadConfigInBuild(), DriverHooks(), steps=3)
    with pytest.raises(RunFailed, match="ConfigError is not retryable") as info:
        job.run()
    assert job.state is DriverState.ERRORED and job.incarnation == 0
    assert [(r.trigger, r.ok) for r in job.history] == [("start", False)]
    assert info.value.failure is not None and isinstance(info.value.failure.error, ConfigError)
    [failure] = job.summary.failures
    assert (failure.worker, failure.phase, failure.step) == ("critic", "start", 0)
