"""The Ray driver's own checks, without Ray: its settings, a recipe's roles, and a run's cleanup."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from lifecycle.errors import ConfigError
from lifecycle.ray.driver import Driver, DriverConfig
from lifecycle.ray.policy import RunFailed
from lifecycle.ray.run_report import merge_traces


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
