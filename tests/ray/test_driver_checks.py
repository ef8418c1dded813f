"""The Ray driver's own checks, without Ray: its settings, a recipe's roles, and a run's cleanup."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from lifecycle.errors import ConfigError, LifecycleError
from lifecycle.ray.driver import Driver, DriverConfig
from lifecycle.ray.policy import RunFailed
from lifecycle.ray.run_report import merge_batches, merge_traces, split_batch


def test_the_driver_config_refuses_values_of_the_wrong_kind_naming_the_key() -> None:
    for kwargs, key in [({"steps": 2.5}, "driver.steps"), ({"steps": True}, "driver.steps"),
                        ({"steps": float("nan")}, "driver.steps"), ({"steps": "10"}, "driver.steps"),
                        ({"steps": None}, "driver.steps"), ({"rollouts": 1.5}, "driver.rollouts"),
                        ({"save_every": 0}, "driver.save_every"), ({"max_failures": None}, "driver.max_failures"),
                        ({"poll_s": True}, "driver.poll_s"),
                        ({"failure_policy": {"max_failures": 3}}, "driver.failure_policy")]:
        with pytest.raises(ConfigError) as info:
            DriverConfig(**{"steps": 3, **kwargs})  # type: ignore[arg-type]
        assert info.value.key == key, kwargs


@pytest.mark.parametrize("roles", ["actor", ["actor", "actor"], ["actor", "rollout1"], ["rollout"], [],
                                   ["actor", 7], ["../x"], None])
def test_a_recipe_whose_roles_cannot_name_distinct_trainer_workers_is_refused(roles: object) -> None:
    class Recipe:
        pass

    Recipe.roles = roles  # type: ignore[attr-defined]
    with pytest.raises(ConfigError) as info:
        Driver(Recipe(), {}, DriverConfig(steps=1))
    assert info.value.key == "recipe.roles"


def test_a_run_whose_cleanup_fails_still_raises_its_own_error_and_logs_each_failed_step(tmp_path: Path) -> None:
    class Recipe:
        roles = ["actor"]

    driver = Driver(Recipe(), {}, DriverConfig(steps=1, work_dir=str(tmp_path)))
    given_up = RunFailed("giving up")

    def control(last: int) -> None:
        raise given_up

    def stop() -> None:
        raise OSError("the group is gone")

    driver._control = control  # type: ignore[method-assign]
    driver._stop_group = stop  # type: ignore[method-assign]
    (tmp_path / "trace.json").mkdir()  # the merged trace cannot be written there
    with capture_logs() as logs, pytest.raises(RunFailed) as info:
        driver.run()
    assert info.value is given_up
    failed = [(r["step"], r["error"]) for r in logs if r["event"] == "driver.cleanup_failed"]
    assert [step for step, _ in failed] == ["stopping the worker group", "writing the trace"]
    assert "the group is gone" in failed[0][1]


def test_a_fifo_among_the_worker_traces_is_left_out_without_blocking(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    traces.mkdir()
    os.mkfifo(traces / "actor-0.jsonl")
    (traces / "critic-0.jsonl").write_text('{"ph": "X", "name": "save", "ts": 1, "dur": 2}\n[1, 2]\n"text"\n')
    out = merge_traces(traces, tmp_path / "trace.json", [])
    names = [e.get("args", {}).get("name") for e in json.loads(out.read_text())["traceEvents"]]
    assert "critic-0" in names and "actor-0" not in names


def test_the_driver_takes_numpy_counts_and_any_sequence_of_roles() -> None:
    import collections

    import numpy as np

    assert DriverConfig(steps=np.int64(4), rollouts=np.int32(2), max_failures=np.int64(1)).steps == 4

    class Roles(collections.abc.Sequence):  # as OmegaConf's ListConfig is
        def __init__(self, items: list[str]) -> None:
            self.items = items

        def __getitem__(self, i):  # type: ignore[no-untyped-def]
            return self.items[i]

        def __len__(self) -> int:
            return len(self.items)

    class Recipe:
        roles = Roles(["actor", "critic"])

    assert Driver(Recipe(), {}, DriverConfig(steps=1)).roles == ["actor", "critic"]


class _Job:
    roles = ["actor", "critic"]


@pytest.mark.parametrize("kwargs, key", [
    ({"threads": -1}, "driver.threads"), ({"threads": "4"}, "driver.threads"), ({"num_cpus": -3}, "driver.num_cpus"),
    ({"work_dir": 5}, "driver.work_dir"), ({"address": 5}, "driver.address"), ({"address": " "}, "driver.address"),
    ({"options": {"actor": 5}}, "driver.options"), ({"options": [("actor", {})]}, "driver.options"),
    ({"ray_init": "x"}, "driver.ray_init"), ({"ray_init": {1: 2}}, "driver.ray_init"),
])
def test_the_driver_config_refuses_settings_ray_would_reject_later_naming_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        DriverConfig(steps=1, **kwargs)
    assert info.value.key == key


@pytest.mark.parametrize("args, key", [
    (({"steps": 2},), "settings"), ((None,), "settings"),
    ((DriverConfig(steps=1), 5), "hooks"),
    ((DriverConfig(steps=1), None, {"actor": 5}), "overrides"),
    ((DriverConfig(steps=1), None, [("actor", {})]), "overrides"),
    ((DriverConfig(steps=1), None, {"nobody": {}}), "overrides"),
    ((DriverConfig(steps=1, options={"actr": {"num_gpus": 1}}),), "driver.options"),
])
def test_the_driver_refuses_arguments_of_the_wrong_kind_naming_them(args: tuple, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        Driver(_Job(), {}, *args)
    assert info.value.key == key


@pytest.mark.parametrize("override, key", [
    ({"actor": {"checkpoint": {"root": "/elsewhere"}}}, "overrides.checkpoint.root"),
    ({"critic": {"checkpoint": {"roles": ["critic"]}}}, "overrides.checkpoint.roles"),
    ({"rollout": {"engine": {"backend": "shm"}}}, "overrides.engine.backend"),
])
def test_an_override_that_splits_what_the_roles_share_is_refused(override: dict, key: str, tmp_path: Path) -> None:
    """A trainer saving under a root of its own never completes a step with the others (every
    recovery restarted from step 0); a rollout of another engine than the policy fails every sync."""
    config = {"checkpoint": {"root": str(tmp_path)}, "engine": {"backend": "gloo"}}
    with pytest.raises(ConfigError) as info:
        Driver(_Job(), config, DriverConfig(steps=1), None, override)
    assert info.value.key == key


def test_per_role_overrides_of_keys_roles_need_not_share_are_taken(tmp_path: Path) -> None:
    config = {"checkpoint": {"root": str(tmp_path)}}
    job = Driver(_Job(), config, DriverConfig(steps=1), None,
                 {"critic": {"checkpoint": {"keep_last": 5}}, "rollout": {"engine": {"timeout_s": 30}}})
    assert job.configs["critic"]["checkpoint"]["keep_last"] == 5
    assert job.configs["rollout"]["engine"]["timeout_s"] == 30


def test_a_ray_address_that_nothing_answers_is_refused_at_once_not_retried_for_minutes() -> None:
    pytest.importorskip("ray")
    from backends.base import free_port

    job = Driver(_Job(), {}, DriverConfig(steps=1, address=f"127.0.0.1:{free_port('127.0.0.1')}"))
    with pytest.raises(ConfigError, match="cannot connect") as info:
        job._init_ray()
    assert info.value.key == "driver.address" and not job._owns_ray
    for address in ("a..b:6379", f"{'x' * 70}.example:6379"):  # names the IDNA codec refuses
        with pytest.raises(ConfigError) as info:
            Driver(_Job(), {}, DriverConfig(steps=1, address=address))._init_ray()
        assert info.value.key == "driver.address"


@pytest.mark.parametrize("batches, match", [
    ([{"r": torch.ones(2)}, {"rewards": torch.ones(2)}], "keys"),
    ([{"r": torch.ones(2)}, {"r": "text"}], "cannot be joined"),
    ([{"r": "a"}, {"r": "b"}], "cannot be joined"),
    ([{"r": {"x": 1}}, {"r": {"x": 2}}], "cannot be joined"),
    ([{"r": True}, {"r": False}], "cannot be joined"),
    ([{"r": torch.ones(2, 3)}, {"r": torch.ones(2, 4)}], "do not join"),
    ([{"r": 1.0}, [1.0]], "returned a list"),
])
def test_rollout_batches_that_do_not_join_are_refused_naming_the_key_or_rollout(batches: list, match: str) -> None:
    with pytest.raises(LifecycleError, match=match):
        merge_batches(batches, ["rollout0", "rollout1"])


def test_rollout_batches_join_per_sample_values_and_average_numbers() -> None:
    """Per-sample values of every kind are joined (numpy arrays were averaged, element by element,
    across the rollouts: a batch of half the samples, each reward the mean of two)."""
    merged = merge_batches([{"t": torch.tensor([1, 2]), "a": np.array([1.0, 2.0]), "l": [1], "p": (2,), "m": 1.0},
                            {"t": torch.tensor([3]), "a": np.array([3.0]), "l": [3], "p": (4,), "m": 2}])
    assert merged["t"].tolist() == [1, 2, 3] and merged["a"].tolist() == [1.0, 2.0, 3.0]
    assert merged["l"] == [1, 3] and merged["p"] == [2, 4] and merged["m"] == 1.5
    means = merge_batches([{"t": torch.tensor(1.0), "a": np.float32(2.0)}, {"t": torch.tensor(3.0), "a": np.array(4.0)}])
    assert means == {"t": 2.0, "a": 3.0}  # a rollout's mean as a 0-d tensor or array is a number


def test_prompts_split_between_rollouts_by_their_first_dimension_or_are_refused() -> None:
    assert [p.tolist() for p in split_batch(np.arange(5), 2)] == [[0, 1, 2], [3, 4]]
    assert [p.tolist() for p in split_batch(torch.arange(4), 2)] == [[0, 1], [2, 3]]
    assert split_batch(("a", "b", "c"), 2) == [["a", "b"], ["c"]]
    assert split_batch(range(3), 2) == [[0, 1], [2]]
    for prompts in ({"ids": [1, 2]}, "abc", torch.tensor(3)):
        with pytest.raises(LifecycleError, match="cannot be split"):
            split_batch(prompts, 2)


def test_actor_options_ray_refuses_are_a_config_error_naming_the_role_before_any_actor_starts() -> None:
    pytest.importorskip("ray")
    from lifecycle.ray.worker_group import WorkerGroup
    from lifecycle.ray.workers import TrainerWorker, WorkerSpec

    group = WorkerGroup(call_timeout_s=5, poll_s=1, options={"critic": {"num_cpu": 1}}, on_overdue=lambda *a: None)
    specs = [(role, TrainerWorker, role, WorkerSpec(role=role, recipe=None, config={})) for role in ("actor", "critic")]
    with pytest.raises(ConfigError, match="num_cpu") as info:
        group.start(specs)
    assert info.value.key == "driver.options.critic" and group.handles == {}


def test_a_worker_failure_record_and_the_run_failed_error_carry_no_terminal_colour_codes() -> None:
    """Ray colours the worker's name in its error text; logs, the summary and the errors raised are plain text."""
    from lifecycle.ray.controller import Controller
    from lifecycle.ray.policy import FailureKind, FailurePolicy, RunFailed, WorkerFailed

    error = RuntimeError("\x1b[36mray::TrainerWorker.train()\x1b[39m (pid=7) boom")
    failed = WorkerFailed("actor", "train", 3, error, FailureKind.RAISED)
    failure, verdict = Controller(FailurePolicy(retry_raised=False))._judge(failed)
    assert failure.error == "RuntimeError: ray::TrainerWorker.train() (pid=7) boom"
    assert str(failed) == "worker actor failed in train of step 3: " + failure.error
    assert "\x1b" not in str(RunFailed(verdict.reason, failed)) and failure.error in verdict.reason


def test_a_workers_overdue_report_is_kept_for_the_driver_when_its_log_sink_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import structlog

    from lifecycle.ray.workers import OverdueInbox

    class Full:
        def warning(self, *args: object, **kwargs: object) -> None:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(structlog, "get_logger", lambda *a: Full())
    inbox = OverdueInbox("actor")
    inbox("lifecycle.phase_overdue", trigger="train_step", step=1, stacks={"main": '  File "x.py", line 1, in f\n'})
    [report] = inbox.drain()
    assert (report["worker"], report["trigger"], report["where"]) == ("actor", "train_step", 'File "x.py", line 1, in f')
