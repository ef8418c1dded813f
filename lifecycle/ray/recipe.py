"""What a worker is built from: the `Recipe` (the RL algorithm, one picklable object shipped to
every worker) and the `WorkerSpec` that carries it, with the worker's config, to its process.
`lifecycle.ray.workers` builds the workers from them."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from lifecycle.errors import ConfigError, shorten
from lifecycle.types import Parts

ROLLOUT = "rollout"


class Recipe(Protocol):
    """An RL algorithm as the workers see it; every method runs inside one worker process."""

    roles: Sequence[str]
    """Trainer roles; the first is the policy whose weights the rollouts serve."""

    def build(self, role: str) -> Parts:
        """Fresh objects for a trainer role, or the model of a rollout (role `rollout`)."""

    def prompts(self, parts: Parts, step: int) -> Any:
        """On the policy trainer: the prompts of `step`, drawn from `parts.dataloader`."""

    def generate(self, model: Any, prompts: Any, step: int) -> dict[str, Any]:
        """On a rollout: responses (and rewards) for `prompts`, from the rollout's own weights."""

    def score(self, role: str, parts: Parts, batch: Mapping[str, Any]) -> dict[str, Any]:
        """On every trainer, before any update: what the others need (values, old log-probs)."""

    def update(self, role: str, parts: Parts, batch: Mapping[str, Any], step: int) -> dict[str, float]:
        """One training step of `role` on `batch`, inside the lifecycle's train_step phase."""


@dataclass(kw_only=True, slots=True)
class WorkerSpec:
    """Everything a worker process needs to build itself, picklable."""

    role: str
    """A trainer role of the recipe, or `rollout`."""
    recipe: Any
    """The `Recipe`."""
    config: dict[str, Any]
    """The worker's `LifecycleConfig`, as a plain dict."""
    incarnation: int = 0
    """How many times the worker group was rebuilt before this worker: names its files."""
    index: int = 0
    """Which rollout this is (0 for trainers)."""
    log_dir: str | None = None
    """JSON-lines log file folder for this worker; None leaves logging as the process has it."""
    trace_dir: str | None = None
    """Folder for this worker's trace events (`{file_stem}.jsonl`, one appended per event); None: no file."""
    threads: int | None = None
    """torch intra-op threads; None keeps what the process has (Ray sets OMP_NUM_THREADS)."""

    @property
    def name(self) -> str:
        suffix = f"{self.index}" if self.role == ROLLOUT else ""
        return f"{self.role}{suffix}"

    @property
    def file_stem(self) -> str:
        return f"{self.name}-{self.incarnation}-pid{os.getpid()}"


def built(recipe: Any, role: str) -> Parts:
    """`recipe.build(role)`; anything but `Parts` is a `ConfigError`: a rebuilt group would get the same."""
    parts = recipe.build(role)
    if not isinstance(parts, Parts):
        raise ConfigError("recipe.build", f"build({role!r}) returned {shorten(parts)} ({type(parts).__name__}), "
                                          "not a lifecycle.types.Parts")
    return parts


__all__ = ["ROLLOUT", "Recipe", "WorkerSpec", "built"]
