"""The driver's settings and the checks of what it is given: `DriverConfig`, a recipe's roles,
per-role config overrides and a Ray address (`lifecycle.ray.driver` runs the job)."""

from __future__ import annotations

import os
import re
import socket
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lifecycle.boundary import role_problem
from lifecycle.config import MAX_TIMEOUT_S
from lifecycle.config_rules import check_keywords, path_problem
from lifecycle.errors import ConfigError, shorten
from lifecycle.ray.policy import FailurePolicy
from lifecycle.ray.recipe import ROLLOUT
from lifecycle.types import is_count

MAX_THREADS = 4096
"""Most torch threads per worker process: more than any machine has cores (torch itself fails on
2**31 with a raw `ValueError`, in every worker, at each restart)."""


@dataclass(kw_only=True, slots=True)
class DriverConfig:
    """How the driver runs the job; the lifecycle config of each worker is separate."""

    steps: int
    """Train until this step (counting the steps of a run this one resumes)."""
    save_every: int = 5
    """Every trainer saves after each step divisible by this, and after the last step."""
    max_failures: int = 3
    """Restarts allowed; the failure after them gives up (`RunFailed`)."""
    failure_policy: FailurePolicy | None = None
    """Decides restart or give up; None: `FailurePolicy(max_failures=max_failures)`."""
    rollouts: int = 1
    """Rollout workers; the prompts of a step are split between them."""
    address: str | None = None
    """Ray cluster to join (`ray.init(address=...)`); None starts a local Ray for this driver."""
    num_cpus: int | None = None
    """CPUs of the local Ray; None lets Ray count them. Only without `address`."""
    work_dir: str | None = None
    """Folder for every worker's JSON logs (`logs/`) and the merged Chrome trace; None: none written."""
    threads: int | None = None
    """torch threads per worker process; None keeps Ray's OMP_NUM_THREADS."""
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Ray actor options per role (`actor`, `critic`, `rollout`), e.g. {"actor": {"num_gpus": 1}}."""
    call_timeout_s: float = 600.0
    """A worker call that takes longer counts as a failure."""
    save_grace_s: float = 120.0
    """Before the worker group is stopped (to rebuild it after a failure, or as a run ends in an
    error), how long each trainer's async save in flight gets to commit; 0 waits for none."""
    poll_s: float = 1.0
    """While it waits on workers, the driver asks them this often for phases past their watchdog budget."""
    ray_init: dict[str, Any] = field(default_factory=dict)
    """Further `ray.init` arguments (runtime_env, namespace, ...)."""

    def __new__(cls, *args: object, **kwargs: object) -> DriverConfig:  # not typing.Self (Python 3.11+)
        """A misspelt, positional or missing argument is a `ConfigError` naming `driver.<key>`,
        as a config section's is, not the generated `__init__`'s `TypeError`."""
        check_keywords(cls, "driver", args, kwargs, "give each setting by name, e.g. DriverConfig(steps=10)")
        return object.__new__(cls)

    def __getnewargs_ex__(self) -> tuple[tuple[object, ...], dict[str, object]]:
        """What pickle and `copy` pass to `__new__`: the required setting."""
        return (), {"steps": self.steps}

    def __post_init__(self) -> None:
        for key, low in (("steps", 1), ("save_every", 1), ("rollouts", 1), ("max_failures", 0)):
            value = getattr(self, key)
            if not is_count(value, low):
                raise ConfigError(f"driver.{key}", f"must be an integer >= {low}, got {shorten(value)}")
            setattr(self, key, int(value))  # a numpy integer would reach the JSON of logs and traces
        for key, positive in (("call_timeout_s", True), ("poll_s", True), ("save_grace_s", False)):
            value = getattr(self, key)  # bounded as the engines' timeouts: a wait past it overflows the clock
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and value <= MAX_TIMEOUT_S
                                               and (value > 0 if positive else value >= 0)):
                raise ConfigError(f"driver.{key}", f"must be a number of seconds {'>' if positive else '>='} 0 and "
                                                   f"<= {MAX_TIMEOUT_S:g}, got {shorten(value)}")
        if self.failure_policy is not None and not isinstance(self.failure_policy, FailurePolicy):
            raise ConfigError("driver.failure_policy", f"must be a FailurePolicy, got a "
                                                       f"{type(self.failure_policy).__name__}")
        if self.failure_policy is not None and self.failure_policy.max_failures != self.max_failures:
            raise ConfigError("driver.max_failures", f"{self.max_failures} differs from driver.failure_policy."
                                                     f"max_failures={self.failure_policy.max_failures}; the policy "
                                                     "decides, so give both the same number")
        for key, low in (("threads", 1), ("num_cpus", 0)):
            value = getattr(self, key)
            if value is not None and not is_count(value, low):
                raise ConfigError(f"driver.{key}", f"must be None or an integer >= {low}, got {shorten(value)}")
            if value is not None:
                setattr(self, key, int(value))
        if self.threads is not None and self.threads > MAX_THREADS:
            raise ConfigError("driver.threads", f"must be at most {MAX_THREADS} threads per worker, got {self.threads}")
        if self.address is not None and not (isinstance(self.address, str) and self.address.strip()):
            raise ConfigError("driver.address", f"must be None or a Ray address ('auto', 'host:port'), got "
                                                f"{shorten(self.address)}")
        if self.address is not None and any(char.isspace() for char in self.address):
            raise ConfigError("driver.address", f"{shorten(self.address)} holds whitespace, which no Ray address "
                                                "does (Ray would try to reach it for minutes)")
        if self.address is not None and not self.address.isprintable():
            raise ConfigError("driver.address", f"{shorten(self.address)} holds control characters, which no Ray "
                                                "address does")
        if self.work_dir is not None:
            path = os.fspath(self.work_dir) if isinstance(self.work_dir, (str, os.PathLike)) else None
            if not isinstance(path, str):
                raise ConfigError("driver.work_dir", f"must be None or a path, got {shorten(self.work_dir)}")
            if problem := path_problem(path):  # as checkpoint.root: every worker would fail its setup on it
                raise ConfigError("driver.work_dir", problem)
        for key in ("options", "ray_init"):
            value = getattr(self, key)
            if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
                raise ConfigError(f"driver.{key}", f"must be a dict with string keys, got {shorten(value)}")
        bad = {role: value for role, value in self.options.items() if not isinstance(value, Mapping)}
        if bad:
            raise ConfigError("driver.options", f"maps a role to its Ray actor options, e.g. {{'actor': "
                                                f"{{'num_gpus': 1}}}}; got {shorten(bad)}")
        if self.address is not None and self.num_cpus is not None:
            raise ConfigError("driver.num_cpus", "sizes a local Ray, but driver.address joins an existing cluster; "
                                                 "drop one of them")

    @property
    def policy(self) -> FailurePolicy:
        return self.failure_policy or FailurePolicy(max_failures=self.max_failures)


def trainer_roles(roles: Any) -> list[str]:
    """A recipe's trainer roles, as a list of distinct role names; `ConfigError` for a bare string
    (each letter would be a role), a name no checkpoint folder can take, a repeat, or a name the
    rollout workers go by (`rollout`, `rollout0`, ...), whose handles a trainer's would replace."""
    if isinstance(roles, (str, bytes)) or not isinstance(roles, Sequence):
        raise ConfigError("recipe.roles", f"must be a list of role names, got {shorten(roles)} "
                                          f"({type(roles).__name__})")
    roles = list(roles)
    problems = [f"{shorten(role)}: {role_problem(role) if isinstance(role, str) else 'not a string'}"
                for role in roles if not isinstance(role, str) or role_problem(role)]
    problems += [f"{role!r}: the rollout workers' name" for role in roles
                 if isinstance(role, str) and (role == ROLLOUT or re.fullmatch(f"{ROLLOUT}[0-9]+", role))]
    repeats = Counter(role for role in roles if isinstance(role, str))  # any other is refused above, hashable or not
    problems += [f"{role!r}: given twice" for role in sorted(role for role, count in repeats.items() if count > 1)]
    if not roles or problems:
        raise ConfigError("recipe.roles", "needs at least one trainer role, each a distinct role name that is not "
                          f"the rollout's: {'; '.join(problems) or 'got none'}")
    return list(roles)


CONNECT_TIMEOUT_S = 10.0
"""How long the driver tries to reach a `host:port` Ray address before refusing it (Ray itself
retries for minutes)."""


def reachable(address: str) -> None:
    """A `host:port` (or `ray://host:port`) address answers a TCP connect within
    `CONNECT_TIMEOUT_S`, else a `ConfigError`; so does an address of no form Ray takes (a port
    that is no number in 1..65535, whitespace), which Ray would try to reach for minutes.
    `auto`, `local` and another scheme's `scheme://...` (a Ray client builder's) are left to Ray."""
    scheme, sep, _ = address.partition("://")
    if address in ("auto", "local") or (sep and scheme != "ray"):
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if (not sep or not host or any(char.isspace() for char in address) or not address.isprintable()
            or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536):
        raise ConfigError("driver.address", f"{shorten(address)} is no Ray address: give 'auto', 'local', 'host:port' "
                                            "or 'ray://host:port' (a port in 1..65535, no whitespace or control "
                                            "characters)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except TimeoutError:
        raise ConfigError("driver.address", f"{shorten(address)}: nothing answered within {CONNECT_TIMEOUT_S:g} s; "
                                            "is the Ray head running there?") from None
    except (OSError, UnicodeError, ValueError) as exc:  # refused, no such host, a name IDNA cannot encode
        why = getattr(exc, "strerror", None) or f"{type(exc).__name__}: {exc}"
        raise ConfigError("driver.address", f"{shorten(address)}: cannot connect ({shorten(why, 200)}); is the Ray "
                                            "head running there?") from None


_RAY_RESTARTS = ("max_restarts", "max_task_retries")
"""Ray's own actor restarts and call retries, which the driver's recovery replaces (0 always)."""


def check_options(options: Mapping[str, Mapping[str, Any]], roles: list[str], rollouts: int) -> None:
    """`ConfigError` for actor options of a role the job does not have, Ray restarts or retries
    (`_RAY_RESTARTS`), or a Ray actor `name` given to the rollouts when there are several (one
    name names one actor: the second would fail to start)."""
    unknown = sorted(set(options) - {*roles, ROLLOUT})
    if unknown:
        raise ConfigError("driver.options", f"roles {unknown} are not in the job; roles: {[*roles, ROLLOUT]}")
    for role, given in options.items():
        restarts = {key: given[key] for key in _RAY_RESTARTS if key in given and given[key] != 0}
        if restarts:
            raise ConfigError(f"driver.options.{role}", f"{restarts}: the driver restarts workers itself (its "
                              "FailurePolicy); an actor Ray restarted would come back unbuilt and take retried calls "
                              "as if it were the worker it replaced; leave these out")
    if rollouts > 1 and options.get(ROLLOUT, {}).get("name") is not None:
        raise ConfigError(f"driver.options.{ROLLOUT}", f"'name' names one Ray actor, but the job has {rollouts} "
                                                       "rollout workers; drop it (Ray names no group of actors)")


def shortest_budget(configs: Mapping[str, Mapping[str, Any]]) -> float | None:
    """The shortest watchdog budget of any worker's config (`watchdog.<trigger>_s`), or None."""
    budgets = [value for config in configs.values() for value in config["watchdog"].values() if value is not None]
    return min(budgets, default=None)


def overrides_of(overrides: Any, roles: list[str]) -> Mapping[str, Mapping[str, Any]]:
    """`overrides` checked: None, or a mapping of the job's roles to mappings of config keys."""
    if overrides is None:
        return {}
    if not isinstance(overrides, Mapping) or not all(isinstance(value, Mapping) for value in overrides.values()):
        raise ConfigError("overrides", f"maps a role to its own config keys, e.g. {{'actor': {{'checkpoint': "
                                       f"{{'pre_load': {{'path': ...}}}}}}}}; got {shorten(overrides)}")
    unknown = sorted(map(str, set(overrides) - set(roles)))
    if unknown:
        raise ConfigError("overrides", f"roles {unknown} are not in the job; roles: {roles}")
    return overrides


_SHARED = (("checkpoint", "root"), ("checkpoint", "roles"))
"""Keys every trainer must share: one root, one list of roles, so a resume finds a step complete for all."""


def check_shared(configs: Mapping[str, Mapping[str, Any]], roles: list[str]) -> None:
    """Refuse overrides that split what the roles share (they would fail or restart from step 0 at
    every recovery, not at once): `_SHARED` between trainers, `engine.backend` between the policy
    trainer and the rollouts."""
    pairs = [(section, key, roles) for section, key in _SHARED] + [("engine", "backend", [roles[0], ROLLOUT])]
    for section, key, who in pairs:
        values = {role: configs[role][section][key] for role in who}
        if len({repr(value) for value in values.values()}) > 1:
            raise ConfigError(f"overrides.{section}.{key}", f"differs between {', '.join(who)} "
                                                            f"({shorten(values)}); they must share it: set it in "
                                                            "the config all roles take, not per role")


def merged(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `override`'s keys replacing its own, section by section."""
    out = dict(base)
    for key, value in override.items():
        out[key] = merged(base[key], value) if isinstance(value, Mapping) and isinstance(base.get(key), Mapping) \
            else value
    return out


__all__ = ["DriverConfig", "check_options", "check_shared", "merged", "overrides_of", "reachable", "shortest_budget",
           "trainer_roles"]
