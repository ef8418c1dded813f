"""Checkpoint folders on disk: staging, commit, completeness, the tracker and retention.

Completeness is decided from the manifests alone, never from the tracker file: a crash can
leave the tracker ahead of, or behind, what was actually committed.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lifecycle.boundary import (STEP_PREFIX, TRACKER, check_step, lstat, os_error, os_errors, parse_step,
                                parse_step_number, read_bytes, real_dir, role_problem)
from lifecycle.aside import DAMAGED, SUPERSEDED, aside_names, quarantine, supersede
from lifecycle.errors import CheckpointError, ConfigError
from lifecycle.manifest import (
    MANIFEST, Progress, build_manifest, check_folder, fsync_dir, read_manifest_file, write_json_atomic, write_text_atomic,
)
from lifecycle.records import say
from lifecycle.retention import (
    REPLACED, STAGING, apply_retention, exchange, left_staging, only_copy, remove, replaced_copies, rmtree, tidy,
)
from lifecycle.writer_lock import LockHeld, WriterLock, lock_errno

TRACKER_LIMIT = 64
"""The tracker holds one step number: anything longer is not a tracker."""
Identity = tuple[tuple[int, int] | None, ...]
"""What a step's role folders are (inode and change time, None where missing), to tell a change."""
Agree = Callable[[bool], int]
"""Every rank says whether it failed; returns how many ranks did (all ranks call it)."""


def check_role(role: str) -> str:
    """A role becomes a folder name, so it must not be able to point anywhere else."""
    if problem := role_problem(role):
        raise ConfigError("role", problem)
    return role


def _default_barrier(world_size: int) -> Callable[[], None] | None:
    if world_size <= 1:
        return None
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.barrier
    raise ConfigError("world_size", f"world_size={world_size} needs a barrier or an initialized process group")


class CheckpointStore:
    """One training run's checkpoint root, shared by every role and rank."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        rank: int = 0,
        world_size: int = 1,
        barrier: Callable[[], None] | None = None,
        agree: Agree | None = None,
    ) -> None:
        with os_errors("cannot make the checkpoint root absolute (is the working directory gone?)", root):
            self.root = Path(root).absolute()  # a later chdir (a callback, a tool) must not move a save in flight
        self.rank = rank
        self.world_size = world_size
        self._barrier = barrier if barrier is not None else _default_barrier(world_size)
        self._agree = agree
        self.kept: set[str] = set()  # folders retention named as kept, each once (see `retention._say_kept`)

    def _sync(self) -> None:
        if self.world_size > 1 and self._barrier is not None:
            self._barrier()

    @property
    def tracker_path(self) -> Path:
        return self.root / TRACKER

    def step_dir(self, step: int) -> Path:
        return self.root / f"{STEP_PREFIX}{check_step(step)}"  # 1.5, True, -1: a folder no listing reads

    def role_dir(self, step: int, role: str) -> Path:
        return self.step_dir(step) / check_role(role)

    def writer_lock(self, role: str) -> WriterLock:
        """The lock that keeps a second writer of `role` out of this root (see `writer_lock`)."""
        return WriterLock(self.root, check_role(role))

    def staging(self, step: int, role: str, lock: WriterLock | None = None, roles: Sequence[str] = ()) -> Path:
        """Inside the step folder, so the final rename never crosses a filesystem.

        Rank 0 takes `lock` first (and tidies what crashed saves of `role` left, see
        `lifecycle.retention.tidy`), refuses a step below the newest one committed for every role
        of `roles` (see `check_not_behind`), then clears whatever stands at the staging path. With
        an `agree` function every rank learns whether rank 0 managed, before any rank writes, so
        no rank writes into a folder that is not this save's; with a plain barrier, rank 0
        still reaches it when it failed, so its peers never wait for it here.
        """
        path = self.step_dir(step) / f"{STAGING}{check_role(role)}"
        failed = False
        try:
            if self.rank == 0:
                failed = True
                with os_errors(f"cannot prepare the staging folder of step {step} (role {role})"):
                    self.root.mkdir(parents=True, exist_ok=True)
                    if lock is not None:
                        lock.acquire()
                        tidy(self, role)
                    self.check_not_behind(step, role, roles)
                    if not real_dir(self.step_dir(step), "a step folder"):
                        self.step_dir(step).mkdir(exist_ok=True)
                    if lstat(path) is not None:
                        rmtree(path)
                    path.mkdir()
                failed = False
        finally:
            if self._agree is not None and self.world_size > 1:
                if self._agree(failed) and not failed:
                    raise CheckpointError(f"{path}: rank 0 could not prepare the staging folder of step {step} "
                                          f"(role {role}); see its error. Nothing was written")
            else:
                self._sync()
        return path

    def check_not_behind(self, step: int, role: str, roles: Sequence[str]) -> None:
        """Refuse to save `step` below the newest step committed for every role of `roles`: an
        automatic resume takes that newer step, so this save's line would be lost on the first
        restart (and retention, counting the newer step, would prune this line first). Re-saving
        the newest step replaces it; a rollback (`resume.path` into this root) sets the newer
        steps aside first, so its saves pass."""
        if roles and (newer := self.newest_committed(roles)) is not None and newer > step:
            raise CheckpointError(
                f"{self.step_dir(step)}: cannot save step {step} (role {role}): step {newer} is committed in "
                f"{self.root} for every role ({', '.join(roles)}), and an automatic resume would restart from it, "
                "not from this save. Resume from it, roll back with resume.mode: path (under verl: resume_from_path "
                "with checkpoint.root naming this root), which sets the newer steps aside, or save into another "
                "checkpoint.root")

    def discard_staging(self, step: int, role: str) -> None:
        """After a failed save (rank 0): remove what it wrote, so a full disk gets its space back."""
        path = self.step_dir(step) / f"{STAGING}{check_role(role)}"
        try:
            if lstat(path) is not None:
                rmtree(path)
        except (OSError, CheckpointError) as exc:
            say("warning", "checkpoint.staging_not_removed", step=step, path=str(path), error=str(exc))

    def commit(
        self,
        step: int,
        role: str,
        *,
        contents: Mapping[str, str],
        parallel: Mapping[str, Any] | None = None,
        model_config_hash: str | None = None,
        extra_meta: Mapping[str, Any] | None = None,
        folders: Mapping[str, str] | None = None,
        roles: Sequence[str] | None = None,
        fsync: bool = False,
        digests: Mapping[str, str] | None = None,
        tracker: bool = True,
    ) -> Path:
        """Publish the staging folder once every rank has written its part.

        `contents` maps content -> backend name; `folders` maps content -> folder when it is
        not the content's own name (one folder may serve two contents). `roles` are the roles
        the step must hold before the tracker may point at it (default: this role). `digests`
        maps paths relative to the role folder to the digests this rank's writers returned:
        rank 0's manifest takes them instead of reading those files again. `tracker` false
        leaves the tracker to the trainer (`checkpoint.tracker`). The commit is the rename of the
        staging folder into place: what follows it (the tracker, removing a replaced folder) is
        best effort, logged when it fails, never raised.
        """
        step = check_step(step)  # a numpy integer too: the manifest holds a JSON number
        final = self.role_dir(step, role)
        self._sync()
        failed = self.rank == 0
        try:
            if self.rank == 0:
                with os_errors(f"cannot commit step {step} (role {role})"):
                    self._commit_rank0(step, role, contents, parallel or {}, model_config_hash,
                                       extra_meta or {}, folders or {}, fsync, digests or {})
                failed = False
        finally:  # rank 0 reaches this however its commit went, so no peer waits for it
            told = self._agree is not None and self.world_size > 1
            rank0_failed = bool(self._agree(failed)) if told else False  # type: ignore[misc]
            if not told:
                self._sync()
        if self.rank == 0:
            if tracker:
                self._advance_tracker(step, list(roles or [role]))
        elif rank0_failed or (not told and lstat(final / MANIFEST) is None):
            raise CheckpointError(f"{final / MANIFEST}: rank 0 did not commit step {step} (see its error)")
        return final

    def _commit_rank0(
        self,
        step: int,
        role: str,
        contents: Mapping[str, str],
        parallel: Mapping[str, Any],
        model_config_hash: str | None,
        meta: Mapping[str, Any],
        folders: Mapping[str, str],
        fsync: bool,
        digests: Mapping[str, str],
    ) -> None:
        staging = self.step_dir(step) / f"{STAGING}{role}"
        if not real_dir(staging, "the staging folder"):
            raise CheckpointError(f"{staging}: staging folder missing; call staging() before commit()")
        entries = {name: {"backend": backend, "folder": folders.get(name, name)}
                   for name, backend in contents.items()}
        manifest = build_manifest(staging, step=step, role=role, contents=entries, parallel=parallel,
                                  model_config_hash=model_config_hash, meta=meta, fsync=fsync, digests=digests)
        with os_errors(f"cannot write the manifest of step {step} (role {role})", staging / MANIFEST):
            write_json_atomic(staging / MANIFEST, manifest)  # a full disk's error names no file of its own
        final = self.role_dir(step, role)
        if lstat(final) is None:
            os.rename(staging, final)
            old = None
        elif exchange(staging, final):
            old = staging  # the replaced folder, now under the staging name
        else:  # two renames; a crash between them leaves the only committed copy at `old`, which
            old = self.root / f"{REPLACED}{step}-{role}-{uuid.uuid4().hex[:8]}"  # `put_back` restores
            os.rename(final, old)
            try:
                os.rename(staging, final)
            except OSError:
                os.rename(old, final)  # the step keeps the folder it had
                raise
        self._after_rename(step, final, old)

    def _after_rename(self, step: int, final: Path, old: Path | None) -> None:
        """Committed already: make the rename durable and drop the folder it replaced, best effort."""
        try:
            fsync_dir(final.parent)
        except OSError as exc:
            say("error", "checkpoint.commit_not_durable", step=step, path=str(final.parent), error=str(exc))
        if old is not None:
            remove(self, old, step)

    def _advance_tracker(self, step: int, roles: list[str]) -> None:
        """Point at `step` once it is complete, unless the tracker names a newer complete step.
        Best effort: resume never reads the tracker, so failing to write it fails nothing."""
        try:
            if not self.is_complete(step, roles):
                return
            try:
                current = self.read_tracker()
            except CheckpointError:
                current = None
            if current is None or current <= step or not self.is_complete(current, roles):
                self.write_tracker(step)
        except (CheckpointError, OSError) as exc:
            say("warning", "checkpoint.tracker_failed", step=step, path=str(self.tracker_path), error=str(exc),
                action="the next save retries")

    def read_manifest(self, step: int, role: str) -> dict[str, Any]:
        return read_manifest_file(self.role_dir(step, role))

    def validate(self, step: int, role: str, *, deep: bool) -> list[str]:
        """Problems with one role's folder; cheap mode checks presence, types and sizes only."""
        return check_folder(self.role_dir(step, role), deep=deep, expect_step=step, expect_role=role)

    def verify(self, step: int, role: str, progress: Progress | None = None) -> list[str]:
        """Deep check with progress (bytes done, bytes total) for a command-line inspector."""
        return check_folder(self.role_dir(step, role), deep=True, expect_step=step,
                            expect_role=role, progress=progress)

    def entries(self) -> list[os.DirEntry[str]]:
        """What the root holds, unchecked; an empty list when the root does not exist yet."""
        try:
            with os.scandir(self.root) as entries:
                return list(entries)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise os_error(exc, "cannot list the checkpoint root", self.root) from exc

    def steps(self) -> list[int]:
        """Step folders, oldest first: canonical names (`global_step_<n>`) of real folders only."""
        found = [step for e in self.entries()
                 if (step := parse_step(e.name)) is not None and e.is_dir(follow_symlinks=False)]
        return sorted(found)

    def quarantined(self) -> list[str]:
        """Names of the steps resume set aside as damaged, oldest step first."""
        return aside_names(self, DAMAGED)

    def superseded(self) -> list[str]:
        """Names of the steps set aside because the run was rolled back past them."""
        return aside_names(self, SUPERSEDED)

    def status(self, step: int, roles: Sequence[str], *, deep: bool = False) -> dict[str, list[str]]:
        """Per role, why the step cannot be trusted (an empty list: it can)."""
        return {role: self.validate(step, role, deep=deep) for role in roles}

    def is_complete(self, step: int, roles: Sequence[str], deep: bool = False) -> bool:
        return bool(roles) and all(not problems for problems in self.status(step, roles, deep=deep).values())

    def newest_complete(self, roles: Sequence[str]) -> int | None:
        for step in reversed(self.steps()):
            if self.is_complete(step, roles):
                return step
        return None

    def newest_committed(self, roles: Sequence[str], below: int | None = None) -> int | None:
        """Newest step (older than `below`, when given) `committed` for every role, whatever the
        manifests and the files hold now: resume judges those next. A role whose committed copy
        is in a `.replaced-` folder (see `put_back`) counts as committed."""
        aside = {(step, role) for step, role, _ in replaced_copies(self)}
        for step in reversed(self.steps()):
            if below is not None and step >= below:
                continue
            if roles and all(self.committed(step, role) or (step, role) in aside for role in roles):
                return step
        return None

    def committed(self, step: int, role: str) -> bool:
        """Whether `role`'s folder of `step` holds a manifest (it only ever appears with one, by the
        commit's rename); a `CheckpointError` when that cannot be told (EACCES)."""
        return lstat(self.role_dir(step, role) / MANIFEST) is not None

    def tidy(self, role: str) -> None:
        """Before a resume: what crashed saves of `role` left, tidied under its writer lock (see
        `lifecycle.retention.tidy`); skipped while another process holds it. Never another role's:
        taking its lock would refuse a save of it starting then as a second writer's. A lock that cannot be
        taken at all (ENOLCK) skips it with a warning: resume counts a `.replaced-` copy as committed."""
        if not (replaced_copies(self, role) or left_staging(self, role)):
            return
        lock = self.writer_lock(role)
        try:
            lock.acquire()
        except LockHeld:
            return
        except CheckpointError as exc:
            say("warning", "checkpoint.tidy_skipped", role=role, path=str(lock.path), errno=lock_errno(exc),
                error=str(exc), action="what crashed saves left stays until a resume can take the writer lock")
            return
        try:
            tidy(self, role)
        finally:
            lock.release()

    def identity(self, step: int, roles: Sequence[str]) -> Identity:
        """What the role folders of `step` are now: a commit, a rename or a removal changes it."""
        found: list[tuple[int, int] | None] = []
        for role in roles:
            try:
                st = os.lstat(self.role_dir(step, role))
                found.append((st.st_ino, st.st_ctime_ns))
            except OSError:
                found.append(None)
        return tuple(found)

    def in_flux(self, step: int, roles: Sequence[str], before: Identity) -> bool:
        """Whether `step` changed since `before`, or a role's folder is missing while that role's
        save (its staging folder) or its committed copy (`.replaced-`) is there: a commit in
        flight, never damage to set aside."""
        if self.identity(step, roles) != before:
            return True
        aside = {(s, role) for s, role, _ in replaced_copies(self)}
        return any(only_copy(self, step, role)
                   and ((step, role) in aside or os.path.lexists(self.step_dir(step) / f"{STAGING}{role}"))
                   for role in roles)

    def quarantine(self, step: int, problems: Sequence[str], roles: Sequence[str]) -> Path | None:
        """Rename a damaged step aside (see `lifecycle.aside.quarantine`); nothing is deleted."""
        return quarantine(self, step, problems, roles)

    def supersede(self, newer_than: int) -> list[Path]:
        """Rename aside every step newer than `newer_than` (see `lifecycle.aside.supersede`)."""
        return supersede(self, newer_than)

    def read_tracker(self) -> int | None:
        """The step the tracker names, even when that step is gone: others report that."""
        path = self.tracker_path
        if lstat(path) is None:
            return None
        raw = read_bytes(path, TRACKER_LIMIT, "the tracker")
        try:
            text = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            raise CheckpointError(f"{path}: tracker must hold a step number, found {raw[:40]!r}") from None
        return parse_step_number(text, path)

    def write_tracker(self, step: int) -> None:
        with os_errors("cannot write the tracker", self.tracker_path):
            self.root.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.tracker_path, f"{int(step)}\n")

    def apply_retention(self, keep_last: int | None, roles: Sequence[str], protect: set[int], *,
                        role: str) -> list[int]:
        """Prune `role`'s folders of the steps older than the newest `keep_last` ones complete for
        `roles`, and a step folder once no other role's folder remains in it (see
        `lifecycle.retention`); never the step the tracker names, whoever writes it."""
        return (apply_retention(self, keep_last, roles, protect, check_role(role))
                if self.rank == 0 else [])
