"""Old import paths kept after a module moved: each still works, with a `DeprecationWarning`.

Only paths an earlier README documented get a forwarding module; the warning is raised when
a name is taken from it (PEP 562 `__getattr__`), so it points at the caller's line however
often the module was imported before.
"""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Any, Callable


def forwarder(old: str, new: ModuleType) -> Callable[[str], Any]:
    """A module `__getattr__` for `old` that hands out `new`'s attributes and warns."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__") or not hasattr(new, name):
            raise AttributeError(f"module {old!r} has no attribute {name!r} (it moved to {new.__name__!r})")
        warnings.warn(f"{old} is deprecated: import {name} from {new.__name__} instead",
                      DeprecationWarning, stacklevel=2)
        return getattr(new, name)

    return __getattr__
