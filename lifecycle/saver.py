"""Save: write -> agree -> commit, the one path of every save.

A save writes its contents into a staging folder (`lifecycle.contents`), the ranks agree that
every one of them wrote its part, and the store commits (manifest last, then the rename);
retention and the figures follow, and never fail the save. A synchronous save runs the three
in the caller's thread; an async one (`lifecycle.async_save.AsyncSaver`) stages what must be
written at once, then writes the rest and commits through this same `Saver` in the background.
Rank 0 holds the role's writer lock from staging to commit; a save that fails before its
commit removes what it staged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Generic, TypeVar

from backends.base import failed_ranks
from lifecycle.contents import ContentWriter
from lifecycle.errors import CheckpointError
from lifecycle.manifest import read_manifest_file
from lifecycle.records import say
from lifecycle.role import RoleRank
from lifecycle.store import Agree, CheckpointStore
from lifecycle.types import Parts, Progress, SaveInfo, Written
from lifecycle.writer_lock import WriterLock

_T = TypeVar("_T")


def agree_fn(collective: bool, group: Any = None) -> Agree | None:
    """How a store's ranks learn that one of them failed: a count over `group`, when the save
    spans the ranks of a process group (a caller's own barrier tells nothing)."""
    return partial(failed_ranks, group=group) if collective else None


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveJob:
    """One save of one step, handed from stage to stage (and perhaps to the background thread)."""

    step: int
    writer: ContentWriter
    model_hash: str | None
    started: float
    """`time.perf_counter()` when the caller asked for the save: its figures' `seconds` count from here."""
    lock: WriterLock | None
    """Rank 0's writer lock of the role, taken when staging and released after the commit."""

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


@dataclass(frozen=True, slots=True)
class Staged(Generic[_T]):
    """What staging left: the folder, what was written into it, and the result of `also`."""

    folder: Path
    written: Written
    also: _T


class Saver:
    """Writes, agrees on and commits one role's saves; every rank of the role makes the same calls."""

    def __init__(self, at: RoleRank, *, parallel: dict[str, Any]) -> None:
        """`parallel`: the layout the manifests record (world size and the caller's own keys)."""
        self.at = at
        self._parallel = parallel

    def save(self, job: SaveJob, parts: Parts, progress: Progress) -> SaveInfo:
        """The synchronous path: every content staged, agreed, committed; the lock released."""
        try:
            staged = self.stage(job, parts, progress, job.writer.wanted, also=lambda: None)
            return self.commit(job, staged.written)
        finally:
            job.release()

    def stage(
        self, job: SaveJob, parts: Parts, progress: Progress, contents: Collection[str], *, also: Callable[[], _T],
    ) -> Staged[_T]:
        """Prepare the staging folder, write `contents` into it and run `also`, agreed across ranks."""
        def write() -> Staged[_T]:
            folder = self.at.store().staging(job.step, self.at.role, job.lock, self.at.roles)
            return Staged(folder, job.writer.write(folder, parts, progress, contents), also())

        return self.agreed(job.step, write, cleanup=self.discard(job))

    def write(
        self, job: SaveJob, folder: Path, parts: Parts, progress: Progress, contents: Collection[str], *,
        group: Any = None,
    ) -> Written:
        """Write `contents` into the folder `stage` prepared, agreed across the ranks of `group`."""
        return self.agreed(job.step, lambda: job.writer.write(folder, parts, progress, contents), group=group,
                           cleanup=self.discard(job))

    def agreed(self, step: int, write: Callable[[], _T], group: Any = None,
               cleanup: Callable[[], None] | None = None) -> _T:
        """`write()` on every rank, then a count of the ranks whose write failed.

        A rank that failed (rank 0 alone writing the HF files, say) would otherwise never reach
        the commit barrier, and its peers would wait there until the process group's timeout.
        The failed rank raises its own error, the others a `CheckpointError` naming the step;
        once all know, `cleanup` runs (every rank has stopped writing by then).
        """
        try:
            if not self.at.collective():
                return write()
            try:
                result = write()
            except BaseException:
                failed_ranks(True, group)
                raise
            if failed := failed_ranks(False, group):
                raise CheckpointError(f"save of step {step} (role {self.at.role}): {failed} other rank(s) failed to "
                                      "write their part (see their errors); nothing was committed")
            return result
        except BaseException:
            if cleanup is not None:
                cleanup()
            raise

    def discard(self, job: SaveJob) -> Callable[[], None]:
        """What a failed save leaves: its staging folder, removed by rank 0 once it holds the lock
        (never another writer's staging)."""
        def discard() -> None:
            if job.lock is not None and job.lock.held:
                self.at.store().discard_staging(job.step, self.at.role)
        return discard

    def commit(self, job: SaveJob, written: Written, store: CheckpointStore | None = None) -> SaveInfo:
        """Commit (through `store`: the background's own, whose barriers are not training's),
        then housekeeping that never fails the save: retention, and the figures."""
        store = store or self.at.store()
        try:
            final = store.commit(job.step, self.at.role, contents=written.contents, folders=written.folders,
                                 parallel=self._parallel, model_config_hash=job.model_hash, extra_meta={},
                                 roles=self.at.roles, fsync=self.at.config.checkpoint.fsync, digests=written.digests,
                                 tracker=self.at.config.checkpoint.tracker)
        except BaseException:
            self.discard(job)()
            raise
        ckpt = self.at.config.checkpoint
        store.apply_retention(ckpt.keep_last, self.at.roles, {job.step}, role=self.at.role)
        size = count = 0
        try:
            files = read_manifest_file(final)["files"]
            size, count = sum(f["size"] for f in files), len(files)
        except CheckpointError as exc:
            say("warning", "checkpoint.figures_unavailable", step=job.step, error=str(exc))
        return SaveInfo(step=job.step, path=final, contents=list(written.contents), backend=job.writer.name,
                        bytes=size, files=count, seconds=time.perf_counter() - job.started)
