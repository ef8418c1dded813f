"""`CheckpointEngineRegistry`: engine names to classes, imported only when asked for.

Built-in engines are listed whether or not their dependency is installed; asking for one
whose dependency is missing raises a `ConfigError` naming the package. Engines from outside
the package come in three ways: `@CheckpointEngineRegistry.register("name")` on a subclass
of `CheckpointEngine`, an import path `pkg.module:Class` as `engine.backend`, or an entry point
in the group `trainer_lifecycle.checkpoint_engines`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from lifecycle.errors import ConfigError

if TYPE_CHECKING:
    from backends.engines.base import CheckpointEngine

E = TypeVar("E", bound="type[CheckpointEngine]")

ENTRY_POINT_GROUP = "trainer_lifecycle.checkpoint_engines"
DEVICE_BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
"""What `backend: auto` picks for the device the model lives on."""
_BUILTIN: dict[str, str] = {
    "gloo": "backends.engines.gloo:GlooEngine",
    "nccl": "backends.engines.nccl:NcclEngine",
    "hccl": "backends.engines.hccl:HcclEngine",
    "shm": "backends.engines.shm:ShmEngine",
    "naive": "backends.engines.naive:NaiveEngine",
}
_KEY = "engine.backend"


class CheckpointEngineRegistry:
    """Names to checkpoint-engine classes; see the module docstring for the ways in."""

    _registered: ClassVar[dict[str, type[CheckpointEngine]]] = {}

    @classmethod
    def register(cls, name: str) -> Callable[[E], E]:
        """Class decorator: make `name` build this engine class."""

        def add(engine: E) -> E:
            engine.name = name
            cls._registered[name] = engine
            return engine

        return add

    @classmethod
    def names(cls) -> list[str]:
        """Every engine that can be asked for, installed dependency or not."""
        return cls._known(_entry_points())

    @classmethod
    def _known(cls, entry_points: dict[str, EntryPoint]) -> list[str]:
        return sorted(set(_BUILTIN) | set(cls._registered) | set(entry_points))

    @classmethod
    def _from_entry_point(cls, name: str) -> Any:
        """Scans the installed entry points once, for the engine and, if it is not there, the message."""
        found = _entry_points()
        if name not in found:
            raise ConfigError(_KEY, f"unknown checkpoint engine {name!r}; known: {', '.join(cls._known(found))}, "
                                    "or an import path 'pkg.module:Class'")
        return found[name].load()

    @classmethod
    def get(cls, name: str) -> type[CheckpointEngine]:
        """The class behind `name` (a registered name or `pkg.module:Class`), ready to run here."""
        if name in cls._registered:
            engine = cls._registered[name]
        elif name in _BUILTIN:
            engine = _load(_BUILTIN[name], name)
        elif ":" in name:
            engine = _load(name, name)
        else:
            engine = cls._from_entry_point(name)
        _check_class(engine, name)
        engine.check_available()
        return engine

    @classmethod
    def new(cls, name: str, **kwargs: Any) -> CheckpointEngine:
        """A new engine `name` built with `kwargs` (bucket_bytes, verify, timeout_s, rollout_dtype...)."""
        return cls.get(name)(**kwargs)

    @staticmethod
    def resolve(backend: str, device_type: str) -> str:
        """The engine name for `backend`, mapping `auto` from the device type."""
        if backend != "auto":
            return backend
        try:
            return DEVICE_BACKENDS[device_type]
        except KeyError:
            supported = ", ".join(f"{device} -> {name}" for device, name in DEVICE_BACKENDS.items())
            raise ConfigError(_KEY, f"backend 'auto' has no checkpoint engine for device type {device_type!r}; "
                                    f"supported device types: {supported}; or name an engine") from None


def _entry_points() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def _load(target: str, name: str) -> Any:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(_KEY, f"checkpoint engine {name!r} needs the package {exc.name or module_name!r}, "
                                f"which is not installed: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(_KEY, f"checkpoint engine {name!r}: module {module_name!r} has no {attr!r}") from None


def _check_class(engine: Any, name: str) -> None:
    from backends.engines.base import CheckpointEngine

    if not (isinstance(engine, type) and issubclass(engine, CheckpointEngine)):
        raise ConfigError(_KEY, f"checkpoint engine {name!r} is {engine!r}, not a subclass of "
                                "backends.engines.CheckpointEngine")
