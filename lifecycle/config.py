"""Typed lifecycle config, so a bad key fails at start-up with its full dotted path, not mid-run.

Each section validates itself in `__post_init__` from its type hints and per-field rules: kwargs,
nested dicts and YAML all go through that one path.
"""

from __future__ import annotations

import os
import re
import types
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import Field, dataclass, field, fields, is_dataclass
from enum import Enum
from functools import cache
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import structlog
import yaml

from lifecycle.errors import ConfigError

__all__ = [
    "APPLY_MODES", "ENGINE_BACKENDS", "ROLLOUT_DTYPES", "CheckpointConfig", "Content", "EngineConfig", "Format",
    "LifecycleConfig", "LoadConfig", "PreLoadConfig", "ResumeConfig", "ResumeMode", "SaveConfig",
]


class Format(str, Enum):
    """On-disk layout of model weights; decides which checkpointer reads or writes them."""

    HF = "hf"
    MBRIDGE = "mbridge"
    DIST_CKPT = "dist_ckpt"
    TORCH_DCP = "torch_dcp"


class Content(str, Enum):
    """One part of a checkpoint step folder."""

    MODEL = "model"
    HF_MODEL = "hf_model"
    OPTIMIZER = "optimizer"
    EXTRA = "extra"


class ResumeMode(str, Enum):
    """Where resume looks: the newest complete step, nowhere, or one given folder."""

    AUTO = "auto"
    DISABLE = "disable"
    PATH = "path"


ENGINE_BACKENDS: tuple[str, ...] = ("auto", "gloo", "nccl", "hccl", "shm", "naive")
ROLLOUT_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
APPLY_MODES: tuple[str, ...] = ("atomic", "streamed")

_MEGATRON, _TORCH = "Megatron", "plain-torch"
_FAMILIES: dict[Format, str] = {
    Format.MBRIDGE: _MEGATRON, Format.DIST_CKPT: _MEGATRON, Format.HF: _TORCH, Format.TORCH_DCP: _TORCH
}
_ALL_CONTENTS: tuple[Content, ...] = (Content.MODEL, Content.OPTIMIZER, Content.EXTRA)


@dataclass(frozen=True, slots=True)
class _Rule:
    """Constraints beyond a field's type, kept as data so one validator serves every field."""

    key: str | None = None
    """External (dict/YAML) name when the attribute name cannot be used, e.g. a Python keyword."""
    ge: float | None = None
    """Inclusive lower bound."""
    gt: float | None = None
    """Exclusive lower bound."""
    choices: tuple[str, ...] = ()
    """Allowed string values; `pattern` may admit more."""
    pattern: str | None = None
    """Regex each string (or list item) must fully match, unless it is one of `choices`."""
    shape: str = ""
    """Words for `pattern` in error messages, since users should not have to read a regex."""
    unique: bool = False
    """A list may not repeat an item."""
    non_empty: bool = False
    """A list must hold at least one item."""
    deprecated: bool = False
    """Accepted and translated, but neither listed among the valid keys nor dumped."""


_NO_RULE = _Rule()


def _rule(**kwargs: Any) -> dict[str, _Rule]:
    return {"rule": _Rule(**kwargs)}


class _Section:
    """Shared behaviour of config sections: validate on construction, dump to plain data."""

    __slots__ = ()

    def __post_init__(self) -> None:
        _validate(self)

    def _check(self) -> None:
        """Cross-field rules of the section; runs after every field is coerced."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data that `from_dict` turns back into an equal config."""
        return {_key_of(f): _plain(getattr(self, f.name)) for f in fields(self)  # type: ignore[arg-type]
                if not f.metadata.get("rule", _NO_RULE).deprecated}


@dataclass(kw_only=True, slots=True)
class PreLoadConfig(_Section):
    """Weights for the first load, before any checkpoint of this run exists."""

    format: Format | None = None
    """Layout of the weights at `path`; None: mbridge for a Megatron save format, else hf."""
    path: str | None = None
    """Folder of the initial weights; None keeps the model's own initialisation."""


@dataclass(kw_only=True, slots=True)
class LoadConfig(_Section):
    """How resume reads a step folder."""

    format: Format | None = None
    """Layout to read; None reads whatever `save.format` writes."""
    contents: list[Content] = field(
        default_factory=lambda: list(_ALL_CONTENTS), metadata=_rule(non_empty=True, unique=True)
    )
    """Parts of the step folder to restore."""
    verify: bool = True
    """Check every file's checksum while resuming. Presence and sizes are always checked;
    false trusts the bytes on disk, for loads at the raw read speed."""

    def _check(self) -> None:
        if Content.HF_MODEL in self.contents:
            raise ConfigError(
                "checkpoint.load.contents",
                "hf_model is an export and cannot be resumed from; list 'model' instead",
            )


@dataclass(kw_only=True, slots=True)
class SaveConfig(_Section):
    """How each step folder is written."""

    format: Format = Format.HF
    """Layout of the saved model weights."""
    contents: list[Content] = field(
        default_factory=lambda: list(_ALL_CONTENTS), metadata=_rule(non_empty=True, unique=True)
    )
    """Parts written into each step folder."""
    async_: bool = field(default=False, metadata=_rule(key="async"))
    """Write in the background so training resumes before the files are on disk."""


@dataclass(kw_only=True, slots=True)
class CheckpointConfig(_Section):
    """Where checkpoints live and how they are loaded and saved."""

    root: str | None = None
    """Folder holding the global_step_N/ folders; None disables saving and resuming."""
    roles: list[str] = field(
        default_factory=list,
        metadata=_rule(
            unique=True, pattern=r"[A-Za-z0-9_.-]+", shape="a name of letters, digits, '_', '.' or '-'"
        ),
    )
    """Roles a step must hold to count as complete; empty means only this worker's role."""
    keep_last: int | None = field(default=None, metadata=_rule(ge=1))
    """Number of newest complete steps to keep; None keeps all."""
    fsync: bool = False
    """fsync every file before the commit: survives power loss on a local disk, at a full flush's cost."""
    pre_load: PreLoadConfig = field(default_factory=PreLoadConfig)
    """The first load of weights."""
    load: LoadConfig = field(default_factory=LoadConfig)
    """How resume reads a step."""
    save: SaveConfig = field(default_factory=SaveConfig)
    """How a step is written."""
    use_dist_checkpointing: bool | None = field(default=None, metadata=_rule(deprecated=True))
    """Deprecated (verl's flag): true means pre_load.format and save.format dist_ckpt."""
    use_mbridge: bool | None = field(default=None, metadata=_rule(deprecated=True))
    """Deprecated (verl's flag): true means pre_load.format and save.format mbridge."""

    @property
    def load_format(self) -> Format:
        """The format resume reads with, since an unset `load.format` follows `save.format`."""
        return self.load.format or self.save.format

    @property
    def pre_load_format(self) -> Format:
        """The first load's format; unset, HF weights enter a Megatron model through mbridge."""
        if self.pre_load.format is not None:
            return self.pre_load.format
        return Format.MBRIDGE if _FAMILIES[self.save.format] == _MEGATRON else Format.HF

    def _translate_legacy_flags(self) -> None:
        """verl's two booleans become the formats they chose there: dist_checkpointing wins the
        first load and the save; mbridge alone means HF weights through the bridge both ways."""
        dist, bridge = self.use_dist_checkpointing, self.use_mbridge
        if dist is None and bridge is None:
            return
        fmt = Format.DIST_CKPT if dist else Format.MBRIDGE if bridge else None
        given = [f"checkpoint.use_dist_checkpointing={dist}"] if dist is not None else []
        given += [f"checkpoint.use_mbridge={bridge}"] if bridge is not None else []
        if fmt is not None:
            for key, current in (("checkpoint.save.format", self.save.format),
                                 ("checkpoint.pre_load.format", self.pre_load.format)):
                if current not in (None, Format.HF, fmt):
                    raise ConfigError(key, f"{key} {current.value!r} conflicts with the deprecated "
                                           f"{' and '.join(given)}, which mean {fmt.value!r}; drop the flags")
            self.save.format = self.pre_load.format = fmt
        action = f"use checkpoint.save.format and checkpoint.pre_load.format = {fmt.value!r}" if fmt else \
            "drop them (false changes nothing)"
        message = f"deprecated config {' and '.join(given)}: {action}"
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        structlog.get_logger().warning("config.deprecated", keys=given, action=action)
        self.use_dist_checkpointing = self.use_mbridge = None

    def _check(self) -> None:
        """A worker runs one model implementation: every format must load into that model.

        Inside a family the formats may differ (resume an old dist_ckpt, save mbridge from
        now on): resume reads each content with the backend its manifest names.
        """
        self._translate_legacy_flags()
        save = self.save.format
        _same_family("checkpoint.pre_load.format", self.pre_load_format, "checkpoint.save.format", save)
        _same_family("checkpoint.load.format", self.load_format, "checkpoint.save.format", save)


@dataclass(kw_only=True, slots=True)
class ResumeConfig(_Section):
    """Whether and from where a restarted worker picks up training."""

    mode: ResumeMode = ResumeMode.AUTO
    """auto: newest complete step under checkpoint.root; disable: start fresh; path: the step at `path`."""
    path: str | None = None
    """Step folder to resume from; only with mode 'path'."""
    strict: bool = True
    """Refuse a checkpoint whose model-config hash differs from the running model's."""

    def _check(self) -> None:
        if self.mode is ResumeMode.PATH and self.path is None:
            raise ConfigError("resume.path", "resume.mode is 'path' but resume.path is not set")
        if self.mode is not ResumeMode.PATH and self.path is not None:
            raise ConfigError(
                "resume.path",
                f"resume.path is set but resume.mode is {self.mode.value!r}; "
                "set resume.mode to 'path' or drop resume.path",
            )


@dataclass(kw_only=True, slots=True)
class EngineConfig(_Section):
    """The weight-sync engine that moves trained weights to the rollout workers."""

    backend: str = field(
        default="auto",
        metadata=_rule(
            choices=ENGINE_BACKENDS,
            pattern=r"[A-Za-z_][\w.]*:[A-Za-z_]\w*",
            shape="an import path 'pkg.module:Name'",
        ),
    )
    """Built-in engine name, or an import path to a custom engine class."""
    bucket_bytes: int = field(default=2 * 1024**3, metadata=_rule(gt=0))
    """Largest transfer bucket; bounds the extra memory one sync needs."""
    verify: bool = True
    """Checksum each bucket so a corrupt transfer fails loudly instead of serving bad weights."""
    apply: str = field(default="atomic", metadata=_rule(choices=APPLY_MODES))
    """When a receiver hands tensors to its rollout: `atomic` once every bucket of the sync has
    verified (it holds the whole sync meanwhile), `streamed` bucket by bucket (two buckets held;
    a later bad bucket leaves earlier ones applied and the rollout stale)."""
    timeout_s: float = field(default=300.0, metadata=_rule(gt=0))
    """Seconds one sync may take before it is an error."""
    rollout_dtype: str | None = field(default=None, metadata=_rule(choices=ROLLOUT_DTYPES))
    """Dtype the rollout side expects; None sends the trainer's dtype unchanged."""
    profile: bool = False
    """Record a profiler trace of each sync."""
    profile_dir: str | None = None
    """Folder for profiler traces; required when `profile` is true."""

    def _check(self) -> None:
        if self.profile and self.profile_dir is None:
            raise ConfigError(
                "engine.profile_dir", "engine.profile is true but engine.profile_dir is not set"
            )


@dataclass(kw_only=True, slots=True)
class LifecycleConfig(_Section):
    """Everything one trainer worker's lifecycle needs to know."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving, loading and pruning of checkpoints."""
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    """Picking up after a restart."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Weight sync to the rollout workers."""

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any] | None) -> LifecycleConfig:
        """Build from parsed data (plain dict, converted DictConfig); None or empty gives defaults."""
        return _build(cls, {} if mapping is None else mapping)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> LifecycleConfig:
        """Build from a YAML file; file-level errors name the file since there is no key yet."""
        name = os.fspath(path)
        try:
            text = Path(name).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(name, f"cannot read config file: {exc.strerror or exc}") from exc
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(name, f"not valid YAML: {exc}") from exc
        if data is not None and not isinstance(data, Mapping):
            raise ConfigError(name, f"the top level must be a mapping of sections, got {_describe(data)}")
        return cls.from_dict(data)

    @classmethod
    def coerce(
        cls, source: LifecycleConfig | Mapping[str, Any] | str | os.PathLike[str] | None
    ) -> LifecycleConfig:
        """Accept whatever a caller has at hand, so entry points need no branching of their own."""
        if source is None or isinstance(source, Mapping):
            return cls.from_dict(source)
        if isinstance(source, cls):
            return source
        if isinstance(source, (str, os.PathLike)):
            return cls.from_yaml(source)
        raise ConfigError(
            "", f"expected a LifecycleConfig, a mapping, a YAML path or None, got {_describe(source)}"
        )


def _describe(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def _join(prefix: str, key: object) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _key_of(f: Field[Any]) -> str:
    return f.metadata.get("rule", _NO_RULE).key or f.name


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


@cache
def _keys(cls: type) -> dict[str, str]:
    return {_key_of(f): f.name for f in fields(cls)}


def _deprecated(cls: type, name: str) -> bool:
    return any(f.name == name and f.metadata.get("rule", _NO_RULE).deprecated for f in fields(cls))


def _build(cls: type[Any], data: object) -> Any:
    """Turn a mapping into a section, rejecting unknown keys with the section's valid ones."""
    path = _PATHS[cls]
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"expected a mapping for section {path or 'config'}, got {_describe(data)}")
    keys = _keys(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in keys:
            listed = sorted(k for k, name in keys.items() if not _deprecated(cls, name))
            raise ConfigError(_join(path, key), f"unknown key; valid keys: {', '.join(listed)}")
        kwargs[keys[key]] = value
    return cls(**kwargs)


def _validate(section: _Section) -> None:
    """The one validation path: coerce every field by its type hint, apply its rule, then cross-check."""
    path = _PATHS[type(section)]
    hints = _hints(type(section))
    for f in fields(section):  # type: ignore[arg-type]
        key = _join(path, _key_of(f))
        value = _coerce(getattr(section, f.name), hints[f.name], key)
        if value is not None:
            _apply_rule(value, f.metadata.get("rule", _NO_RULE), key)
        setattr(section, f.name, value)
    section._check()


_SCALARS: dict[type, tuple[str, tuple[type, ...]]] = {
    bool: ("a boolean", (bool,)),
    int: ("an integer", (int,)),
    float: ("a number", (int, float)),
    str: ("a string", (str,)),
}


def _coerce(value: object, hint: Any, key: str, where: str = "") -> Any:
    """Convert `value` to the hinted type, accepting the plain forms YAML and dicts produce.

    A section given as None takes its defaults, since that is what an emptied YAML block parses to.
    """
    if get_origin(hint) in (Union, types.UnionType):
        inner = [arg for arg in get_args(hint) if arg is not type(None)]
        return None if value is None else _coerce(value, inner[0], key, where)
    if get_origin(hint) is list:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ConfigError(key, f"expected a list, got {_describe(value)}")
        return [_coerce(v, get_args(hint)[0], key, f"item {i}: ") for i, v in enumerate(value)]
    if isinstance(hint, type) and issubclass(hint, Enum):
        choices = [member.value for member in hint]
        if isinstance(value, str) and value in choices:
            return hint(value)
        raise ConfigError(key, f"{where}expected one of {', '.join(choices)}, got {_describe(value)}")
    if hint in _SCALARS:
        what, accepted = _SCALARS[hint]
        if isinstance(value, bool) and hint is not bool or not isinstance(value, accepted):
            raise ConfigError(key, f"{where}expected {what}, got {_describe(value)}")
        return float(value) if hint is float else value  # type: ignore[arg-type]
    if is_dataclass(hint):
        return value if isinstance(value, hint) else _build(hint, {} if value is None else value)
    raise ConfigError(key, f"no coercion for field type {hint!r}")


def _apply_rule(value: Any, rule: _Rule, key: str) -> None:
    """Check the data-driven constraints of one coerced, non-None field value."""
    if rule.ge is not None and not value >= rule.ge:
        raise ConfigError(key, f"must be >= {rule.ge:g}, got {value!r}")
    if rule.gt is not None and not value > rule.gt:
        raise ConfigError(key, f"must be > {rule.gt:g}, got {value!r}")
    if isinstance(value, list):
        if rule.non_empty and not value:
            raise ConfigError(key, "must list at least one item")
        seen: set[Any] = set()
        for i, item in enumerate(value):
            if rule.unique and item in seen:
                raise ConfigError(key, f"item {i}: duplicate {getattr(item, 'value', item)!r}")
            seen.add(item)
            _check_string(item, rule, key, f"item {i}: ")
    elif isinstance(value, str):
        _check_string(value, rule, key, "")


def _check_string(value: str, rule: _Rule, key: str, where: str) -> None:
    if (not rule.choices and rule.pattern is None) or value in rule.choices:
        return
    if rule.pattern is not None and re.fullmatch(rule.pattern, value):
        return
    wanted = [f"one of {', '.join(rule.choices)}"] if rule.choices else []
    wanted += [rule.shape] if rule.pattern is not None else []
    raise ConfigError(key, f"{where}expected {' or '.join(wanted)}, got {value!r}")


def _same_family(key: str, fmt: Format, other_key: str, other: Format) -> None:
    """One worker runs one model implementation, so all its formats must suit that implementation."""
    if _FAMILIES[fmt] != _FAMILIES[other]:
        raise ConfigError(
            key,
            f"{key} {fmt.value!r} is a {_FAMILIES[fmt]} format but {other_key} {other.value!r} "
            f"is a {_FAMILIES[other]} format; a worker's formats must share one model family",
        )


def _plain(value: Any) -> Any:
    if isinstance(value, _Section):
        return value.to_dict()
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _section_paths(cls: type, path: str, out: dict[type, str]) -> dict[type, str]:
    """Each section class sits at exactly one place in the tree, so its dotted path is fixed."""
    out[cls] = path
    for name, hint in _hints(cls).items():
        if isinstance(hint, type) and issubclass(hint, _Section):
            _section_paths(hint, _join(path, name), out)
    return out


_PATHS: dict[type, str] = _section_paths(LifecycleConfig, "", {})
