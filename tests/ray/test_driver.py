"""The driver on a local Ray: workers really killed (SIGKILL of the actor's process), the run recovers.

One Ray for the module; tiny Qwen2 models; a few steps each. Kills happen at exact points of
the loop (a phase hook, or a recipe that makes a worker kill itself at a given moment), so
nothing depends on timing.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
from structlog.testing import capture_logs

from lifecycle.manifest import MANIFEST
from lifecycle.ray.driver import Driver, DriverConfig, DriverHooks
from lifecycle.ray.run_report import RunSummary
from lifecycle.store import CheckpointStore
from lifecycle.trace import read_events
from lifecycle.types import Parts
from tests.ray.recipe import DigitsRecipe

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


def run(tmp_path: Path, recipe: Any, hooks: DriverHooks, *, steps: int, save_every: int = 3,
        **checkpoint: Any) -> RunSummary:
    config = {"checkpoint": {"root": str(tmp_path / "ckpt"), "keep_last": 2, **checkpoint},
              "engine": {"bucket_bytes": 4 << 20, "timeout_s": 30}}
    settings = DriverConfig(steps=steps, save_every=save_every, max_failures=1, work_dir=str(tmp_path / "work"))
    return Driver(recipe, config, settings, hooks).run()


def assert_every_step_once(summary: RunSummary, steps: int) -> None:
    assert [r.step for r in summary.steps] == list(range(1, steps + 1))
    assert CheckpointStore(summary_root(summary)).newest_complete(ROLES) == steps


def summary_root(summary: RunSummary) -> Path:
    assert summary.trace is not None
    return summary.trace.parent.parent / "ckpt"


def test_actor_killed_mid_run_finishes_every_step_resumed_from_the_last_complete_step(tmp_path: Path) -> None:
    with capture_logs() as logs:
        summary = run(tmp_path, DigitsRecipe(), KillAt("actor", "train", 5), steps=7)
    assert_every_step_once(summary, 7)
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
class Sabotaged(DigitsRecipe):
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
    [trace] = (work / "traces").glob(f"rollout0-{incarnation}-pid*.jsonl")
    events = read_events(trace)
    return [e for e in events if e.get("cat") == "worker"]


def test_rollout_killed_mid_sync_is_replaced_and_synced_before_it_generates(tmp_path: Path) -> None:
    recipe = RolloutDiesMidSync(marker=str(tmp_path / "died"), role="rollout")
    summary = run(tmp_path, recipe, DriverHooks(), steps=6)
    [failure] = summary.failures
    assert (failure.worker, failure.phase, failure.step, failure.resumed_at) == ("rollout0", "sync", 4, 3)
    assert_every_step_once(summary, 6)

    replacement = rollout_events(tmp_path / "work", 1)
    assert replacement[0]["name"] == "receive_weights" and replacement[0]["args"]["stale"] is False
    version = None
    for event in replacement:
        if event["name"] == "receive_weights":
            version = event["args"]["version"]
        else:
            assert event["args"]["version"] == version, "generates only with the weights it last received"
    dead = rollout_events(tmp_path / "work", 0)
    assert dead[-1]["name"] == "generate" and dead[-1]["args"]["step"] == 4, "it died inside the next sync"
