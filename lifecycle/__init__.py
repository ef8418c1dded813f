"""Trainer lifecycle: one explicit state machine per RL worker for load, train, save, sync, resume.

The Ray application lives in `lifecycle.ray` and is not imported here: `import lifecycle`
never imports Ray.
"""

from lifecycle.config import LifecycleConfig
from lifecycle.core import Lifecycle
from lifecycle.errors import CheckpointError, ConfigError, EngineError, InvalidTransition, LifecycleError
from lifecycle.machine import TABLE, State
from lifecycle.phase import DELETE, Observer, TransitionRecord
from lifecycle.types import Parts, Progress, SaveInfo
from lifecycle.version import __version__

Transition = TransitionRecord
"""The record's earlier name, kept for `from lifecycle import Transition`."""

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
    "TransitionRecord",
    "__version__",
]
