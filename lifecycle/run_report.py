"""Moved to `lifecycle.ray.run_report`: this path forwards there with a `DeprecationWarning`.

Kept because earlier READMEs documented `lifecycle.run_report`; new code imports `lifecycle.ray`.
"""

from lifecycle.moved import forwarder
from lifecycle.ray import run_report as _new

__all__ = list(_new.__all__)
__getattr__ = forwarder(__name__, _new)
