"""How a worker class becomes a Ray actor class: `deferred`.

The actor builds itself in its first call, not in Ray's creation task, and every error one of
its calls raises leaves the worker as one the driver can unpickle (`policy.portable`), so the
driver's `FailurePolicy` judges the worker's own error, not a stand-in of Ray's. Ray is imported
only to test an error with Ray's own pickler.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from lifecycle.ray.policy import portable
from lifecycle.ray.workers import WorkerSpec

WATCH = "watch"
"""The concurrency group of the calls that answer while the worker is busy in a phase
(`overdue_reports`, `settle_saves`): one thread beside the worker's own."""


@functools.cache
def deferred(cls: type) -> type:
    """`cls` as a Ray actor builds it: constructed in a first call, `build()`, not in Ray's creation
    task. An error there reaches the driver as itself (a `ConfigError` ends the run, as
    `FailurePolicy.fatal` says), where one raised by the creation task kills the actor and
    reaches it as a death carrying only the error's text, which the policy retries. The pid and
    node are asked for before the build, so a build that hangs can be killed. Each public method
    raises what it raised as an error that crosses to the driver (`_crossing`)."""

    class Deferred(cls):  # type: ignore[valid-type,misc]
        def __init__(self, spec: WorkerSpec) -> None:  # the build comes later
            self._spec = spec

        @_crossing
        def build(self) -> None:
            cls.__init__(self, self._spec)

    for name, attr in inspect.getmembers(cls, inspect.isfunction):
        if not name.startswith("_"):
            setattr(Deferred, name, _crossing(attr))
    Deferred.__name__, Deferred.__qualname__ = cls.__name__, cls.__qualname__
    return Deferred


def _crossing(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method`, raising an error that would not unpickle on the driver (an application's
    exception whose `__init__` takes other arguments than it passes on) as its `portable` twin:
    its nearest class that crosses, with its message and the type name it was raised as. Ray
    would otherwise hand the driver an `UnserializableException` in its place, which no
    `FailurePolicy.fatal` class matches."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            if _crosses(exc):
                raise
            twin = portable(exc)
            if twin is exc or twin is None:
                raise
            raise twin from exc

    return call


def _crosses(error: BaseException) -> bool:
    """Whether `error` survives Ray's own pickling (cloudpickle: a class defined in a script or a
    function goes by value, where `pickle` would refuse it)."""
    try:
        from ray import cloudpickle
    except ImportError:  # a worker class used without Ray: the plain pickle test of `portable`
        return False
    try:
        cloudpickle.loads(cloudpickle.dumps(error))
    except Exception:  # noqa: BLE001 - any way it fails, it does not cross
        return False
    return True


__all__ = ["WATCH", "deferred"]
