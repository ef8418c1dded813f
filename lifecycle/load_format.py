"""Which format backend reads a content of a step on resume: the one its manifest names, built
with this worker's options, and refused when it is a module path the worker's config does not
name (a checkpoint's own word is never imported) or of another model family."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from backends.base import FormatBackend, backend_class, format_capabilities
from backends.registry import IMPORT_PATH
from lifecycle.config import format_family
from lifecycle.errors import CheckpointError, ConfigError, shorten
from lifecycle.manifest import MANIFEST
from lifecycle.records import say


def value_of(item: Any) -> str:
    """A config value as the name it stands for (an enum member's value, else the value as text)."""
    return str(getattr(item, "value", item))


def unnamed_path(config: Any, name: str) -> bool:
    """Whether a manifest's format `name` is a module path (`pkg.module:Class`) this worker's
    config does not name: a checkpoint's own word is never imported (a crafted `this:X` would
    run a module on resume). Names, and the configured paths, are looked up as usual."""
    ckpt = config.checkpoint
    return IMPORT_PATH.fullmatch(name) is not None and name not in {
        value_of(ckpt.load_format), value_of(ckpt.save.format), value_of(ckpt.pre_load_format)}


def verifies_reads(config: Any, name: str) -> bool:
    """Whether format `name` checks digests as it reads; one of another family, or one not
    installed, is refused when loading (and a built-in's answer needs no import)."""
    if unnamed_path(config, name):
        return False
    try:
        capabilities = format_capabilities(name, "checkpoint.load.format")
    except ConfigError:
        return False
    return (capabilities.verifies_reads
            and capabilities.family == format_family(value_of(config.checkpoint.load_format)))


def format_for(config: Any, content: str, name: str, folder: Path) -> FormatBackend:
    """The format `name` that saved `content`, refused when it loads into another model family."""
    wanted = value_of(config.checkpoint.load_format)
    if unnamed_path(config, name):
        raise CheckpointError(f"{folder.parent / MANIFEST}: {content!r} was saved with format {shorten(name)}, "
                              "a module path this worker's config does not name; a checkpoint's own word is "
                              f"never imported (set checkpoint.load.format to it to load it)")
    if name != wanted:
        say("warning", "checkpoint.resume.format_differs", content=content, saved_with=name, load_format=wanted,
            path=str(folder))
    wanted_family, saved_family = format_family(wanted), format_family(name)
    if saved_family != wanted_family:
        raise CheckpointError(f"{folder.parent / MANIFEST}: {content!r} was saved with format {name!r} "
                              f"({saved_family or 'not a format'}), which cannot load into this worker's "
                              f"{wanted_family} model (checkpoint.load.format {wanted!r})")
    try:
        return build_format(config, name)
    except ConfigError as exc:
        raise CheckpointError(f"{folder.parent / MANIFEST}: {content!r} was saved with format {name!r}, "
                              f"which cannot be loaded here: {exc}") from exc


def build_format(config: Any, name: str) -> FormatBackend:
    """Format `name`, with the options configured under `checkpoint.save` when it is the format
    saved with (they are composed for that format only); any other with its defaults."""
    save = config.checkpoint.save
    return backend_class(name)(**save.options) if name == value_of(save.format) else backend_class(name)()
