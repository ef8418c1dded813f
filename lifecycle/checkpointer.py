"""The on-disk Checkpointer: one role's save, resume and first load through a format backend.

A facade over the parts that do the work: `lifecycle.contents` (how each content is written
and read), `lifecycle.saver` (write -> agree -> commit) and its async wrapper
`lifecycle.async_save.AsyncSaver` (host copy, background writer), and `lifecycle.resumer`
(locate -> verify -> load, and the one place `resume.mode` is decided). Layout and commit
belong to `CheckpointStore`, bytes to the format backends. This module builds the parts, checks
at construction what they could only refuse mid-save, and does the first load (`pre_load`).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from backends.base import FormatBackend, backend_class, format_capabilities, listed
from lifecycle.async_save import AsyncSaver
from lifecycle.boundary import check_step, lstat, os_errors, special_files
from lifecycle.config import LifecycleConfig
from lifecycle.contents import ContentWriter
from lifecycle.errors import CheckpointError, ConfigError
from lifecycle.extra import check_progress
from lifecycle.manifest import MANIFEST, check_folder
from lifecycle.load_format import build_format, value_of
from lifecycle.records import say
from lifecycle.resumer import HashFn, NotResumed, Resumed, Resumer, all_or_none
from lifecycle.role import RoleRank
from lifecycle.saver import SaveJob, Saver, agree_fn
from lifecycle.store import CheckpointStore, check_role
from lifecycle.types import Parts, Progress, SaveInfo

_EARLIER_VOLATILE_KEYS = ("transformers_version", "_name_or_path", "_commit_hash")
"""The keys left out of the hash by the releases before runtime flags were: their steps still resume."""
_VOLATILE_CONFIG_KEYS = (*_EARLIER_VOLATILE_KEYS, "use_cache", "output_attentions", "output_hidden_states",
                         "return_dict")
"""Keys that change with the library, the load path or runtime switches, not with the architecture."""


def earlier_config_hash(parts: Parts) -> str | None:
    """`model_config_hash` as releases before runtime flags were left out computed it (runtime flags
    included, `str` of a set as it came), which a step they saved carries: a resume accepts it too."""
    return model_config_hash(parts, volatile=_EARLIER_VOLATILE_KEYS, text=str)


def unsorted_config_hash(parts: Parts) -> str | None:
    """`model_config_hash` as the release before set items were sorted computed it (`str` of a set
    as it came), which a step it saved carries: a resume accepts it too."""
    return model_config_hash(parts, text=str)


EARLIER_HASHES: tuple[HashFn, ...] = (unsorted_config_hash, earlier_config_hash)
"""The hashes earlier releases wrote for the same model, which a resume accepts besides the current one."""


def model_config_hash(parts: Parts, *, volatile: tuple[str, ...] = _VOLATILE_CONFIG_KEYS,
                      text: Callable[[Any], str] | None = None) -> str | None:
    """Fingerprint of the architecture, so resume can refuse a checkpoint of another model.

    Keys that change with the library version, the load path or a runtime switch (`use_cache`),
    not the model, are left out (`volatile`). A value JSON cannot hold is hashed as its `text`
    (`_text` unless given).
    """
    model = parts.model
    if model is None:
        return None
    describe = getattr(model, "fingerprint", None) or getattr(getattr(model, "config", None), "to_dict", None)
    if callable(describe):
        cfg = {k: v for k, v in describe().items() if k not in volatile}
        payload = json.dumps(cfg, sort_keys=True, default=text or _text)
    else:
        layout = sorted([n, list(t.shape), str(t.dtype)] if hasattr(t, "shape") and hasattr(t, "dtype")
                        else [n, [], type(t).__name__]  # extra state (`get_extra_state`) is any object
                        for n, t in model.state_dict().items())
        payload = json.dumps(layout)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


def _text(value: Any) -> str:
    """`str(value)`, a set's items sorted by their text: `str` of a set follows PYTHONHASHSEED
    (and, for integers, the order they were added), so the same model's hash could differ between
    the saving and the resuming process. The text may differ from `str`'s (`{9, 10}` gives
    `{10, 9}`): a step saved with `str`'s text is accepted through `EARLIER_HASHES`."""
    if not isinstance(value, (set, frozenset)) or not value:
        return str(value)
    items = "{" + ", ".join(sorted(_text(v) if isinstance(v, (set, frozenset)) else repr(v) for v in value)) + "}"
    return items if type(value) is set else f"{type(value).__name__}({items})"


def check_parts(config: LifecycleConfig, parts: Parts, world_size: int = 1) -> None:
    """Refuse at construction what a backend could only refuse mid-save (hf_model from a
    dist_ckpt model without a bridge, an async save the format cannot do): each format in use
    checks the model it will get, and may wrap it (a bare GPTModel becomes a MegatronModel)
    in `parts`."""
    ckpt = config.checkpoint
    if ckpt.save.async_:
        check_async(backend_class(value_of(ckpt.save.format)), world_size)
    if parts.model is None:
        return
    uses = [("checkpoint.save.format", ckpt.save.format, [value_of(c) for c in ckpt.save.contents]),
            ("checkpoint.load.format", ckpt.load_format, [])]
    if ckpt.pre_load.path:
        uses.append(("checkpoint.pre_load.format", ckpt.pre_load_format, []))
    for key, fmt, contents in uses:
        parts.model = backend_class(value_of(fmt), key).check_model(parts.model, contents, key)


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
        self._store: CheckpointStore | None = None
        at = RoleRank(config=config, store=lambda: self.store, role=self.role, roles=self.roles, rank=rank,
                      world_size=world_size, collective=lambda: self._collective)
        self._resumer = Resumer(at, model_hash=self._model_hash,
                                also_accepted=() if model_config_hash is not None else EARLIER_HASHES)
        self._saver = Saver(at, parallel={"world_size": world_size, **(parallel or {})})
        self._async: AsyncSaver | None = None

    @property
    def store(self) -> CheckpointStore:
        if self._store is None:
            root = self.config.checkpoint.root
            if root is None:
                raise ConfigError("checkpoint.root", "not set; saving and resuming need a folder")
            self._store = CheckpointStore(root, rank=self.rank, world_size=self.world_size,
                                          barrier=self._barrier, agree=agree_fn(self._collective))
        return self._store

    @property
    def _collective(self) -> bool:
        """Whether this save spans ranks of a process group (a caller's own barrier: not ours to use)."""
        import torch.distributed as dist

        return (self.world_size > 1 and self._barrier is None and dist.is_available()
                and dist.is_initialized())

    def _model_hash(self, parts: Parts) -> str | None:
        return (self._hash_fn or model_config_hash)(parts)

    def load_initial(self, parts: Parts) -> dict[str, Any]:
        pre = self.config.checkpoint.pre_load
        if not pre.path and self._resumer.overwritten:
            raise CheckpointError(
                f"the model's weights may be partly overwritten by {self._resumer.overwritten}, and "
                "checkpoint.pre_load.path is not set to load fresh ones: set it, or rebuild the model"
            )
        if not pre.path:
            return {}
        name, folder = value_of(self.config.checkpoint.pre_load_format), Path(pre.path)
        if parts.model is None:
            raise CheckpointError(f"{folder}: checkpoint.pre_load.path is set but there is no model to load into")
        if not folder.is_dir():
            raise CheckpointError(f"{folder}: checkpoint.pre_load.path is not a folder")
        self._verify_pre_load(folder, name)
        backend = build_format(self.config, name)
        try:
            with os_errors("cannot read checkpoint.pre_load.path", folder):
                backend.load_model(parts.model, folder)
        except CheckpointError:
            raise
        except Exception as exc:  # a backend's or a model's own error: typed, naming the folder, as resume does
            raise CheckpointError(f"{folder}: loading the initial weights (format {name}) failed: "
                                  f"{type(exc).__name__}: {exc}") from exc
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
            say("warning", "checkpoint.pre_load.unverified", path=str(folder), format=name,
                reason="not a committed checkpoint: no checksums to verify the files against; metadata is "
                       "read through an allow-list, but load only checkpoints you trust")
        if committed is not None and (problems := check_folder(committed, deep=True)):
            raise CheckpointError(f"{committed}: cannot load initial weights:\n  " + listed(problems))

    def save(self, step: int, parts: Parts, progress: Progress) -> SaveInfo:
        """Write and commit `step`; with `save.async`, return once the state is copied to host.

        The figures' `seconds` include waiting for the previous async save's commit: all of it
        is time the training loop stood still."""
        started = time.perf_counter()
        step = check_step(step)
        check_progress(progress, f"save of step {step} (role {self.role})")  # before a byte is written
        self.wait()
        save = self.config.checkpoint.save
        name = value_of(save.format)
        backend = backend_class(name)(**save.options)
        background = self._async_saver(backend) if save.async_ else None
        writer = ContentWriter(backend=backend, name=name, wanted=[value_of(c) for c in save.contents],
                               rank=self.rank, role=self.role, step=step)
        job = SaveJob(step=step, writer=writer, model_hash=self._model_hash(parts), started=started,
                      lock=self.store.writer_lock(self.role) if self.rank == 0 else None)
        return (background or self._saver).save(job, parts, progress)

    def check_save(self, step: int) -> None:
        """Refuse a save of a step behind the newest one committed for every role (see
        `CheckpointStore.check_not_behind`) before the lifecycle moves: refused inside the save, it
        fails the lifecycle and loses the steps trained since the last save. Rank 0 looks and its
        peers learn the outcome through the process group; under a caller's own barrier, which
        tells nothing, the check inside the save is the only one."""
        if self.config.checkpoint.root is None or (self.world_size > 1 and not self._collective):
            return
        what = f"save of step {step} (role {self.role})"
        all_or_none(lambda: self._check_not_behind(check_step(step)) if self.rank == 0 else None,
                    agree_fn(self._collective), f"{what} refused by rank 0", what=f"{what}: cannot check the root")

    def _check_not_behind(self, step: int) -> None:
        """Refuse `step` behind a committed step, or behind the step of this role's async save
        still in flight when that save, once committed, completes its step for every role: the
        save would wait for that commit and then be refused, failing the lifecycle."""
        self.store.check_not_behind(step, self.role, self.roles)
        ahead = None if self._async is None else self._async.background.in_flight()
        if ahead is not None and ahead > step and all(self.store.committed(ahead, r) for r in self.roles
                                                      if r != self.role):
            raise CheckpointError(
                f"{self.store.step_dir(step)}: cannot save step {step} (role {self.role}): step {ahead} is being "
                f"saved in the background and, once committed, is committed in {self.store.root} for every role "
                f"({', '.join(self.roles)}): an automatic resume would restart from it, not from this save")

    def _async_saver(self, backend: FormatBackend) -> AsyncSaver:
        check_async(type(backend), self.world_size)
        if self._async is None:
            self._async = AsyncSaver(self._saver, own_barrier=self._barrier is not None)
        return self._async

    def wait(self) -> SaveInfo | None:
        """Block until the async save in flight (if any) has committed; raises its failure, once."""
        return None if self._async is None else self._async.wait()

    def close(self) -> None:
        """Wait for the async save in flight and stop the background thread."""
        if self._async is not None:
            self._async.close()

    def resume(self, parts: Parts) -> Progress | None:
        """Restore the newest step every role can resume from (see `lifecycle.resumer`); None
        when the resumer found none to restore, or `resume.mode` says not to."""
        if self._async is not None:
            self._async.wait(raise_failure=False)  # logged already; resume picks the newest complete step
        outcome = self._resumer.resume(parts)
        log_outcome(self.role, outcome, self.config.checkpoint.load.verify)
        if not isinstance(outcome, Resumed):
            self._warn_of_newer_steps()
        return outcome.progress if isinstance(outcome, Resumed) else None

    def _warn_of_newer_steps(self) -> None:
        """A fresh start (`resume.mode: disable`) in a root that holds a step committed for every
        role: its saves below that step will be refused (`CheckpointStore.check_not_behind`), so
        say it now rather than at the first save."""
        if self.config.checkpoint.root is None or self.rank != 0:
            return
        try:
            newest = self.store.newest_committed(self.roles)
        except (CheckpointError, OSError):
            return  # resume judged the root already; this is advice only
        if newest is not None:
            say("warning", "checkpoint.fresh_start_over_newer_steps", role=self.role, step=newest,
                root=str(self.store.root),
                reason=f"step {newest} is committed here for every role: saves below it are refused; roll back to "
                       "an older step with resume.mode: path, or use another checkpoint.root")


def log_outcome(role: str, outcome: Resumed | NotResumed, verify: bool) -> None:
    """One record of what a resume did: the step it restored, or why it restored none (a log sink
    that fails loses the record, never the resume, whose weights are loaded by now)."""
    if isinstance(outcome, NotResumed):
        say("info", "checkpoint.resume.none", role=role, reason=outcome.reason)
    else:
        say("info", "checkpoint.resumed", role=role, step=outcome.step, path=str(outcome.folder),
            checksums_verified=verify)
