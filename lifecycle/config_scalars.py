"""A config value as a plain boolean, integer, number or string: what a YAML file and a dict from
another tool (numpy's scalars included) hand over, with a message that says why a value is not one.

Apart from `lifecycle.config_rules`, which coerces whole sections, since the scalars are the
leaves of every coercion and the only place YAML 1.1's own readings need explaining.
"""

from __future__ import annotations

import math
import numbers
import re
import sys
from typing import Any

from lifecycle.errors import ConfigError, shorten

SCALARS: dict[type, tuple[str, tuple[type, ...]]] = {
    bool: ("a boolean", (bool,)),
    int: ("an integer", (int,)),
    float: ("a number", (int, float)),
    str: ("a string", (str,)),
}
"""The plain types a field may hint, with the words a message uses for each."""


def describe(value: object) -> str:
    """A bounded `repr` of `value` and its type, for messages."""
    return f"{shorten(value)} ({type(value).__name__})"


def scalar(value: object, hint: type, key: str, where: str) -> Any:
    """`value` as the plain `hint` (what JSON holds): numpy's booleans and integers are taken too."""
    numpy = sys.modules.get("numpy")
    if hint is bool and numpy is not None and isinstance(value, numpy.bool_):
        return bool(value)
    integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is int and integral:
        return int(value)  # type: ignore[call-overload]
    if hint is float and (integral or isinstance(value, numbers.Real) and not isinstance(value, bool)):
        return _finite(value, key, where)  # type: ignore[arg-type]
    if isinstance(value, hint) and (hint is bool or not isinstance(value, bool)):
        return value
    raise ConfigError(key, f"{where}expected {SCALARS[hint][0]}, got {describe(value)}{_text_hint(value, hint)}")


def _text_hint(value: object, hint: type) -> str:
    """Why a number written with an exponent reached a number key as text."""
    if hint not in (int, float) or not isinstance(value, str) or not re.fullmatch(_EXPONENT, value.strip()):
        return ""
    return "; YAML 1.1 reads a number like 1e3 as text: write 1000" + ("" if hint is int else " or 1.0e+3")


_EXPONENT = r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+"


def _finite(value: float, key: str, where: str) -> float:
    """`value` as a float; infinity and NaN (or an int too big for a float) cannot be a time or a size."""
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ConfigError(key, f"{where}expected a finite number, got {describe(value)}")
    return number
