"""Whether the driver rebuilds its worker group after a failure or gives up: `FailurePolicy`.

Policy apart from mechanism, as in Ray Train v2's `failure_handling`: the worker group says
what failed and how (a `WorkerFailed` with its `FailureKind`), the policy decides, and the
driver's machine carries the decision out (`recover` or `give_up`). Nothing here imports
Ray: the worker group classifies Ray's exceptions before the policy sees them.
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass, field
from enum import Enum

from lifecycle.errors import ConfigError, LifecycleError, shorten
from lifecycle.records import message
from lifecycle.types import is_count


class FailureKind(str, Enum):
    """How a worker failed, as far as a restart is concerned."""

    DIED = "died"
    """Its process is gone (Ray's `RayActorError`, a crashed worker): a rebuilt group replaces it."""
    TIMED_OUT = "timed_out"
    """It gave no answer within `call_timeout_s`: a rebuilt group replaces it."""
    RAISED = "raised"
    """Its call raised: `WorkerFailed.error` is the worker's own exception, which decides."""


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def plain(text: str) -> str:
    """`text` without the terminal colour codes Ray writes into a remote traceback's header."""
    return _ANSI.sub("", text)


class WorkerFailed(LifecycleError):
    """A worker died or one of its calls failed; names the worker, the driver's loop phase and the step.

    `cause` is the exception the driver saw (Ray's); `error` the worker's own exception when
    its call raised one (unwrapped from Ray's `RayTaskError`), else `cause`.
    """

    def __init__(self, worker: str, phase: str, step: int, cause: BaseException,
                 kind: FailureKind = FailureKind.RAISED, error: BaseException | None = None,
                 cause_type: str | None = None) -> None:
        """`cause_type`: the type name `cause` was raised as, when it crossed a process boundary
        as another (`portable`)."""
        self.worker, self.phase, self.step, self.cause, self.kind = worker, phase, step, cause, kind
        self.error = cause if error is None else error
        self.cause_type = cause_type or raised_as(cause)
        super().__init__(f"worker {worker} failed in {phase} of step {step}: {self.cause_type}: "
                         f"{plain(message(cause))}")

    def __reduce__(self) -> tuple[object, ...]:
        cause = portable(self.cause)
        return type(self), (self.worker, self.phase, self.step, cause, self.kind,
                            cause if self.error is self.cause else portable(self.error), self.cause_type)


class StandIn(LifecycleError):
    """An exception that cannot cross a process boundary (its class takes other arguments, or it
    holds a lock), as its type name and message: what a `WorkerFailed` or `RunFailed` carries in
    its place when pickled."""

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        """The type name of the exception it stands for (its message is its own)."""
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        return type(self), (self.kind, str(self))


def portable(error: BaseException | None) -> BaseException | None:
    """`error` itself when it survives pickling and unpickling; else the same error as its
    nearest class that does (a `ConfigError` subclass whose `__init__` takes other arguments
    crosses as a `ConfigError`, which a `FailurePolicy`'s `fatal` still recognises); else its
    `StandIn`."""
    if error is None or _crosses(error):
        return error
    for cls in type(error).__mro__[1:]:
        if not (isinstance(cls, type) and issubclass(cls, BaseException)) or cls is BaseException:
            break
        try:
            twin = cls.__new__(cls)
            twin.args = error.args
            twin.__dict__.update(getattr(error, "__dict__", {}))
            twin.__dict__[_RAISED_AS] = raised_as(error)
        except Exception:  # noqa: BLE001 - a class that cannot be built so: try its base
            continue
        if _crosses(twin):
            return twin
    return StandIn(raised_as(error), message(error))


_RAISED_AS = "_lifecycle_raised_as"
"""The attribute in which a `portable` twin keeps the type name of the error it stands for."""


def raised_as(error: BaseException) -> str:
    """The type name an error was raised as (a `StandIn`'s or a `portable` twin's, the one it stands for)."""
    if isinstance(error, StandIn):
        return error.kind
    return str(getattr(error, "__dict__", {}).get(_RAISED_AS, type(error).__name__))


def _crosses(error: BaseException) -> bool:
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any way it fails, it does not cross
        return False
    return True


class Decision(str, Enum):
    RETRY = "retry"
    GIVE_UP = "give_up"


@dataclass(frozen=True, slots=True)
class Verdict:
    """The policy's answer, with the reason the driver logs and raises."""

    decision: Decision
    reason: str


class RunFailed(LifecycleError):
    """The driver gave up: the `FailurePolicy` refused to restart after `failure` (or the driver
    itself failed, with no worker at fault: then `failure` is None)."""

    def __init__(self, message: str, failure: WorkerFailed | None = None) -> None:
        self.failure = failure
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        return type(self), (str(self), self.failure)


@dataclass(kw_only=True, slots=True, frozen=True)
class FailurePolicy:
    """Restart or give up, from the failure and how many the run has seen.

    A worker that died or timed out is always worth a restart while the count allows it; an
    exception a worker raised is retried too (a transport error, a peer lost mid-sync), unless
    it is one no restart can mend (`fatal`: a bad config fails the same way in every group).
    Subclass and override `retryable` for rules of your own.
    """

    max_failures: int = 3
    """Restarts allowed in one run; the failure after them gives up."""
    fatal: tuple[type[BaseException], ...] = field(default=(ConfigError,))
    """Exceptions raised by a worker that give up at once, without a restart."""
    retry_raised: bool = True
    """Whether any other exception a worker raised is retried; False gives up on all of them."""

    def __post_init__(self) -> None:
        if not is_count(self.max_failures, 0):
            raise ConfigError("failure_policy.max_failures", f"must be an integer >= 0, got {self.max_failures!r}")
        fatal = (self.fatal,) if isinstance(self.fatal, type) else self.fatal
        if not isinstance(fatal, (tuple, list, frozenset, set)):
            raise ConfigError("failure_policy.fatal", f"takes a tuple of exception classes, got {shorten(fatal)}")
        bad = [t for t in fatal if not (isinstance(t, type) and issubclass(t, BaseException))]
        if bad:
            raise ConfigError("failure_policy.fatal", f"takes exception classes, got {shorten(bad)}")
        object.__setattr__(self, "fatal", tuple(fatal))  # frozen: isinstance() takes a tuple, not a list
        if not isinstance(self.retry_raised, bool):
            raise ConfigError("failure_policy.retry_raised", f"must be true or false, got {shorten(self.retry_raised)}")

    def retryable(self, failure: WorkerFailed) -> bool:
        """Whether a rebuilt group could get past `failure` at all (the count aside)."""
        if failure.kind is not FailureKind.RAISED:
            return True
        return not isinstance(failure.error, self.fatal) and self.retry_raised

    def decide(self, failure: WorkerFailed, failures: int) -> Verdict:
        """`failures`: how many the run has seen, this one included."""
        if not self.retryable(failure):
            rule = "failure_policy.fatal" if isinstance(failure.error, self.fatal) else "failure_policy.retry_raised"
            return Verdict(Decision.GIVE_UP, f"{type(failure.error).__name__} is not retryable ({rule}): {failure}")
        if failures > self.max_failures:
            return Verdict(Decision.GIVE_UP, f"giving up after {failures} failures "
                                             f"(max_failures={self.max_failures}): {failure}")
        return Verdict(Decision.RETRY, f"restart {failures} of at most {self.max_failures}: {failure}")


__all__ = ["Decision", "FailureKind", "FailurePolicy", "RunFailed", "StandIn", "Verdict", "WorkerFailed", "portable", "raised_as"]
