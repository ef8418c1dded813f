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

from lifecycle.boundary import lstat
from lifecycle.errors import CheckpointError

if TYPE_CHECKING:
    from lifecycle.store import CheckpointStore

TRASH = ".trash-"


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
    """Delete steps older than the newest `keep_last` complete ones; None or < 1 keeps all.

    Steps newer than the oldest kept one stay even when incomplete: another role may still be
    writing them. Steps set aside (damaged, superseded) are not steps and are never touched.
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
    deleted: list[int] = []
    for step in all_steps:
        if step >= oldest_kept or step in protect:
            continue
        folder = store.step_dir(step)
        try:
            os.rename(folder, trash := trash_path(store.root, folder.name))
            deleted.append(step)
            rmtree(trash)
        except FileNotFoundError:
            continue  # another process removed it first
        except OSError as exc:
            log.warning("checkpoint.retention_failed", step=step, path=str(folder), error=str(exc),
                        action="left for the next save to remove")
            try:
                gone = lstat(folder) is None
            except CheckpointError:
                gone = False
            if step not in deleted and gone:
                deleted.append(step)
    if deleted:
        log.info("checkpoint.retention", root=str(store.root), deleted=deleted, keep_last=keep_last,
                 protected=sorted(protect))
    return deleted
