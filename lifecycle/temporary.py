"""Attribute changes undone later: `Temporary`, the `DELETE` sentinel, and the bookkeeping that
lets changes of one attribute nest and be restored in any order, from any thread.

Apart from `lifecycle.phase` (which joins each change to the running phase's undo stack, and
re-exports both names) because the nesting is a mechanism of its own that knows no phase.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
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
        self._saved: list[tuple[str, Any, str | _Registered]] = []
        """Each attribute's name, its value before, and where that value was read (`_where`)."""
        self._restored: set[str] = set()
        with _NESTED_LOCK:
            try:
                for name, value in attrs.items():
                    where = _where(obj, name)
                    old = getattr(obj, name, _MISSING)
                    _refuse(obj, name, value, where, old)
                    self._saved.append((name, old, where))
                    _push(obj, name, self)
                    if value is not DELETE:
                        setattr(obj, name, value)
                    elif old is not _MISSING:
                        _delete(obj, name, where)
            except BaseException:
                self.restore()
                raise

    def restore(self) -> None:
        """Put every attribute back as it was, last changed first; idempotent. Every attribute
        gets its turn; then one `LifecycleError` names each that failed (their errors in its notes)."""
        failed: list[tuple[str, BaseException]] = []
        with _NESTED_LOCK:
            for name, old, where in reversed(self._saved):
                if name in self._restored:
                    continue
                for later in _pop(self._obj, name, self):  # made on top of this one: settled by it
                    later._restored.add(name)
                self._restored.add(name)
                try:
                    _put_back(self._obj, name, old, where)
                except BaseException as exc:  # noqa: BLE001 - the other attributes still get theirs
                    failed.append((name, exc))
        if failed:
            raise _restore_failed(self._obj, failed[::-1])  # in the order the attributes were given

    def __repr__(self) -> str:
        names = ", ".join(name for name, _, _ in self._saved)
        return f"restore {type(self._obj).__name__}.{{{names}}}"

    def __enter__(self) -> Temporary:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


_OWN, _CLASS, _FORWARDED = "own", "class", "forwarded"
_REGISTRIES = ("_parameters", "_buffers", "_modules")


@dataclass(frozen=True, slots=True)
class _Registered:
    """A torch module's parameter, buffer or submodule: the registry (`_REGISTRIES`) it was read
    from, its place there (the order of `parameters()`, of the state_dict, of a `Sequential`'s
    forward) and, for a buffer, whether the state_dict holds it. Read off the module's own
    `__dict__`, so that this module needs no torch."""

    registry: str
    index: int
    persistent: bool


def _where(obj: object, name: str) -> str | _Registered:
    """Where `obj.name` is read from: `_Registered`, a torch module's registries; `_CLASS`, a
    plain class attribute absent from the object's own `__dict__`; `_FORWARDED`, neither the
    object's nor its class's but read all the same, by a `__getattr__` that forwards to a wrapped
    object (a peft `PeftModel`, torch.compile's module); else `_OWN` (the object's `__dict__`, a
    slot, a property or another data descriptor, or nothing yet). Those the object only shows are
    restored by deleting what the change pinned."""
    try:
        own = vars(obj)
    except TypeError:  # no `__dict__`: what can be set is a slot or a descriptor of the class
        return _OWN
    if name in own:
        return _OWN
    if all(isinstance(own.get(registry), dict) for registry in _REGISTRIES):  # an `nn.Module`
        for registry in _REGISTRIES:
            if name in own[registry]:
                persistent = name not in own.get("_non_persistent_buffers_set", ())
                return _Registered(registry, list(own[registry]).index(name), persistent)
    for klass in (obj.__mro__[1:] if isinstance(obj, type) else type(obj).__mro__):
        if name in vars(klass):
            kind = type(vars(klass)[name])
            return _OWN if hasattr(kind, "__set__") or hasattr(kind, "__delete__") else _CLASS
    return _FORWARDED if hasattr(obj, name) else _OWN


def _refuse(obj: object, name: str, value: Any, where: str | _Registered, old: Any) -> None:
    """`LifecycleError` for a change that could not be undone: deleting what the class holds, or
    setting an attribute with no value now that cannot be deleted again (a lazy property)."""
    said = f"temporarily({type(obj).__name__}, {name}={'DELETE' if value is DELETE else '...'})"
    if value is DELETE and where == _CLASS:
        raise LifecycleError(f"{said}: {name!r} is not the object's own attribute but its class's, which "
                             f"deleting from the object cannot remove")
    if value is not DELETE and old is _MISSING and not _deletable(obj, name):
        raise LifecycleError(f"{said}: {name!r} has no value to put back and {type(obj).__name__}.{name} "
                             f"cannot be deleted (a property without a deleter), so the change could not be undone")


def _deletable(obj: object, name: str) -> bool:
    for klass in (obj.__mro__[1:] if isinstance(obj, type) else type(obj).__mro__):
        if name in vars(klass):
            attr = vars(klass)[name]
            if isinstance(attr, property):
                return attr.fdel is not None
            return hasattr(type(attr), "__delete__") or not hasattr(type(attr), "__set__")
    return True


def _delete(obj: object, name: str, where: str | _Registered) -> None:
    try:
        delattr(obj, name)
    except AttributeError as exc:
        if where != _FORWARDED:
            raise
        raise LifecycleError(f"temporarily({type(obj).__name__}, {name}=DELETE): {name!r} is read through "
                             f"{type(obj).__name__}'s __getattr__ from an object it wraps, and deleting it from the "
                             f"wrapper cannot remove it; change the wrapped object instead") from exc


def _put_back(obj: object, name: str, old: Any, where: str | _Registered) -> None:
    if isinstance(where, _Registered):
        _put_back_registered(obj, name, old, where)
    elif where != _OWN and name in vars(obj):  # pinned on the object: what it showed shows through again
        delattr(obj, name)
    elif where == _FORWARDED:  # set through the object (a wrapper forwarding sets too): put back unless back
        if getattr(obj, name, _MISSING) is not old:
            setattr(obj, name, old)
    elif where == _OWN:
        if old is not _MISSING:
            setattr(obj, name, old)
        elif hasattr(obj, name):
            delattr(obj, name)


def _put_back_registered(module: Any, name: str, old: Any, where: _Registered) -> None:
    """Into the registry it was read from, at its place, through the module's own `register_*` or
    `__setattr__` (torch's checks and hooks run); whatever took the name meanwhile goes first (a
    plain tensor set after a DELETE, a buffer made a parameter)."""
    own = vars(module)
    own.pop(name, None)
    for registry in _REGISTRIES:
        if registry != where.registry and name in own[registry]:
            delattr(module, name)
    held: dict[str, Any] = own[where.registry]
    if name in held:  # replaced, never removed: torch kept its place and, for a buffer, its persistence
        if held[name] is not old:
            setattr(module, name, old)
        return
    if where.registry == "_buffers":
        module.register_buffer(name, old, persistent=where.persistent)
    else:
        (module.register_parameter if where.registry == "_parameters" else module.add_module)(name, old)
    names = list(held)
    names.insert(min(where.index, len(names) - 1), names.pop())
    placed = {key: held[key] for key in names}
    held.clear()
    held.update(placed)


def _restore_failed(obj: object, failed: list[tuple[str, BaseException]]) -> BaseException:
    """One error for every attribute that could not be put back: an interrupt among them as it is,
    otherwise a `LifecycleError` naming each, chained to the first, each error in its notes."""
    what = ", ".join(f"{name} ({type(exc).__name__}: {exc})" for name, exc in failed)
    said = f"restoring {type(obj).__name__}.{{{', '.join(name for name, _ in failed)}}} failed for {what}"
    error = next((exc for _, exc in failed if not isinstance(exc, Exception)), None)
    if error is None:
        error = LifecycleError(f"{said}; they keep the values the change set")
        error.__cause__ = failed[0][1]
    for name, exc in failed:
        if exc is not error:
            note = f"{name}: {type(exc).__name__}: {exc}"  # `add_note`'s list, which Python 3.10 lacks
            error.__notes__ = [*getattr(error, "__notes__", ()), note]
    return error


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
