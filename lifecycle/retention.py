"""Retention and removal: best effort, after a commit, never failing the save that runs it.

A step is first renamed out of sight (`root/.trash-*`), so a half-removed step never looks
like a damaged one, then removed. Whatever cannot be removed (a file held open on a network
filesystem, a folder without write permission) is logged as `checkpoint.retention_failed`
and left for the next save's sweep.
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from lifecycle.boundary import lstat, role_problem
from lifecycle.errors import CheckpointError

if TYPE_CHECKING:
    from lifecycle.store import CheckpointStore

TRASH = ".trash-"
STAGING = ".staging-"
"""`global_step_N/.staging-<role>`: a save of that role not committed yet (the store's name for it)."""


def trash_path(root: Path, name: str) -> Path:
    return root / f"{TRASH}{name}-{uuid.uuid4().hex[:8]}"


def rmtree(path: Path) -> None:
    """Remove a tree (or a file or symlink, never what it points at) that another process may
    be removing at the same time."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return

    def vanished_ok(func: Callable[..., Any], name: str, exc: Any) -> None:
        err = exc[1] if isinstance(exc, tuple) else exc
        if not isinstance(err, FileNotFoundError):
            raise err

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=vanished_ok)
    else:
        shutil.rmtree(path, onerror=vanished_ok)


def sweep(root: Path, entries: Iterable[os.DirEntry[str]]) -> None:
    """Remove the `.trash-*` entries of `root` that earlier removals left."""
    for entry in entries:
        if entry.name.startswith(TRASH):
            try:
                rmtree(Path(entry.path))
            except OSError as exc:
                structlog.get_logger().warning("checkpoint.retention_failed", path=entry.path, error=str(exc),
                                               action="left for the next save to remove")


def apply_retention(store: CheckpointStore, keep_last: int | None, roles: Sequence[str], protect: set[int]) -> list[int]:
    """Prune the steps older than the newest `keep_last` complete ones; None or < 1 keeps all.

    Pruning a step removes the folders of `roles` in it (and their staging folders), and the
    step folder itself, with whatever else it holds (the trainer's `data.pt`, a crashed save's
    leftovers), only once no folder of another role remains in it: each role's retention is its
    own, as verl's own managers' is, and one role's `keep_last` never removes another role's
    only checkpoint. Steps newer than the oldest kept one stay even when incomplete: another
    role may still be writing them. Steps set aside (damaged, superseded) are not steps and are
    never touched. Returns the steps pruned.
    """
    log = structlog.get_logger()
    try:
        sweep(store.root, store.entries())
        if keep_last is None or keep_last < 1:
            return []
        all_steps = store.steps()
        complete = [s for s in all_steps if store.is_complete(s, roles)]
    except CheckpointError as exc:
        log.warning("checkpoint.retention_failed", path=str(store.root), error=str(exc))
        return []
    if len(complete) <= keep_last:
        return []
    oldest_kept = complete[-keep_last]
    pruned = [step for step in all_steps
              if step < oldest_kept and step not in protect and _prune(store, step, roles)]
    if pruned:
        log.info("checkpoint.retention", root=str(store.root), deleted=pruned, keep_last=keep_last,
                 protected=sorted(protect), roles=list(roles))
    return pruned


def _prune(store: CheckpointStore, step: int, roles: Sequence[str]) -> bool:
    """Remove `roles`' part of `step`, or the whole step when no other role's folder remains;
    whether anything went."""
    folder = store.step_dir(step)
    try:
        with os.scandir(folder) as found:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in found]
    except FileNotFoundError:
        return False  # another process removed it first
    except OSError as exc:
        structlog.get_logger().warning("checkpoint.retention_failed", step=step, path=str(folder), error=str(exc),
                                       action="left for the next save to remove")
        return False
    ours = {*roles, *(f"{STAGING}{role}" for role in roles)}
    if not any(is_dir and name not in ours and _role_folder(name) for name, is_dir in entries):
        return _remove(store, folder, step)
    removed = [_remove(store, folder / name, step) for name, _ in entries if name in ours]
    return any(removed)


def _role_folder(name: str) -> bool:
    """Whether `name` is a role's folder or staging folder (committed or not, ours or another
    checkpoint manager's): what a step folder holds for a role that may still need it."""
    return role_problem(name.removeprefix(STAGING)) is None


def _remove(store: CheckpointStore, path: Path, step: int) -> bool:
    """Rename `path` into the trash, then remove it; whether it is gone from where it was."""
    log = structlog.get_logger()
    try:
        os.rename(path, trash := trash_path(store.root, path.name if path.parent == store.root
                                             else f"{path.parent.name}-{path.name}"))
    except FileNotFoundError:
        return False  # another process removed it first
    except OSError as exc:
        log.warning("checkpoint.retention_failed", step=step, path=str(path), error=str(exc),
                    action="left for the next save to remove")
        try:
            return lstat(path) is None
        except CheckpointError:
            return False
    try:
        rmtree(trash)
    except OSError as exc:
        log.warning("checkpoint.retention_failed", step=step, path=str(trash), error=str(exc),
                    action="left for the next save to remove")
    return True
