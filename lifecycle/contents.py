"""The contents of a step folder as one table: how each is written and how it is read.

A save writes each content of `checkpoint.save.contents` with its entry's `write`, a resume
reads each of `checkpoint.load.contents` with its `read`; neither knows a content by name.
Adding a content is one `ContentIO` entry in `CONTENTS` (and its name in the config's
`Content`). Writers return the digests they took while writing, readers the files they
verified while reading: both travel as values to the manifest and to the resume's checks.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any


from backends.base import FormatBackend
from lifecycle.boundary import os_errors
from lifecycle.errors import CheckpointError, LifecycleError
from lifecycle.extra import RESET_WITHOUT_EXTRA, load_extra, read_extra, save_extra
from lifecycle.jsontree import read_json
from lifecycle.optim_identity import OPTIM_JSON
from lifecycle.records import say
from lifecycle.types import Content, Parts, Progress, Written

_RANK_DIR = re.compile(r"rank_([0-9]+)")


@dataclass(frozen=True, slots=True, kw_only=True)
class Writing:
    """What one content's writer is given."""

    backend: FormatBackend
    parts: Parts
    progress: Progress
    folder: Path
    """The content's own folder inside the staging folder (created by the writer)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Reading:
    """What one content's reader is given."""

    backend: FormatBackend | None
    """The format its manifest names; None for a content the lifecycle writes itself."""
    parts: Parts
    folder: Path
    expected: Mapping[str, str]
    """Digests (paths relative to `folder`) the reader may check as it reads; any it does not
    return as verified are hashed after the load."""
    rank: int
    world_size: int
    saved_world_size: Any
    """The world size the manifest states the step was saved at (unchecked JSON)."""
    step: int | None = None
    """The step being resumed: a progress that names another is refused before it is restored."""


@dataclass(frozen=True, slots=True)
class Loaded:
    """What a reader restored: the files of `Reading.expected` it verified, and any progress."""

    verified: frozenset[str] = frozenset()
    progress: Progress | None = None
    then: Callable[[], None] | None = None
    """What the resume runs once every rank agreed to it (the RNGs), so a refused resume moves
    none of them."""
    undo: Callable[[], None] | None = None
    """What puts back what the reader changed at once (the data position) when the resume is
    refused after it (a later content, another rank)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ContentIO:
    """How one content is written and read."""

    write: Callable[[Writing], Mapping[str, str] | None]
    """Writes the content; returns {path relative to its folder: digest} for what it hashed
    (None from a format written before formats returned digests: nothing was hashed)."""
    read: Callable[[Reading], Loaded] | None
    """Restores the content; None for an export, which no resume reads."""
    holds: str | None = None
    """The `Parts` field it is the state of: a worker without that object neither saves nor loads it."""
    by_format: bool = True
    """Written and read by the checkpoint format; False: the lifecycle's own, the same in every format."""
    per_rank: bool = False
    """Each rank writes a sub-folder of its own (`rank_N`)."""
    shares_folder_when_native_hf: str | None = None
    """With a format whose `save_model` already writes HF safetensors (`native_hf`), this content
    is the folder of that other content when both are saved: the files are written once."""
    copied_for_async: bool = True
    """An async save copies its state to host and writes it in the background; False: written
    at once, as it stands at the step (RNG states and data position move as training goes on)."""
    optional_on_resume: bool = False
    """A step saved without it still resumes, with a warning."""
    resets: tuple[str, ...] = ()
    """The `Progress` fields only it restores: a resume not reading it starts them afresh."""

    def folder(self, name: str, rank: int) -> str:
        """Its folder in the role folder."""
        return f"{name}/rank_{rank}" if self.per_rank else name


def _read_model(reading: Reading) -> Loaded:
    verified = _backend(reading).load_model(reading.parts.model, reading.folder, expected=reading.expected)
    return Loaded(frozenset(verified or ()))


def _read_optimizer(reading: Reading) -> Loaded:
    parts = reading.parts
    verified = _backend(reading).load_optimizer(parts.optimizer, parts.lr_scheduler, reading.folder,
                                                model=parts.model, expected=reading.expected)
    if parts.lr_scheduler is None and _holds_scheduler(reading.folder / OPTIM_JSON):
        say("warning", "checkpoint.resume.content_not_loaded", content="lr_scheduler", step=reading.step,
            path=str(reading.folder), reason="the step holds its state, but no lr_scheduler was given")
    return Loaded(frozenset(verified or ()))


def _holds_scheduler(path: Path) -> bool:
    """Whether the `optimizer.json` the built-in formats write holds a scheduler's state; False
    for a format that writes none (the load has read and checked it already)."""
    try:
        doc = read_json(path) if path.is_file() else None
    except CheckpointError:
        return False
    return isinstance(doc, dict) and doc.get("lr_scheduler") is not None


def _backend(reading: Reading) -> FormatBackend:
    if reading.backend is None:
        raise CheckpointError(f"{reading.folder}: no format given to read it with")
    return reading.backend


def _read_extra(reading: Reading) -> Loaded:
    """Per-rank RNG and dataloader state only fit the world size that saved them."""
    folder = reading.folder
    for entry in folder.iterdir():
        if not (_RANK_DIR.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink()):
            raise CheckpointError(f"{entry}: unexpected entry in extra folder (only rank_N folders)")
    own = folder / f"rank_{reading.rank}"
    if reading.saved_world_size == reading.world_size and own.is_dir():
        progress, restore, undo = read_extra(own, reading.parts.dataloader, step=reading.step)
        return Loaded(progress=progress, then=restore, undo=undo)
    say("warning", "checkpoint.resume.extra_layout_changed", path=str(folder), rank=reading.rank,
        saved_world_size=reading.saved_world_size, world_size=reading.world_size,
        action="progress from rank 0; RNG and dataloader state not restored",
    )
    return Loaded(progress=load_extra(folder / "rank_0", None, restore_rng=False, step=reading.step))


CONTENTS: Mapping[str, ContentIO] = MappingProxyType({
    Content.MODEL.value: ContentIO(
        write=lambda w: w.backend.save_model(w.parts.model, w.folder),
        read=_read_model, holds="model"),
    Content.HF_MODEL.value: ContentIO(
        write=lambda w: w.backend.export_hf(w.parts.model, w.folder),
        read=None, holds="model", shares_folder_when_native_hf="model"),
    Content.OPTIMIZER.value: ContentIO(
        write=lambda w: w.backend.save_optimizer(w.parts.optimizer, w.parts.lr_scheduler, w.folder,
                                                 model=w.parts.model),
        read=_read_optimizer, holds="optimizer"),
    Content.EXTRA.value: ContentIO(
        write=lambda w: save_extra(w.folder, w.progress, w.parts.dataloader),
        read=_read_extra, by_format=False, per_rank=True, copied_for_async=False, optional_on_resume=True,
        resets=RESET_WITHOUT_EXTRA),
})
"""Every content a step folder can hold, keyed by the plain names of `Content`."""


def content_io(name: str, where: Path) -> ContentIO:
    """The table's entry for `name`; `CheckpointError` naming `where` for a content it lacks."""
    found = CONTENTS.get(name)
    if found is None:
        raise CheckpointError(f"{where}: no content {name!r} is known here (known: {', '.join(CONTENTS)})")
    return found


def has_state(content: ContentIO, parts: Parts) -> bool:
    """Whether the worker has the object the content is the state of."""
    return content.holds is None or getattr(parts, content.holds) is not None


def say_unread(wanted: Sequence[str], entries: Mapping[str, Any], parts: Parts, folder: Path, step: int) -> None:
    """Warn of what a step holds that this resume leaves as it was: a content `wanted` (of
    `checkpoint.load.contents`) the worker has no object for, and the progress fields of one
    `wanted` leaves out."""
    for name, content in CONTENTS.items():
        if name not in entries or content.read is None:
            continue
        if name not in wanted and content.resets:
            say("warning", "checkpoint.resume.progress_not_restored", content=name, step=step, path=str(folder),
                reset=content.resets, reason=f"checkpoint.load.contents leaves out {name!r}, which holds them")
        elif name in wanted and not has_state(content, parts):
            say("warning", "checkpoint.resume.content_not_loaded", content=name, step=step, path=str(folder),
                reason=f"the step holds it, but no {content.holds} was given")


@dataclass(frozen=True, slots=True, kw_only=True)
class ContentWriter:
    """Writes contents of one save into its staging folder, collecting what the writers returned."""

    backend: FormatBackend
    name: str
    """The format's name as the config gives it, which the manifest records."""
    wanted: Sequence[str]
    """Every content the save writes (some perhaps in another call: see `write`)."""
    rank: int
    role: str
    step: int

    def write(self, staging: Path, parts: Parts, progress: Progress, only: Collection[str]) -> Written:
        """Write each wanted content of `only`. An `OSError` (disk full, permission) names the
        save, the content and the file."""
        written, what = Written(), f"save of step {self.step} (role {self.role})"
        for name in (c for c in self.wanted if c in only):
            content = content_io(name, staging)
            if not has_state(content, parts):
                say("warning", "checkpoint.save.content_skipped", content=name, role=self.role,
                                               reason="the worker has no object to save for it")
                continue
            with os_errors(f"{what} cannot write {name!r}", staging):
                shared = content.shares_folder_when_native_hf
                if shared is not None and self.backend.capabilities.native_hf and shared in self.wanted:
                    written.folders[name] = shared
                else:
                    sub = content.folder(name, self.rank)
                    digests = self._write_one(content, name, Writing(backend=self.backend, parts=parts,
                                                                     progress=progress, folder=staging / sub))
                    written.digests.update({f"{sub}/{rel}": d for rel, d in (digests or {}).items()})
            written.contents[name] = self.name if content.by_format else name
        return written

    def _write_one(self, content: ContentIO, name: str, writing: Writing) -> Mapping[str, str] | None:
        """`content.write`; an error not ours (a user object's `state_dict()` raising its own type)
        becomes a `CheckpointError` naming the save and the content, the original as its cause.
        An `OSError` passes on to `os_errors`, which names the file."""
        try:
            return content.write(writing)
        except (LifecycleError, OSError):
            raise
        except Exception as exc:
            raise CheckpointError(f"{writing.folder}: save of step {self.step} (role {self.role}) cannot write "
                                  f"{name!r}: {type(exc).__name__}: {exc}") from exc
