"""The on-disk Checkpointer: one role's save, resume and first load through a format backend.

Layout and commit belong to `CheckpointStore`; bytes belong to the backends. This module
decides which content goes where, and refuses to load anything that does not verify.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Collection, Mapping
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import structlog

from backends.base import FormatBackend, backend_class, failed_ranks, format_capabilities, listed
from lifecycle.async_save import BackgroundSaver, PendingSave
from lifecycle.boundary import check_step, lstat, os_errors, special_files
from lifecycle.config import LifecycleConfig
from lifecycle.errors import CheckpointError, ConfigError
from lifecycle.extra import save_extra
from lifecycle.manifest import MANIFEST, check_folder, read_manifest_file
from lifecycle.resumer import HashFn, Resumer, _value, log_resumed
from lifecycle.store import CheckpointStore, check_role
from lifecycle.types import Parts, Progress, SaveInfo, Written
from lifecycle.writer_lock import WriterLock

_T = TypeVar("_T")
EXTRA_BACKEND = "extra"
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "_commit_hash")


def model_config_hash(parts: Parts) -> str | None:
    """Fingerprint of the architecture, so resume can refuse a checkpoint of another model.

    Keys that change with the library version or the load path, not the model, are left out.
    """
    model = parts.model
    if model is None:
        return None
    describe = getattr(model, "fingerprint", None) or getattr(getattr(model, "config", None), "to_dict", None)
    if callable(describe):
        cfg = {k: v for k, v in describe().items() if k not in _VOLATILE_CONFIG_KEYS}
        payload = json.dumps(cfg, sort_keys=True, default=str)
    else:
        layout = sorted([n, list(t.shape), str(t.dtype)] for n, t in model.state_dict().items())
        payload = json.dumps(layout)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


def check_parts(config: LifecycleConfig, parts: Parts, world_size: int = 1) -> None:
    """Refuse at construction what a backend could only refuse mid-save (hf_model from a
    dist_ckpt model without a bridge, an async save the format cannot do): each format in use
    checks the model it will get, and may wrap it (a bare GPTModel becomes a MegatronModel)
    in `parts`."""
    ckpt = config.checkpoint
    if ckpt.save.async_:
        check_async(backend_class(_value(ckpt.save.format)), world_size)
    if parts.model is None:
        return
    uses = [("checkpoint.save.format", ckpt.save.format, [_value(c) for c in ckpt.save.contents]),
            ("checkpoint.load.format", ckpt.load_format, [])]
    if ckpt.pre_load.path:
        uses.append(("checkpoint.pre_load.format", ckpt.pre_load_format, []))
    for key, fmt, contents in uses:
        parts.model = backend_class(_value(fmt), key).check_model(parts.model, contents, key)


def check_async(backend: type[FormatBackend], world_size: int) -> None:
    """`ConfigError` on `checkpoint.save.async` when `backend` cannot save in the background."""
    if not backend.capabilities.supports_async:
        raise ConfigError("checkpoint.save.async", f"format {backend.name!r} cannot write in the background; "
                          "set checkpoint.save.async to false")
    if world_size > 1 and backend.capabilities.collective_save:
        raise ConfigError(
            "checkpoint.save.async",
            f"format {backend.name!r} saves with collectives on every rank, which in the background would "
            f"interleave with training's own; with world_size {world_size} set checkpoint.save.async to false",
        )


def _under(folder: str, digests: Mapping[str, str] | None) -> dict[str, str]:
    """A content's digests (relative to its folder) keyed relative to the role folder; None
    from a backend written before formats returned digests means nothing was hashed."""
    return {f"{folder}/{rel}": digest for rel, digest in (digests or {}).items()}


def folder_figures(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


class DiskCheckpointer:
    """Checkpointer over `config.checkpoint.root`; every rank of the role makes the same calls."""

    def __init__(
        self,
        config: LifecycleConfig,
        *,
        role: str,
        rank: int = 0,
        world_size: int = 1,
        barrier: Callable[[], None] | None = None,
        model_config_hash: HashFn | None = None,
        parallel: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.role = check_role(role)
        self.rank = rank
        self.world_size = world_size
        roles = [str(r) for r in config.checkpoint.roles]
        self.roles = roles if role in roles else [*roles, role]
        self._barrier = barrier
        self._hash_fn = model_config_hash
        self._parallel = {"world_size": world_size, **(parallel or {})}
        self._store: CheckpointStore | None = None
        self._resumer = Resumer(config, lambda: self.store, role=self.role, roles=self.roles, rank=rank,
                                collective=lambda: self._collective,
                                model_hash=self._model_hash,
                                world_size=world_size)
        self._background: BackgroundSaver | None = None
        self._background_store: CheckpointStore | None = None
        self._background_group: Any = None
        """The gloo group the background commit's barriers and agreement run on (several ranks)."""

    @property
    def store(self) -> CheckpointStore:
        if self._store is None:
            root = self.config.checkpoint.root
            if root is None:
                raise ConfigError("checkpoint.root", "not set; saving and resuming need a folder")
            self._store = CheckpointStore(root, rank=self.rank, world_size=self.world_size,
                                          barrier=self._barrier, agree=self._agree_fn())
        return self._store

    def _model_hash(self, parts: Parts) -> str | None:
        return (self._hash_fn or model_config_hash)(parts)

    def _agree_fn(self, group: Any = None) -> Callable[[bool], int] | None:
        return partial(failed_ranks, group=group) if self._collective else None

    def load_initial(self, parts: Parts) -> dict[str, Any]:
        pre = self.config.checkpoint.pre_load
        if not pre.path and self._resumer.overwritten:
            raise CheckpointError(
                f"the model's weights may be partly overwritten by {self._resumer.overwritten}, and "
                "checkpoint.pre_load.path is not set to load fresh ones: set it, or rebuild the model"
            )
        if not pre.path:
            return {}
        name, folder = _value(self.config.checkpoint.pre_load_format), Path(pre.path)
        if parts.model is None:
            raise CheckpointError(f"{folder}: checkpoint.pre_load.path is set but there is no model to load into")
        if not folder.is_dir():
            raise CheckpointError(f"{folder}: checkpoint.pre_load.path is not a folder")
        self._verify_pre_load(folder, name)
        with os_errors("cannot read checkpoint.pre_load.path", folder):
            backend_class(name)().load_model(parts.model, folder)
        self._resumer.overwritten = None
        size, count = folder_figures(folder)
        return {"backend": name, "path": str(folder), "bytes": size, "files": count}

    def _verify_pre_load(self, folder: Path, name: str) -> None:
        """A folder inside a committed checkpoint is verified first; any other folder is read as
        it is, and a sharded format's loads say so (their metadata is read through an
        allow-list, but nothing vouches for the bytes)."""
        with os_errors("cannot read checkpoint.pre_load.path", folder):
            committed = next((f for f in (folder, folder.parent) if lstat(f / MANIFEST) is not None), None)
        if committed is None and (odd := special_files(folder)):
            raise CheckpointError(f"{folder}: cannot load initial weights:\n  " + listed(odd))
        if committed is None and format_capabilities(name, "checkpoint.pre_load.format").reads_pickles:
            structlog.get_logger().warning(
                "checkpoint.pre_load.unverified", path=str(folder), format=name,
                reason="not a committed checkpoint: no checksums to verify the files against; metadata is "
                       "read through an allow-list, but load only checkpoints you trust")
        if committed is not None and (problems := check_folder(committed, deep=True)):
            raise CheckpointError(f"{committed}: cannot load initial weights:\n  " + listed(problems))

    def save(self, step: int, parts: Parts, progress: Progress) -> SaveInfo:
        """Write and commit `step`; with `save.async`, return once the state is copied to host.

        The figures' `seconds` include waiting for the previous async save's commit: all of it
        is time the training loop stood still. Rank 0 holds the role's writer lock from
        staging to commit; a save that fails before its commit removes what it staged."""
        started = time.perf_counter()
        step = check_step(step)
        self.wait()
        name = _value(self.config.checkpoint.save.format)
        backend = backend_class(name)(**self.config.checkpoint.save.options)
        background = self._async_saver(backend) if self.config.checkpoint.save.async_ else None
        model_hash = self._model_hash(parts)
        lock = self.store.writer_lock(self.role) if self.rank == 0 else None
        if background is not None:
            return self._save_async(background, backend, step, parts, progress, model_hash, started, lock)
        try:
            def write() -> Written:
                staging = self.store.staging(step, self.role, lock)
                return self._write_contents(backend, name, staging, parts, progress, step)

            written = self._agreed(step, write, cleanup=self._cleanup(self.store, step, lock))
            return self._commit(self.store, step, name, written, model_hash, started, lock)
        finally:
            if lock is not None:
                lock.release()

    def _cleanup(self, store: CheckpointStore, step: int, lock: WriterLock | None) -> Callable[[], None]:
        """What a failed save leaves: its staging folder, removed by rank 0 once it holds the lock
        (never another writer's staging)."""
        def discard() -> None:
            if lock is not None and lock.held:
                store.discard_staging(step, self.role)
        return discard

    def _agreed(self, step: int, write: Callable[[], _T], group: Any = None,
                cleanup: Callable[[], None] | None = None) -> _T:
        """`write()` on every rank, then a count of the ranks whose write failed.

        A rank that failed (rank 0 alone writing the HF files, say) would otherwise never reach
        the commit barrier, and its peers would wait there until the process group's timeout.
        The failed rank raises its own error, the others a `CheckpointError` naming the step;
        once all know, `cleanup` runs (every rank has stopped writing by then).
        `write` creates the staging folder too (rank 0 does, between barriers it always reaches).
        """
        try:
            if not self._collective:
                return write()
            try:
                result = write()
            except BaseException:
                failed_ranks(True, group)
                raise
            if failed := failed_ranks(False, group):
                raise CheckpointError(f"save of step {step} (role {self.role}): {failed} other rank(s) failed to "
                                      "write their part (see their errors); nothing was committed")
            return result
        except BaseException:
            if cleanup is not None:
                cleanup()
            raise

    @property
    def _collective(self) -> bool:
        """Whether this save spans ranks of a process group (a caller's own barrier: not ours to use)."""
        import torch.distributed as dist

        return (self.world_size > 1 and self._barrier is None and dist.is_available()
                and dist.is_initialized())

    def _commit(
        self, store: CheckpointStore, step: int, name: str, written: Written,
        model_hash: str | None, started: float, lock: WriterLock | None,
    ) -> SaveInfo:
        """Commit, then housekeeping that never fails the save: retention, and the figures."""
        try:
            final = store.commit(step, self.role, contents=written.contents, folders=written.folders,
                                 parallel=self._parallel, model_config_hash=model_hash, extra_meta={},
                                 roles=self.roles, fsync=self.config.checkpoint.fsync, digests=written.digests)
        except BaseException:
            self._cleanup(store, step, lock)()
            raise
        store.apply_retention(self.config.checkpoint.keep_last, self.roles, {step})
        size = count = 0
        try:
            files = read_manifest_file(final)["files"]
            size, count = sum(f["size"] for f in files), len(files)
        except CheckpointError as exc:
            structlog.get_logger().warning("checkpoint.figures_unavailable", step=step, error=str(exc))
        return SaveInfo(step=step, path=final, contents=list(written.contents), backend=name, bytes=size,
                        files=count, seconds=time.perf_counter() - started)

    def _save_async(
        self, background: BackgroundSaver, backend: FormatBackend, step: int, parts: Parts, progress: Progress,
        model_hash: str | None, started: float, lock: WriterLock | None,
    ) -> PendingSave:
        """`extra` (RNG states, data position) is written now, as it stands at this step; the
        rest is written from a host copy on the background thread, then committed there. The
        writer lock goes with the save to the background and is released after its commit."""
        name = backend.name
        wanted = [_value(c) for c in self.config.checkpoint.save.contents]
        store = self._commit_store()
        cleanup = self._cleanup(self.store, step, lock)

        def extra_and_copy() -> tuple[Path, Written, Parts]:
            staging = self.store.staging(step, self.role, lock)
            return (staging, self._write_contents(backend, name, staging, parts, progress, step, only={"extra"}),
                    background.copier.snapshot(parts))

        try:
            staging, now, frozen = self._agreed(step, extra_and_copy, cleanup=cleanup)
        except BaseException:
            if lock is not None:
                lock.release()
            raise

        def write_and_commit() -> SaveInfo:
            try:
                later = self._agreed(step, lambda: self._write_contents(
                    backend, name, staging, frozen, progress, step, only={c for c in wanted if c != "extra"}),
                    group=self._background_group, cleanup=cleanup)
                return self._commit(store, step, name, later | now, model_hash, started, lock)
            finally:
                if lock is not None:
                    lock.release()

        try:
            committed = background.submit(step, write_and_commit)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        return PendingSave(step=step, path=self.store.role_dir(step, self.role), contents=wanted, backend=name,
                           bytes=background.copier.bytes, seconds=time.perf_counter() - started,
                           committed=committed)

    def _async_saver(self, backend: FormatBackend) -> BackgroundSaver:
        check_async(type(backend), self.world_size)
        if self._background is None:
            self._background = BackgroundSaver(self.role)
        return self._background

    def _commit_store(self) -> CheckpointStore:
        """The commit's barriers run on the background thread: never on the group training uses."""
        if self.world_size <= 1 or self._barrier is not None:
            return self.store
        if self._background_store is None:
            import torch.distributed as dist

            group = self._background_group = dist.new_group(backend="gloo")
            self._background_store = CheckpointStore(self.store.root, rank=self.rank, world_size=self.world_size,
                                                     barrier=partial(dist.barrier, group=group),
                                                     agree=self._agree_fn(group))
        return self._background_store

    def wait(self) -> SaveInfo | None:
        """Block until the async save in flight (if any) has committed; raises its failure, once."""
        return None if self._background is None else self._background.wait()

    def close(self) -> None:
        """Wait for the async save in flight and stop the background thread."""
        if self._background is not None:
            self._background.close()

    def _write_contents(
        self, backend: FormatBackend, name: str, staging: Path, parts: Parts, progress: Progress, step: int,
        only: Collection[str] | None = None,
    ) -> Written:
        """Write each wanted content (of `only`, when given) once, collecting what each writer
        returned. An `OSError` (disk full, permission) names the step, content and file."""
        wanted = [_value(c) for c in self.config.checkpoint.save.contents]
        written = Written()
        log = structlog.get_logger()
        needs = {"model": parts.model, "hf_model": parts.model, "optimizer": parts.optimizer}
        for content in wanted:
            if only is not None and content not in only:
                continue
            if content in needs and needs[content] is None:
                log.warning("checkpoint.save.content_skipped", content=content, role=self.role,
                            reason="the worker has no object to save for it")
                continue
            with os_errors(f"save of step {step} (role {self.role}) cannot write {content!r}", staging):
                if content == "hf_model" and backend.capabilities.native_hf and "model" in wanted:
                    written.folders[content] = "model"
                else:
                    sub = f"extra/rank_{self.rank}" if content == "extra" else content
                    written.digests.update(_under(sub, self._write_one(backend, content, staging / sub, parts,
                                                                      progress)))
            written.contents[content] = EXTRA_BACKEND if content == "extra" else name
        return written

    def _write_one(
        self, backend: FormatBackend, content: str, folder: Path, parts: Parts, progress: Progress
    ) -> dict[str, str] | None:
        """Write one content into `folder`; returns the digests its writer took while writing."""
        if content == "model":
            return backend.save_model(parts.model, folder)
        if content == "hf_model":
            return backend.export_hf(parts.model, folder)
        if content == "optimizer":
            return backend.save_optimizer(parts.optimizer, parts.lr_scheduler, folder, model=parts.model)
        if content == "extra":
            return save_extra(folder, progress, parts.dataloader)
        raise CheckpointError(f"{folder}: no writer for content {content!r}")

    def resume(self, parts: Parts) -> Progress | None:
        """Restore the newest step every role can resume from (see `lifecycle.resumer`)."""
        if self._background is not None:
            self._background.wait(raise_failure=False)  # logged already; resume picks the newest complete step
        resumed = self._resumer.resume(parts)
        if resumed is None:
            return None
        log_resumed(self.role, resumed.step, resumed.folder, self.config.checkpoint.load.verify)
        return resumed.progress
