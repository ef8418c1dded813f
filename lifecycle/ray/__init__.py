"""The Ray application: a driver that runs trainer and rollout workers as Ray actors.

It sits on top of the core (`Lifecycle`, the checkpoint store, the engines) and nothing in
the core imports it. Ray itself is imported only when a driver starts or a worker asks for
its node, so this package imports without Ray installed.

    from lifecycle.ray import Driver, DriverConfig, DriverHooks, render_summary
"""

from lifecycle.ray.driver import Driver, DriverConfig, DriverHooks
from lifecycle.ray.policy import FailureKind, FailurePolicy, RunFailed, WorkerFailed
from lifecycle.ray.run_report import Failure, Overdue, RunSummary, StepRecord, render_summary
from lifecycle.ray.workers import ROLLOUT, Recipe, RolloutWorker, TrainerWorker, WorkerSpec

__all__ = [
    "ROLLOUT",
    "Driver",
    "DriverConfig",
    "DriverHooks",
    "Failure",
    "FailureKind",
    "FailurePolicy",
    "Overdue",
    "Recipe",
    "RolloutWorker",
    "RunFailed",
    "RunSummary",
    "StepRecord",
    "TrainerWorker",
    "WorkerFailed",
    "WorkerSpec",
    "render_summary",
]
