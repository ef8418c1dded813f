"""How a config section checks itself: per-field rules kept as data, one coercion driven by the
type hints, and error messages that stay short and printable whatever value they quote.

Apart from `lifecycle.config` so that module reads as the list of keys; nothing here knows a key.
Whatever the input (a YAML file, a dict from another tool, a hostile mapping), the only
exception that leaves is a `ConfigError` naming the dotted key.

A component outside the lifecycle (an engine's or a format's options dataclass) states its
bounds as plain field metadata named like `Rule`'s fields (`{"ge": 64, "choices": (...)}`), so
it need not import this module; a section composes such a dataclass by inheriting it, and a
component's own extra keys land in the section's `extras` field (see
`lifecycle.config_components.compose`).
"""

from __future__ import annotations

import re
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, fields
from enum import Enum
from functools import cache
from typing import Any, ClassVar, TypeVar, Union, get_args, get_origin, get_type_hints

from lifecycle.config_file import FREE_FORM_LIMIT, check_free_form, path_problem, read_items, read_sequence
from lifecycle.config_scalars import SCALARS, describe, scalar
from lifecycle.errors import ConfigError, shorten


@dataclass(frozen=True, slots=True)
class Rule:
    """Constraints beyond a field's type, kept as data so one validator serves every field."""

    key: str | None = None
    """External (dict/YAML) name when the attribute name cannot be used, e.g. a Python keyword."""
    ge: float | None = None
    """Inclusive lower bound."""
    gt: float | None = None
    """Exclusive lower bound."""
    le: float | None = None
    """Inclusive upper bound, for values past which nothing can work (allocation, clock arithmetic)."""
    choices: tuple[str, ...] = ()
    """Allowed string values; `pattern` may admit more."""
    pattern: str | None = None
    """Regex each string (or list item) must fully match, unless it is one of `choices`."""
    shape: str = ""
    """Words for `pattern` in error messages, since users should not have to read a regex."""
    problem: Callable[[str], str | None] | None = None
    """Says why a string (or list item) is unusable, or None: lets a rule owned elsewhere (the
    filesystem boundary's role names) apply here unchanged, so config and store cannot disagree."""
    unique: bool = False
    """A list may not repeat an item."""
    non_empty: bool = False
    """A list must hold at least one item."""
    deprecated: bool = False
    """Accepted and translated, but neither listed among the valid keys nor dumped."""
    path: bool = False
    """The string names a file or folder: checked by `path_problem`."""
    extras: bool = False
    """A `dict` field holding the keys the section does not declare, for the component the
    section selects to check (`compose`); flattened into the section in data and dumps."""


NO_RULE = Rule()
_RULE_KEYS = frozenset(Rule.__dataclass_fields__)


def rule_of(f: Field[Any]) -> Rule:
    """A field's rule: `rule(...)` metadata, or plain metadata keys named like `Rule`'s fields."""
    given = f.metadata.get("rule")
    if isinstance(given, Rule):
        return given
    plain = {key: value for key, value in f.metadata.items() if key in _RULE_KEYS}
    return Rule(**plain) if plain else NO_RULE


def rule(**kwargs: Any) -> dict[str, Rule]:
    """Field metadata carrying a `Rule`: `field(metadata=rule(ge=1))`."""
    return {"rule": Rule(**kwargs)}


S = TypeVar("S", bound="Section")


class Section:
    """Shared behaviour of config sections: validate on construction, dump to plain data."""

    __slots__ = ()
    _prefix: ClassVar[str] = ""
    """Dotted path of the section in the tree, set by `place_sections`; errors start from it."""

    def __new__(cls: type[S], *args: object, **kwargs: object) -> S:
        """Keyword arguments are keys like any other (`check_keywords`). (`__new__`, since the
        dataclass decorator writes `__init__` after the class.)"""
        check_keywords(cls, cls._prefix, args, kwargs, "build one from a mapping with LifecycleConfig.from_dict")
        return object.__new__(cls)

    def __post_init__(self) -> None:
        validate(self)

    def _check(self) -> None:
        """Cross-field rules of the section; runs after every field is coerced."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data that `from_dict` turns back into an equal config."""
        data: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            rule = rule_of(f)
            if rule.extras:
                data.update(_plain(getattr(self, f.name)))
            elif not rule.deprecated:
                data[_key_of(f)] = _plain(getattr(self, f.name))
        return data


def check_keywords(cls: type, prefix: str, args: tuple[object, ...], kwargs: Mapping[str, object], how: str) -> None:
    """A dataclass's constructor arguments as config keys: a positional one, a misspelt one or a
    missing required one is a `ConfigError` naming the key (and the valid ones), as in a dict or
    YAML, rather than the generated `__init__`'s `TypeError`. `how`: what to do instead of
    positional arguments. Pickle and `copy` call `__new__` too: a class with a required field
    gives them its value in `__getnewargs_ex__`."""
    if args:
        raise ConfigError(prefix, f"{cls.__name__} takes keyword arguments only, got {len(args)} positional; {how}")
    names = _init_names(cls)
    for key in kwargs:
        if key not in names:
            listed = ", ".join(sorted(name for name in names if not _deprecated(cls, name)))
            raise ConfigError(join(prefix, key), f"unknown keyword argument; valid ones: {listed}")
    for f in fields(cls):
        if f.init and f.name not in kwargs and f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError(join(prefix, f.name), f"required; give {cls.__name__}({f.name}=...)")


@cache
def _init_names(cls: type) -> frozenset[str]:
    """The keyword arguments a section's `__init__` takes: its fields' attribute names."""
    return frozenset(f.name for f in fields(cls) if f.init)


def place_sections(cls: type[Section], prefix: str = "") -> None:
    """Give each section class its dotted path; each sits at exactly one place in the tree."""
    cls._prefix = prefix
    for name, hint in hints_of(cls).items():
        if isinstance(hint, type) and issubclass(hint, Section):
            place_sections(hint, join(prefix, name))


def join(prefix: str, key: object) -> str:
    """The dotted key; a key that would not read as one (not a string, empty, unprintable, padded,
    huge) is quoted, so a message cannot hide it or forge a line of its own."""
    readable = isinstance(key, str) and key != "" and key.strip() == key and key.isprintable() and len(key) <= 80
    text = key if readable else shorten(key)
    return f"{prefix}.{text}" if prefix else text


def _key_of(f: Field[Any]) -> str:
    return rule_of(f).key or f.name


@cache
def hints_of(cls: type) -> dict[str, Any]:
    """A dataclass's resolved type hints, once per class."""
    return get_type_hints(cls)


@cache
def keys_of(cls: type) -> dict[str, str]:
    """External key -> attribute of the fields that take a key of their own (not `extras`)."""
    return {_key_of(f): f.name for f in fields(cls) if not rule_of(f).extras}


@cache
def _extras_field(cls: type) -> str | None:
    return next((f.name for f in fields(cls) if rule_of(f).extras), None)


def valid_keys(cls: type) -> list[str]:
    """The keys a section lists as valid: its own, less the deprecated ones."""
    return sorted(key for key, name in keys_of(cls).items() if not _deprecated(cls, name))


def _deprecated(cls: type, name: str) -> bool:
    return any(f.name == name and rule_of(f).deprecated for f in fields(cls))


def build(cls: type[Any], data: object) -> Any:
    """Turn a mapping into a section, rejecting unknown keys with the section's valid ones."""
    path = cls._prefix
    data = _resolved(data, path)
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"expected a mapping for section {path or 'config'}, got {describe(data)}")
    keys, extras_field = keys_of(cls), _extras_field(cls)
    kwargs: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    for key, value in read_items(data.items, path, f"section {path}" if path else "the config"):
        if not isinstance(key, str):
            raise ConfigError(join(path, key), f"a key must be a string, got {describe(key)}")
        if key in keys:
            kwargs[keys[key]] = value
        elif extras_field is not None:
            extras[key] = value
        else:
            raise ConfigError(join(path, key), f"unknown key; valid keys: {', '.join(valid_keys(cls))}")
    if extras:
        kwargs[extras_field] = extras  # type: ignore[index]
    return cls(**kwargs)


def _resolved(value: object, key: str) -> object:
    """`value` as plain data if it is an OmegaConf container (a trainer's `DictConfig`, which is a
    `Mapping`), every interpolation resolved; any other value as it is. Read key by key, a missing
    value (`???`) or a broken interpolation would raise OmegaConf's own exceptions; resolved whole,
    they become a `ConfigError` naming the key. No value can be one before omegaconf is imported,
    so omegaconf is never imported here for it."""
    omegaconf = sys.modules.get("omegaconf")
    if omegaconf is None or not isinstance(value, omegaconf.Container):
        return value
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    try:
        return OmegaConf.to_container(value, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as error:
        full_key = str(getattr(error, "full_key", None) or "")
        node = str(value._get_full_key(None) or "")  # a sub-node (cfg.lifecycle): its keys start from the root
        if node and full_key.startswith(node):
            full_key = full_key[len(node):].lstrip(".")
        where = join(key, re.sub(r"\[\d+\]$", "", full_key)) if full_key else key
        if isinstance(error, MissingMandatoryValue):
            raise ConfigError(where, "missing ('???' in the OmegaConf config); give it a value") from None
        problem = (str(error).splitlines() or [type(error).__name__])[0]
        raise ConfigError(where, f"cannot resolve its interpolation: {shorten(problem)}") from None


def validate(section: Section) -> None:
    """The one validation path: coerce every field by its type hint, apply its rule, then cross-check.
    The extras field is only read here: `compose` checks each of its keys, by the component's type."""
    hints = hints_of(type(section))
    for f in fields(section):  # type: ignore[arg-type]
        key, value = join(section._prefix, _key_of(f)), getattr(section, f.name)
        setattr(section, f.name, _mapping(value, key, "") if rule_of(f).extras else
                check_value(value, hints[f.name], rule_of(f), key))
    section._check()


def check_value(value: object, hint: Any, rule: Rule, key: str) -> Any:
    """`value` coerced to the type `hint` and checked against `rule`; a `ConfigError` on `key`."""
    value = _coerce(value, hint, key)
    if value is not None:
        _apply_rule(value, rule, key)
    return value


def _coerce(value: object, hint: Any, key: str, where: str = "") -> Any:
    """Convert `value` to the hinted type, accepting the plain forms YAML and dicts produce.

    A section given as None takes its defaults, since that is what an emptied YAML block parses to.
    A section given as an instance is checked again: it may have been changed since it was built.
    """
    value = _resolved(value, key)
    if get_origin(hint) in (Union, types.UnionType):
        inner = [arg for arg in get_args(hint) if arg is not type(None)]
        if len(inner) > 1:  # which member a value meant is not for a coercion to guess
            raise ConfigError(key, f"no coercion for field type {hint!r}")
        return None if value is None else _coerce(value, inner[0], key, where)
    if get_origin(hint) is dict:
        data, inner = _mapping(value, key, where), get_args(hint)[1] if len(get_args(hint)) == 2 else Any
        if inner is Any:  # free-form: kept as given, once known to end (no cycle, bounded depth and size)
            check_free_form(data, key, where)
        return {k: v if inner is Any else _coerce(v, inner, key, f"{where}key {shorten(k)}: ") for k, v in data.items()}
    if get_origin(hint) is list:
        if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
            raise ConfigError(key, f"expected a list, got {describe(value)}")
        if (items := read_sequence(value, key, "the list", FREE_FORM_LIMIT)) is None:
            raise ConfigError(key, f"holds more than {FREE_FORM_LIMIT} items")
        return [_coerce(v, get_args(hint)[0], key, f"item {i}: ") for i, v in enumerate(items)]
    if isinstance(hint, type) and issubclass(hint, Enum):
        if isinstance(value, hint):
            return value
        for member in hint:  # by value, of the value's own type: True is no stand-in for 1
            if isinstance(value, type(member.value)) and isinstance(value, bool) == isinstance(member.value, bool) \
                    and value == member.value:
                return member
        choices = ", ".join(str(member.value) for member in hint)
        raise ConfigError(key, f"{where}expected one of {choices}, got {describe(value)}")
    if hint is str and isinstance(value, Enum) and isinstance(value.value, str):
        value = value.value  # a str Enum's member (`Format.HF`) stands for its name
    if hint in SCALARS:
        return scalar(value, hint, key, where)
    if isinstance(hint, type) and issubclass(hint, Section):
        if isinstance(value, hint):
            validate(value)  # type: ignore[arg-type]
            return value
        return build(hint, {} if value is None else value)
    raise ConfigError(key, f"no coercion for field type {hint!r}")


def _mapping(value: object, key: str, where: str) -> dict[str, Any]:
    """`value` read into a plain dict with string keys, else a `ConfigError`."""
    value = _resolved(value, key)
    items = read_items(value.items, key, "the mapping") if isinstance(value, Mapping) else None
    if items is None or not all(isinstance(k, str) for k, _ in items):
        raise ConfigError(key, f"{where}expected a mapping of keys to values, got {describe(value)}")
    return dict(items)


def _bound(number: float) -> str:
    return f"{number:g}" if isinstance(number, float) else str(number)


def _apply_rule(value: Any, rule: Rule, key: str) -> None:
    """Check the data-driven constraints of one coerced, non-None field value."""
    if rule.ge is not None and not value >= rule.ge:
        raise ConfigError(key, f"must be >= {_bound(rule.ge)}, got {shorten(value)}")
    if rule.gt is not None and not value > rule.gt:
        raise ConfigError(key, f"must be > {_bound(rule.gt)}, got {shorten(value)}")
    if rule.le is not None and not value <= rule.le:
        raise ConfigError(key, f"must be <= {_bound(rule.le)}, got {shorten(value)}")
    if isinstance(value, list):
        if rule.non_empty and not value:
            raise ConfigError(key, "must list at least one item")
        seen: set[Any] = set()
        for i, item in enumerate(value):
            if rule.unique and item in seen:
                raise ConfigError(key, f"item {i}: duplicate {shorten(getattr(item, 'value', item))}")
            seen.add(item)
            _check_string(item, rule, key, f"item {i}: ")
    elif isinstance(value, str):
        _check_string(value, rule, key, "")


def _check_string(value: str, rule: Rule, key: str, where: str) -> None:
    try:
        problem = rule.problem(value) if rule.problem is not None else None
    except Exception as exc:  # noqa: BLE001 - a component's own rule may raise anything
        raise ConfigError(key, f"{where}checking the value failed: {type(exc).__name__}: {shorten(str(exc))}") from exc
    if problem:
        raise ConfigError(key, f"{where}{problem}")
    if rule.path and (problem := path_problem(value)):
        raise ConfigError(key, f"{where}{problem}")
    if (not rule.choices and rule.pattern is None) or value in rule.choices:
        return
    if rule.pattern is not None and re.fullmatch(rule.pattern, value):
        return
    wanted = [f"one of {', '.join(rule.choices)}"] if rule.choices else []
    wanted += [rule.shape] if rule.pattern is not None else []
    raise ConfigError(key, f"{where}expected {' or '.join(wanted)}, got {shorten(value)}")


def _plain(value: Any) -> Any:
    if isinstance(value, Section):
        return value.to_dict()
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
