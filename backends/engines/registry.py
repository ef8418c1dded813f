"""`CheckpointEngineRegistry`: engine names to classes, imported only when asked for.

A facade over one `backends.registry.Registry`, the type formats use too. Built-in engines
are listed whether or not their dependency is installed; asking for one whose dependency is
missing raises a `ConfigError` naming the package. Engines from outside the package come in
three ways: `@CheckpointEngineRegistry.register("name")` on a subclass of `CheckpointEngine`,
an import path `pkg.module:Class` as `engine.backend`, or an entry point in the group
`trainer_lifecycle.checkpoint_engines`; each is then selected by name in config like a built-in.
This module imports neither torch nor an engine, so the config checks names with it cheaply.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from backends.engines.options import AUTO, EngineCapabilities, EngineOptions
from backends.registry import Builtin, Registry
from lifecycle.errors import ConfigError, shorten

if TYPE_CHECKING:
    from backends.engines.base import CheckpointEngine

E = TypeVar("E", bound="type[CheckpointEngine]")

ENTRY_POINT_GROUP = "trainer_lifecycle.checkpoint_engines"
DEVICE_BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
"""What `backend: auto` picks for the device the model lives on."""
_KEY = "engine.backend"


def _contract(cls: type) -> str | None:
    """What `WeightSync` and the config rely on beyond subclassing `CheckpointEngine`."""
    capabilities, options = getattr(cls, "capabilities", None), getattr(cls, "Options", None)
    if not isinstance(capabilities, EngineCapabilities):
        return f"its `capabilities` is {shorten(capabilities)}, not an EngineCapabilities"
    if not (isinstance(options, type) and issubclass(options, EngineOptions)):
        return f"its `Options` is {shorten(options)}, not a subclass of EngineOptions"
    return None


ENGINES: Registry[CheckpointEngine] = Registry(
    "checkpoint engine", base="backends.engines.base:CheckpointEngine", group=ENTRY_POINT_GROUP, key=_KEY,
    reserved=(AUTO,), check=_contract, builtins={
        "gloo": Builtin("backends.engines.gloo:GlooEngine"),
        "nccl": Builtin("backends.engines.nccl:NcclEngine"),
        "hccl": Builtin("backends.engines.hccl:HcclEngine"),
        "shm": Builtin("backends.engines.shm:ShmEngine"),
        "cuda_ipc": Builtin("backends.engines.cuda_ipc:CudaIpcEngine"),
        "naive": Builtin("backends.engines.naive:NaiveEngine"),
    },
)


class CheckpointEngineRegistry:
    """Names to checkpoint-engine classes; see the module docstring for the ways in."""

    @staticmethod
    def register(name: str) -> Callable[[E], E]:
        """Class decorator: make `name` build this engine class."""
        return ENGINES.register(name)  # type: ignore[return-value]

    @staticmethod
    def names() -> list[str]:
        """Every engine that can be asked for, installed dependency or not."""
        return ENGINES.names()

    @staticmethod
    def problem(name: str) -> str | None:
        """Why `engine.backend: name` selects no engine, or None; imports nothing."""
        return None if name == AUTO else ENGINES.problem(name, also=(AUTO,))

    @staticmethod
    def get(name: str) -> type[CheckpointEngine]:
        """The class behind `name` (a registered name or `pkg.module:Class`), ready to run here."""
        engine = ENGINES.get(name)
        engine.check_available()
        return engine

    @classmethod
    def new(cls, name: str, **kwargs: Any) -> CheckpointEngine:
        """A new engine `name` built with `kwargs` (bucket_bytes, verify, timeout_s, rollout_dtype...)."""
        return cls.get(name)(**kwargs)

    @staticmethod
    def resolve(backend: str, device_type: str) -> str:
        """The engine name for `backend`, mapping `auto` from the device type."""
        if backend != AUTO:
            return backend
        try:
            return DEVICE_BACKENDS[device_type]
        except KeyError:
            supported = ", ".join(f"{device} -> {name}" for device, name in DEVICE_BACKENDS.items())
            raise ConfigError(_KEY, f"backend 'auto' has no checkpoint engine for device type {device_type!r}; "
                                    f"supported device types: {supported}; or name an engine") from None

    @staticmethod
    def apply_problem(name: str, apply: str) -> str | None:
        """Why the engine `name` (registered, or `pkg.module:Class`) does not take `engine.apply:
        apply`, or None. Its class says which modes it takes (`CheckpointEngine.applies`), and is
        loaded only for a mode that not every engine takes (`flip`)."""
        from backends.engines.base import CheckpointEngine

        if apply in CheckpointEngine.applies():
            return None
        takes = ENGINES.get(name, _KEY).applies()
        return None if apply in takes else \
            f"engine {name!r} does not take {apply!r}; it takes {', '.join(map(repr, takes))}"
