"""The Ray application under hostile input and bad timing, without a Ray cluster: the worker
group's calls run against fake handles and a fake `ray.wait` / `ray.get`, the driver's machine
against a fake job, and the workers in process."""

from __future__ import annotations

import collections
import json
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from lifecycle.errors import (
    ConfigError,
    DamagedCheckpoint,
    InvalidTransition,
    LifecycleError,
)
from lifecycle.machine import DriverState, State
from lifecycle.manifest import MANIFEST
from lifecycle.ray.controller import Controller
from lifecycle.ray.driver import Driver, DriverConfig
from lifecycle.ray.policy import (
    Decision,
    FailureKind,
    FailurePolicy,
    RunFailed,
    StandIn,
    WorkerFailed,
    raised_as,
)
from lifecycle.ray.run_report import (
    Failure,
    fingerprint,
    merge_batches,
    render_summary,
    split_batch,
)
from lifecycle.ray.settings import reachable
from lifecycle.trace import write_trace_events
from lifecycle.watchdog import WATCHDOG
from tests.ray.recipe import BigramRecipe

ray = pytest.importorskip("ray")


class _Recipe:
    roles = ("actor", "critic")


# -- a fake of the few Ray calls the worker group makes ------------------------------------------


class _Ref:
    """A call's result: computed when `ray.get` asks; `ready` False stands for one still running."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], ready: bool) -> None:
        self.fn, self.args, self.ready = fn, args, ready


class _Method:
    def __init__(self, fn: Callable[..., Any], ready: bool = True) -> None:
        self.fn, self.ready = fn, ready

    def options(self, **_: Any) -> _Method:
        return self

    def remote(self, *args: Any) -> _Ref:
        return _Ref(self.fn, args, self.ready)


class _Handle:
    """A worker as the group sees it: each attribute a method whose calls return `_Ref`s."""

    def __init__(self, **methods: Callable[..., Any] | _Method) -> None:
        for name, fn in methods.items():
            setattr(self, name, fn if isinstance(fn, _Method) else _Method(fn))


def _wait(refs: list[_Ref], num_returns: int = 1, timeout: float | None = None) -> tuple[list[_Ref], list[_Ref]]:
    ready = [ref for ref in refs if ref.ready][:num_returns]
    return ready, [ref for ref in refs if ref not in ready]


def _get(ref: _Ref) -> Any:
    return ref.fn(*ref.args)


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray, "wait", _wait)
    monkeypatch.setattr(ray, "get", _get)


@pytest.fixture
def no_local_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call that needs a Ray cluster fails instead of starting one (Ray starts one on first use)."""
    import ray._private.auto_init_hook as hook

    monkeypatch.setattr(hook, "enable_auto_connect", False)


def _group(**kwargs: Any) -> Any:
    from lifecycle.ray.worker_group import WorkerGroup

    told: list[tuple[str, dict[str, Any]]] = []
    group = WorkerGroup(call_timeout_s=5, poll_s=1, options={}, on_overdue=lambda name, r: told.append((name, r)),
                        **kwargs)
    group.told = told  # type: ignore[attr-defined]
    return group


def _dead(*_: Any) -> Any:
    raise ray.exceptions.RayActorError()


# -- 1: a recovery lets the trainers' async saves in flight commit before it kills them ---------


def test_a_trainers_async_save_in_flight_commits_before_the_worker_reports_it_settled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from backends.hf import HFBackend
    from lifecycle.ray.workers import TrainerWorker, WorkerSpec

    real = HFBackend.save_model
    release = threading.Event()

    def slow(backend: Any, model: Any, folder: Path) -> None:
        release.wait(30)  # held until the test has seen the save in flight
        real(backend, model, folder)

    monkeypatch.setattr(HFBackend, "save_model", slow)
    config = {"checkpoint": {"root": str(tmp_path), "roles": ["actor"], "save": {"async": True}},
              "engine": {"backend": "naive"}}
    worker = TrainerWorker(WorkerSpec(role="actor", recipe=BigramRecipe(roles=("actor",)), config=config))
    try:
        assert worker.settle_saves(5.0) is None, "no save in flight"
        worker.start()
        worker.save(1)
        early = worker.settle_saves(0.01)
        assert early is not None and (early["step"], early["committed"]) == (1, False)
        release.set()
        settled = worker.settle_saves(30.0)
        assert settled is not None and (settled["step"], settled["committed"]) == (1, True)
        assert (tmp_path / "global_step_1" / "actor" / MANIFEST).is_file()
    finally:
        release.set()
        worker.close()
        WATCHDOG.backstop_s = None


def test_the_group_waits_for_each_live_workers_save_and_skips_the_dead(fake_ray: None) -> None:
    group = _group()
    asked: list[float] = []

    def committing(timeout_s: float) -> dict[str, Any]:
        """In flight when asked with no time to wait; committed within the grace period."""
        asked.append(timeout_s)
        return {"step": 4, "committed": timeout_s > 0, "waited_s": min(timeout_s, 0.2)}

    group.handles = {"actor": _Handle(settle_saves=committing), "critic": _Handle(settle_saves=_dead),
                     "rollout0": _Handle(settle_saves=lambda t: None),
                     "stuck": _Handle(settle_saves=_Method(committing, ready=False))}
    with capture_logs() as logs:
        group.settle_saves(7.0)
    assert asked == [0.0, 7.0], "asked which save is in flight, then waited for that one only"
    settled = [(r["event"], r["worker"]) for r in logs]
    assert settled == [("driver.save_settled", "actor"), ("driver.save_unsettled", "stuck")]
    asked.clear()
    with capture_logs() as logs:
        group.settle_saves(7.0, skip=["actor", "stuck"])
    assert asked == [] and logs == [], "the workers skipped are not asked"


def test_a_driver_stopping_its_group_lets_saves_settle_and_reads_overdue_reports_first() -> None:
    calls: list[str] = []

    class Group:
        def __init__(self) -> None:
            self.handles = {"actor": object(), "rollout0": object()}

        def settle_saves(self, timeout_s: float, skip: Sequence[str] = ()) -> None:
            calls.append(f"settle {timeout_s:g} skip {','.join(skip)}")
            raise RuntimeError("Ray went away")

        def drain_overdue(self, names: list[str]) -> None:
            calls.append(f"overdue {','.join(names)}")

        def stop(self) -> None:
            calls.append("stop")

    driver = Driver(_Recipe(), {}, DriverConfig(steps=1, save_grace_s=9))
    driver.group = Group()  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="went away"):
        driver._stop_group()
    assert calls == ["settle 9 skip ", "overdue actor,rollout0", "stop"], "stopped whatever the settling raised"
    calls.clear()
    driver.stopping_for = Failure(step=3, phase="train", worker="actor", error="stuck", incarnation=0,
                                  kind=FailureKind.TIMED_OUT.value)
    with pytest.raises(RuntimeError, match="went away"):
        driver._stop_group()
    assert calls[0] == "settle 9 skip actor", "a worker that hung in its call is not waited on again"


def test_the_save_grace_setting_is_checked_naming_its_key() -> None:
    assert DriverConfig(steps=1).save_grace_s == 120.0 and DriverConfig(steps=1, save_grace_s=0).save_grace_s == 0
    for bad in (-1, float("inf"), "5", True):
        with pytest.raises(ConfigError) as info:
            DriverConfig(steps=1, save_grace_s=bad)  # type: ignore[arg-type]
        assert info.value.key == "driver.save_grace_s"


# -- 2: an address Ray would retry for minutes ---------------------------------------------------


@pytest.mark.parametrize("address", ["127.0.0.1:6379 ", " 127.0.0.1:6379", "127.0.0.1 :6379", "10.0.0.1:\t6379"])
def test_an_address_with_whitespace_is_refused_naming_driver_address(address: str) -> None:
    with pytest.raises(ConfigError) as info:
        DriverConfig(steps=1, address=address)
    assert info.value.key == "driver.address"
    with pytest.raises(ConfigError) as info:
        reachable(address)
    assert info.value.key == "driver.address"


@pytest.mark.parametrize("address", ["127.0.0.1:abc", "127.0.0.1:", ":6379", "127.0.0.1:99999", "127.0.0.1:0",
                                     "127.0.0.1:\u00b2", "127.0.0.1", "ray://127.0.0.1", "ray://:10001"])
def test_an_address_reachable_cannot_parse_is_refused_at_once(address: str) -> None:
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        reachable(address)
    assert info.value.key == "driver.address" and time.monotonic() - started < 2


def test_auto_and_local_addresses_are_left_to_ray() -> None:
    reachable("auto")
    reachable("local")


# -- 3: a worker's error reaches the policy as itself --------------------------------------------


class _RecipeError(ConfigError):
    def __init__(self, message: str) -> None:
        super().__init__("recipe.vocab", message)


class _Refused(InvalidTransition):
    def __init__(self) -> None:
        super().__init__("save", State.READY, ["close"], "actor")


class _Short(DamagedCheckpoint):
    def __init__(self, step: int) -> None:
        super().__init__(f"step {step} is short", [f"step {step}"])


class _TwoArguments(Exception):
    def __init__(self, step: int, reason: str) -> None:
        super().__init__(f"step {step}: {reason}")


@pytest.mark.parametrize("error", [_RecipeError("vocab must be > 0"), _Refused(), _Short(3)],
                         ids=lambda e: type(e).__name__)
def test_a_lifecycle_error_subclass_with_its_own_init_pickles_as_itself(error: LifecycleError) -> None:
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error) and vars(back) == vars(error)


def test_a_worker_methods_error_leaves_the_worker_as_one_the_driver_can_unpickle() -> None:
    from lifecycle.ray.worker_group import deferred

    class Worker:
        def __init__(self, spec: Any) -> None:
            if spec == "bad":
                raise _TwoArguments(0, "bad vocab")

        def train(self, error: BaseException) -> None:
            raise error

    built = deferred(Worker)(None)
    built.build()
    for call, said in [(lambda: deferred(Worker)("bad").build(), "step 0: bad vocab"),
                       (lambda: built.train(_TwoArguments(3, "nan loss")), "step 3: nan loss")]:
        with pytest.raises(Exception) as info:
            call()
        back = pickle.loads(pickle.dumps(info.value))
        assert str(back) == said and raised_as(back) == "_TwoArguments"
    with pytest.raises(_RecipeError):
        built.train(_RecipeError("bad"))  # an error that crosses as itself is raised as itself


def test_an_error_the_driver_cannot_unpickle_is_recorded_by_its_original_text_and_retried(fake_ray: None) -> None:
    from ray.exceptions import UnserializableException

    original = ('ray.exceptions.RayTaskError: ray::TrainerWorker.build() (pid=7, ip=1.2.3.4)\n  File "x.py", '
                'line 6, in build\n    raise E(1, 2)\nNanLoss: step 3: loss is nan\n')
    failed = _group()._failure(UnserializableException(original), "critic", [], {})
    assert failed.kind is FailureKind.RAISED and isinstance(failed.error, StandIn)
    assert (failed.cause_type, str(failed.error)) == ("NanLoss", "step 3: loss is nan")
    assert "NanLoss: step 3: loss is nan" in str(failed)
    assert FailurePolicy().decide(failed, 1).decision is Decision.RETRY
    assert FailurePolicy(retry_raised=False).decide(failed, 1).decision is Decision.GIVE_UP


# -- 4: a phase overdue that ended before the driver's first poll --------------------------------


def test_an_overdue_report_of_a_call_that_ended_before_the_first_poll_is_collected(fake_ray: None) -> None:
    inbox = [{"trigger": "train_step", "step": 1, "elapsed_s": 0.3, "budget_s": 0.3}]
    group = _group(overdue_after_s=0.0)
    group.handles = {"actor": _Handle(overdue_reports=lambda: [inbox.pop()] if inbox else [],
                                      train=lambda step: {"loss": 1.0})}
    assert group.gather([("actor", group["actor"].train.remote(1))]) == [{"loss": 1.0}]
    assert group.told == [("actor", {"trigger": "train_step", "step": 1, "elapsed_s": 0.3, "budget_s": 0.3})]


def test_a_call_shorter_than_every_watchdog_budget_asks_for_no_overdue_reports(fake_ray: None) -> None:
    asked: list[str] = []
    group = _group(overdue_after_s=60.0)
    group.handles = {"actor": _Handle(overdue_reports=lambda: asked.append("asked") or [], train=lambda step: 1)}
    assert group.gather([("actor", group["actor"].train.remote(1))]) == [1]
    assert asked == []
    assert Driver(_Recipe(), {"watchdog": {"train_step_s": 0.3}}, DriverConfig(steps=1)).group.overdue_after_s == 0.3
    assert Driver(_Recipe(), {"watchdog": {"sync_weights_s": None, "receive_weights_s": None}},
                  DriverConfig(steps=1)).group.overdue_after_s is None


# -- 5: numpy counts and values that are not JSON ------------------------------------------------


def test_the_driver_config_keeps_numpy_counts_as_python_ints() -> None:
    config = DriverConfig(steps=np.int64(4), save_every=np.int32(2), rollouts=np.int64(2), max_failures=np.int64(1),
                          threads=np.int16(2), num_cpus=np.uint8(3))
    for key in ("steps", "save_every", "rollouts", "max_failures", "threads", "num_cpus"):
        assert type(getattr(config, key)) is int, key
    assert type(config.policy.max_failures) is int


def test_a_run_with_numpy_steps_writes_its_trace(tmp_path: Path) -> None:
    class NoRay(Driver):
        def _start_group(self) -> int:
            return 0

        def _run_step(self, step: int) -> None:
            with self._in("train", step):
                pass

        def _close_group(self) -> None:
            pass

        def _stop_group(self) -> None:
            pass

    summary = NoRay(_Recipe(), {}, DriverConfig(steps=np.int64(2), work_dir=str(tmp_path))).run()
    assert summary.trace == tmp_path / "trace.json" and summary.trace.is_file()


def test_a_trace_event_holding_a_value_json_cannot_encode_is_written_anyway(tmp_path: Path) -> None:
    events = [{"ph": "X", "name": "x", "args": {"step": np.int64(3), "loss": np.float32(0.5), "state": State.READY,
                                               "odd": object(), "big": np.zeros(10**6)}}]
    written = json.loads(write_trace_events(events, tmp_path / "t.json").read_text())["traceEvents"]
    args = written[0]["args"]
    assert (args["step"], args["loss"], args["state"]) == (3, 0.5, "READY") and "object" in args["odd"]
    assert isinstance(args["big"], str) and len(args["big"]) < 300, "a large array is quoted, bounded"


# -- 6, 7: fingerprints, splits and joins --------------------------------------------------------


def test_fingerprints_differ_for_prompts_that_differ_in_one_element() -> None:
    a = np.arange(2000).reshape(100, 20)
    b = a.copy()
    b[50, 10] = -1
    ta, tb = torch.as_tensor(a), torch.as_tensor(b)
    for left, right in [(a, b), ({"input_ids": ta}, {"input_ids": tb}), ([ta], [tb]), ((ta, 1), (tb, 1)),
                        (ta, tb), (ta.to(torch.bfloat16), tb.to(torch.bfloat16)), ([10 ** 5000], [10 ** 5000 + 1]),
                        (a.astype(np.int32), a.astype(np.int64))]:
        assert fingerprint(left) != fingerprint(right), (type(left), type(right))


def test_fingerprints_are_equal_for_equal_prompts_of_any_kind() -> None:
    def prompts() -> list[Any]:
        ids = torch.arange(12).reshape(3, 4)
        return [ids, ids.T, ids.to(torch.bfloat16), ids.float().to(torch.float8_e4m3fn), ids.numpy(), {"ids": ids, "n": 3},
                [ids, "text", None, 2.5], np.array(["a", "bc"]), np.array([{"x": 1}], dtype=object), np.int64(3),
                torch.tensor(7), 10 ** 5000]

    for left, right in zip(prompts(), prompts()):
        assert fingerprint(left) == fingerprint(right), type(left)
    assert fingerprint({"a": 1, "b": 2}) == fingerprint({"b": 2, "a": 1}), "a dict's order is no part of its data"
    nested: list[Any] = []
    nested.append(nested)
    assert fingerprint(nested) == fingerprint(nested), "a list holding itself is fingerprinted, not recursed forever"


def test_an_empty_or_any_sequence_of_prompts_is_split_without_a_raw_error() -> None:
    assert split_batch([], 2) == [[]]
    assert split_batch(collections.deque([1, 2, 3]), 2) == [[1, 2], [3]]
    assert [p.tolist() for p in split_batch(torch.zeros(0, 3), 2)] == [[]]


@pytest.mark.parametrize("values", [
    [np.array(["2020-01-01"], dtype="datetime64[D]"), np.array([1.0])],
    [np.array(["a"]), np.array([1])],
    [10 ** 400, 1],
], ids=["datetime64-float", "str-int", "huge-int"])
def test_batch_values_that_cannot_join_are_a_lifecycle_error_naming_the_key(values: list[Any]) -> None:
    with pytest.raises(LifecycleError, match="batch key 'x'"):
        merge_batches([{"x": value} for value in values], ["rollout0", "rollout1"])


# -- 8: what Ray refuses as the actors start -----------------------------------------------------


def test_a_ray_actor_name_given_to_a_role_of_several_workers_is_refused_naming_the_role() -> None:
    with pytest.raises(ConfigError) as info:
        Driver(_Recipe(), {}, DriverConfig(steps=1, rollouts=2, options={"rollout": {"name": "gen"}}))
    assert info.value.key == "driver.options.rollout" and "name" in str(info.value)
    Driver(_Recipe(), {}, DriverConfig(steps=1, rollouts=1, options={"rollout": {"name": "gen"}}))


def test_a_recipe_that_cannot_be_pickled_is_refused_before_any_actor_starts(no_local_ray: None) -> None:
    from lifecycle.ray.workers import TrainerWorker, WorkerSpec

    class Locked:
        roles = ("actor", "critic")

        def __init__(self) -> None:
            self.lock = threading.Lock()

    group = _group()
    specs = [(role, TrainerWorker, role, WorkerSpec(role=role, recipe=Locked(), config={}))
             for role in ("actor", "critic")]
    with pytest.raises(ConfigError, match="lock") as info:
        group.start(specs)
    assert info.value.key == "recipe" and group.handles == {}


def test_actor_options_ray_refuses_at_creation_are_a_config_error_naming_the_role(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.exceptions import ActorAlreadyExistsError

    from lifecycle.ray.workers import RolloutWorker, WorkerSpec

    class Actor:
        def options(self, **_: Any) -> Actor:
            return self

        def remote(self, spec: Any) -> Any:
            if spec.index == 1:
                raise ActorAlreadyExistsError("The name gen (namespace=None) is already taken.")
            return object()

    monkeypatch.setattr(ray, "remote", lambda **_: lambda cls: Actor())
    group = _group()
    specs = [(f"rollout{i}", RolloutWorker, "rollout", WorkerSpec(role="rollout", recipe=_Recipe(), config={},
                                                                   index=i)) for i in range(2)]
    with pytest.raises(ConfigError, match="already taken") as info:
        group.start(specs)
    assert info.value.key == "driver.options.rollout" and list(group.handles) == ["rollout0"], "kept, to be stopped"


# -- 9: kill and call by a name the group does not have ------------------------------------------


def test_kill_and_call_before_the_group_is_up_say_no_group_is_running() -> None:
    driver = Driver(_Recipe(), {}, DriverConfig(steps=1))
    for attempt in (lambda: driver.kill("actor"), lambda: driver.call("actor", "state")):
        with pytest.raises(LifecycleError, match="no worker group is running"):
            attempt()


def test_kill_and_call_of_an_unknown_worker_or_method_name_it_and_the_workers() -> None:
    driver = Driver(_Recipe(), {}, DriverConfig(steps=1))
    driver.group.handles = {"actor": _Handle(state=lambda: "READY"), "rollout0": _Handle()}
    driver.group.pids = {"actor": 1, "rollout0": 2}
    with pytest.raises(LifecycleError, match=r"no worker 'rollout7'.*actor, rollout0"):
        driver.kill("rollout7")
    with pytest.raises(LifecycleError, match=r"no worker 'critic'.*actor, rollout0"):
        driver.call("critic", "state")
    with pytest.raises(LifecycleError, match=r"worker 'actor' has no method 'nope'"):
        driver.call("actor", "nope")


# -- 10, 11: the run report after a failed restart -----------------------------------------------


def _death(step: int, worker: str, phase: str = "train") -> WorkerFailed:
    return WorkerFailed(worker, phase, step, RuntimeError("ActorDiedError: the actor died"), FailureKind.DIED)


class _Job(Controller):
    """Saves every 2 steps; `plan` maps (where, incarnation, step or saved step) to a failure raised there once."""

    def __init__(self, plan: dict[tuple[str, int, int], WorkerFailed], max_failures: int) -> None:
        super().__init__(FailurePolicy(max_failures=max_failures))
        self.plan, self.saved = dict(plan), 0

    def _fail(self, where: str, step: int) -> None:
        failure = self.plan.pop((where, self.incarnation, step), None)
        if failure is not None:
            raise failure

    def _start_group(self) -> int:
        self._fail("start", self.saved)
        return self.saved

    def _run_step(self, step: int) -> None:
        self._fail("step", step)
        if step % 2 == 0:
            self.saved = step

    def _close_group(self) -> None:
        pass

    def _stop_group(self) -> None:
        pass


def test_a_failure_whose_restart_failed_and_was_retried_is_reported_resumed_not_given_up() -> None:
    job = _Job({("step", 0, 3): _death(3, "actor"), ("start", 1, 2): _death(3, "rollout0", "recover")}, 3)
    job._control(5)
    assert job.state is DriverState.FINISHED
    assert [(f.worker, f.resumed_at) for f in job.summary.failures] == [("actor", 2), ("rollout0", 2)]
    assert all(f.recovery_s > 0 for f in job.summary.failures)
    table = render_summary(job.summary, "actor/reward")
    assert "gave up" not in table and table.count("resumed") == 2


def test_only_the_failure_the_policy_gave_up_on_is_reported_gave_up() -> None:
    job = _Job({("step", 0, 3): _death(3, "actor"), ("start", 1, 2): _death(3, "rollout0", "recover")}, 1)
    with pytest.raises(RunFailed):
        job._control(5)
    first, last = job.summary.failures
    assert (first.gave_up, last.gave_up) == (False, True) and first.resumed_at is None
    table = render_summary(job.summary, "actor/reward")
    assert table.count("gave up") == 1 and "not resumed" in table


def test_a_resume_at_the_step_that_failed_logs_no_negative_lost_steps() -> None:
    driver = Driver(_Recipe(), {}, DriverConfig(steps=2))
    with capture_logs() as logs:
        driver._on_resume(Failure(step=2, phase="close", worker="critic", error="died", incarnation=0, resumed_at=2))
    [resumed] = [r for r in logs if r["event"] == "driver.resumed"]
    assert resumed["lost_steps"] == 0
