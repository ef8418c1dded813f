"""Typed lifecycle config, so a bad key fails at start-up with its full dotted path, not mid-run.

Each section validates itself in `__post_init__` from its type hints and per-field rules
(`lifecycle.config_rules`): kwargs, nested dicts and YAML all go through that one path, and a
value that cannot work (an infinite timeout, a bucket no engine can pack, a role that is no
folder name, an empty path) is refused there rather than in the middle of a save or a sync.

The components own their keys: `engine:` is `backends.engines.options.EngineOptions` plus the
backend's name, and a format's or an engine's own options (`checkpoint.save.max_shard_bytes`
for hf) are checked against the class the section names. Formats and engines are names in
their registries, so one registered from outside is selected exactly as a built-in is. The
registries are imported when a config is checked, not with this module: the `lifecycle`
package imports this module, and a backend module imported first imports `lifecycle.errors`.
Composing a component's options is `lifecycle.config_components`' part, reading a YAML file
`lifecycle.config_file`'s.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from backends.engines.options import (
    APPLY_MODES, AUTO, MAX_BUCKET_BYTES, MAX_TIMEOUT_S, MIN_BUCKET_BYTES, ROLLOUT_DTYPES, EngineOptions,
)
from lifecycle.boundary import role_problem
from lifecycle.config_components import compose
from lifecycle.config_file import CONFIG_FILE_LIMIT, read_yaml
from lifecycle.config_rules import (
    Section, build, describe, join, path_problem, place_sections, rule, validate,
)
from lifecycle.errors import ConfigError, shorten
from lifecycle.types import Content
from lifecycle.watchdog import MIN_BUDGET_S

if TYPE_CHECKING:
    from backends.base import FormatCapabilities

__all__ = [
    "APPLY_MODES", "CONFIG_FILE_LIMIT", "MAX_BUCKET_BYTES", "MAX_KEEP_LAST", "MAX_TIMEOUT_S",
    "MIN_BUCKET_BYTES", "ROLLOUT_DTYPES", "CheckpointConfig", "Content", "EngineConfig", "LifecycleConfig",
    "LoadConfig", "OnDamaged", "WatchdogConfig", "format_family", "PreLoadConfig", "ResumeConfig", "ResumeMode", "SaveConfig",
]

O = TypeVar("O", bound=EngineOptions)


class ResumeMode(str, Enum):
    """Where resume looks: the newest complete step, nowhere, or one given folder."""

    AUTO = "auto"
    DISABLE = "disable"
    PATH = "path"


class OnDamaged(str, Enum):
    """What resume does with a newest step that fails verification: step past it, or stop."""

    FALLBACK = "fallback"
    REFUSE = "refuse"


MAX_KEEP_LAST: int = 10**18
"""Step folders have at most 18 digits, so no root can hold more steps than this."""

_ALL_CONTENTS: tuple[Content, ...] = (Content.MODEL, Content.OPTIMIZER, Content.EXTRA)


def _format_problem(name: str) -> str | None:
    from backends.base import FORMATS

    return FORMATS.problem(name)


def _engine_problem(name: str) -> str | None:
    from backends.engines.registry import CheckpointEngineRegistry

    return CheckpointEngineRegistry.problem(name)


@dataclass(kw_only=True, slots=True)
class PreLoadConfig(Section):
    """Weights for the first load, before any checkpoint of this run exists."""

    format: str | None = field(default=None, metadata=rule(problem=_format_problem))
    """Layout of the weights at `path`; None: the format that reads HF weights into the save
    format's model family (mbridge for a Megatron one, hf for plain torch)."""
    path: str | None = field(default=None, metadata=rule(problem=path_problem))
    """Folder of the initial weights; None keeps the model's own initialisation."""


@dataclass(kw_only=True, slots=True)
class LoadConfig(Section):
    """How resume reads a step folder."""

    format: str | None = field(default=None, metadata=rule(problem=_format_problem))
    """Layout to read; None reads whatever `save.format` writes."""
    contents: list[Content] = field(
        default_factory=lambda: list(_ALL_CONTENTS), metadata=rule(non_empty=True, unique=True)
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
class SaveConfig(Section):
    """How each step folder is written."""

    format: str = field(default="hf", metadata=rule(problem=_format_problem))
    """Layout of the saved model weights: a registered format's name or `pkg.module:Class`."""
    contents: list[Content] = field(
        default_factory=lambda: list(_ALL_CONTENTS), metadata=rule(non_empty=True, unique=True)
    )
    """Parts written into each step folder."""
    async_: bool = field(default=False, metadata=rule(key="async"))
    """Write in the background so training resumes before the files are on disk."""
    options: dict[str, Any] = field(default_factory=dict, metadata=rule(extras=True))
    """The format's own keys (hf: `max_shard_bytes`), written beside the others and checked
    against the format's options dataclass, which holds their defaults."""

    def _check(self) -> None:
        from backends.base import FORMATS, format_capabilities

        key = join(self._prefix, "format")
        capabilities = format_capabilities(self.format, key)
        if held := [c.value for c in self.contents if c is not Content.EXTRA and c.value not in capabilities.contents]:
            raise ConfigError(join(self._prefix, "contents"),
                              f"format {self.format!r} cannot hold {', '.join(held)}; it holds "
                              f"{', '.join(sorted(capabilities.contents))} (and extra)")
        if self.options or FORMATS.builtin(self.format) is None:  # a built-in is imported only when needed
            options = FORMATS.get(self.format, key).Options
            self.options = compose(self, self.options, options, selector=key,
                                   what=f"format {shorten(self.format)}")[0]


@dataclass(kw_only=True, slots=True)
class CheckpointConfig(Section):
    """Where checkpoints live and how they are loaded and saved."""

    root: str | None = field(default=None, metadata=rule(problem=path_problem))
    """Folder holding the global_step_N/ folders; None disables saving and resuming."""
    roles: list[str] = field(default_factory=list, metadata=rule(unique=True, problem=role_problem))
    """Roles a step must hold to count as complete; empty means only this worker's role. Each is
    a folder name, checked by the same rule the checkpoint store applies."""
    keep_last: int | None = field(default=None, metadata=rule(ge=1, le=MAX_KEEP_LAST))
    """Number of newest complete steps to keep; None keeps all."""
    fsync: bool = False
    """fsync every file before the commit: survives power loss on a local disk, at a full flush's cost."""
    tracker: bool = True
    """Write latest_checkpointed_iteration.txt once a step is complete for `roles`; false leaves it
    to the trainer (verl's writes its own after every role has saved)."""
    pre_load: PreLoadConfig = field(default_factory=PreLoadConfig)
    """The first load of weights."""
    load: LoadConfig = field(default_factory=LoadConfig)
    """How resume reads a step."""
    save: SaveConfig = field(default_factory=SaveConfig)
    """How a step is written."""
    use_dist_checkpointing: bool | None = field(default=None, metadata=rule(deprecated=True))
    """Deprecated (verl's flag): true means pre_load.format and save.format dist_ckpt."""
    use_mbridge: bool | None = field(default=None, metadata=rule(deprecated=True))
    """Deprecated (verl's flag): true means pre_load.format and save.format mbridge."""

    @property
    def load_format(self) -> str:
        """The format resume reads with, since an unset `load.format` follows `save.format`."""
        return self.load.format or self.save.format

    @property
    def pre_load_format(self) -> str:
        """The first load's format; unset, the save format if it reads HF weights, else the
        built-in that reads them into the save format's family (HF weights enter a Megatron
        model through mbridge), else the save format itself."""
        from backends.base import FORMATS, format_capabilities

        if self.pre_load.format is not None:
            return self.pre_load.format
        save = self.save.format
        capabilities = format_capabilities(save)
        if capabilities.native_hf:
            return save
        family = capabilities.family
        return next((name for name in FORMATS.builtin_names() if _reads_hf(format_capabilities(name), family)), save)

    def _translate_legacy_flags(self) -> None:
        """verl's two booleans become the formats they chose there: dist_checkpointing wins the
        first load and the save; mbridge alone means HF weights through the bridge both ways."""
        dist, bridge = self.use_dist_checkpointing, self.use_mbridge
        if dist is None and bridge is None:
            return
        fmt = "dist_ckpt" if dist else "mbridge" if bridge else None
        given = [f"checkpoint.use_dist_checkpointing={dist}"] if dist is not None else []
        given += [f"checkpoint.use_mbridge={bridge}"] if bridge is not None else []
        if fmt is not None:
            for key, current in (("checkpoint.save.format", self.save.format),
                                 ("checkpoint.pre_load.format", self.pre_load.format)):
                if current not in (None, "hf", fmt):
                    raise ConfigError(key, f"{key} {current!r} conflicts with the deprecated "
                                           f"{' and '.join(given)}, which mean {fmt!r}; drop the flags")
            self.save.format = self.pre_load.format = fmt
            validate(self.save)  # the options given under checkpoint.save are now the new format's to check
        action = f"use checkpoint.save.format and checkpoint.pre_load.format = {fmt!r}" if fmt else \
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
class ResumeConfig(Section):
    """Whether and from where a restarted worker picks up training."""

    mode: ResumeMode = ResumeMode.AUTO
    """auto: newest complete step under checkpoint.root; disable: start fresh; path: the step at `path`."""
    path: str | None = field(default=None, metadata=rule(problem=path_problem))
    """Step folder to resume from; only with mode 'path'."""
    strict: bool = True
    """Refuse a checkpoint whose model-config hash differs from the running model's."""
    on_damaged: OnDamaged = OnDamaged.FALLBACK
    """What resume.mode auto does when the newest committed step fails verification: fallback
    renames it aside (global_step_N.damaged-<time>) and resumes the next newest complete step;
    refuse stops with the error. resume.mode path always refuses."""

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
class EngineConfig(Section, EngineOptions):
    """The weight-sync engine that moves trained weights to the rollout workers: its name, and
    the options every engine takes (`EngineOptions`, whose fields and defaults these are)."""

    backend: str = field(default=AUTO, metadata=rule(problem=_engine_problem))
    """`auto` (the engine for the model's device), a registered engine's name, or `pkg.module:Class`."""
    options: dict[str, Any] = field(default_factory=dict, metadata=rule(extras=True))
    """The named engine's own keys, written beside the others and checked against its `Options`."""

    def _check(self) -> None:
        """The named engine's own keys are checked against its `Options`, which is then built
        and asked for its `problem()`: an engine's own cross-field rule fails here, not at the
        first sync. `auto` takes only the keys every engine does; a built-in named without keys
        of its own is not imported."""
        from backends.engines.registry import ENGINES, CheckpointEngineRegistry

        key = join(self._prefix, "backend")
        named = self.backend != AUTO and (self.options or ENGINES.builtin(self.backend) is None)
        engine = ENGINES.get(self.backend, key) if named else None
        what = f"engine {shorten(self.backend)}" if self.backend != AUTO else \
            "backend 'auto', which picks the engine by device,"
        common = {f.name: getattr(self, f.name) for f in fields(EngineOptions)}
        self.options, options = compose(self, self.options, engine.Options if engine else EngineOptions,
                                        selector=key, what=what, common=EngineOptions, values=common)
        try:
            where, why = options.problem() or (None, None)
        except Exception as exc:  # noqa: BLE001 - an engine's own problem() may raise anything
            raise ConfigError(key, f"{what}: checking its options failed: {type(exc).__name__}: "
                                   f"{shorten(str(exc))}") from exc
        if where is not None:
            raise ConfigError(join(self._prefix, where), str(why))
        if self.backend != AUTO and (problem := CheckpointEngineRegistry.apply_problem(self.backend, self.apply)):
            raise ConfigError(join(self._prefix, "apply"), problem)

    def options_for(self, options: type[O]) -> O:
        """The options of an engine whose `Options` class is `options`: this section's values."""
        return options(**{f.name: getattr(self, f.name) for f in fields(EngineOptions)}, **self.options)


@dataclass(kw_only=True, slots=True)
class WatchdogConfig(Section):
    """Budgets, in seconds, past which a running phase logs `lifecycle.phase_overdue` with every
    thread's stack (again at each further multiple); None watches nothing. The work is never
    interrupted: an engine's `timeout_s` still ends a sync that waits on a dead peer."""

    init_load_s: float | None = field(default=None, metadata=rule(ge=MIN_BUDGET_S, le=MAX_TIMEOUT_S))
    train_step_s: float | None = field(default=None, metadata=rule(ge=MIN_BUDGET_S, le=MAX_TIMEOUT_S))
    save_s: float | None = field(default=None, metadata=rule(ge=MIN_BUDGET_S, le=MAX_TIMEOUT_S))
    sync_weights_s: float | None = field(default=120.0, metadata=rule(ge=MIN_BUDGET_S, le=MAX_TIMEOUT_S))
    """On by default: a sync is the phase that hangs most often (a rollout that never joins)."""
    resume_s: float | None = field(default=None, metadata=rule(ge=MIN_BUDGET_S, le=MAX_TIMEOUT_S))
    close_s: float | None = field(default=None, metadata=rule(ge=MIN_BUDGET_S, le=MAX_TIMEOUT_S))
    receive_weights_s: float | None = field(default=120.0, metadata=rule(ge=MIN_BUDGET_S, le=MAX_TIMEOUT_S))
    """A rollout's side of a sync (`lifecycle.rollout.RolloutWeights`), on by default like the sender's."""
    generate_s: float | None = field(default=None, metadata=rule(ge=MIN_BUDGET_S, le=MAX_TIMEOUT_S))

    def budget(self, trigger: str) -> float | None:
        """The budget of `trigger`'s phase, or None."""
        return getattr(self, f"{trigger}_s", None)


@dataclass(kw_only=True, slots=True)
class LifecycleConfig(Section):
    """Everything one trainer worker's lifecycle needs to know."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving, loading and pruning of checkpoints."""
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    """Picking up after a restart."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Weight sync to the rollout workers."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """How long each phase may run before it is reported as overdue."""

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any] | None) -> LifecycleConfig:
        """Build from parsed data (plain dict, converted DictConfig); None or empty gives defaults."""
        return build(cls, {} if mapping is None else mapping)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> LifecycleConfig:
        """Build from a YAML file; file-level errors name the file since there is no key yet."""
        name = os.fspath(path) if isinstance(path, (str, os.PathLike)) else path
        if not isinstance(name, str):  # bytes, or a PathLike that gives bytes
            raise ConfigError("", f"a YAML path must be a str or os.PathLike of str, got {describe(path)}")
        data = read_yaml(name)
        if data is not None and not isinstance(data, Mapping):
            raise ConfigError(name, f"the top level must be a mapping of sections, got {describe(data)}")
        return cls.from_dict(data)

    @classmethod
    def coerce(
        cls, source: LifecycleConfig | Mapping[str, Any] | str | os.PathLike[str] | None
    ) -> LifecycleConfig:
        """Accept whatever a caller has at hand, so entry points need no branching of their own."""
        if source is None or isinstance(source, Mapping):
            return cls.from_dict(source)
        if isinstance(source, cls):
            validate(source)
            return source
        if isinstance(source, (str, os.PathLike)):
            return cls.from_yaml(source)
        raise ConfigError(
            "", f"expected a LifecycleConfig, a mapping, a YAML path or None, got {describe(source)}"
        )


def format_family(name: str) -> str | None:
    """The model family a format belongs to ("Megatron", "plain-torch" or a plugin's own); None
    for a name that selects no format here."""
    from backends.base import format_capabilities

    try:
        return format_capabilities(name).family
    except ConfigError:
        return None


def _reads_hf(capabilities: FormatCapabilities, family: str) -> bool:
    return capabilities.native_hf and capabilities.family == family


def _same_family(key: str, fmt: str, other_key: str, other: str) -> None:
    """One worker runs one model implementation, so all its formats must suit that implementation."""
    from backends.base import format_capabilities

    mine, theirs = format_capabilities(fmt, key).family, format_capabilities(other, other_key).family
    if mine != theirs:
        raise ConfigError(
            key,
            f"{key} {fmt!r} is a {mine} format but {other_key} {other!r} "
            f"is a {theirs} format; a worker's formats must share one model family",
        )


place_sections(LifecycleConfig)
