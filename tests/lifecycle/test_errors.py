"""The library's errors cross process boundaries whole (a Ray driver reads a worker's error by type)."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil
import warnings
from collections.abc import Iterator
from types import ModuleType

import pytest

import backends
import lifecycle
from lifecycle.errors import (
    CheckpointError,
    ConfigError,
    DamagedCheckpoint,
    EngineError,
    InvalidTransition,
    LifecycleError,
)
from lifecycle.machine import State
from lifecycle.ray.policy import FailureKind, WorkerFailed


@pytest.mark.parametrize("error", [
    ConfigError("engine.backend", "unknown backend 'x'"), ConfigError("", "no key"),
    InvalidTransition("save", State.READY, ["close"], "actor"), DamagedCheckpoint("step 3 is short", ["a", "b"]),
    CheckpointError("disk full"), EngineError("peer lost"),
], ids=lambda e: type(e).__name__)
def test_each_error_pickles_with_its_message_and_fields(error: Exception) -> None:
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error) and vars(back) == vars(error)


def _every_module(*packages: ModuleType) -> Iterator[str]:
    """Every module of `packages` but entry points (`__main__` runs the CLI) and the framework
    integrations (importing one registers it with its framework, which may not be installed)."""
    for package in packages:
        for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if not module.name.endswith(".__main__") and ".integrations" not in module.name:
                yield module.name


def _subclasses(cls: type[LifecycleError]) -> set[type[LifecycleError]]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub, *_subclasses(sub)}
    return found


def _every_lifecycle_error() -> list[type[LifecycleError]]:
    """Every subclass of `LifecycleError` in the modules that import here (one whose optional
    dependency is missing cannot define one anyone meets)."""
    modules = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # old module paths and backends without their accelerators warn
        for name in _every_module(lifecycle, backends):
            try:
                importlib.import_module(name)
            except ImportError:
                continue
            modules.add(name)
    ours = {cls for cls in _subclasses(LifecycleError) if cls.__module__ in modules}  # not tests' own
    return sorted(ours | {LifecycleError}, key=lambda cls: cls.__qualname__)


_DIED = WorkerFailed("actor", "train", 3, RuntimeError("ActorDiedError"), FailureKind.DIED)
SAMPLES: dict[str, object] = {
    "message": "step 3 is short", "key": "engine.backend", "trigger": "save", "state": State.READY,
    "allowed": ["close"], "role": "actor", "problems": ["a.safetensors is short"], "where": "optimizer",
    "value": object(), "worker": "rollout1", "phase": "sync", "step": 3, "cause": ConnectionError("peer lost"),
    "kind": FailureKind.RAISED, "error": ConfigError("engine.backend", "unknown backend 'x'"), "failure": _DIED,
}
"""A representative argument per `__init__` parameter name of the library's errors."""


def _build(cls: type[LifecycleError]) -> LifecycleError:
    """`cls` with a representative value for each parameter its `__init__` names."""
    if cls.__init__ is BaseException.__init__:  # type: ignore[comparison-overlap]
        return cls(SAMPLES["message"])
    args: list[object] = []
    for name, param in list(inspect.signature(cls.__init__).parameters.items())[1:]:
        if param.kind is not param.POSITIONAL_OR_KEYWORD:
            continue
        if name not in SAMPLES:
            assert param.default is not param.empty, f"add a representative {name!r} (of {cls.__qualname__}) to SAMPLES"
            break
        args.append(SAMPLES[name])
    return cls(*args)


def _same(a: object, b: object) -> bool:
    """Equal, with exceptions (which compare by identity) compared by type, message and fields."""
    if isinstance(a, BaseException):
        return type(a) is type(b) and str(a) == str(b) and _same(vars(a), vars(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


@pytest.mark.parametrize("cls", _every_lifecycle_error(), ids=lambda cls: cls.__qualname__)
def test_every_lifecycle_error_of_the_package_pickles_with_its_fields(cls: type[LifecycleError]) -> None:
    error = _build(cls)
    back = pickle.loads(pickle.dumps(error))
    assert _same(back, error), f"{cls.__qualname__}: {vars(back)} != {vars(error)}"
