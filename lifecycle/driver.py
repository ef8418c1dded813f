"""Moved to `lifecycle.ray.driver`: this path forwards there with a `DeprecationWarning`.

Kept because earlier READMEs documented `lifecycle.driver`; new code imports `lifecycle.ray`.
"""

from lifecycle.moved import forwarder
from lifecycle.ray import driver as _new

__all__ = list(_new.__all__)
__getattr__ = forwarder(__name__, _new)
