"""The driver on a simulated three-node Ray cluster: a whole node is lost mid-run, the run recovers.

Ray's own `ray.cluster_utils.Cluster` runs a head and two worker nodes (each its own raylet and
object store) as processes on this machine. The driver runs on the head; the policy trainer
(`actor`) and the rollout are placed on worker node 1, the critic on worker node 2. Node 1 is
removed just before the train phase of step 4, its processes SIGKILLed as a crash of the host
would (the raylet too, so the head learns of it from missed health checks, not a goodbye).
The driver goes RUNNING -> RECOVERING -> RUNNING, its rebuilt workers land on the nodes that
are left, resume from step 2 (the newest complete for both roles) and train to the last step.

Placement is Ray's soft node affinity (`NodeAffinitySchedulingStrategy(..., soft=True)`),
given per role through `DriverConfig.options`: the first group goes exactly where it is told,
and a rebuilt one goes elsewhere when its node is gone. A hard pin could not be placed again:
with `soft=False` each rebuild fails at once (Ray's `ActorUnschedulableError`), with a custom
resource only the lost node had it waits out `call_timeout_s`, until the policy gives up.

What this does not show (every node is this machine, one IP): rendezvous between hosts (the
weight sync meets on 127.0.0.1), storage shared over a network, node-local /dev/shm, a lost
head node, a network partition.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import pytest

from lifecycle.machine import DriverState
from lifecycle.ray.driver import Driver, DriverConfig, DriverHooks
from lifecycle.ray.run_report import Failure
from lifecycle.store import CheckpointStore
from lifecycle.types import Parts
from tests.ray.recipe import BigramRecipe

if TYPE_CHECKING:
    from ray._private.node import Node
    from ray.cluster_utils import Cluster

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")
pytestmark = pytest.mark.slow
ROLES = ["actor", "critic"]
HANG_GUARD_S = 240
"""The driver's run (about 20 s here); past it the test raises instead of stalling the whole pytest run."""
START_GUARD_S = 120
"""The cluster's start (about 6 s here)."""
FAST_HEALTH_CHECKS = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                      "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}
"""The head declares a silent node dead after ~1.5 s instead of Ray's ~15 s default."""
SLOT = "worker_slot"
"""A resource every node has and every worker asks one of: Ray honours soft node affinity only
for an actor that asks for some resource; one that asks for none (the driver's default: 0 CPUs)
goes to any node (ray-project/ray#25360 made hard affinity the exception, not soft)."""


@dataclass
class PlacedBigrams(BigramRecipe):
    """The digits recipe on `Bigram`s; writes each worker process's Ray node id to `where/{pid}` as it builds."""

    where: str = ""

    def build(self, role: str) -> Parts:
        (Path(self.where) / str(os.getpid())).write_text(f"{role} {ray.get_runtime_context().get_node_id()}")
        return super().build(role)


class LoseNodeAt(DriverHooks):
    """Removes `node` from `cluster` just before `phase` of `step` (first group only), once its
    workers' processes are gone; records each group's workers and pids."""

    def __init__(self, cluster: Cluster, node: Node, placed: Path, phase: str, step: int) -> None:
        self.cluster, self.node, self.placed, self.where = cluster, node, placed, (phase, step)
        self.groups: dict[int, dict[str, int]] = {}
        self.lost_pids: list[int] = []

    def on_start(self, driver: Driver, step: int) -> None:
        self.groups[driver.incarnation] = dict(driver.pids)

    def on_resume(self, driver: Driver, failure: Failure) -> None:
        self.groups[driver.incarnation] = dict(driver.pids)

    def on_phase(self, driver: Driver, phase: str, step: int) -> None:
        if driver.incarnation == 0 and (phase, step) == self.where:
            self.lost_pids = [pid for pid in driver.pids.values()
                              if (self.placed / str(pid)).read_text().split()[1] == self.node.node_id]
            self.cluster.remove_node(self.node, allow_graceful=False)
            wait_gone(self.lost_pids, 30)


def wait_gone(pids: list[int], timeout_s: float) -> None:
    """Until none of `pids` runs (a zombie counts as gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid in pids if running(pid)]
        if not alive:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"workers {alive} of the removed node still run {timeout_s}s after it went")
        time.sleep(0.05)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextmanager
def hang_guard(seconds: int) -> Iterator[None]:
    """SIGALRM raises in the main thread after `seconds`: the driver's loop ends ERRORED and the
    `finally`s below still stop the workers and the cluster."""

    def expired(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"the node-loss test still ran after {seconds}s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """Head plus two worker nodes, no CPUs (the workers ask for none), in a Ray temp dir of their
    own: `Cluster` records its address in `{temp}/ray/ray_current_cluster`, where any plain
    `ray.init()` on this machine would otherwise find and join it."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    temp = tempfile.mkdtemp(prefix="ray-node-loss-")
    monkeypatch.setenv("RAY_TMPDIR", temp)
    made: Cluster | None = None
    try:
        with hang_guard(START_GUARD_S):
            made = Cluster(initialize_head=True, head_node_args={
                "num_cpus": 0, "resources": {SLOT: 8}, "include_dashboard": False, "no_monitor": True,
                "include_log_monitor": False, "_system_config": FAST_HEALTH_CHECKS})
            for _ in range(2):
                made.add_node(wait=False, num_cpus=0, resources={SLOT: 8})
            made.wait_for_nodes()
        yield made
    finally:
        ray.shutdown()  # the driver's own connection, should the test end before the driver ends it
        if made is not None:
            made.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def test_a_lost_node_s_workers_are_rebuilt_on_the_surviving_nodes_and_resume_the_last_complete_step(
        tmp_path: Path, cluster: Cluster) -> None:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    head = cluster.head_node
    lost, kept = sorted(cluster.worker_nodes, key=lambda n: n.node_id)
    placed = tmp_path / "placed"
    placed.mkdir()
    hooks = LoseNodeAt(cluster, lost, placed, "train", 4)
    on = {"actor": lost, "rollout": lost, "critic": kept}
    settings = DriverConfig(
        steps=5, save_every=2, max_failures=1, address=cluster.address, work_dir=str(tmp_path / "work"),
        call_timeout_s=60, ray_init={"log_to_driver": False},
        options={role: {"resources": {SLOT: 1},
                        "scheduling_strategy": NodeAffinitySchedulingStrategy(node.node_id, soft=True)}
                 for role, node in on.items()})
    config = {"checkpoint": {"root": str(tmp_path / "ckpt"), "keep_last": 2},
              "engine": {"bucket_bytes": 4 << 20, "timeout_s": 30}}
    job = Driver(PlacedBigrams(where=str(placed)), config, settings, hooks)
    with hang_guard(HANG_GUARD_S):
        summary = job.run()

    def nodes(incarnation: int) -> dict[str, str]:
        return {name: (placed / str(pid)).read_text().split()[1] for name, pid in hooks.groups[incarnation].items()}

    first, rebuilt = nodes(0), nodes(1)
    assert first == {"actor": lost.node_id, "critic": kept.node_id, "rollout0": lost.node_id}
    assert sorted(hooks.lost_pids) == sorted([hooks.groups[0]["actor"], hooks.groups[0]["rollout0"]])
    assert set(rebuilt.values()) <= {head.node_id, kept.node_id}, f"rebuilt on the lost node: {rebuilt}"
    assert rebuilt["critic"] == kept.node_id

    assert [(r.trigger, r.src, r.dst, r.ok) for r in job.history] == [
        ("start", DriverState.CREATED, DriverState.RUNNING, True),
        ("recover", DriverState.RUNNING, DriverState.RUNNING, True),
        ("finish", DriverState.RUNNING, DriverState.FINISHED, True)]
    assert job.history[1].path == (DriverState.RUNNING, DriverState.RECOVERING, DriverState.RUNNING)
    [failure] = summary.failures
    assert (failure.worker, failure.phase, failure.step, failure.resumed_at) == ("actor", "train", 4, 2)
    assert "ActorDiedError" in failure.error and lost.node_id in failure.error, "Ray blames the lost node"

    assert [r.step for r in summary.steps] == [1, 2, 3, 4, 5]
    assert CheckpointStore(tmp_path / "ckpt").newest_complete(ROLES) == 5
    runs = {(r.step, r.incarnation): r for r in summary.attempts}
    before, again = runs[(3, 0)], runs[(3, 1)]
    assert again.prompts == before.prompts and again.metrics == before.metrics, "step 3 re-ran exactly"
    lrs = summary.metric("actor/lr")
    assert lrs == sorted(lrs, reverse=True) and len(set(lrs)) == 5, "one lr per step: none run twice or skipped"
