"""`Registry[T]`: the one way names become classes, for checkpoint formats and engines alike.

A name reaches a class in one of four ways, tried in this order:

- `@REGISTRY.register("name")` on a subclass, in code that has been imported;
- a built-in: the package's own classes, listed by import path so that listing (and checking
  a config against) them imports nothing, neither torch nor an optional dependency;
- an import path `pkg.module:Class`, for a class nobody registered;
- an entry point in the registry's group, for a package that is installed but never imported.

A plugin cannot make a name mean something else by accident or on purpose: a built-in's name
always selects the built-in (its import path is what is loaded), a reserved name (an engine's
`auto`) is never a plugin's, a name registered twice by different classes is refused, and a
name two installed packages declare differently is refused when asked for, not settled by
install order. A class answers to one name, the one it carries into manifests and figures.

Every failure is a `ConfigError` naming the config key: a module that cannot be imported
(naming the missing package and, for a built-in, the extra that installs it), one whose import
raises anything at all, a target that is missing, not a class, not a subclass, the base class
itself, or refused by the registry's `check` (the contract beyond subclassing). This module
imports only the standard library and `lifecycle.errors`, so the config and the backends may
both use it.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Generic, TypeVar

from lifecycle.errors import ConfigError, shorten

T = TypeVar("T")

IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
"""`pkg.module:Class`: a dotted module, a colon, one attribute."""
_NAME = re.compile(r"[A-Za-z_][\w.-]*")
"""A registered name: never mistaken for an import path (no colon) and printable in a message."""
MAX_NAME = 200
"""Characters a name or an import path may have; real ones have a few dozen."""
_LISTED = 30
"""Names a message lists before it counts the rest."""
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
        self, kind: str, *, base: type[T] | str, group: str, key: str, builtins: Mapping[str, Builtin] | None = None,
        reserved: Collection[str] = (), check: Callable[[type], str | None] | None = None,
    ) -> None:
        """`kind` words the messages ("format"); `base` may be an import path when importing it
        is heavy; `key` is the config key errors name unless a caller gives its own; `reserved`:
        names the config gives a meaning of its own; `check`: why a subclass still cannot serve
        (capabilities of the wrong type...), or None."""
        self.kind = kind
        self.group = group
        self.key = key
        self._base = base
        self._builtins: dict[str, Builtin] = dict(builtins or {})
        self._registered: dict[str, type[T]] = {}
        self._reserved = frozenset(reserved)
        self._check = check

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator: make `name` select this class. A built-in's name stays its own."""
        if problem := self._name_problem(name):
            raise ConfigError(self.key, f"cannot register {self.kind} {shorten(name)}: {problem}")

        def add(cls: type[T]) -> type[T]:
            self._check_class(cls, name, self.key)
            builtin, other = self._builtins.get(name), self._registered.get(name)
            if builtin is not None and builtin.target != _path(cls):
                raise ConfigError(self.key, f"cannot register {_path(cls)} as {self.kind} {name!r}: "
                                            f"the name belongs to the built-in {builtin.target}")
            if other is not None and _path(other) != _path(cls):  # the same path twice: a module reloaded
                raise ConfigError(self.key, f"cannot register {_path(cls)} as {self.kind} {name!r}: "
                                            f"{_path(other)} is registered under that name")
            self._name(cls, name, self.key, {})
            if builtin is None:  # a built-in is always loaded by its import path, so no look-alike stands in
                self._registered[name] = cls
            return cls

        return add

    def names(self) -> list[str]:
        """Every name that can be asked for, installed dependency or not."""
        return self._known(self._entry_points()[0])

    def builtin_names(self) -> list[str]:
        """The names of the package's own classes."""
        return sorted(self._builtins)

    def builtin(self, name: str) -> Builtin | None:
        """The built-in entry for `name`, or None."""
        return self._builtins.get(name) if isinstance(name, str) else None

    def problem(self, name: str, also: Sequence[str] = ()) -> str | None:
        """Why `name` selects no class, or None; imports nothing. `also`: words the caller
        accepts besides (an engine's `auto`), listed with the names."""
        if problem := _text_problem(name):
            return problem
        if name in self._registered or name in self._builtins or IMPORT_PATH.fullmatch(name):
            return None
        found, unreadable = self._entry_points()
        if name in found:
            return self._ambiguity(name, found[name])
        return f"expected one of {_listed([*also, *self._known(found)])} or {_PATH_HINT}, got {shorten(name)}" + (
            f"; {unreadable}" if unreadable else "")

    def get(self, name: str, key: str | None = None) -> type[T]:
        """The class behind `name`; `ConfigError` on `key` when none can be had here."""
        key = key or self.key
        if problem := _text_problem(name):
            raise ConfigError(key, f"{self.kind} {shorten(name)}: {problem}")
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

    def _known(self, entry_points: Mapping[str, object]) -> list[str]:
        return sorted(set(self._builtins) | set(self._registered) | set(entry_points))

    def _name_problem(self, name: object) -> str | None:
        if not isinstance(name, str) or len(name) > MAX_NAME or not _NAME.fullmatch(name):
            return (f"a name is at most {MAX_NAME} letters, digits, '_', '.' or '-', and starts with a letter "
                    "or '_'")
        return f"{name!r} is reserved: the config gives it a meaning of its own" if name in self._reserved else None

    def _entry_points(self) -> tuple[dict[str, list[EntryPoint]], str | None]:
        """The installed entry points by name (those whose name could be asked for), and why
        none could be read, if so: a broken package's metadata fails the look-up of every name."""
        try:
            points = list(entry_points(group=self.group))
        except Exception as exc:  # noqa: BLE001 - an installed package's metadata can be anything
            return {}, f"the installed packages' {self.group} entry points cannot be read: {_why(exc)}"
        found: dict[str, list[EntryPoint]] = {}
        for point in points:
            if self._name_problem(point.name) is None:
                found.setdefault(point.name, []).append(point)
        return found, None

    def _ambiguity(self, name: str, points: list[EntryPoint]) -> str | None:
        if len({point.value for point in points}) < 2:
            return None
        where = "; ".join(f"{_origin(point)}: {shorten(point.value)}" for point in points)
        return (f"{self.kind} {name!r} is declared by {len(points)} installed packages ({where}); "
                f"uninstall one, or select the class by {_PATH_HINT}")

    def _from_entry_point(self, name: str, key: str) -> Any:
        """Scans the installed entry points once, for the class and, if it is not there, the message."""
        found, unreadable = self._entry_points()
        if name not in found:
            raise ConfigError(key, f"unknown {self.kind} {shorten(name)}; known: {_listed(self._known(found))}, "
                                   f"or {_PATH_HINT}" + (f"; {unreadable}" if unreadable else ""))
        if problem := self._ambiguity(name, found[name]):
            raise ConfigError(key, problem)
        point = found[name][0]
        try:
            target = f"{point.module}:{point.attr}" if point.attr else point.module
        except AttributeError:  # `EntryPoint.module` on a value that is no `module:attr`
            raise ConfigError(key, f"{self.kind} {name!r}: the entry point of {_origin(point)} names "
                                   f"{shorten(point.value)}, not 'module:attr'") from None
        cls = self._load(target, name, key)
        self._check_class(cls, name, key)
        self._name(cls, name, key, found)
        return cls

    def _name(self, cls: Any, name: str, key: str, points: Mapping[str, list[EntryPoint]]) -> None:
        """Give `cls` the name it was asked for as, unless another name of this registry already
        selects it: its manifests and figures would carry whichever was asked for last."""
        current, path = cls.__dict__.get("name"), _path(cls)
        builtin = self._builtins.get(current) if isinstance(current, str) else None
        if isinstance(current, str) and current != name and (
                self._registered.get(current) is cls or (builtin is not None and builtin.target == path)
                or any(point.value.split()[0] == path for point in points.get(current, ()))):
            raise ConfigError(key, f"{self.kind} {name!r}: {path} is already {self.kind} {current!r}; "
                                   f"a class answers to one name, so subclass it to give it another")
        cls.name = name

    def _load(self, target: str, name: str, key: str, extra: str | None = None) -> Any:
        module_name, _, attr = target.partition(":")
        what = f"{self.kind} {shorten(name)}"
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            hint = f"; install the extra: pip install 'trainer-lifecycle[{extra}]'" if extra else ""
            raise ConfigError(key, f"{what} needs the package {shorten(exc.name or module_name)}, "
                                   f"which is not installed: {shorten(str(exc), 200)}{hint}") from exc
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - a plugin's module may raise anything on import
            raise ConfigError(key, f"{what}: importing {shorten(module_name)} failed: {_why(exc)}") from exc
        found: Any = module
        try:
            for part in attr.split(".") if attr else ():
                found = getattr(found, part)
        except AttributeError:
            raise ConfigError(key, f"{what}: module {shorten(module_name)} has no {shorten(attr)}") from None
        except Exception as exc:  # noqa: BLE001 - a module's own __getattr__ may raise anything
            raise ConfigError(key, f"{what}: reading {shorten(target)} failed: {_why(exc)}") from exc
        return found

    def _check_class(self, cls: Any, name: str, key: str) -> None:
        base = self._base_class()
        if not (isinstance(cls, type) and issubclass(cls, base)) or cls is base:
            what = "the base class itself" if cls is base else shorten(cls)
            raise ConfigError(key, f"{self.kind} {shorten(name)} is {what}, not a subclass of "
                                   f"{base.__module__}.{base.__qualname__}")
        try:
            problem = self._check(cls) if self._check is not None else None
        except Exception as exc:  # noqa: BLE001 - reading a plugin's class attributes runs its code
            problem = f"checking it failed: {_why(exc)}"
        if problem:
            raise ConfigError(key, f"{self.kind} {shorten(name)} ({cls.__qualname__}): {problem}")

    def _base_class(self) -> type[T]:
        if isinstance(self._base, str):
            self._base = self._load(self._base, self._base, self.key)
        return self._base  # type: ignore[return-value]


def _text_problem(name: object) -> str | None:
    """Why `name` cannot even be looked up: not a string, or longer than any real name."""
    if not isinstance(name, str):
        return f"expected a string, got {shorten(name)} ({type(name).__name__})"
    return f"{shorten(name)} is longer than {MAX_NAME} characters" if len(name) > MAX_NAME else None


def _path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {shorten(str(exc), 200)}"


def _origin(point: EntryPoint) -> str:
    """The distribution that declares `point`, for messages."""
    try:
        return f"{point.dist.name} {point.dist.version}"  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - a hand-made EntryPoint has no dist, a broken one no metadata
        return "an installed package"


def _listed(names: Sequence[str]) -> str:
    more = len(names) - _LISTED
    return ", ".join([*names[:_LISTED], *([f"... ({more} more)"] if more > 0 else [])])
