"""Trainer and rollout workers in one process (no Ray): a sync over gloo on loopback, and the
rollout's refusal to serve weights it did not receive whole."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from structlog.testing import capture_logs

from lifecycle import EngineError, LifecycleError, State
from lifecycle.machine import RolloutState
from lifecycle.ray.workers import RolloutWorker, TrainerWorker, WorkerSpec, process_start
from lifecycle.watchdog import WATCHDOG
from tests.ray.recipe import DigitsRecipe


@pytest.fixture(autouse=True)
def _backstop_left_off() -> Any:
    """A worker built in this process turns the process's watchdog backstop on, as its entry
    point; the tests after these do not run under it."""
    yield
    WATCHDOG.backstop_s = None


def spec(tmp_path: Path, role: str, **watchdog: float) -> WorkerSpec:
    config = {"checkpoint": {"root": str(tmp_path / "ckpt"), "roles": ["actor"]},
              "engine": {"bucket_bytes": 1 << 18, "timeout_s": 20}, "watchdog": watchdog}
    return WorkerSpec(role=role, recipe=DigitsRecipe(batch=4), config=config, trace_dir=str(tmp_path / "traces"))


def sync(trainer: TrainerWorker, rollout: RolloutWorker) -> tuple[Any, Any]:
    """Both sides of one sync at once, as the driver runs them; each side's result or error."""
    rendezvous = trainer.rendezvous(1, "127.0.0.1")
    out: dict[str, Any] = {}

    def side(name: str, fn: Callable[[], Any]) -> None:
        try:
            out[name] = fn()
        except Exception as exc:  # noqa: BLE001 - the test looks at what each side raised
            out[name] = exc

    threads = [threading.Thread(target=side, args=("send", lambda: trainer.sync(rendezvous))),
               threading.Thread(target=side, args=("receive", lambda: rollout.receive(rendezvous, 1)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out["send"], out["receive"]


def test_rollout_refuses_to_generate_until_a_whole_sync_has_landed(tmp_path: Path) -> None:
    trainer, rollout = TrainerWorker(spec(tmp_path, "actor")), RolloutWorker(spec(tmp_path, "rollout"))
    assert trainer.start() is None
    prompts = trainer.prompts(1)
    with pytest.raises(EngineError, match="stale .a sync failed part-way or none has landed yet"):
        rollout.generate(prompts, 1, 0)

    sent, received = sync(trainer, rollout)
    assert received == sent["version"] == 1 and rollout.status() == {"weights_version": 1, "stale": False,
                                                                     "paused": False}
    policy = trainer.lc.parts.model.state_dict()
    assert all(torch.equal(policy[k], v) for k, v in rollout.lc.parts.model.state_dict().items())
    assert rollout.generate(prompts, 1, 1)["sequences"].shape[0] == 4
    with pytest.raises(EngineError, match="weights are v1, the policy's are v2"):
        rollout.generate(prompts, 1, 2)
    trainer.save(1)

    real = rollout.load_weights

    def breaks_after_one(named: Any) -> None:
        real([next(iter(named))])
        raise OSError("rollout host ran out of memory")

    rollout.load_weights = breaks_after_one  # type: ignore[method-assign]
    sent, received = sync(trainer, rollout)
    assert isinstance(received, OSError) and isinstance(sent, EngineError) and "out of memory" in str(sent)
    assert rollout.status()["stale"] is True and trainer.lc.state is State.FAILED
    assert (rollout.weights.state, rollout.weights_version) == (RolloutState.STALE, 1), "the old version, stale"
    with pytest.raises(EngineError, match="weights are stale"):
        rollout.generate(prompts, 2, 2)

    rollout.load_weights = real  # type: ignore[method-assign]
    assert trainer.start() == 1, "a failed sync leaves the trainer FAILED: it resumes its checkpoint"
    sent, received = sync(trainer, rollout)
    assert received == sent["version"] == 2 and rollout.status()["stale"] is False
    assert rollout.generate(prompts, 2, 2)["reward"].shape == (4,)
    assert (tmp_path / "traces").is_dir() and len(list((tmp_path / "traces").glob("*.jsonl"))) == 2


def _stuck_until_reported(worker: TrainerWorker) -> list[dict[str, Any]]:
    """Stands for a step that hangs; asks as the driver's `watch` thread does, until it hears."""
    deadline = time.monotonic() + 30
    reports: list[dict[str, Any]] = []
    while not reports and time.monotonic() < deadline:
        time.sleep(0.02)
        reports = worker.overdue_reports()
    return reports


def test_a_worker_keeps_its_overdue_phases_for_the_driver_and_logs_them_too(tmp_path: Path) -> None:
    trainer = TrainerWorker(spec(tmp_path, "actor", train_step_s=0.05))
    trainer.start()
    with capture_logs() as logs, trainer.lc.train_step(4):
        reports = _stuck_until_reported(trainer)
    [first, *_] = reports
    assert (first["worker"], first["trigger"], first["state"], first["role"], first["step"]) == (
        "actor", "train_step", "TRAINING", "actor", 4)
    assert first["elapsed_s"] >= 0.05 and first["budget_s"] == 0.05 and first["overdue"] >= 1
    assert "in _stuck_until_reported" in first["where"] and "stacks" not in first
    assert any(r["event"] == "lifecycle.phase_overdue" and "stacks" in r for r in logs), "still logged in full"
    assert trainer.watchdog.watching == 0



def test_workers_sharing_a_process_share_its_one_watchdog_thread(tmp_path: Path) -> None:
    """Colocated workers (or workers built in a test) each keep their own overdue reports, and none
    starts a watchdog thread of its own."""
    before = {t for t in threading.enumerate() if t.name == "lifecycle-watchdog"}
    workers = [TrainerWorker(spec(tmp_path / str(i), "actor", train_step_s=0.05)) for i in range(3)]
    for worker in workers:
        worker.start()
        with worker.lc.train_step(1):
            assert _stuck_until_reported(worker), "each worker's report reaches its own inbox"
    after = {t for t in threading.enumerate() if t.name == "lifecycle-watchdog"}
    assert len(after - before) <= 1 and all(worker.watchdog is WATCHDOG for worker in workers)
    assert WATCHDOG.watching == 0 and WATCHDOG._thread in after | {None}  # it ends soon after nothing is watched
    assert WATCHDOG.backstop_s is not None  # a worker's process has the faulthandler backstop on


def test_a_rollouts_weights_errors_name_its_index_and_it_reports_its_process(tmp_path: Path) -> None:
    rollout = RolloutWorker(dataclasses.replace(spec(tmp_path, "rollout"), index=1))
    assert rollout.weights.rank == 1 and rollout.paused is False
    with pytest.raises(LifecycleError, match="^rollout 1: load_weights outside a receive"):
        rollout.weights.load_weights([])
    assert rollout.process() == (os.getpid(), process_start())

