"""Attribute changes undone later: `Temporary`, the `DELETE` sentinel, and the bookkeeping that
lets changes of one attribute nest and be restored in any order, from any thread.

Apart from `lifecycle.phase` (which joins each change to the running phase's undo stack, and
re-exports both names) because the nesting is a mechanism of its own that knows no phase.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from lifecycle.errors import LifecycleError


class _Delete:
    """Sentinel: `lc.temporarily(obj, attr=DELETE)` removes `attr` for the phase."""

    _instance: _Delete | None = None

    def __new__(cls) -> _Delete:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "DELETE"


DELETE = _Delete()
_MISSING = object()


class Temporary:
    """Attributes changed for the rest of a phase; also a context manager to restore sooner.

    Changes of one attribute nest: restoring one also settles every change made to the same
    attribute after it (they were made on top of it), so restores in any order, from any
    thread, leave the value the first of them found, never one set in between."""

    __slots__ = ("_obj", "_saved", "_restored", "__weakref__")

    def __init__(self, obj: object, attrs: dict[str, Any]) -> None:
        self._obj = obj
        self._saved: list[tuple[str, Any, bool]] = []
        """Each attribute's name, its value before, and whether that value was read from the class."""
        self._restored: set[str] = set()
        with _NESTED_LOCK:
            try:
                for name, value in attrs.items():
                    inherited = _inherited(obj, name)
                    if inherited and value is DELETE:
                        raise LifecycleError(
                            f"temporarily({type(obj).__name__}, {name}=DELETE): {name!r} is not the object's own "
                            f"attribute but its class's, which deleting from the object cannot remove")
                    self._saved.append((name, getattr(obj, name, _MISSING), inherited))
                    _push(obj, name, self)
                    if value is DELETE:
                        if hasattr(obj, name):
                            delattr(obj, name)
                    else:
                        setattr(obj, name, value)
            except BaseException:
                self.restore()
                raise

    def restore(self) -> None:
        """Put every attribute back as it was, last changed first; idempotent. Every attribute
        gets its turn: the first error is raised once all were tried."""
        errors: list[BaseException] = []
        with _NESTED_LOCK:
            for name, old, inherited in reversed(self._saved):
                if name in self._restored:
                    continue
                for later in _pop(self._obj, name, self):  # made on top of this one: settled by it
                    later._restored.add(name)
                self._restored.add(name)
                try:
                    if inherited:  # no instance value to pin: the class's shows through again, as it changes
                        if name in vars(self._obj):
                            delattr(self._obj, name)
                    elif old is _MISSING:
                        if hasattr(self._obj, name):
                            delattr(self._obj, name)
                    else:
                        setattr(self._obj, name, old)
                except BaseException as exc:  # noqa: BLE001 - the other attributes still get theirs
                    errors.append(exc)
        if errors:
            raise errors[0]

    def __repr__(self) -> str:
        names = ", ".join(name for name, _, _ in self._saved)
        return f"restore {type(self._obj).__name__}.{{{names}}}"

    def __enter__(self) -> Temporary:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def _inherited(obj: object, name: str) -> bool:
    """Whether `obj.name` is read from its class: a plain class attribute, absent from the object's
    own `__dict__`. A slot, a property or another data descriptor is the object's own to set back."""
    try:
        own = vars(obj)
    except TypeError:  # no `__dict__`: what can be set is a slot or a descriptor of the class
        return False
    if name in own:
        return False
    for klass in (obj.__mro__[1:] if isinstance(obj, type) else type(obj).__mro__):
        if name in vars(klass):
            kind = type(vars(klass)[name])
            return not (hasattr(kind, "__set__") or hasattr(kind, "__delete__"))
    return False


_NESTED: dict[tuple[int, str], list[weakref.ref[Temporary]]] = {}
"""The changes of each (object id, attribute) not yet restored, oldest first. Held weakly: a
change dropped unrestored (outside a phase, without `with`) pins neither itself nor its object;
its dead entry is pruned when its key is next used, or by `_push` when the table grows."""
_NESTED_LOCK = threading.RLock()
"""Held while a change is made or restored (a setter that makes a change of its own re-enters)."""
_PRUNE_AT = 1024


def _alive(key: tuple[int, str]) -> list[weakref.ref[Temporary]]:
    return [ref for ref in _NESTED.get(key, ()) if ref() is not None]


def _push(obj: object, name: str, change: Temporary) -> None:
    if len(_NESTED) >= _PRUNE_AT:
        for key in [key for key in _NESTED if not _alive(key)]:
            del _NESTED[key]
    key = (id(obj), name)
    _NESTED[key] = [*_alive(key), weakref.ref(change)]


def _pop(obj: object, name: str, change: Temporary) -> list[Temporary]:
    """Drop `change` of obj.name and the changes made after it; those, live ones only."""
    key = (id(obj), name)
    stack = _alive(key)
    mine = next((i for i, ref in enumerate(stack) if ref() is change), None)
    later = [] if mine is None else [c for ref in stack[mine + 1:] if (c := ref()) is not None]
    stack = stack if mine is None else stack[:mine]
    if stack:
        _NESTED[key] = stack
    else:
        _NESTED.pop(key, None)
    return later


__all__ = ["DELETE", "Temporary"]
