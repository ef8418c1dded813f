"""What the worker group checks before any actor of it starts: each role's actor options against
the Ray cluster's size, and that the recipe pickles (every worker gets a copy of it).

Ray is imported inside the functions only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lifecycle.errors import ConfigError, shorten


def check_picklable(recipe: Any) -> None:
    """`ConfigError` naming the recipe unless it pickles: every worker gets a copy of it."""
    from ray import cloudpickle

    try:
        cloudpickle.dumps(recipe)
    except Exception as exc:  # noqa: BLE001 - any way it fails, no worker can get it
        raise ConfigError("recipe", f"{type(recipe).__name__} cannot be pickled, and every worker gets a copy of "
                                    f"it: {type(exc).__name__}: {shorten(str(exc), 300)}") from None


def check_feasible(role: str, options: Mapping[str, Any]) -> None:
    """`ConfigError` naming `driver.options.<role>` when one actor of it asks for more of a resource than
    the whole cluster has (an autoscaling one: at the largest its config allows, as Ray Train judges):
    Ray would never place it, and the driver would wait out `call_timeout_s` in every incarnation.
    The totals are the nodes alive now: a node lost is no longer counted (see `WorkerGroup.start`)."""
    import ray

    try:
        from ray._private.state import state
        largest = state.get_max_resources_from_cluster_config() or {}
    except Exception:  # noqa: BLE001 - a Ray whose private state API moved: the size is unknowable
        return
    asked = {"CPU": options.get("num_cpus"), "GPU": options.get("num_gpus"), "memory": options.get("memory"),
             **(options.get("resources") or {})}
    totals = ray.cluster_resources()
    for resource, amount in asked.items():
        have = max(totals.get(resource, 0), largest.get(resource, 0))
        if isinstance(amount, (int, float)) and not isinstance(amount, bool) and amount > have:
            size = "could grow to, by its autoscaler's config," if largest else "has on all its nodes"
            raise ConfigError(f"driver.options.{role}", f"one {role} actor asks for {resource}={amount:g}, more "
                              f"than the whole Ray cluster {size} ({have:g}): Ray could never start it (a cluster "
                              "that adds nodes without reporting an autoscaler config: start it with such a node)")


__all__ = ["check_feasible", "check_picklable"]
