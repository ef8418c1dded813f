"""The on-disk Checkpointer: one role's save, resume and first load through a format backend.

Layout and commit belong to `CheckpointStore`; bytes belong to the backends. This module
decides which content goes where, and refuses to load anything that does not verify.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable, Collection, Mapping
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import structlog

from backends.base import FormatBackend, backend_class, failed_ranks
from lifecycle.async_save import BackgroundSaver, PendingSave
from lifecycle.config import LifecycleConfig
from lifecycle.errors import CheckpointError, ConfigError
from lifecycle.extra import load_extra, save_extra
from lifecycle.checksum import ALGORITHM, check_unverified, expecting
from lifecycle.manifest import MANIFEST, check_folder, checksum_of, read_manifest_file, resolve_inside
from lifecycle.store import CheckpointStore, check_role
from lifecycle.types import Parts, Progress, SaveInfo

HashFn = Callable[[Parts], str | None]
_T = TypeVar("_T")
EXTRA_BACKEND = "extra"
_RANK_DIR = re.compile(r"rank_([0-9]+)")
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "_commit_hash")


def _value(item: Any) -> str:
    """Config enums are `str` Enums; the manifest and the registry want their plain value."""
    return str(getattr(item, "value", item))


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
        check = getattr(backend_class(_value(fmt)), "check_model", None)
        if check is not None:
            parts.model = check(parts.model, contents, key)


def check_async(backend: type[FormatBackend], world_size: int) -> None:
    """`ConfigError` on `checkpoint.save.async` when `backend` cannot save in the background."""
    if not backend.supports_async:
        raise ConfigError("checkpoint.save.async", f"format {backend.name!r} cannot write in the background; "
                          "set checkpoint.save.async to false")
    if world_size > 1 and backend.parallel_invariant:
        raise ConfigError(
            "checkpoint.save.async",
            f"format {backend.name!r} saves with collectives on every rank, which in the background would "
            f"interleave with training's own; with world_size {world_size} set checkpoint.save.async to false",
        )


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
        self._protected: set[int] = set()
        self._store: CheckpointStore | None = None
        self._overwritten: str | None = None
        """Set when a failed load may have left the model's weights half-replaced."""
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
                                          barrier=self._barrier)
        return self._store

    def protect(self, step: int) -> None:
        """Keep `step` out of retention: it is what this worker resumed from."""
        self._protected.add(int(step))

    @property
    def protected(self) -> frozenset[int]:
        return frozenset(self._protected)

    def load_initial(self, parts: Parts) -> dict[str, Any]:
        pre = self.config.checkpoint.pre_load
        if not pre.path and self._overwritten:
            raise CheckpointError(
                f"the model's weights may be partly overwritten by {self._overwritten}, and "
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
        backend_class(name)().load_model(parts.model, folder)
        self._overwritten = None
        size, count = folder_figures(folder)
        return {"backend": name, "path": str(folder), "bytes": size, "files": count}

    def _verify_pre_load(self, folder: Path, name: str) -> None:
        """A folder inside a committed checkpoint is verified first; DCP's pickled metadata demands it."""
        committed = next((f for f in (folder, folder.parent) if (f / MANIFEST).is_file()), None)
        if committed is None and name == "torch_dcp":
            raise CheckpointError(
                f"{folder}: a torch_dcp first load reads DCP's pickled .metadata, so it only loads from a "
                "committed checkpoint: point checkpoint.pre_load.path at the model folder next to a manifest.json"
            )
        if committed is None and name == "dist_ckpt":
            structlog.get_logger().warning(
                "checkpoint.pre_load.unverified", path=str(folder), format=name,
                reason="not a committed checkpoint: Megatron's pickled .metadata is read unverified; "
                       "load only dist checkpoints you trust")
        if committed is not None and (problems := check_folder(committed, deep=True)):
            raise CheckpointError(f"{committed}: cannot load initial weights:\n  " + "\n  ".join(problems))

    def save(self, step: int, parts: Parts, progress: Progress) -> SaveInfo:
        """Write and commit `step`; with `save.async`, return once the state is copied to host.

        The figures' `seconds` include waiting for the previous async save's commit: all of it
        is time the training loop stood still."""
        started = time.perf_counter()
        self.wait()
        name = _value(self.config.checkpoint.save.format)
        backend = backend_class(name)()
        background = self._async_saver(backend) if self.config.checkpoint.save.async_ else None
        model_hash = (self._hash_fn or model_config_hash)(parts)
        if background is not None:
            return self._save_async(background, backend, step, parts, progress, model_hash, started)

        def write() -> tuple[dict[str, str], dict[str, str]]:
            return self._write_contents(backend, name, self.store.staging(step, self.role), parts, progress)

        contents, folders = self._agreed(step, write)
        return self._commit(self.store, step, name, contents, folders, model_hash, started)

    def _agreed(self, step: int, write: Callable[[], _T], group: Any = None) -> _T:
        """`write()` on every rank, then a count of the ranks whose write failed.

        A rank that failed (rank 0 alone writing the HF files, say) would otherwise never reach
        the commit barrier, and its peers would wait there until the process group's timeout.
        The failed rank raises its own error, the others a `CheckpointError` naming the step.
        `write` creates the staging folder too (rank 0 does, between barriers it always reaches).
        Not covered: a failure on one rank after the commit (retention); peers do not wait for
        that one, but it is raised on that rank only.
        """
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

    @property
    def _collective(self) -> bool:
        """Whether this save spans ranks of a process group (a caller's own barrier: not ours to use)."""
        import torch.distributed as dist

        return (self.world_size > 1 and self._barrier is None and dist.is_available()
                and dist.is_initialized())

    def _commit(
        self, store: CheckpointStore, step: int, name: str, contents: dict[str, str], folders: dict[str, str],
        model_hash: str | None, started: float,
    ) -> SaveInfo:
        final = store.commit(step, self.role, contents=contents, folders=folders, parallel=self._parallel,
                             model_config_hash=model_hash, extra_meta={}, roles=self.roles,
                             fsync=self.config.checkpoint.fsync)
        store.apply_retention(self.config.checkpoint.keep_last, self.roles, self._protected | {step})
        files = read_manifest_file(final)["files"]
        return SaveInfo(step=step, path=final, contents=list(contents), backend=name,
                        bytes=sum(f["size"] for f in files), files=len(files),
                        seconds=time.perf_counter() - started)

    def _save_async(
        self, background: BackgroundSaver, backend: FormatBackend, step: int, parts: Parts, progress: Progress,
        model_hash: str | None, started: float,
    ) -> PendingSave:
        """`extra` (RNG states, data position) is written now, as it stands at this step; the
        rest is written from a host copy on the background thread, then committed there."""
        name = backend.name
        wanted = [_value(c) for c in self.config.checkpoint.save.contents]
        store = self._commit_store()

        def extra_and_copy() -> tuple[Path, tuple[dict[str, str], dict[str, str]], Parts]:
            staging = self.store.staging(step, self.role)
            return (staging, self._write_contents(backend, name, staging, parts, progress, only={"extra"}),
                    background.copier.snapshot(parts))

        staging, now, frozen = self._agreed(step, extra_and_copy)

        def write_and_commit() -> SaveInfo:
            later = self._agreed(step, lambda: self._write_contents(backend, name, staging, frozen, progress,
                                                                    only={c for c in wanted if c != "extra"}),
                                 group=self._background_group)
            contents, folders = {**later[0], **now[0]}, {**later[1], **now[1]}
            return self._commit(store, step, name, contents, folders, model_hash, started)

        committed = background.submit(step, write_and_commit)
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
                                                     barrier=partial(dist.barrier, group=group))
        return self._background_store

    def wait(self) -> SaveInfo | None:
        """Block until the async save in flight (if any) has committed; raises its failure, once."""
        return None if self._background is None else self._background.wait()

    def close(self) -> None:
        """Wait for the async save in flight and stop the background thread."""
        if self._background is not None:
            self._background.close()

    def _write_contents(
        self, backend: FormatBackend, name: str, staging: Path, parts: Parts, progress: Progress,
        only: Collection[str] | None = None,
    ) -> tuple[dict[str, str], dict[str, str]]:
        """Write each wanted content (of `only`, when given) once; returns content -> backend and
        content -> folder."""
        wanted = [_value(c) for c in self.config.checkpoint.save.contents]
        contents: dict[str, str] = {}
        folders: dict[str, str] = {}
        log = structlog.get_logger()
        needs = {"model": parts.model, "hf_model": parts.model, "optimizer": parts.optimizer}
        for content in wanted:
            if only is not None and content not in only:
                continue
            if content in needs and needs[content] is None:
                log.warning("checkpoint.save.content_skipped", content=content, role=self.role,
                            reason="the worker has no object to save for it")
                continue
            if content == "model":
                backend.save_model(parts.model, staging / "model")
            elif content == "hf_model" and backend.native_hf and "model" in wanted:
                folders[content] = "model"
            elif content == "hf_model":
                backend.export_hf(parts.model, staging / "hf_model")
            elif content == "optimizer":
                backend.save_optimizer(parts.optimizer, parts.lr_scheduler, staging / "optimizer", model=parts.model)
            elif content == "extra":
                save_extra(staging / "extra" / f"rank_{self.rank}", progress, parts.dataloader)
            contents[content] = EXTRA_BACKEND if content == "extra" else name
        return contents, folders

    def resume(self, parts: Parts) -> Progress | None:
        if self._background is not None:
            self._background.wait(raise_failure=False)  # logged already; resume picks the newest complete step
        mode = _value(self.config.resume.mode)
        if mode == "disable":
            return None
        if mode == "path":
            folder, step = self._resolve_path(Path(str(self.config.resume.path)))
        else:
            if self.config.checkpoint.root is None:
                return None
            found = self.store.newest_committed(self.roles)
            if found is None:
                return None
            folder, step = self.store.role_dir(found, self.role), found
        verify = self.config.checkpoint.load.verify
        try:
            manifest = read_manifest_file(folder)
        except CheckpointError as exc:
            raise CheckpointError(f"{folder}: cannot resume from step {step}: {exc}") from exc
        later = self._verified_while_reading(manifest) if verify else set()
        problems = check_folder(folder, deep=verify, expect_step=step, expect_role=self.role, verified_later=later,
                                manifest=manifest)
        if problems:
            raise CheckpointError(f"{folder}: cannot resume from step {step}:\n  " + "\n  ".join(problems))
        self._check_hash(parts, manifest, folder)
        digests = {folder / f["path"]: checksum_of(f)[1] for f in manifest["files"] if f["path"] in later}
        try:
            with expecting(digests) as verified:
                progress = self._load_contents(parts, manifest, folder, step)
            check_unverified(digests, verified)
        except CheckpointError as exc:
            self._overwritten = f"a failed resume from {folder}"
            raise CheckpointError(f"{folder}: cannot resume from step {step}: {exc}") from exc
        self._overwritten = None
        self.protect(step)
        structlog.get_logger().info("checkpoint.resumed", role=self.role, step=step, path=str(folder),
                                    checksums_verified=verify)
        return progress

    def _verified_while_reading(self, manifest: dict[str, Any]) -> set[str]:
        """Weight files whose backend checks the digest as it reads them: no separate pass.

        Only files the manifest checksums with the current `ALGORITHM`, the one readers compute;
        older manifests are hashed apart, before loading.
        """
        later: set[str] = set()
        for entry in manifest["contents"].values():
            try:
                fused = backend_class(entry["backend"]).verifies_reads
            except ConfigError:
                fused = False
            prefix = entry["folder"].rstrip("/") + "/"
            later.update(f["path"] for f in manifest["files"]
                         if fused and f["path"].startswith(prefix) and f["path"].endswith(".safetensors")
                         and checksum_of(f)[0] == ALGORITHM)
        return later

    def _resolve_path(self, path: Path) -> tuple[Path, int]:
        """resume.path may name the step folder or this role's folder inside it."""
        if (path / MANIFEST).is_file():
            folder = path
        elif (path / self.role).is_dir():
            folder = path / self.role
        else:
            raise CheckpointError(f"{path}: resume.path is neither a committed role folder nor a "
                                  f"global_step_N folder holding role {self.role!r}")
        match = re.fullmatch(r"global_step_([0-9]+)", folder.parent.name)
        step = int(match.group(1)) if match else read_manifest_file(folder)["step"]
        return folder, step

    def _check_hash(self, parts: Parts, manifest: dict[str, Any], folder: Path) -> None:
        if not self.config.resume.strict:
            return
        saved, current = manifest["model_config_hash"], (self._hash_fn or model_config_hash)(parts)
        if saved is not None and current is not None and saved != current:
            raise CheckpointError(
                f"{folder / MANIFEST}: model-config hash {saved} differs from the running model's "
                f"{current}; set resume.strict=false to load anyway"
            )

    def _load_contents(self, parts: Parts, manifest: dict[str, Any], folder: Path, step: int) -> Progress:
        entries: dict[str, dict[str, str]] = manifest["contents"]
        progress = Progress(step=step)
        for content in (_value(c) for c in self.config.checkpoint.load.contents):
            if content in ("model", "optimizer") and getattr(parts, content) is None:
                continue
            entry = entries.get(content)
            if entry is None and content == "extra":
                structlog.get_logger().warning("checkpoint.resume.no_extra", path=str(folder), step=step)
                continue
            if entry is None:
                raise CheckpointError(f"{folder / MANIFEST}: no {content!r} content to resume from "
                                      f"(holds {sorted(entries)})")
            sub = resolve_inside(folder, entry["folder"])
            if sub is None:
                raise CheckpointError(f"{folder / MANIFEST}: {content!r} folder {entry['folder']!r} escapes {folder}")
            if content == "extra":
                progress = self._load_extra(sub, parts, manifest)
            else:
                self._load_with_backend(content, entry["backend"], sub, parts)
        return progress

    def _load_with_backend(self, content: str, name: str, folder: Path, parts: Parts) -> None:
        wanted = _value(self.config.checkpoint.load_format)
        if name != wanted:
            structlog.get_logger().warning("checkpoint.resume.format_differs", content=content,
                                           saved_with=name, load_format=wanted, path=str(folder))
        backend = backend_class(name)()
        if content == "model":
            backend.load_model(parts.model, folder)
        else:
            backend.load_optimizer(parts.optimizer, parts.lr_scheduler, folder, model=parts.model)

    def _load_extra(self, folder: Path, parts: Parts, manifest: dict[str, Any]) -> Progress:
        """Per-rank RNG and dataloader state only fit the world size that saved them."""
        for entry in folder.iterdir():
            if not (_RANK_DIR.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink()):
                raise CheckpointError(f"{entry}: unexpected entry in extra folder (only rank_N folders)")
        same_layout = manifest["parallel"].get("world_size") == self.world_size
        own = folder / f"rank_{self.rank}"
        if same_layout and own.is_dir():
            return load_extra(own, parts.dataloader)
        structlog.get_logger().warning(
            "checkpoint.resume.extra_layout_changed", path=str(folder), rank=self.rank,
            saved_world_size=manifest["parallel"].get("world_size"), world_size=self.world_size,
            action="progress from rank 0; RNG and dataloader state not restored",
        )
        return load_extra(folder / "rank_0", None, restore_rng=False)
