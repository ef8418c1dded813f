"""What a pickle changed on the objects it was handed, put back after the load and refused.

An unpickler hands a pickle its allowed globals (classes, functions standing in for others) and
whatever calling them returns, and BUILD sets attributes on any object on the stack: on a class
itself, on a shared enum member, on a function, not only on an instance the pickle made. Such a
change would outlive the load, for the whole process. `unchanged` records every attribute BUILD
can reach on the objects given, puts back whatever differs once the load is over, and raises.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FunctionType

from lifecycle.errors import CheckpointError

_GONE = object()
_FUNCTION_FIELDS = ("__defaults__", "__kwdefaults__", "__name__", "__qualname__", "__module__", "__doc__")
"""A function's writable fields outside its dict (its code cannot be built from what is allowed)."""


def _attributes(obj: object) -> dict[str, object]:
    """What BUILD can set on `obj`: its attributes, an instance's class, a function's writable fields."""
    found = dict(vars(obj))
    if not isinstance(obj, type):
        found["__class__"] = type(obj)
    if isinstance(obj, FunctionType):
        found.update((name, getattr(obj, name)) for name in _FUNCTION_FIELDS)
    return found


def _put_back(obj: object, before: dict[str, object]) -> list[str]:
    """Undo every change to `obj` since `before` was taken; the names changed."""
    now = _attributes(obj)
    changed = sorted((n for n in now.keys() | before.keys() if now.get(n, _GONE) is not before.get(n, _GONE)),
                     key=lambda name: name != "__class__")  # its class first: a frozen one refuses setattr
    for name in changed:
        if name not in before:
            delattr(obj, name)
        elif name == "__class__":
            object.__setattr__(obj, name, before[name])
        else:
            setattr(obj, name, before[name])
    return changed


@contextmanager
def unchanged(shared: Iterable[tuple[str, object]], path: Path) -> Iterator[None]:
    """Put back what changed on each (name, object) of `shared` while the block ran, and raise a
    CheckpointError naming `path` and every attribute changed."""
    before = [(name, obj, _attributes(obj)) for name, obj in shared]
    try:
        yield
    finally:
        changed = [f"{name}.{field}" for name, obj, attrs in before for field in _put_back(obj, attrs)]
        if changed:
            raise CheckpointError(f"{path}: tried to change {', '.join(sorted(changed))} of DCP's classes, enum "
                                  "members or the functions standing in for them; undone and refused")
