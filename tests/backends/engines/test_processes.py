"""Weight sync between real processes: a trainer and two rollouts, each holding a tiny Qwen2.

- After a training step and a sync over each engine, greedy generation on every rollout
  equals generation on the trainer's model (and their weights are bit-identical).
- A rollout SIGKILLed mid-transfer: the trainer's sync raises `EngineError` within the
  timeout, the surviving rollout is stale and refuses to generate, and after `resume` the
  next sync, to it and to a fresh process in the dead one's place, succeeds.

Every rank runs under `run_ranks`' deadline; the killed rollout is a grandchild process
(rank 2 starts it and takes its place once it is dead), as a driver would restart it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from backends.engines import Rendezvous, receive_into
from lifecycle import Lifecycle
from lifecycle.errors import EngineError
from lifecycle.testing import MemoryCheckpointer
from tests.backends.dist_util import free_port, run_ranks
from tests.backends.engines.kit import (
    REPO, ModelRollout, digest, greedy, new_engine, read_case, tiny_qwen2, train_step,
)

ENGINES = ("gloo", "shm")


def _case(tmp_path: Path, **case: Any) -> Path:
    path = tmp_path / "case.json"
    path.write_text(json.dumps(case), encoding="utf-8")
    return path


def _state(model: torch.nn.Module) -> str:
    return digest(model.state_dict().items())


def _trainer(model: torch.nn.Module, engine: str, options: dict[str, Any]) -> Lifecycle:
    lc = Lifecycle({"engine": {"backend": engine, **options}}, model=model, checkpointer=MemoryCheckpointer())
    lc.init_load()
    return lc


def _generation_rank(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any]:
    case = read_case(tmp_path / "case.json")
    model = tiny_qwen2()
    rollout = None if rank == 0 else ModelRollout(model)
    out: dict[str, Any] = {"initial": _state(model)}
    for step, (engine, port) in enumerate(zip(ENGINES, case["ports"]), start=1):
        rdv = Rendezvous("127.0.0.1", port, receivers=world_size - 1)
        if rollout is None:
            lc = _trainer(model, engine, case["options"])
            with lc.train_step(step):
                train_step(model, seed=step)
            version, tokens = lc.sync_weights(rdv), greedy(model)
            lc.close()
        else:
            version = receive_into(new_engine(engine, **case["options"]), rollout, rdv, rank=rank)
            tokens = rollout.generate()
        out[engine] = {"version": version, "tokens": tokens, "state": _state(model)}
    return out


def test_after_a_train_step_and_a_sync_over_each_engine_every_rollout_generates_as_the_trainer(
    tmp_path: Path,
) -> None:
    _case(tmp_path, ports=[free_port() for _ in ENGINES], options={"bucket_bytes": 64 * 1024, "timeout_s": 30})
    trainer, *rollouts = run_ranks(_generation_rank, tmp_path, world_size=3, timeout_s=90)
    assert trainer["gloo"]["state"] != trainer["initial"] != trainer["shm"]["state"] != trainer["gloo"]["state"]
    for engine in ENGINES:
        for rollout in rollouts:
            assert rollout[engine] == trainer[engine], engine
        assert trainer[engine]["version"] == 1


@pytest.mark.transformers
def test_after_a_naive_sync_in_process_rollouts_generate_as_the_trainer() -> None:
    model = tiny_qwen2()
    rollouts = [ModelRollout(tiny_qwen2(seed=s)) for s in (1, 2)]
    lc = _trainer(model, "naive", {})
    with lc.train_step(1):
        train_step(model, seed=1)
    assert lc.sync_weights(rollouts) == 1
    for rollout in rollouts:
        assert rollout.generate() == greedy(model) and _state(rollout.model) == _state(model)
        assert rollout.weights_version == 1


def _kill_rank(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any]:
    import torch.distributed as dist

    case_path = tmp_path / "case.json"
    case = read_case(case_path)
    rdv = Rendezvous("127.0.0.1", case["port"], receivers=2)
    model = tiny_qwen2()
    if rank == 2:
        victim = subprocess.Popen([sys.executable, "-c", "import sys; from tests.backends.engines.kit import "
                                   "die_mid_receive; die_mid_receive(sys.argv[1])", str(case_path)], cwd=REPO)
        while not Path(case["victim_ready"]).exists() and victim.poll() is None:
            time.sleep(0.05)
    dist.barrier()
    if rank == 0:
        return _trainer_survives(model, case, rdv)
    if rank == 1:
        return _rollout_survives(ModelRollout(model), case, rdv)
    exit_code = victim.wait(timeout=30)
    rollout = ModelRollout(model)
    version = receive_into(new_engine(case["engine"], **case["options"]), rollout, rdv, rank=2)
    return {"victim_exit": exit_code, "version": version, "state": _state(model), "tokens": rollout.generate()}


def _trainer_survives(model: torch.nn.Module, case: dict[str, Any], rdv: Rendezvous) -> dict[str, Any]:
    lc = _trainer(model, case["engine"], {**case["options"], "timeout_s": case["trainer_timeout_s"]})
    lc.save(0)
    with lc.train_step(1):
        train_step(model, seed=1)
    start = time.monotonic()
    try:
        lc.sync_weights(rdv)
        error = None
    except EngineError as exc:
        error = str(exc)
    out: dict[str, Any] = {"error": error, "seconds": time.monotonic() - start, "state_after": lc.state.name}
    lc.resume()
    with lc.train_step(1):
        train_step(model, seed=2)
    out.update(version=lc.sync_weights(rdv), state=_state(model), tokens=greedy(model))
    return out


def _rollout_survives(rollout: ModelRollout, case: dict[str, Any], rdv: Rendezvous) -> dict[str, Any]:
    engine = new_engine(case["engine"], **case["options"])
    try:
        receive_into(engine, rollout, rdv, rank=1)
        first = None
    except EngineError as exc:
        first = str(exc)
    stale = rollout.stale
    try:
        rollout.generate()
        refused = False
    except RuntimeError:
        refused = True
    version = receive_into(engine, rollout, rdv, rank=1)
    return {"first": first, "stale": stale, "refused": refused, "version": version, "stale_after": rollout.stale,
            "state": _state(rollout.model), "tokens": rollout.generate()}


@pytest.mark.parametrize("engine", ["gloo"])  # a killed shm receiver: test_liveness, at each phase
def test_a_rollout_killed_mid_transfer_fails_the_sync_in_time_and_the_next_one_repairs(
    engine: str, tmp_path: Path,
) -> None:
    timeout = 3.0
    _case(tmp_path, engine=engine, port=free_port(), victim_ready=str(tmp_path / "victim.ready"),
          trainer_timeout_s=timeout, options={"bucket_bytes": 16 * 1024, "timeout_s": 30})
    trainer, survivor, replaced = run_ranks(_kill_rank, tmp_path, world_size=3, timeout_s=90)
    assert trainer["error"] and trainer["error"].startswith(f"{engine} engine: ")
    assert trainer["seconds"] < timeout + 1 and trainer["state_after"] == "FAILED"
    assert survivor["first"] and survivor["stale"] and survivor["refused"]
    assert replaced["victim_exit"] == -9
    assert trainer["version"] == survivor["version"] == replaced["version"] == 1
    assert trainer["state"] == survivor["state"] == replaced["state"]
    assert trainer["tokens"] == survivor["tokens"] == replaced["tokens"] and not survivor["stale_after"]
