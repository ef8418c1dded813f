"""Checkpoint folders on disk: staging, commit, completeness, the tracker and retention.

Completeness is decided from the manifests alone, never from the tracker file: a crash can
leave the tracker ahead of, or behind, what was actually committed.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from lifecycle.errors import CheckpointError, ConfigError
from lifecycle.manifest import (
    MANIFEST,
    Progress,
    build_manifest,
    check_folder,
    fsync_dir,
    read_manifest_file,
    write_json_atomic,
    write_text_atomic,
)

TRACKER = "latest_checkpointed_iteration.txt"
_STEP_RE = re.compile(r"global_step_([0-9]+)")
_ROLE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def check_role(role: str) -> str:
    """A role becomes a folder name, so it must not be able to point anywhere else."""
    if not isinstance(role, str) or not _ROLE_RE.fullmatch(role):
        raise ConfigError("role", f"{role!r} is not a valid role name (letters, digits, _ . -)")
    return role


def _default_barrier(world_size: int) -> Callable[[], None] | None:
    if world_size <= 1:
        return None
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.barrier
    raise ConfigError("world_size", f"world_size={world_size} needs a barrier or an initialized process group")


def _remove_tree(path: Path) -> bool:
    """Move out of sight first so a half-deleted step never looks like a damaged one."""
    trash = path.parent / f".trash-{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return False
    _rmtree(trash)
    return True


def _rmtree(path: Path) -> None:
    """Remove a tree that another process may be removing at the same time."""

    def vanished_ok(func: Callable[..., Any], name: str, exc: Any) -> None:
        err = exc[1] if isinstance(exc, tuple) else exc
        if not isinstance(err, FileNotFoundError):
            raise err

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=vanished_ok)
    else:
        shutil.rmtree(path, onerror=vanished_ok)


class CheckpointStore:
    """One training run's checkpoint root, shared by every role and rank."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        rank: int = 0,
        world_size: int = 1,
        barrier: Callable[[], None] | None = None,
    ) -> None:
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self._barrier = barrier if barrier is not None else _default_barrier(world_size)

    def _sync(self) -> None:
        if self.world_size > 1 and self._barrier is not None:
            self._barrier()

    @property
    def tracker_path(self) -> Path:
        return self.root / TRACKER

    def step_dir(self, step: int) -> Path:
        return self.root / f"global_step_{int(step)}"

    def role_dir(self, step: int, role: str) -> Path:
        return self.step_dir(step) / check_role(role)

    def staging(self, step: int, role: str) -> Path:
        """Inside the step folder, so the final rename never crosses a filesystem."""
        path = self.step_dir(step) / f".staging-{check_role(role)}"
        try:
            if self.rank == 0:
                if path.exists():
                    shutil.rmtree(path)
                path.mkdir(parents=True)
        finally:
            self._sync()  # reached by rank 0 even when it failed, so its peers never wait for it here
        return path

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
    ) -> Path:
        """Publish the staging folder once every rank has written its part.

        `contents` maps content -> backend name; `folders` maps content -> folder when it is
        not the content's own name (one folder may serve two contents). `roles` are the roles
        the step must hold before the tracker may point at it (default: this role).
        """
        final = self.role_dir(step, role)
        self._sync()
        try:
            if self.rank == 0:
                self._commit_rank0(step, role, contents, parallel or {}, model_config_hash,
                                   extra_meta or {}, folders or {}, fsync)
                self._advance_tracker(step, list(roles or [role]))
        finally:
            self._sync()
        if not (final / MANIFEST).is_file():
            raise CheckpointError(f"{final / MANIFEST}: rank 0 did not commit step {step}")
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
    ) -> None:
        staging = self.step_dir(step) / f".staging-{role}"
        if not staging.is_dir():
            raise CheckpointError(f"{staging}: staging folder missing; call staging() before commit()")
        entries = {name: {"backend": backend, "folder": folders.get(name, name)}
                   for name, backend in contents.items()}
        manifest = build_manifest(staging, step=step, role=role, contents=entries, parallel=parallel,
                                  model_config_hash=model_config_hash, meta=meta, fsync=fsync)
        write_json_atomic(staging / MANIFEST, manifest)
        final = self.role_dir(step, role)
        old = final.parent / f".replaced-{role}-{uuid.uuid4().hex[:8]}"
        had_old = final.exists()
        if had_old:
            os.rename(final, old)
        os.rename(staging, final)
        fsync_dir(final.parent)
        if had_old:
            _rmtree(old)

    def _advance_tracker(self, step: int, roles: list[str]) -> None:
        """Point at `step` once it is complete, unless the tracker names a newer complete step."""
        if not self.is_complete(step, roles):
            return
        try:
            current = self.read_tracker()
        except CheckpointError:
            current = None
        if current is None or current <= step or not self.is_complete(current, roles):
            self.write_tracker(step)

    def read_manifest(self, step: int, role: str) -> dict[str, Any]:
        return read_manifest_file(self.role_dir(step, role))

    def validate(self, step: int, role: str, *, deep: bool) -> list[str]:
        """Problems with one role's folder; cheap mode checks presence and sizes only."""
        return check_folder(self.role_dir(step, role), deep=deep, expect_step=step, expect_role=role)

    def verify(self, step: int, role: str, progress: Progress | None = None) -> list[str]:
        """Deep check with progress (bytes done, bytes total) for a command-line inspector."""
        return check_folder(self.role_dir(step, role), deep=True, expect_step=step,
                            expect_role=role, progress=progress)

    def steps(self) -> list[int]:
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        found = [int(m.group(1)) for e in entries
                 if (m := _STEP_RE.fullmatch(e.name)) and e.is_dir(follow_symlinks=False)]
        return sorted(found)

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

    def newest_committed(self, roles: Sequence[str]) -> int | None:
        """Newest step every role published a readable manifest for, whatever its files hold now.

        Resume starts here and checks the files deeply: a committed step that lost or changed
        a file is refused loudly, never skipped for an older step or a fresh start.
        """
        for step in reversed(self.steps()):
            if roles and all(self._has_manifest(step, role) for role in roles):
                return step
        return None

    def _has_manifest(self, step: int, role: str) -> bool:
        try:
            read_manifest_file(self.role_dir(step, role))
        except CheckpointError:
            return False
        return True

    def read_tracker(self) -> int | None:
        """The step the tracker names, even when that step is gone: others report that."""
        path = self.tracker_path
        try:
            text = path.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: cannot read tracker: {exc}") from exc
        if not text.isascii() or not text.isdigit():
            raise CheckpointError(f"{path}: tracker must hold a step number, found {text[:40]!r}")
        return int(text)

    def write_tracker(self, step: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.tracker_path, f"{int(step)}\n")

    def apply_retention(self, keep_last: int | None, roles: Sequence[str], protect: set[int]) -> list[int]:
        """Delete steps older than the newest `keep_last` complete ones; None or < 1 keeps all.

        Steps newer than the oldest kept one stay even when incomplete: another role may
        still be writing them.
        """
        if self.rank != 0 or keep_last is None or keep_last < 1:
            return []
        for leftover in self.root.glob(".trash-*"):
            _rmtree(leftover)  # a crash mid-retention left it; it was out of resume's sight already
        all_steps = self.steps()
        complete = [s for s in all_steps if self.is_complete(s, roles)]
        if len(complete) <= keep_last:
            return []
        oldest_kept = complete[-keep_last]
        deleted: list[int] = []
        log = structlog.get_logger()
        for step in all_steps:
            if step >= oldest_kept or step in protect:
                continue
            if _remove_tree(self.step_dir(step)):
                deleted.append(step)
        if deleted:
            log.info("checkpoint.retention", root=str(self.root), deleted=deleted,
                     keep_last=keep_last, protected=sorted(protect))
        return deleted
