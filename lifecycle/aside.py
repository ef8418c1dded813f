"""Steps set aside, never deleted: damaged ones resume skipped, and those a rollback left behind.

Both are renames inside the root (`global_step_N.damaged-<time>`, `global_step_N.superseded-<time>`),
so nothing is lost: whatever a step folder holds (another role's staging folder while its
writer is still at work, a folder written by another trainer's own checkpoint manager, the
trainer's `data.pt`) is moved with it, whole, and so are the step's copies a re-commit left in
the root (`.replaced-<step>-*`, see `lifecycle.retention`): left there, they would be taken for
a later step of that number's. No later resume and no retention takes a step set aside for its
own; the command-line inspector lists them.
"""

from __future__ import annotations

import errno
import os
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lifecycle.boundary import STEP_PREFIX, lstat, os_error, parse_step
from lifecycle.errors import CheckpointError
from lifecycle.records import say
from lifecycle.retention import replaced_copies
from lifecycle.writer_lock import LockHeld, lock_errno

if TYPE_CHECKING:
    from lifecycle.store import CheckpointStore

DAMAGED = ".damaged-"
"""`global_step_N.damaged-<time>`: a step resume set aside; never resumed, never deleted by retention."""
SUPERSEDED = ".superseded-"
"""`global_step_N.superseded-<time>`: a step newer than the one a run was rolled back to."""
MAX_LOGGED = 50
"""Problems one log record lists; the rest are counted."""


def _aside_path(store: CheckpointStore, step: int, marker: str) -> Path:
    """`<step folder's name><marker><time>-<random>` in the root."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return store.root / f"{store.step_dir(step).name}{marker}{stamp}-{uuid.uuid4().hex[:6]}"


def set_aside(store: CheckpointStore, step: int, marker: str, why: str) -> Path | None:
    """Rename step `step` to `<name><marker><time>-<random>`; None when it is gone already."""
    folder = store.step_dir(step)
    aside = _aside_path(store, step, marker)
    try:
        os.rename(folder, aside)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise os_error(exc, f"{why}, and cannot be set aside", folder) from exc
    _move_copies(store, step, aside)
    return aside


def _move_copies(store: CheckpointStore, step: int, aside: Path) -> None:
    """Move `step`'s `.replaced-` copies into `aside`: a role's only committed copy (its folder
    missing there) back in its place, so the step is set aside whole; any other by its name."""
    try:
        copies = [(role, path) for copy_step, role, path in replaced_copies(store) if copy_step == step]
    except CheckpointError as exc:  # short of resources: the step is aside already, its copies stay
        say("error", "checkpoint.replaced_not_moved", step=step, path=str(store.root), error=str(exc),
            action="its step is gone from the root: the next save's sweep removes its copies")
        return
    for role, path in copies:
        try:
            os.rename(path, aside / (role if lstat(aside / role) is None else path.name))
        except FileNotFoundError:
            continue  # put back or removed meanwhile
        except (OSError, CheckpointError) as exc:
            say("error", "checkpoint.replaced_not_moved", step=step, path=str(path), error=str(exc),
                action="its step is gone from the root: the next save's sweep removes it")


def quarantine(store: CheckpointStore, step: int, problems: Sequence[str], roles: Sequence[str]) -> Path | None:
    """Rename a damaged step aside (`global_step_N.damaged-<time>`); nothing is deleted.

    A tracker naming it is pointed at the step resume tries next (the newest older one
    committed for every role of `roles`), as after a rollback. None when it is gone already:
    another role or rank set it aside first."""
    aside = set_aside(store, step, DAMAGED, "damaged")
    if aside is not None:
        say("error", "checkpoint.step_quarantined", step=step, path=str(aside), files=list(problems[:MAX_LOGGED]),
            more=max(0, len(problems) - MAX_LOGGED), action="resuming the next newest complete step")
        try:
            older = store.newest_committed(roles, below=step)
        except CheckpointError:
            older = None
        if older is not None:
            tracker_back_to(store, older)
    return aside


def supersede(store: CheckpointStore, newer_than: int) -> list[Path]:
    """Rename aside (`global_step_N.superseded-<time>`) every step newer than `newer_than`: the
    run was rolled back past them, and neither a later resume nor retention may take them for
    its own. Nothing is deleted, whatever a step holds: a folder without a manifest may be
    another role's save in progress, or another checkpoint manager's. A tracker left naming a
    step now gone is pointed at `newer_than`, since verl's trainer resumes from what the tracker
    names (and starts fresh when that step is missing). Best effort: the rollback itself has
    happened already."""
    moved: list[Path] = []
    for step in store.steps():
        try:
            if step > newer_than and (aside := set_aside(store, step, SUPERSEDED, "rolled back past")) is not None:
                moved.append(aside)
        except CheckpointError as exc:
            say("error", "checkpoint.supersede_failed", step=step, error=str(exc),
                action="a later automatic resume may pick this step")
    if moved:
        say("warning", "checkpoint.steps_superseded", resumed_step=newer_than, paths=[str(p) for p in moved],
            reason="resumed from an older step; these are never resumed or deleted")
    tracker_back_to(store, newer_than)
    return moved


def abandon_line(store: CheckpointStore, role: str, resumed: int | None, roles: Sequence[str]) -> list[Path]:
    """Move `role`'s own committed folders of the steps newer than `resumed` (all of them on a
    fresh start, `resumed` None) aside, each into a `global_step_N.superseded-<time>` folder of its
    own, with that role's `.replaced-` copies of the step. An automatic resume went back past them
    (no other role committed those steps): left in place, one would pair with another role's
    folder of that step from the new line into a step made of two histories. Never another
    role's folder, never deleted, never a step every role of `roles` committed (a rank whose view
    of the disk lagged agreed on an older step); a step folder left empty is removed. Best effort
    (rank 0 of `role`, under its writer lock, so no save of it is in flight): a failure is logged."""
    if not _past(store, role, resumed, roles):
        return []
    lock = store.writer_lock(role)
    try:
        lock.acquire()
    except CheckpointError as exc:  # held by another writer, or no lock to be had (ENOLCK): named either way
        say("error", "checkpoint.abandoned_line_not_moved", role=role, resumed_step=resumed, error=str(exc),
            path=str(lock.path), errno=lock_errno(exc), held=isinstance(exc, LockHeld),
            action="a later automatic resume may pair its newer steps with another role's")
        return []
    try:
        moved = [aside for step in _past(store, role, resumed, roles) if (aside := _move_role(store, step, role))]
    finally:
        lock.release()
    if moved:
        say("warning", "checkpoint.role_steps_superseded", role=role, resumed_step=resumed,
            paths=[str(p) for p in moved], reason="an automatic resume went back past them (not committed by "
            "every role); set aside, never resumed or deleted")
        if resumed is not None:
            tracker_back_to(store, resumed)
    return moved


def _past(store: CheckpointStore, role: str, resumed: int | None, roles: Sequence[str]) -> list[int]:
    """The steps newer than `resumed` (all, for None) holding a committed folder of `role` but
    not of every role of `roles`."""
    try:
        return [step for step in store.steps() if (resumed is None or step > resumed) and store.committed(step, role)
                and not all(store.committed(step, who) for who in {*roles, role})]
    except CheckpointError as exc:
        say("error", "checkpoint.abandoned_line_not_moved", role=role, resumed_step=resumed, error=str(exc),
            action="a later automatic resume may pair its newer steps with another role's")
        return []


def _move_role(store: CheckpointStore, step: int, role: str) -> Path | None:
    """`role`'s folder of `step`, and its `.replaced-` copies of it, into a folder set aside."""
    aside = _aside_path(store, step, SUPERSEDED)
    try:
        aside.mkdir()
        try:
            os.rename(store.role_dir(step, role), aside / role)
        except OSError:
            aside.rmdir()  # nothing moved: no empty folder left for the inspector to list
            raise
        for path in (path for copy_step, _, path in replaced_copies(store, role) if copy_step == step):
            os.rename(path, aside / path.name)
        _remove_if_empty(store.step_dir(step))
    except (OSError, CheckpointError) as exc:
        say("error", "checkpoint.abandoned_line_not_moved", step=step, role=role, error=str(exc),
            action="a later automatic resume may pair it with another role's folder of this step")
        return None
    return aside


def _remove_if_empty(folder: Path) -> None:
    try:
        os.rmdir(folder)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):  # not another role's folder in it
            say("warning", "checkpoint.step_folder_not_removed", path=str(folder), error=str(exc),
                action="left empty: no role's folder is in it")


def tracker_back_to(store: CheckpointStore, step: int) -> None:
    """Point a tracker that names a step newer than `step`, now gone, back at `step`."""
    try:
        named = store.read_tracker()
        if named is not None and named > step and lstat(store.step_dir(named)) is None:
            store.write_tracker(step)
    except CheckpointError as exc:
        say("warning", "checkpoint.tracker_failed", step=step, path=str(store.tracker_path), error=str(exc),
            action="the next save rewrites it")


def aside_names(store: CheckpointStore, marker: str) -> list[str]:
    """Names of the steps set aside with `marker`, oldest step first."""
    names = [e.name for e in store.entries()
             if marker in e.name and parse_step(e.name.split(marker)[0]) is not None]
    return sorted(names, key=lambda name: (int(name.split(marker)[0].removeprefix(STEP_PREFIX)), name))
