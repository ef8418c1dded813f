"""The Ray application given what a recipe or a cluster should not give: a rollout model with a
weight the policy never sends, recipe methods returning the wrong thing, rollout chunks of
unequal sizes, prompts a repr would summarise, a result the driver cannot unpickle, actor
options no node can hold, and a call with the wrong arguments. Workers run in process; the
worker group against fake handles and a fake `ray.wait` / `ray.get`, as in `test_ray_hostile`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from lifecycle.errors import ConfigError, EngineError, LifecycleError
from lifecycle.ray.batches import add_scores, fingerprint, merge_batches, split_batch
from lifecycle.ray.policy import FailureKind, WorkerFailed
from lifecycle.ray.workers import RolloutWorker, TrainerWorker, WorkerSpec
from lifecycle.watchdog import WATCHDOG
from tests.ray.recipe import BigramRecipe
from tests.ray.test_workers import sync
from tests.ray.test_ray_hostile import (  # noqa: F401 - the fixtures, shared
    _dead,
    _group,
    _Handle,
    _Method,
    _Ref,
    fake_ray,
    no_local_ray,
)

ray = pytest.importorskip("ray")


@pytest.fixture(autouse=True)
def _backstop_left_off() -> Any:
    """A worker built in this process turns the process's watchdog backstop on, as its entry point."""
    yield
    WATCHDOG.backstop_s = None


def _config(tmp_path: Path) -> dict[str, Any]:
    return {"checkpoint": {"root": str(tmp_path / "ckpt"), "roles": ["actor"]},
            "engine": {"bucket_bytes": 1 << 18, "timeout_s": 20}}


# -- H2: a rollout serves only weights it received -----------------------------------------------


@dataclasses.dataclass
class _RolloutHasMore(BigramRecipe):
    def model(self, role: str) -> torch.nn.Module:
        model = super().model(role)
        if role == "rollout":  # the rollout's copy of the policy has a weight the policy does not
            model.extra = torch.nn.Linear(4, 4)
        return model


def test_a_sync_that_leaves_out_a_weight_of_the_rollouts_model_is_refused_and_the_rollout_stays_stale(
        tmp_path: Path) -> None:
    recipe = _RolloutHasMore(batch=4, roles=("actor",))
    trainer = TrainerWorker(WorkerSpec(role="actor", recipe=recipe, config=_config(tmp_path)))
    rollout = RolloutWorker(WorkerSpec(role="rollout", recipe=recipe, config=_config(tmp_path)))
    try:
        trainer.start()
        sent, received = sync(trainer, rollout)
        assert isinstance(received, EngineError) and "extra.weight" in str(received)
        assert isinstance(sent, EngineError)
        assert rollout.status()["stale"] is True
        with pytest.raises(EngineError, match="stale"):
            rollout.generate(torch.randint(97, 120, (2, 4)), 1, 1)
    finally:
        rollout.close()
        trainer.close()


def test_a_sync_of_every_weight_of_the_rollouts_model_still_lands_and_serves(tmp_path: Path) -> None:
    recipe = BigramRecipe(batch=4, roles=("actor",))
    trainer = TrainerWorker(WorkerSpec(role="actor", recipe=recipe, config=_config(tmp_path)))
    rollout = RolloutWorker(WorkerSpec(role="rollout", recipe=recipe, config=_config(tmp_path)))
    try:
        trainer.start()
        sent, received = sync(trainer, rollout)
        assert received == 1 and sent["version"] == 1
        assert sorted(rollout.generate(torch.randint(97, 120, (2, 4)), 1, 1)) == ["reward", "sequences"]
    finally:
        rollout.close()
        trainer.close()


# -- H5, H11: what recipe.update and recipe.build return -----------------------------------------


@dataclasses.dataclass
class _UpdateReturns(BigramRecipe):
    returned: Any = None

    def update(self, role: str, parts: Any, batch: Any, step: int) -> Any:
        return self.returned


@pytest.mark.parametrize("returned", [None, torch.tensor(1.5), 3.0], ids=["none", "tensor", "float"])
def test_recipe_update_returning_no_dict_fails_the_train_step_with_lifecycle_error_naming_recipe_update(
        tmp_path: Path, returned: Any) -> None:
    recipe = _UpdateReturns(batch=4, roles=("actor",), returned=returned)
    trainer = TrainerWorker(WorkerSpec(role="actor", recipe=recipe, config=_config(tmp_path)))
    try:
        trainer.start()
        with pytest.raises(LifecycleError, match=r"recipe\.update\('actor', step 1\) returned .*not a dict"):
            trainer.train(1, {})
        record = trainer.lc.history[-1]
        assert (record.trigger, record.ok, trainer.lc.progress.step) == ("train_step", False, 0)
    finally:
        trainer.close()


@dataclasses.dataclass
class _BuildReturns(BigramRecipe):
    returned: Any = None

    def build(self, role: str) -> Any:
        return self.returned


@pytest.mark.parametrize("returned", [None, {"model": "m"}, "a model"], ids=["none", "dict", "str"])
@pytest.mark.parametrize("worker", [TrainerWorker, RolloutWorker], ids=["trainer", "rollout"])
def test_recipe_build_returning_no_parts_is_a_config_error_naming_recipe_build_and_the_role(
        tmp_path: Path, returned: Any, worker: type) -> None:
    role = "actor" if worker is TrainerWorker else "rollout"
    recipe = _BuildReturns(batch=4, roles=("actor",), returned=returned)
    with pytest.raises(ConfigError, match=rf"recipe\.build: build\('{role}'\) returned .*not a lifecycle\.types"):
        worker(WorkerSpec(role=role, recipe=recipe, config=_config(tmp_path)))


# -- H3, H6: what the trainers' score adds to the batch ------------------------------------------


def test_a_score_returning_a_key_the_rollouts_batch_holds_is_refused_naming_the_trainer_and_the_key() -> None:
    batch = {"reward": torch.ones(2), "sequences": torch.ones(2, 3)}
    with pytest.raises(LifecycleError, match=r"recipe\.score\('critic', \.\.\.\) returned key 'reward'.*rollouts'"):
        add_scores(batch, [{}, {"reward": torch.zeros(2)}], ["actor", "critic"])
    assert batch["reward"].tolist() == [1.0, 1.0]


def test_a_score_returning_a_key_another_trainer_returned_is_refused_naming_both() -> None:
    with pytest.raises(LifecycleError, match=r"score\('critic', \.\.\.\) returned key 'values'.*score\('actor'"):
        add_scores({"reward": 1}, [{"values": 1}, {"values": 2}], ["actor", "critic"])


@pytest.mark.parametrize("scored", [None, [1, 2, 3], "values"], ids=["none", "list", "str"])
def test_a_score_returning_no_mapping_is_a_lifecycle_error_naming_the_role_and_recipe_score(scored: Any) -> None:
    with pytest.raises(LifecycleError, match=r"recipe\.score\('critic', \.\.\.\) returned .*not a dict"):
        add_scores({"reward": 1}, [{}, scored], ["actor", "critic"])


def test_scores_of_keys_of_their_own_are_added_to_the_batch() -> None:
    joined = add_scores({"reward": 1}, [{"old_logp": 2}, {"values": 3}], ["actor", "critic"])
    assert joined == {"reward": 1, "old_logp": 2, "values": 3}


# -- H7: rollout chunks and their means ------------------------------------------------------------


def test_rollout_means_of_unequal_chunks_merge_weighted_by_each_chunks_prompts() -> None:
    prompts = list(range(5))
    rewards = [1.0, 1.0, 1.0, 0.0, 0.0]
    parts = split_batch(prompts, 2)
    batches = [{"reward": torch.tensor([rewards[i] for i in p]),
                "reward_mean": torch.tensor([rewards[i] for i in p]).mean()} for p in parts]
    merged = merge_batches(batches, ["rollout0", "rollout1"], [len(p) for p in parts])
    assert merged["reward_mean"] == pytest.approx(0.6) == pytest.approx(float(merged["reward"].mean()))


@pytest.mark.parametrize("prompts", [torch.ones(3, 2), np.ones((3, 2)), [[1, 1]] * 3], ids=["tensor", "array", "list"])
def test_fewer_prompt_rows_than_rollouts_give_no_empty_chunk_and_no_nan_mean(prompts: Any) -> None:
    chunks = split_batch(prompts, 4)
    assert [len(chunk) for chunk in chunks] == [1, 1, 1]
    batches = [{"reward_mean": torch.tensor([float(row[0]) for row in chunk]).mean()} for chunk in chunks]
    merged = merge_batches(batches, ["rollout0", "rollout1", "rollout2"], [len(c) for c in chunks])
    assert merged["reward_mean"] == 1.0


def test_a_list_of_prompts_splits_into_chunks_whose_lengths_differ_by_one_at_most() -> None:
    assert [len(chunk) for chunk in split_batch(list(range(5)), 4)] == [2, 1, 1, 1]
    assert split_batch(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_batch([], 3) == [[]]
    assert [len(chunk) for chunk in split_batch(torch.ones(0, 2), 3)] == [0]


# -- H13: fingerprints of prompts a repr would summarise -------------------------------------------


@dataclasses.dataclass
class _PromptBatch:
    input_ids: torch.Tensor


class _Plain:
    """No `__repr__` of its own: the default names the object's address."""

    def __init__(self, ids: Any) -> None:
        self.ids = ids


def test_fingerprints_of_dataclasses_holding_long_tensors_differ_in_one_token() -> None:
    left = torch.arange(4096).reshape(8, 512)
    right = left.clone()
    right[4, 200] = -1
    assert fingerprint(_PromptBatch(left)) != fingerprint(_PromptBatch(right))
    assert fingerprint(_PromptBatch(left)) == fingerprint(_PromptBatch(left.clone()))


def test_fingerprints_of_equal_plain_objects_are_equal_and_differ_when_their_attributes_do() -> None:
    assert fingerprint(_Plain([1, 2])) == fingerprint(_Plain([1, 2]))
    assert fingerprint(_Plain([1, 2])) != fingerprint(_Plain([1, 3]))


def test_fingerprints_of_conjugate_and_negative_views_differ_in_one_element() -> None:
    left = torch.randn(4000, dtype=torch.complex64)
    right = left.clone()
    right[2000] += 1j
    assert fingerprint(left.conj()) != fingerprint(right.conj())
    assert fingerprint(left.conj()) == fingerprint(left.conj().resolve_conj())
    assert fingerprint(left.conj().imag) != fingerprint(right.conj().imag)  # a negative view


# -- H9: a result the driver cannot unpickle from a worker that lives ------------------------------


def _unreadable(*_: Any) -> Any:
    raise ray.exceptions.RaySystemError("cannot rebuild this object outside the worker")


@pytest.mark.usefixtures("fake_ray")
def test_a_result_the_driver_cannot_unpickle_from_a_live_worker_is_raised_not_died() -> None:
    group = _group()
    group.handles = {"actor": _Handle(odd=_unreadable, overdue_reports=lambda: [{"trigger": "t"}])}
    with capture_logs() as logs, pytest.raises(WorkerFailed, match="cannot rebuild") as info:
        group.gather([("actor", group.handles["actor"].odd.remote())])
    assert info.value.kind is FailureKind.RAISED
    assert [r["worker"] for r in logs if r["event"] == "driver.worker_result_unreadable"] == ["actor"]
    assert group.told == [("actor", {"trigger": "t"})], "the reports the liveness check collected are handed on"


@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("answer", [_dead, _Method(list, ready=False)], ids=["dead", "silent"])
def test_a_result_the_driver_cannot_unpickle_from_a_worker_that_is_dead_or_silent_is_still_died(answer: Any) -> None:
    group = _group()
    group.handles = {"actor": _Handle(odd=_unreadable, overdue_reports=answer)}
    with pytest.raises(WorkerFailed, match="cannot rebuild") as info:
        group.gather([("actor", group.handles["actor"].odd.remote())])
    assert info.value.kind is FailureKind.DIED


# -- H10: actor options no node can hold -----------------------------------------------------------


def _cluster(monkeypatch: pytest.MonkeyPatch, totals: dict[str, float], largest: dict[str, int] | None) -> None:
    from ray._private.state import state

    monkeypatch.setattr(ray, "cluster_resources", lambda: totals)
    monkeypatch.setattr(state, "get_max_resources_from_cluster_config", lambda: largest)


@pytest.mark.usefixtures("no_local_ray")
@pytest.mark.parametrize("options, resource", [({"num_cpus": 100}, "CPU"), ({"num_gpus": 1}, "GPU"),
                                               ({"resources": {"TPU": 4}}, "TPU")])
def test_actor_options_beyond_the_whole_cluster_are_a_config_error_naming_the_role_before_any_actor_starts(
        monkeypatch: pytest.MonkeyPatch, options: dict[str, Any], resource: str) -> None:
    _cluster(monkeypatch, {"CPU": 2.0, "memory": 1e9}, None)
    group = _group()
    group.options = {"critic": options}
    spec = WorkerSpec(role="critic", recipe=BigramRecipe(), config={})
    with pytest.raises(ConfigError, match=rf"driver\.options\.critic.*one critic actor asks for {resource}="):
        group.start([("critic", TrainerWorker, "critic", spec)])
    assert group.handles == {}


def test_actor_options_within_an_autoscaling_clusters_largest_size_are_not_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from lifecycle.ray.preflight import check_feasible

    _cluster(monkeypatch, {"CPU": 2.0}, {"CPU": 64, "GPU": 8})
    check_feasible("critic", {"num_cpus": 32, "num_gpus": 8})
    with pytest.raises(ConfigError, match=r"could grow to, by its autoscaler's config, \(8\)"):
        check_feasible("critic", {"num_gpus": 16})
    _cluster(monkeypatch, {"CPU": 2.0}, None)
    check_feasible("critic", {"num_cpus": 2, "num_gpus": 0, "resources": {}})


# -- H12: a call with the wrong arguments ----------------------------------------------------------


class _Bound(_Method):
    """A method as Ray's handle has it: the arguments are bound to its signature at `.remote`."""

    def remote(self, *args: Any) -> _Ref:
        import inspect

        inspect.signature(self.fn).bind(*args)
        return super().remote(*args)


@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("args, problem", [((1,), "missing a required argument: 'b'"),
                                           ((1, 2, 3), "too many positional arguments")])
def test_a_call_with_the_wrong_arguments_is_a_lifecycle_error_naming_worker_method_and_problem(
        args: tuple[Any, ...], problem: str) -> None:
    group = _group()
    group.handles = {"actor": _Handle(work=_Bound(lambda a, b: a + b))}
    with pytest.raises(LifecycleError, match=rf"worker 'actor': work\(\) cannot take arguments .*{problem}"):
        group.call("actor", "work", *args)
    assert group.call("actor", "work", 1, 2) == 3


# -- review 2: one rollout gets the policy's prompts whole, whatever they are ----------------------


class _NoLength:
    """Prompts a recipe may hand its one rollout: an object of its own, with no `__len__`."""

    def __init__(self, seed: int) -> None:
        self.seed = seed


class _OneActor:
    roles = ("actor",)


@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("make", [lambda: None, lambda: 7, lambda: torch.tensor(3), lambda: (i for i in range(3)),
                                  lambda: _NoLength(5)], ids=["none", "int", "0-d-tensor", "generator", "no-len"])
def test_with_one_rollout_prompts_without_a_length_go_whole_to_it_and_the_step_trains(make: Callable[[], Any]) -> None:
    from lifecycle.ray.driver import Driver, DriverConfig

    prompts, got = make(), []
    driver = Driver(_OneActor(), {}, DriverConfig(steps=1, rollouts=1))
    driver.group.handles = {
        "actor": _Handle(prompts=lambda step: prompts, score=lambda batch: {}, train=lambda step, batch: {"loss": 0.5},
                         rendezvous=lambda n, host: "here", sync=lambda where: {"version": 1},
                         save=lambda step: {"step": step}),
        "rollout0": _Handle(generate=lambda p, step, version: got.append(p) or {"reward": 1.0},
                            receive=lambda where, rank: 1)}
    driver._run_step(1)
    assert len(got) == 1 and got[0] is prompts, "the rollout got the very prompts object"
    assert [(r.step, r.metrics) for r in driver.summary.attempts] == [(1, {"actor/loss": 0.5})]


# -- review 12: sizes that do not match the batches ------------------------------------------------


@pytest.mark.parametrize("sizes", [[3], [3, 1, 1], []], ids=["fewer", "more", "empty"])
def test_merge_batches_refuses_sizes_of_another_count_than_the_batches_naming_both_counts(sizes: list[int]) -> None:
    batches = [{"reward_mean": 1.0}, {"reward_mean": 0.0}]
    with pytest.raises(LifecycleError, match=rf"{len(sizes)} size\(s\) for 2 rollouts' batches"):
        merge_batches(batches, ["rollout0", "rollout1"], sizes)
    assert merge_batches(batches, ["rollout0", "rollout1"], [3, 1])["reward_mean"] == pytest.approx(0.75)


# -- review 5: a recovery after a node was lost ----------------------------------------------------


class _ActorClass:
    """What `ray.remote(...)(cls).options(...)` gives: `.remote(spec)` creates an actor (a fake one)."""

    def options(self, **_: Any) -> _ActorClass:
        return self

    def remote(self, spec: Any) -> _Handle:
        return _Handle(process=lambda: (2**22 + 7, None), node=lambda: "10.0.0.9", build=lambda: None)


@pytest.fixture
def fake_actors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Actors created, started, built and killed without a Ray cluster (on a node of their own)."""
    monkeypatch.setattr(ray, "remote", lambda **_: lambda cls: _ActorClass())
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart=True: None)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.1")


@pytest.mark.usefixtures("fake_ray", "fake_actors")
def test_a_group_rebuilt_after_its_cluster_lost_a_node_is_not_refused_as_asking_beyond_the_cluster(
        monkeypatch: pytest.MonkeyPatch) -> None:
    workers = [("critic", TrainerWorker, "critic", WorkerSpec(role="critic", recipe=BigramRecipe(), config={}))]
    group = _group()
    group.options = {"critic": {"num_gpus": 8}}
    _cluster(monkeypatch, {"CPU": 16.0, "GPU": 8.0}, None)
    group.start(workers)
    group.stop()
    _cluster(monkeypatch, {"CPU": 8.0, "GPU": 0.0}, None)  # the GPU node died: Ray no longer counts it
    group.start(workers)  # the rebuilt actor waits for the node, as before the check existed
    assert list(group.handles) == ["critic"]
    fresh = _group()
    fresh.options = {"critic": {"num_gpus": 8}}
    with pytest.raises(ConfigError, match=r"driver\.options\.critic.*GPU=8"):
        fresh.start(workers)  # a group's first start is still checked against the cluster it finds


# -- review 3: Python 3.10, as pyproject allows ----------------------------------------------------


_TYPING_SINCE_3_11 = {"Self", "LiteralString", "Never", "assert_never", "assert_type", "reveal_type",
                      "TypeVarTuple", "Unpack", "Required", "NotRequired", "dataclass_transform",
                      "get_overloads", "clear_overloads", "override", "TypeAliasType", "ReadOnly", "TypeIs"}


def test_the_ray_modules_import_nothing_from_typing_that_python_3_10_lacks() -> None:
    import ast

    import lifecycle.ray

    late = []
    for path in sorted(Path(lifecycle.ray.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "typing":
                late += [f"{path.name}: {alias.name}" for alias in node.names if alias.name in _TYPING_SINCE_3_11]
    assert late == []


@pytest.mark.parametrize("given", [{"max_restarts": 1}, {"max_task_retries": -1}, {"max_restarts": 2, "num_cpus": 1}])
def test_ray_restarts_or_retries_in_actor_options_are_refused_naming_the_role(given: dict[str, Any]) -> None:
    """Ray restarted a killed worker without its deferred build and retried the call on it, which
    the driver then took for a raised AttributeError of a new, untracked process."""
    from lifecycle.ray.driver import Driver, DriverConfig
    from tests.ray.test_ray_hostile import _Recipe

    with pytest.raises(ConfigError) as info:
        Driver(_Recipe(), {}, DriverConfig(steps=1, options={"actor": given}))
    assert info.value.key == "driver.options.actor" and "restarts workers itself" in str(info.value)
    Driver(_Recipe(), {}, DriverConfig(steps=1, options={"actor": {"max_restarts": 0, "num_cpus": 1}}))
