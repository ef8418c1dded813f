"""Retention and removal: best effort, after a commit, never failing the save that runs it.

A step is first renamed out of sight (`root/.trash-*`), so a half-removed step never looks
like a damaged one, then removed. Whatever cannot be removed (a file held open on a network
filesystem, a folder without write permission) is logged as `checkpoint.retention_failed`
and left for the next save's sweep. So is a role folder a re-commit replaced
(`root/.replaced-<step>-<role>-*`), unless it is the only committed copy of its role's step (a
crash between the two renames of a re-commit on a filesystem that cannot swap two folders in
one step, see `exchange`): the next resume, or save of that role, puts that back (`tidy`). One
whose step folder is gone (pruned) is an orphan, which the sweep removes: no later step of that
number may take it for its own (setting a step aside moves its copies with it).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lifecycle.boundary import OutOfResources, lstat, real_dir, role_problem
from lifecycle.errors import CheckpointError
from lifecycle.records import say

if TYPE_CHECKING:
    from lifecycle.store import CheckpointStore

TRASH = ".trash-"
STAGING = ".staging-"
"""`global_step_N/.staging-<role>`: a save of that role not committed yet (the store's name for it)."""
REPLACED = ".replaced-"
"""`root/.replaced-<step>-<role>-<hex>`: a committed role folder a re-commit moved away (see `exchange`)."""
_REPLACED_RE = re.compile(r"\.replaced-(0|[1-9][0-9]{0,17})-(.+)-[0-9a-f]{8}")
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_CANNOT_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EXDEV, errno.ENOTSUP, errno.EOPNOTSUPP}


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


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    """glibc's `renameat2` (2.28 and later); None elsewhere (musl before 1.2.5, macOS)."""
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return function


def exchange(a: Path, b: Path) -> bool:
    """Swap `a` and `b` in one step (`renameat2(RENAME_EXCHANGE)`), so a re-commit never leaves
    a moment without a committed folder at `b`; False, changing nothing, where the system or
    the filesystem cannot (the caller renames twice then)."""
    function = _renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _CANNOT_EXCHANGE:
        return False
    raise OSError(code, os.strerror(code), os.fspath(a), None, os.fspath(b))


def replaced_copies(store: CheckpointStore, role: str | None = None,
                    entries: Sequence[os.DirEntry[str]] | None = None) -> list[tuple[int, str, Path]]:
    """The root's `.replaced-` folders (of `role` alone, when given): step, role, path; none when
    the root cannot be listed, unless for want of this process's resources (`OutOfResources`,
    raised: a role whose only committed copy is aside would read as uncommitted, and a resume
    would pick an older step). `entries`: the root's listing, when the caller has it already."""
    try:
        entries = store.entries() if entries is None else entries
    except OutOfResources:
        raise
    except CheckpointError:
        return []
    found = [(int(m[1]), m[2], Path(e.path)) for e in entries
             if (m := _REPLACED_RE.fullmatch(e.name)) and e.is_dir(follow_symlinks=False)]
    return [(step, name, path) for step, name, path in found
            if role_problem(name) is None and role in (None, name)]


def only_copy(store: CheckpointStore, step: int, role: str) -> bool:
    """Whether a `.replaced-` folder of `role`'s `step` is that role's only committed copy: a
    crash between the two renames of a re-commit left its role folder missing. False for an
    orphan, whose step folder is gone (see `orphaned`); True when that cannot be told, so
    nothing removes it."""
    try:
        return not orphaned(store, step) and lstat(store.role_dir(step, role)) is None
    except CheckpointError:
        return True


def orphaned(store: CheckpointStore, step: int) -> bool:
    """Whether the step folder of a `.replaced-` copy is gone (pruned, or removed by hand): no
    step takes the copy back, and the sweep removes it."""
    return lstat(store.step_dir(step)) is None


def left_staging(store: CheckpointStore, role: str) -> list[tuple[int, Path]]:
    """`role`'s staging folders, in every step: step, path."""
    return [(step, path) for step in store.steps()
            if os.path.lexists(path := store.step_dir(step) / f"{STAGING}{role}")]


def tidy(store: CheckpointStore, role: str) -> None:
    """Under `role`'s writer lock, so no save of `role` is in flight (its staging folders are
    written only while its rank 0 holds that lock): `put_back` its only committed copies, then
    remove its staging folders a crash left in any step (a save that never committed, or the
    copy an `exchange` replaced, manifest and all)."""
    put_back(store, role)
    for step, path in left_staging(store, role):
        if remove(store, path, step):
            say("info", "checkpoint.staging_removed", step=step, role=role, path=str(path),
                reason="left by a save that crashed before or right after its commit")


def put_back(store: CheckpointStore, role: str) -> None:
    """Under `role`'s writer lock (no commit of it in flight): rename each `.replaced-` copy that
    is its step's only committed copy back into place, so resume reads it again."""
    for step, _, path in replaced_copies(store, role):
        try:
            if not only_copy(store, step, role) or not real_dir(store.step_dir(step), "a step folder"):
                continue
            os.rename(path, store.role_dir(step, role))
        except (OSError, CheckpointError) as exc:
            say("error", "checkpoint.replaced_not_restored", step=step, role=role, path=str(path), error=str(exc))
            continue
        say("warning", "checkpoint.replaced_restored", step=step, role=role, path=str(store.role_dir(step, role)),
            reason="a re-commit of this step was interrupted between its two renames")


def sweep(store: CheckpointStore) -> None:
    """Remove the `.trash-*` entries of the root that earlier removals left, and the `.replaced-`
    folders whose role folder is committed again or whose step is gone (never the only
    committed copy of a step)."""
    entries = store.entries()
    for entry in entries:
        if entry.name.startswith(TRASH):
            try:
                rmtree(Path(entry.path))
            except OSError as exc:
                say("warning", "checkpoint.retention_failed", path=entry.path, error=str(exc),
                    action="left for the next save to remove")
    for step, role, path in replaced_copies(store, entries=entries):
        if not only_copy(store, step, role):
            remove(store, path, step)


def apply_retention(
    store: CheckpointStore, keep_last: int | None, roles: Sequence[str], protect: set[int], role: str,
) -> list[int]:
    """Prune `role`'s part of the steps older than the newest `keep_last` complete ones (complete
    for every role of `roles`); None or < 1 keeps all. The step the tracker names is kept too (see
    `tracked`), whoever writes it: the trainer's (verl's, after every role saved) names the last
    step all roles finished, the only one left when a crash falls between two roles' saves.

    Pruning a step removes `role`'s folder in it (and its staging folder), and the step folder
    itself, with whatever else it holds (the trainer's `data.pt`, a crashed save's leftovers),
    only once no folder of any other role remains in it: each role's retention is its own, as
    verl's own managers' is, and one role's `keep_last` never removes another role's
    checkpoint, whatever `roles` lists. Steps newer than the oldest kept one stay even when
    incomplete: another role may still be writing them. Steps set aside (damaged, superseded)
    are not steps and are never touched, and neither is a step whose folder of `role` holds no
    manifest of this library (another checkpoint manager's: logged, kept). Returns the steps pruned.
    """
    try:
        sweep(store)
        if keep_last is None or keep_last < 1:
            return []
        all_steps = store.steps()
        complete = [s for s in all_steps if store.is_complete(s, roles)]
        protect = protect | tracked(store)
    except CheckpointError as exc:
        say("warning", "checkpoint.retention_failed", path=str(store.root), error=str(exc))
        return []
    if len(complete) < keep_last:
        return []
    oldest_kept = complete[-keep_last]  # older steps are incomplete, or another role's retention made them so
    pruned = [step for step in all_steps
              if step < oldest_kept and step not in protect and _prune(store, step, role)]
    if pruned:
        say("info", "checkpoint.retention", root=str(store.root), deleted=pruned, keep_last=keep_last,
            protected=sorted(protect), role=role)
    return pruned


def tracked(store: CheckpointStore) -> set[int]:
    """The step the tracker names, which retention keeps: a tracker write that failed (a full disk)
    leaves it naming an older step than the one just committed, and a trainer that reads the
    tracker (verl's) resumes from that one. Nothing when there is no tracker, or one that names
    no step; `OutOfResources` when it cannot be read for want of this process's resources (so
    nothing is pruned, until the next save)."""
    try:
        named = store.read_tracker()
    except OutOfResources:
        raise
    except CheckpointError:
        return set()
    return set() if named is None else {named}


def _prune(store: CheckpointStore, step: int, role: str) -> bool:
    """Remove `role`'s part of `step`, or the whole step when no other role's folder remains;
    whether anything went."""
    folder = store.step_dir(step)
    try:
        with os.scandir(folder) as found:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in found]
    except FileNotFoundError:
        return False  # another process removed it first
    except OSError as exc:
        say("warning", "checkpoint.retention_failed", step=step, path=str(folder), error=str(exc),
            action="left for the next save to remove")
        return False
    try:
        theirs = any(name == role for name, _ in entries) and not (dict(entries)[role] and store.committed(step, role))
    except CheckpointError as exc:  # EACCES, EMFILE: nothing known of the folder, so it stays
        say("warning", "checkpoint.retention_failed", step=step, path=str(folder / role), error=str(exc),
            action="cannot tell whether this library committed it; left for the next save to remove")
        return False
    if theirs:  # a role folder without a manifest (verl's own manager's, a copy put there by hand): not ours
        _say_kept(store, folder / role, step, role)
        return False
    ours = {role, f"{STAGING}{role}"}
    if not any(is_dir and name not in ours and _role_folder(name) for name, is_dir in entries):
        return remove(store, folder, step)
    removed = [remove(store, folder / name, step) for name, _ in entries if name in ours]
    return any(removed)


_KEPT_LIMIT = 1024
"""How many kept folders a store remembers having named; past it, it starts over (names them again)."""


def _say_kept(store: CheckpointStore, path: Path, step: int, role: str) -> None:
    """Name a kept folder once per store, not at every save."""
    if str(path) in store.kept:
        return
    if len(store.kept) >= _KEPT_LIMIT:
        store.kept.clear()
    store.kept.add(str(path))
    say("warning", "checkpoint.retention_kept", step=step, role=role, path=str(path),
        reason="a folder of this role's name without a manifest of this library (another checkpoint "
               "manager's, or copied in by hand): retention removes only what it committed; remove it yourself")


def _role_folder(name: str) -> bool:
    """Whether `name` is a role's folder or staging folder (committed or not, ours or another
    checkpoint manager's): what a step folder holds for a role that may still need it."""
    return role_problem(name.removeprefix(STAGING)) is None


def remove(store: CheckpointStore, path: Path, step: int) -> bool:
    """Rename `path` into the trash, then remove it; whether it is gone from where it was."""
    try:
        os.rename(path, trash := trash_path(store.root, path.name if path.parent == store.root
                                             else f"{path.parent.name}-{path.name}"))
    except FileNotFoundError:
        return False  # another process removed it first
    except OSError as exc:
        say("warning", "checkpoint.retention_failed", step=step, path=str(path), error=str(exc),
            action="left for the next save to remove")
        try:
            return lstat(path) is None
        except CheckpointError:
            return False
    try:
        rmtree(trash)
    except OSError as exc:
        say("warning", "checkpoint.retention_failed", step=step, path=str(trash), error=str(exc),
            action="left for the next save to remove")
    return True
