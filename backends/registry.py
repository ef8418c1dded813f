"""`Registry[T]`: the one way names become classes, for checkpoint formats and engines alike.

A name reaches a class in one of four ways, tried in this order:

- `@REGISTRY.register("name")` on a subclass, in code that has been imported;
- a built-in: the package's own classes, listed by import path so that listing (and checking
  a config against) them imports nothing, neither torch nor an optional dependency;
- an import path `pkg.module:Class`, for a class nobody registered;
- an entry point in the registry's group, for a package that is installed but never imported.

Asking for a class whose module cannot be imported is a `ConfigError` that names the missing
package and, for a built-in, the extra that installs it. This module imports only the
standard library and `lifecycle.errors`, so both the config and the backends may use it.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Generic, TypeVar

from lifecycle.errors import ConfigError, shorten

T = TypeVar("T")

IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
"""`pkg.module:Class`: a dotted module, a colon, one attribute."""
_NAME = re.compile(r"[A-Za-z_][\w.-]*")
"""A registered name: never mistaken for an import path (no colon) and printable in a message."""
_PATH_HINT = "an import path 'pkg.module:Class'"


@dataclass(frozen=True, slots=True)
class Builtin:
    """A class the package ships, named by import path: listing it imports nothing."""

    target: str
    """`module:Class`."""
    extra: str | None = None
    """The pip extra that installs its dependency, named when importing it fails."""
    info: object = None
    """What may be known about the class without importing it (a format's capabilities)."""


class Registry(Generic[T]):
    """Names to subclasses of one base class; see the module docstring for the ways in.

    The classes carry a `name` class attribute: the decorator and an entry point set it to the
    name they were registered under, so an object can say what it was asked for as.
    """

    def __init__(
        self, kind: str, *, base: type[T] | str, group: str, key: str, builtins: Mapping[str, Builtin] | None = None
    ) -> None:
        """`kind` words the messages ("format"); `base` may be an import path when importing it
        is heavy; `key` is the config key errors name unless a caller gives its own."""
        self.kind = kind
        self.group = group
        self.key = key
        self._base = base
        self._builtins: dict[str, Builtin] = dict(builtins or {})
        self._registered: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator: make `name` select this class. A built-in's name stays its own."""
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ConfigError(self.key, f"cannot register {self.kind} {shorten(name)}: a name is letters, digits, "
                                        "'_', '.' or '-', and starts with a letter or '_'")

        def add(cls: type[T]) -> type[T]:
            builtin = self._builtins.get(name)
            if builtin is not None and builtin.target != f"{cls.__module__}:{cls.__qualname__}":
                raise ConfigError(self.key, f"cannot register {cls.__qualname__} as {self.kind} {name!r}: "
                                            f"the name belongs to the built-in {builtin.target}")
            self._check_class(cls, name, self.key)
            cls.name = name  # type: ignore[attr-defined]
            self._registered[name] = cls
            return cls

        return add

    def names(self) -> list[str]:
        """Every name that can be asked for, installed dependency or not."""
        return self._known(self._entry_points())

    def builtin_names(self) -> list[str]:
        """The names of the package's own classes."""
        return sorted(self._builtins)

    def builtin(self, name: str) -> Builtin | None:
        """The built-in entry for `name`, unless code registered that name itself."""
        return None if name in self._registered else self._builtins.get(name)

    def problem(self, name: str, also: Sequence[str] = ()) -> str | None:
        """Why `name` selects no class, or None; imports nothing. `also`: words the caller
        accepts besides (an engine's `auto`), listed with the names."""
        if name in self._registered or name in self._builtins or IMPORT_PATH.fullmatch(name):
            return None
        found = self._entry_points()
        if name in found:
            return None
        return f"expected one of {', '.join([*also, *self._known(found)])} or {_PATH_HINT}, got {shorten(name)}"

    def get(self, name: str, key: str | None = None) -> type[T]:
        """The class behind `name`; `ConfigError` on `key` when none can be had here."""
        key = key or self.key
        if name in self._registered:
            cls: Any = self._registered[name]
        elif name in self._builtins:
            cls = self._load(self._builtins[name].target, name, key, self._builtins[name].extra)
        elif IMPORT_PATH.fullmatch(name):
            cls = self._load(name, name, key)
        else:
            cls = self._from_entry_point(name, key)
        self._check_class(cls, name, key)
        return cls  # type: ignore[no-any-return]

    def _known(self, entry_points: Mapping[str, EntryPoint]) -> list[str]:
        return sorted(set(self._builtins) | set(self._registered) | set(entry_points))

    def _entry_points(self) -> dict[str, EntryPoint]:
        return {point.name: point for point in entry_points(group=self.group)}

    def _from_entry_point(self, name: str, key: str) -> Any:
        """Scans the installed entry points once, for the class and, if it is not there, the message."""
        found = self._entry_points()
        if name not in found:
            raise ConfigError(key, f"unknown {self.kind} {shorten(name)}; known: {', '.join(self._known(found))}, "
                                   f"or {_PATH_HINT}")
        point = found[name]
        cls = self._load(f"{point.module}:{point.attr}" if point.attr else point.module, name, key)
        self._check_class(cls, name, key)
        cls.name = name
        return cls

    def _load(self, target: str, name: str, key: str, extra: str | None = None) -> Any:
        module_name, _, attr = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            hint = f"; install the extra: pip install 'trainer-lifecycle[{extra}]'" if extra else ""
            raise ConfigError(key, f"{self.kind} {name!r} needs the package {exc.name or module_name!r}, "
                                   f"which is not installed: {exc}{hint}") from exc
        found: Any = module
        try:
            for part in attr.split(".") if attr else ():
                found = getattr(found, part)
        except AttributeError:
            raise ConfigError(key, f"{self.kind} {name!r}: module {module_name!r} has no {attr!r}") from None
        return found

    def _check_class(self, cls: Any, name: str, key: str) -> None:
        base = self._base_class()
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ConfigError(key, f"{self.kind} {name!r} is {cls!r}, not a subclass of "
                                   f"{base.__module__}.{base.__qualname__}")

    def _base_class(self) -> type[T]:
        if isinstance(self._base, str):
            self._base = self._load(self._base, self._base, self.key)
        return self._base  # type: ignore[return-value]
