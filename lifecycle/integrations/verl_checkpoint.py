"""verl's checkpoint-manager interface over a `Lifecycle`: a drop-in for `FSDPCheckpointManager`.

A verl worker builds its checkpoint manager once and calls `save_checkpoint(local_path, ...)`
and `load_checkpoint(local_path, ...)` with `local_path = <root>/global_step_<N>/<role>`. This
class reads root, step and role from that path and runs the save or the resume through a
`Lifecycle` over `<root>`: staging and an atomic commit, a manifest with checksums, retention
counted from disk and per role (a step folder goes only once no other role's folder is left in
it), and a resume that verifies every file before it trusts it. The on-disk layout is the one
verl's `find_latest_ckpt_path` already reads (`latest_checkpointed_iteration.txt`,
`global_step_<N>/`); verl's trainer writes its `data.pt` and the tracker beside the role
folders once every role has saved (this manager writes the tracker only under async_save, when
verl's trainer does not), and nothing here reads either.

Duck-typed rather than a subclass of verl's `BaseCheckpointManager`: that constructor asks
`torch.distributed` for a rank (no process group, no manager), importing it pulls in verl's
trainer config (about 15 s), and verl's workers only ever call the two methods. So this module
imports without verl, and nothing here imports it.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from lifecycle.boundary import STEP_PREFIX, check_step, parse_step, path_problem, role_problem, same_folder
from lifecycle.checkpointer import DiskCheckpointer
from lifecycle.config import LifecycleConfig
from lifecycle.core import Lifecycle
from lifecycle.errors import CheckpointError, ConfigError, LifecycleError
from lifecycle.integrations.verl_config import (
    DEFAULT_FORMAT,
    VERL_CONTENTS,
    base_config,
    check_scheduler_contents,
    checked_tracker,
    checkpoint_options,
    contents,
    flag,
    keep_count,
    same_root,
)
from lifecycle.machine import State
from lifecycle.records import say

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
"""A URL's scheme (`hdfs://`, `s3://`): what no local path starts with."""


@dataclass(frozen=True, slots=True)
class StepPath:
    """What verl's `local_path` names: `<root>/global_step_<step>/<role>`."""

    root: Path
    step: int
    role: str

    @property
    def folder(self) -> Path:
        return self.root / f"{STEP_PREFIX}{self.step}" / self.role

    @classmethod
    def parse(cls, local_path: str | os.PathLike[str]) -> StepPath:
        """Refuses, naming the path, anything verl's trainer would not have built."""
        try:
            text = os.fspath(local_path)
        except TypeError:
            raise CheckpointError(f"local_path must be a path, got {type(local_path).__name__}") from None
        if not isinstance(text, str):
            raise CheckpointError(f"{text!r}: local_path must be a str path (as verl's trainer builds it), "
                                  f"got {type(text).__name__}")
        if problem := path_problem(text):
            raise CheckpointError(f"{text!r}: not a usable local_path: {problem}")
        if _SCHEME.match(text) or text.startswith("~"):
            raise CheckpointError(f"{text!r}: not a local path: a URL or an unexpanded '~' would become a folder "
                                  "of that name under the current directory (verl's trainer passes remote paths "
                                  "as hdfs_path, and expands '~' itself)")
        path = Path(os.path.abspath(text))
        step, role = parse_step(path.parent.name), path.name
        if step is None or role_problem(role) is not None:
            raise CheckpointError(
                f"{text}: not a verl checkpoint path: expected <root>/{STEP_PREFIX}<N>/<role> (N without zero "
                f"padding, the role a plain folder name), got step folder {path.parent.name!r} and role {role!r}")
        return cls(root=path.parent.parent, step=step, role=role)


class LifecycleCheckpointManager:
    """A verl checkpoint manager whose saves and loads run through this library's `Lifecycle`.

    Constructed with `FSDPCheckpointManager`'s keywords, plus `lifecycle_config`: this
    library's config (a `LifecycleConfig`, a dict or a YAML path) for the format, verification,
    `checkpoint.roles` and the like; a dict or YAML that names no format gets `torch_dcp`.
    verl's `checkpoint_config` decides what is saved and loaded (`save_contents`,
    `load_contents`) and `async_save`, so `checkpoint.save.contents`, `.load.contents` and
    `.save.async` in `lifecycle_config` are refused; as in verl's managers, a load whose
    `load_contents` lists nothing but `hf_model` (an HF-only export) reads nothing. verl keeps the
    lr scheduler's state in `extra`, this library with the optimizer's: contents that list
    `extra` but not `optimizer` are refused when an `lr_scheduler` is given. The root a save
    writes into and `keep_last` come from each call (`max_ckpt_to_keep`, counted from disk; None,
    0 or a negative one keeps every step), so `checkpoint.keep_last` is refused.

    `checkpoint.root` (optional, verl's `trainer.default_local_dir`) names the run's own root: a
    save into another root is refused, and a load by path from it is a rollback (its newer steps
    are set aside, never deleted, and a tracker naming one of them points back at the step
    loaded). Without it, and for a load from any other root, a load only reads.

    `checkpoint.tracker` follows `async_save`: verl's trainer writes
    `latest_checkpointed_iteration.txt` itself after every role and its `data.pt` are saved,
    except under async_save, where this manager writes it once a step is complete for
    `checkpoint.roles`, so list every role that saves there (`[actor, critic]`), else the
    tracker may name a step whose critic never committed. `checkpoint.tracker: true` in a dict
    or YAML `lifecycle_config` makes a manager without async_save write it too (a critic beside
    an actor with async_save, when verl's trainer writes none); `false` under async_save is
    refused. Retention is per role, as in verl's own managers: each role's `max_ckpt_to_keep`
    prunes that role's folders alone (counting the steps complete for every role of
    `checkpoint.roles`), so the actor's `max_ckpt_to_keep: 1` never removes the critic's.
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        processing_class: Any = None,
        checkpoint_config: Any = None,
        trust_remote_code: bool = False,
        *,
        tokenizer: Any = None,
        lifecycle_config: LifecycleConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.processing_class = processing_class if processing_class is not None else tokenizer
        """Kept for callers that read it; not saved (verl's `huggingface/` folder is not written)."""
        self.checkpoint_config = checkpoint_config
        self.trust_remote_code = trust_remote_code
        options = checkpoint_options(checkpoint_config)
        self.checkpoint_save_contents = contents(options, "save_contents", ["model", "optimizer", "extra"])
        if not self.checkpoint_save_contents:
            raise ConfigError("checkpoint_config.save_contents", "lists nothing to save (this manager writes no "
                                                                 "huggingface/ folder of configs and tokenizer); "
                                                                 f"list some of {list(VERL_CONTENTS)}")
        self.checkpoint_load_contents = contents(options, "load_contents", self.checkpoint_save_contents)
        self._loads = [c for c in self.checkpoint_load_contents if c != "hf_model"]
        """What a load restores: verl's managers load no hf_model (an export), so none may be all."""
        if flag(options, "save_lora_only"):
            raise ConfigError("checkpoint_config.save_lora_only",
                              "not supported: this checkpoint manager saves the whole model; set it to false")
        check_scheduler_contents("save_contents", self.checkpoint_save_contents, lr_scheduler)
        check_scheduler_contents("load_contents", self._loads, lr_scheduler)
        self._async = flag(options, "async_save")
        self._base = base_config(lifecycle_config)
        self._tracker = checked_tracker(self._base, self._async)
        self._said_negative_keep = False
        # a config, or a format that cannot hold this model, fails here rather than at the first save
        Lifecycle(self._config_for(None, keep_last=None), model=model, optimizer=optimizer, lr_scheduler=lr_scheduler)
        self._lc: Lifecycle | None = None
        self._key: tuple[Any, ...] | None = None
        self._loaded: tuple[Path, int] | None = None
        """The root and step of the last load, until the next save."""

    @property
    def lifecycle(self) -> Lifecycle | None:
        """The `Lifecycle` of the last save or load, for its `history` and `state`."""
        return self._lc

    def save_checkpoint(
        self,
        local_path: str | os.PathLike[str] | None,
        hdfs_path: str | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
    ) -> None:
        """Save and commit step `global_step` of the role `local_path` names, then apply
        retention (`max_ckpt_to_keep` newest complete steps, counted from disk)."""
        _refuse_hdfs(hdfs_path)
        if local_path is None:
            return  # as verl's managers do
        where = StepPath.parse(local_path)
        step = check_step(global_step)
        if step != where.step:
            raise CheckpointError(f"{local_path}: the path is for step {where.step} but global_step is {global_step}")
        keep = self._keep_last(max_ckpt_to_keep)
        lc = self._lifecycle(where, ("save", keep), keep_last=keep)
        if lc.state is State.CREATED:
            lc.init_load()  # no pre_load path: nothing is read, the machine reaches READY
        self._set_aside_abandoned(where, step, lc)
        lc.save(step)

    def load_checkpoint(
        self,
        local_path: str | os.PathLike[str] | None,
        hdfs_path: str | None = None,
        del_local_after_load: bool = False,
    ) -> None:
        """Resume exactly the step and role `local_path` names, every file verified first; a
        damaged or uncommitted step is refused with a `CheckpointError` naming the file.

        `del_local_after_load`: verl deletes only local copies it downloaded from HDFS; this
        manager reads local checkpoints only, so there is nothing to delete and nothing is."""
        _refuse_hdfs(hdfs_path)
        if local_path is None:
            return  # as verl's managers do: nothing to resume from
        where = StepPath.parse(local_path)
        if not self._loads:  # as verl's managers do: load_contents lists nothing they load
            structlog.get_logger().info("checkpoint.verl.nothing_to_load", path=str(where.folder),
                                        load_contents=list(self.checkpoint_load_contents))
            return
        if del_local_after_load:
            structlog.get_logger().info("checkpoint.verl.del_local_after_load_ignored", path=str(where.folder),
                                        reason="the checkpoint is local, not a downloaded copy: it is kept")
        lc = self._lifecycle(where, ("load", str(where.folder)), keep_last=None, loading=True)
        try:
            resumed = lc.resume()
        except LifecycleError:
            self.close()
            raise
        if resumed != where.step:
            raise CheckpointError(f"{where.folder}: resumed step {resumed}, not the step {where.step} the path names")
        self._loaded = (where.root, where.step)

    def _keep_last(self, max_ckpt_to_keep: object) -> int | None:
        """`keep_count`; a negative value keeps every step, as verl's managers do (their check
        is `> 0`), with one warning per manager naming it."""
        keep = keep_count(max_ckpt_to_keep)
        if keep is None or keep >= 0:
            return keep
        if not self._said_negative_keep:
            say("warning", "checkpoint.verl.negative_max_ckpt_to_keep", max_ckpt_to_keep=keep,
                action="every step is kept, as verl does")
            self._said_negative_keep = True
        return None

    def _set_aside_abandoned(self, where: StepPath, step: int, lc: Lifecycle) -> None:
        """The first save after a load into the root that load read from: a step past the loaded
        one that every role committed is an abandoned line (verl resumed from its tracker, which a
        crash between the roles' commits and the trainer's own write left behind). It is set aside
        as a rollback's are (the store refuses a save below it). With `checkpoint.root` the load was
        the rollback already; without, only a save into the same root shows the root is this run's."""
        loaded, self._loaded = self._loaded, None
        checkpointer = lc.checkpointer
        if loaded is None or not same_folder(loaded[0], where.root) or not isinstance(checkpointer, DiskCheckpointer):
            return
        store = checkpointer.store
        if store.rank == 0 and (store.newest_committed(checkpointer.roles) or -1) > step:
            store.supersede(loaded[1])

    def wait(self) -> None:
        """Block until an async save in flight has committed (raises its failure)."""
        if self._lc is not None and self._lc.state is not State.CLOSED:
            wait = getattr(self._lc.checkpointer, "wait", None)
            if wait is not None:
                wait()

    def close(self) -> None:
        """Wait for an async save in flight and release the `Lifecycle`."""
        lc, self._lc, self._key = self._lc, None, None
        if lc is not None and lc.state is not State.CLOSED:
            lc.close()

    def _lifecycle(
        self, where: StepPath, purpose: tuple[Any, ...], *, keep_last: int | None, loading: bool = False,
    ) -> Lifecycle:
        """The `Lifecycle` for this root, role and purpose: the last one while it fits and is
        READY, else a new one (a failed save leaves its machine FAILED; the next save starts over;
        every load starts from CREATED)."""
        key = (where.root, where.role, *purpose)
        lc = self._lc
        if lc is not None and not loading and key == self._key and lc.state in (State.CREATED, State.READY):
            return lc
        self.close()
        config = self._config_for(where, keep_last=keep_last, loading=loading)
        self._lc = Lifecycle(config, role=where.role, model=self.model, optimizer=self.optimizer,
                             lr_scheduler=self.lr_scheduler)
        self._key = key
        return self._lc

    def _config_for(self, where: StepPath | None, *, keep_last: int | None, loading: bool = False) -> LifecycleConfig:
        """The base config with what verl decides: root, retention, contents, async, the tracker
        (verl's trainer writes its own unless async_save), and the step a load resumes."""
        data = copy.deepcopy(self._base)
        ckpt = data["checkpoint"]
        ckpt["root"] = None if where is None else self._root(where, loading=loading)
        ckpt["tracker"] = self._tracker
        ckpt["keep_last"] = keep_last  # verl's max_ckpt_to_keep alone: None keeps every step
        ckpt["save"].update(contents=list(self.checkpoint_save_contents), **{"async": self._async})
        if self._loads:  # else no load runs (`load_checkpoint`), and the base's load.contents stays unused
            ckpt["load"]["contents"] = list(self._loads)
        if loading and where is not None:
            data["resume"].update(mode="path", path=str(where.folder))
        return LifecycleConfig.from_dict(data)

    def _root(self, where: StepPath, *, loading: bool) -> str | None:
        """The root the `Lifecycle` works over. A save writes into the root its path names, which
        a configured `checkpoint.root` must be. A load reads the step its path names, from any
        root, and works over the configured root: a load from that root is a rollback (its newer
        steps are set aside, the tracker pointed back), a load from another root changes nothing
        there. Without `checkpoint.root` a load changes nothing anywhere: the root it reads may
        be another run's (verl's resume_from_path into another experiment)."""
        given = self._base["checkpoint"].get("root")
        mine = None if given is None else os.path.abspath(str(given))
        if loading:
            return mine
        if mine is not None and not same_root(mine, where.root):
            raise ConfigError("checkpoint.root", f"{given} differs from the root {where.root} that verl's local_path "
                                                 "names for this save; drop checkpoint.root or make them the same")
        return str(where.root)

    def __repr__(self) -> str:
        return f"LifecycleCheckpointManager(lifecycle={self._lc!r})"


def _refuse_hdfs(hdfs_path: object) -> None:
    if hdfs_path is not None:
        raise ConfigError("hdfs_path", f"{hdfs_path}: copying checkpoints to HDFS is not supported by this "
                                       "checkpoint manager; set trainer.default_hdfs_dir to null (checkpoints "
                                       "stay under trainer.default_local_dir)")


__all__ = ["DEFAULT_FORMAT", "LifecycleCheckpointManager", "StepPath", "VERL_CONTENTS"]
