"""`RoleRank`: the one rank of one role that a saver and a resumer work as."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lifecycle.config import LifecycleConfig
from lifecycle.store import CheckpointStore


@dataclass(frozen=True, slots=True, kw_only=True)
class RoleRank:
    """Who saves or resumes: the config, the store, the role and this rank's place among its peers."""

    config: LifecycleConfig
    store: Callable[[], CheckpointStore]
    """The role's store, built on first use (`ConfigError` without `checkpoint.root`)."""
    role: str
    roles: list[str]
    """Every role a step must hold to be complete, this one included."""
    rank: int
    world_size: int
    collective: Callable[[], bool]
    """Whether the ranks agree through the process group (asked when needed: it may be set up late)."""
