"""What the verl checkpoint manager takes from verl's `checkpoint_config` and from this library's
`lifecycle_config`, checked when the manager is built.

verl decides some keys (contents, async_save, retention, the root a save names), this library
the rest (format, verification, roles); a key set on the wrong side, a value of the wrong type, or
contents whose LR schedule would be lost is a `ConfigError` naming the key, never a silent
default. The OmegaConf containers verl hands over are made plain data first
(`lifecycle.integrations.verl_checks.plain`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from lifecycle.boundary import same_folder
from lifecycle.config import LifecycleConfig
from lifecycle.config_file import read_yaml
from lifecycle.config_scalars import describe
from lifecycle.errors import ConfigError
from lifecycle.integrations.verl_checks import integer, plain

DEFAULT_FORMAT = "torch_dcp"
"""Plain torch modules, FSDP1 and FSDP2 alike, through torch's own state-dict helpers."""
VERL_CONTENTS = ("model", "optimizer", "extra", "hf_model")
"""The names verl's `checkpoint_config.save_contents` / `load_contents` take; ours are the same."""
ADAPTER_KEYS = {
    ("checkpoint", "keep_last"): ("verl's max_ckpt_to_keep (trainer.max_actor_ckpt_to_keep, "
                                  "max_critic_ckpt_to_keep) decides retention, None or 0 keeping every "
                                  "step; drop it"),
    ("checkpoint", "pre_load", "path"): "verl loads the initial weights itself; drop it",
    ("resume", "mode"): "verl's trainer decides (trainer.resume_mode); drop it",
    ("resume", "path"): "verl's trainer names the step (trainer.resume_from_path); drop it",
    ("checkpoint", "save", "async"): "verl's checkpoint_config.async_save decides; drop it",
    ("checkpoint", "save", "contents"): "verl's checkpoint_config.save_contents decides; drop it",
    ("checkpoint", "load", "contents"): "verl's checkpoint_config.load_contents decides; drop it",
}
"""Keys of this library's config that verl decides; set to anything but their default, refused."""
_SECTIONS = (("checkpoint",), ("checkpoint", "save"), ("checkpoint", "load"), ("resume",))
"""Sections the adapter writes into, created when missing (in this order: parents first)."""


def checkpoint_options(config: object) -> dict[str, Any]:
    """verl's `checkpoint_config` as plain data: a `DictConfig`, a dict or verl's `CheckpointConfig`
    (a dataclass); None stands for verl's defaults, anything else is refused."""
    if config is None:
        return {}
    if is_dataclass(config) and not isinstance(config, (type, Mapping)):
        config = {field.name: getattr(config, field.name) for field in fields(config)}
    if not isinstance(config, Mapping):
        raise ConfigError("checkpoint_config", f"expected a mapping (verl's checkpoint config: a DictConfig, a dict "
                                               f"or a CheckpointConfig), got {describe(config)}")
    return plain(config, "checkpoint_config")


def contents(options: Mapping[str, Any], key: str, default: list[str]) -> list[str]:
    """`checkpoint_config.<key>` (save_contents, load_contents): names from `VERL_CONTENTS`, each once."""
    given = options.get(key)
    if given is None:
        return list(default)
    if not isinstance(given, list) or not all(isinstance(c, str) for c in given):
        raise ConfigError(f"checkpoint_config.{key}", f"expected a list of names from {list(VERL_CONTENTS)}, "
                                                      f"got {describe(given)}")
    if unknown := [c for c in given if c not in VERL_CONTENTS]:
        raise ConfigError(f"checkpoint_config.{key}", f"unknown content(s) {unknown}; choose from {list(VERL_CONTENTS)}")
    if twice := sorted({c for c in given if given.count(c) > 1}):
        raise ConfigError(f"checkpoint_config.{key}", f"duplicate {', '.join(map(repr, twice))}; list each once")
    return list(given)


def flag(options: Mapping[str, Any], key: str) -> bool:
    """A boolean of verl's `checkpoint_config`, False when absent or null. Only a bool counts: a
    string such as "false" (from `${oc.env:...}`) is true by its truthiness, and is not guessed at."""
    value = options.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"checkpoint_config.{key}", f"expected a boolean, got {describe(value)}; give true or false, "
                                                      "not a string or a number")
    return value


def keep_count(max_ckpt_to_keep: object) -> int | None:
    """verl's `max_ckpt_to_keep`: None or 0 keeps every step, as in verl; any integer type
    (numpy's too, as configs may hand them), never a bool. A negative one is returned as it is."""
    if max_ckpt_to_keep is None:
        return None
    keep = integer(max_ckpt_to_keep)
    if keep is None:
        raise ConfigError("max_ckpt_to_keep", f"must be None or an integer >= 0, got {max_ckpt_to_keep!r} "
                                              "(a negative integer keeps every step, as in verl)")
    return keep or None


def checked_tracker(base: Mapping[str, Any], async_save: bool) -> bool:
    """Whether this manager writes the tracker: under async_save, when verl's trainer writes
    none, and wherever `checkpoint.tracker: true` asks (a critic saving synchronously beside an
    actor with async_save, whose trainer then writes no tracker). Turning it off under
    async_save would leave no tracker at all, so verl's resume would start afresh: refused."""
    given = base["checkpoint"].get("tracker")
    if given is not None and not isinstance(given, bool):
        raise ConfigError("checkpoint.tracker", f"expected a bool, got {describe(given)}")
    if given is False and async_save:
        raise ConfigError("checkpoint.tracker", "false, but under checkpoint_config.async_save verl's trainer writes "
                                                "no tracker either, so verl's resume would find none; drop it")
    return async_save or bool(given)


def check_scheduler_contents(key: str, listed: list[str], lr_scheduler: Any) -> None:
    """verl keeps the lr scheduler's state in `extra`, this library with the optimizer's: contents
    with extra but no optimizer would lose the LR schedule without a word. verl's workers always
    pass their scheduler, so the remedies are the config's: list the optimizer, or (a load)
    leave out extra too, which starts the schedule afresh in verl as well."""
    if lr_scheduler is None or "extra" not in listed or "optimizer" in listed:
        return
    why = (f"{listed} has 'extra' but not 'optimizer': verl keeps the lr_scheduler's state in extra, but here the LR "
           "schedule travels with the optimizer's state")
    if key == "save_contents":
        raise ConfigError(f"checkpoint_config.{key}", f"{why}, so it would not be saved; add 'optimizer' to "
                                                      "checkpoint_config.save_contents")
    raise ConfigError(f"checkpoint_config.{key}", f"{why}, so this load would restart it; add 'optimizer' to "
                                                  f"checkpoint_config.{key} to keep it (the optimizer's state is "
                                                  "loaded too), or list [model] alone to start both afresh")


def base_config(source: LifecycleConfig | Mapping[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    """This library's config as plain data, with `torch_dcp` unless it names a format. A
    `LifecycleConfig` holds every key: its `checkpoint.tracker: true`, the default, counts as unset."""
    if source is None:
        data: Any = {}
    elif isinstance(source, LifecycleConfig):
        data = source.to_dict()
        if data["checkpoint"]["tracker"] is True:
            del data["checkpoint"]["tracker"]
    elif isinstance(source, (str, os.PathLike)):
        data = read_yaml(os.fspath(source)) or {}
    elif isinstance(source, Mapping):
        data = source
    else:
        raise ConfigError("lifecycle_config", f"expected a LifecycleConfig, a mapping or a YAML path, "
                                              f"got {type(source).__name__}")
    data = plain(data)
    if not isinstance(data, dict):
        raise ConfigError("lifecycle_config", f"the top level must be a mapping, got {type(data).__name__}")
    for keys in _SECTIONS:
        parent = _dig(data, keys[:-1])
        if not isinstance(parent.setdefault(keys[-1], {}), dict):
            raise ConfigError(".".join(keys), f"must be a mapping, got {type(parent[keys[-1]]).__name__}")
    defaults = LifecycleConfig().to_dict()
    for keys, why in ADAPTER_KEYS.items():
        value = _dig(data, keys)
        if value is not None and value != _dig(defaults, keys):
            raise ConfigError(".".join(keys), f"set to {value!r}, but {why}")
    ckpt = data["checkpoint"]
    if "format" not in ckpt["save"] and not (ckpt.get("use_dist_checkpointing") or ckpt.get("use_mbridge")):
        ckpt["save"]["format"] = DEFAULT_FORMAT
    return data


def _dig(data: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if not isinstance(data, Mapping):
            return None
        data = data.get(key)  # type: ignore[assignment]
    return data


def same_root(given: str, root: Path) -> bool:
    """One folder, however spelled (a symlink, `./`, `//`), existing yet or not."""
    return same_folder(Path(given), root) or os.path.realpath(given) == os.path.realpath(root)


__all__ = ["ADAPTER_KEYS", "DEFAULT_FORMAT", "VERL_CONTENTS", "base_config", "check_scheduler_contents",
           "checked_tracker", "checkpoint_options", "contents", "flag", "keep_count", "same_root"]
