"""Trainer lifecycle: one explicit state machine per RL worker for load, train, save, sync, resume."""

from lifecycle.config import LifecycleConfig
from lifecycle.core import Lifecycle, Observer
from lifecycle.errors import CheckpointError, ConfigError, EngineError, InvalidTransition, LifecycleError
from lifecycle.machine import TABLE, State
from lifecycle.phase import DELETE, Transition
from lifecycle.types import Parts, Progress, SaveInfo

__version__ = "0.1.0"

__all__ = [
    "DELETE",
    "TABLE",
    "CheckpointError",
    "ConfigError",
    "EngineError",
    "InvalidTransition",
    "Lifecycle",
    "LifecycleConfig",
    "LifecycleError",
    "Observer",
    "Parts",
    "Progress",
    "SaveInfo",
    "State",
    "Transition",
    "__version__",
]
