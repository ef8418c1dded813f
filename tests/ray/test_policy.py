"""`FailurePolicy`: restart or give up, from the kind of failure, the error and the count. No Ray needed."""

from __future__ import annotations

import pickle
import threading

import pytest

from lifecycle.errors import CheckpointError, ConfigError, EngineError, InvalidTransition
from lifecycle.ray.policy import Decision, FailureKind, FailurePolicy, RunFailed, StandIn, WorkerFailed


def failed(kind: FailureKind, error: BaseException | None = None) -> WorkerFailed:
    cause = error if error is not None else RuntimeError("actor died unexpectedly")
    return WorkerFailed("actor", "train", 4, cause, kind, error)


@pytest.mark.parametrize("kind", [FailureKind.DIED, FailureKind.TIMED_OUT])
def test_a_death_or_a_timeout_is_retried_up_to_max_failures_then_given_up(kind: FailureKind) -> None:
    policy = FailurePolicy(max_failures=2)
    assert [policy.decide(failed(kind), n).decision for n in (1, 2, 3)] == [
        Decision.RETRY, Decision.RETRY, Decision.GIVE_UP]
    assert "giving up after 3 failures (max_failures=2)" in policy.decide(failed(kind), 3).reason


def test_max_failures_zero_gives_up_at_the_first_failure() -> None:
    assert FailurePolicy(max_failures=0).decide(failed(FailureKind.DIED), 1).decision is Decision.GIVE_UP


@pytest.mark.parametrize("error", [EngineError("peer lost mid-sync"), OSError("connection reset"),
                                   CheckpointError("disk full"), RuntimeError("NCCL watchdog")])
def test_an_error_a_worker_raised_is_retried_by_default(error: BaseException) -> None:
    verdict = FailurePolicy().decide(failed(FailureKind.RAISED, error), 1)
    assert verdict.decision is Decision.RETRY and "restart 1 of at most 3" in verdict.reason


def test_a_config_error_is_not_retryable_even_on_the_first_failure() -> None:
    verdict = FailurePolicy(max_failures=5).decide(failed(FailureKind.RAISED, ConfigError("engine.backend", "bad")), 1)
    assert verdict.decision is Decision.GIVE_UP
    assert "ConfigError is not retryable (failure_policy.fatal)" in verdict.reason


def test_fatal_errors_are_the_policys_to_choose_and_deaths_stay_retryable() -> None:
    policy = FailurePolicy(fatal=(ConfigError, InvalidTransition, ValueError))
    assert not policy.retryable(failed(FailureKind.RAISED, ValueError("bad batch")))
    assert policy.retryable(failed(FailureKind.RAISED, EngineError("x")))
    assert policy.retryable(failed(FailureKind.DIED, ValueError("a death whose message looks like anything")))


def test_retry_raised_false_gives_up_on_any_raised_error_but_still_restarts_a_death() -> None:
    policy = FailurePolicy(retry_raised=False)
    verdict = policy.decide(failed(FailureKind.RAISED, EngineError("x")), 1)
    assert verdict.decision is Decision.GIVE_UP and "failure_policy.retry_raised" in verdict.reason
    assert policy.decide(failed(FailureKind.DIED), 1).decision is Decision.RETRY


def test_a_subclass_decides_retryable_by_its_own_rules() -> None:
    class OnlyDeaths(FailurePolicy):
        def retryable(self, failure: WorkerFailed) -> bool:
            return failure.kind is FailureKind.DIED

    policy = OnlyDeaths()
    assert policy.decide(failed(FailureKind.TIMED_OUT), 1).decision is Decision.GIVE_UP
    assert policy.decide(failed(FailureKind.DIED), 1).decision is Decision.RETRY


@pytest.mark.parametrize(("kwargs", "key"), [({"max_failures": -1}, "failure_policy.max_failures"),
                                             ({"max_failures": 1.5}, "failure_policy.max_failures"),
                                             ({"max_failures": True}, "failure_policy.max_failures"),
                                             ({"fatal": ("ConfigError",)}, "failure_policy.fatal"),
                                             ({"fatal": None}, "failure_policy.fatal"),
                                             ({"fatal": "ConfigError"}, "failure_policy.fatal"),
                                             ({"retry_raised": "no"}, "failure_policy.retry_raised"),
                                             ({"retry_raised": 0}, "failure_policy.retry_raised")])
def test_bad_settings_are_refused_naming_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        FailurePolicy(**kwargs)
    assert info.value.key == key


def test_the_failure_keeps_the_workers_own_error_apart_from_what_the_driver_saw() -> None:
    seen = RuntimeError("RayTaskError(ConfigError): ...")
    failure = WorkerFailed("critic", "score", 2, seen, FailureKind.RAISED, ConfigError("x", "y"))
    assert failure.cause is seen and isinstance(failure.error, ConfigError)
    assert str(failure).startswith("worker critic failed in score of step 2: RuntimeError")
    assert WorkerFailed("actor", "sync", 1, seen).error is seen


def test_the_driver_config_builds_its_policy_from_max_failures_or_takes_the_one_given() -> None:
    from lifecycle.ray.driver import DriverConfig

    assert DriverConfig(steps=3, max_failures=5).policy == FailurePolicy(max_failures=5)
    rules = FailurePolicy(fatal=(ConfigError, ValueError))
    assert DriverConfig(steps=3, failure_policy=rules).policy is rules
    with pytest.raises(ConfigError, match="driver.failure_policy.max_failures=5") as info:
        DriverConfig(steps=3, max_failures=2, failure_policy=FailurePolicy(max_failures=5))
    assert info.value.key == "driver.max_failures"


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan")])
def test_the_driver_refuses_a_poll_interval_that_cannot_work(value: float) -> None:
    from lifecycle.ray.driver import DriverConfig

    with pytest.raises(ConfigError) as info:
        DriverConfig(steps=3, poll_s=value)
    assert info.value.key == "driver.poll_s"


@pytest.mark.parametrize("fatal", [[ConfigError, ValueError], ValueError, {ValueError}])
def test_fatal_given_as_a_list_a_set_or_one_class_decides_like_a_tuple(fatal: object) -> None:
    policy = FailurePolicy(fatal=fatal)  # type: ignore[arg-type]
    assert isinstance(policy.fatal, tuple) and ValueError in policy.fatal
    verdict = policy.decide(WorkerFailed("actor", "train", 1, ValueError("bad")), 1)
    assert verdict.decision is Decision.GIVE_UP and "failure_policy.fatal" in verdict.reason
    assert policy.decide(WorkerFailed("actor", "train", 1, OSError("reset")), 1).decision is Decision.RETRY


class _TwoArguments(Exception):
    def __init__(self, step: int, reason: str) -> None:
        super().__init__(f"step {step}: {reason}")


class _HoldsALock(Exception):
    def __init__(self) -> None:
        super().__init__("holds a lock")
        self.lock = threading.Lock()


class _RecipeError(ConfigError):
    def __init__(self, message: str) -> None:
        super().__init__("recipe", message)


@pytest.mark.parametrize(("cause", "crosses_as"), [(_TwoArguments(3, "nan loss"), Exception),
                                                   (_RecipeError("bad vocab"), _RecipeError),
                                                   (_HoldsALock(), StandIn)],
                         ids=["two-arguments", "config-error-subclass", "lock"])
def test_a_failure_whose_cause_cannot_be_pickled_crosses_as_its_nearest_class_that_can(
        cause: Exception, crosses_as: type) -> None:
    failed = WorkerFailed("actor", "train", 3, cause)
    for error in (failed, RunFailed("giving up", failed)):
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error)
    back = pickle.loads(pickle.dumps(failed))
    assert type(back.cause) is crosses_as and back.cause_type == type(cause).__name__
    assert str(back.cause) == str(cause) and back.error is back.cause
    policy = FailurePolicy()
    assert policy.decide(back, 1).decision is policy.decide(failed, 1).decision, "fatal still recognised"
    plain = WorkerFailed("actor", "train", 3, OSError("reset"))
    assert type(pickle.loads(pickle.dumps(plain)).cause) is OSError, "a cause that pickles stays itself"
