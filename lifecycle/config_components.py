"""A component's own options composed into a config section, or refused with the key that
selected the component.

A format or an engine declares its options as a dataclass (`Options`) next to its code; the
section that names the component (`checkpoint.save.format`, `engine.backend`) takes the
dataclass's fields as keys of its own, written beside the section's keys. `compose` checks the
dataclass can be composed at all (a plugin's may not: no dataclass, a field named like a
section key, bounds that are not numbers, a rule that does not fit its field's type), checks
the given values against its fields' rules, and builds it, so the component's own checks run
when the config is built, not mid-run.
"""

from __future__ import annotations

import re
import types
from collections.abc import Collection, Mapping
from dataclasses import MISSING, Field, fields, is_dataclass
from typing import Any, Union, get_args, get_origin

from lifecycle.config_rules import Section, check_value, hints_of, join, keys_of, rule_of, valid_keys
from lifecycle.errors import ConfigError, shorten


def compose(
    section: Section, extras: Mapping[str, Any], options: object, *, selector: str, what: str,
    common: type | None = None, values: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], Any]:
    """`extras`, the keys `section` does not declare, checked as fields of `options`, the options
    dataclass of the component `what` that the key `selector` names (None: it takes no keys),
    and that dataclass built from them, which runs the component's own checks now rather than
    mid-run. `common`: a dataclass `options` extends whose fields the section declares itself,
    given as `values`. Returns the checked extras and the built options (None without any)."""
    own = _component_fields(type(section), options, selector, what, common)
    checked: dict[str, Any] = {}
    for key, value in extras.items():
        where = join(section._prefix, key)
        if key not in own:
            listed = ", ".join(sorted({*valid_keys(type(section)), *own}))
            hint = (f"; a component's own keys sit directly in {section._prefix}, not in a mapping of their own"
                    if isinstance(value, Mapping) else "" if own else f"; {what} takes no keys of its own")
            raise ConfigError(where, f"unknown key; valid keys: {listed}{hint}")
        checked[key] = check_value(value, own[key][1], rule_of(own[key][0]), where)
    if options is None:
        return checked, None
    for name, (f, _) in own.items():
        if name not in checked and f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError(join(section._prefix, name), f"{what} requires this key, which is not set")
    try:
        return checked, options(**(values or {}), **checked)  # type: ignore[operator]
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the component's own checks may raise anything
        raise ConfigError(selector, f"{what} refuses its options {shorten(checked)}: {_why(exc)}") from exc


def _component_fields(
    section: type, options: object, selector: str, what: str, common: type | None
) -> dict[str, tuple[Field[Any], Any]]:
    """The fields `options` adds to `section`, with their type hints; a `ConfigError` on
    `selector` when the section cannot compose them: no dataclass, hints that do not resolve,
    a field named like one of the section's own keys (one of the two would be unreachable),
    a redefined field of `common` (the section's value would silently win) or metadata that
    does not mean what a rule needs."""
    if options is None:
        return {}
    extends = common.__qualname__ if common is not None else ""
    if not (isinstance(options, type) and is_dataclass(options)) or (common and not issubclass(options, common)):
        raise ConfigError(selector, f"{what}: its Options is {shorten(options)}, not a dataclass"
                                    + (f" extending {extends}" if extends else ""))
    try:
        hints = hints_of(options)
    except Exception as exc:  # noqa: BLE001 - evaluating a plugin's annotations runs its code
        raise ConfigError(selector, f"{what}: the types of its Options fields cannot be resolved: {_why(exc)}") from exc
    inherited = {f.name: f for f in fields(common)} if common else {}
    taken = {*keys_of(section), *(f.name for f in fields(section))} - set(inherited)
    own: dict[str, tuple[Field[Any], Any]] = {}
    for f in fields(options):
        if f.name in inherited:
            problem = None if f is inherited[f.name] else \
                f"redefines {f.name!r} of {extends}, whose value the section sets"
        elif not f.init:
            continue
        elif f.name in taken:
            problem = f"its option {f.name!r} is also a key of {section._prefix} itself; rename the option"
        else:
            problem = _metadata_problem(f) or _misfit_problem(f, hints[f.name])
        if problem:
            raise ConfigError(selector, f"{what}: {problem}")
        if f.name not in inherited:
            own[f.name] = (f, hints[f.name])
    return own


def _metadata_problem(f: Field[Any]) -> str | None:
    """Why a component field's rule metadata would fail, or check something else, later."""
    rule = rule_of(f)
    if rule.key or rule.extras or rule.deprecated:
        return f"option {f.name!r}: the metadata key, extras and deprecated are the config's own"
    if any(isinstance(b, bool) or not isinstance(b, (int, float, type(None))) for b in (rule.ge, rule.gt, rule.le)):
        return f"option {f.name!r}: the bounds ge, gt and le must be numbers"
    if isinstance(rule.choices, str) or not isinstance(rule.choices, Collection) or not all(
            isinstance(c, str) for c in rule.choices):
        return f"option {f.name!r}: choices must be a list of strings, got {shorten(rule.choices)}"
    if rule.pattern is not None:
        try:
            re.compile(rule.pattern)
        except (re.error, TypeError):
            return f"option {f.name!r}: pattern {shorten(rule.pattern)} is not a regular expression"
    return None if rule.problem is None or callable(rule.problem) else f"option {f.name!r}: problem must be a function"


def _misfit_problem(f: Field[Any], hint: Any) -> str | None:
    """Why a component field's rule does not fit the field's type, or None: a bound compares the
    value itself, so it needs a number; the string rules check a string or each item of a list
    of strings; `unique` and `non_empty` look at a list, `unique` at items it can hash. A rule
    that does not fit would raise a `TypeError` on the first value given, or check nothing."""
    rule, hint = rule_of(f), _optional_inner(hint)
    item = _optional_inner(get_args(hint)[0]) if get_origin(hint) is list and get_args(hint) else None
    if any(b is not None for b in (rule.ge, rule.gt, rule.le)) and hint not in (int, float):
        return f"option {f.name!r}: the bounds ge, gt and le need a number (int or float) field, not {_shown(hint)}"
    is_string = isinstance(hint, type) and get_origin(hint) is None and issubclass(hint, str)
    if (rule.pattern is not None or rule.choices or rule.problem is not None or rule.path) and not (
            is_string or item is str):
        return (f"option {f.name!r}: the rules pattern, choices, problem and path need a string or a list of "
                f"strings field, not {_shown(hint)}")
    if (rule.unique or rule.non_empty) and get_origin(hint) is not list:
        which = "unique" if rule.unique else "non_empty"
        return f"option {f.name!r}: {which} needs a list field, not {_shown(hint)}"
    hashable = isinstance(item, type) and item.__hash__ is not None and get_origin(item) is None
    if rule.unique and not hashable:
        return f"option {f.name!r}: unique needs a list of hashable items, not {_shown(hint)}"
    return None


def _optional_inner(hint: Any) -> Any:
    """`X` for `X | None`; any other hint as it is."""
    if get_origin(hint) in (Union, types.UnionType):
        inner = [arg for arg in get_args(hint) if arg is not type(None)]
        return inner[0] if len(inner) == 1 else hint
    return hint


def _shown(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) and get_origin(hint) is None else str(hint)


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {shorten(str(exc), 200)}"
