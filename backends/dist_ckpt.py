"""Megatron-Core `dist_checkpointing`: sharded tensors keyed by their place in the full model.

Each rank writes the pieces it owns and the checkpoint records where each piece sits in the
global tensor, so a step saved at TP2 PP2 loads at TP4 PP1. The model is nested the way
Megatron-LM nests it (`model`, or `model0`... with virtual pipelines), so checkpoints of either
read in the other. Optimizer state is placed by the model's sharding too: a Megatron optimizer
brings its own `sharded_state_dict`; a plain torch optimizer's per-parameter tensors are laid
out like the parameters they belong to. Hyper-parameters, the optimizer step and the lr
scheduler go to `optimizer.json` (no pickle).

Loads go through `backends.dist_ckpt_load`, which refuses before Megatron reads a shard what
would load wrong: a crafted `.metadata`, a stored tensor in another dtype than the model's or
the optimizer's (Megatron would cast it), one no rank asks for. The parameters that had no
optimizer state when saved (frozen, unused) are named in `optimizer.json` (`stateless`) and get
none back: on load their templates are zeros in their parameter's dtype, which a stored dtype
must match like any other. A parameter outside the optimizer stacked into one tensor with layers
inside it gets zero state as a stand-in (`stand_ins`), which a load reads and drops. When the
ranks' hyper-parameters or scheduler differ (a PP stage with its own lr), each rank's are kept
(`ranks`), for a resume at the same layout. That bookkeeping of a torch optimizer is
`backends.dist_ckpt_optim`'s.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

from megatron.core import dist_checkpointing

from backends.base import DIST_CKPT_CAPABILITIES, FormatBackend, FormatCapabilities
from backends.dist_ckpt_load import load_sharded
from backends.dist_ckpt_optim import load_torch_optimizer, own_state, torch_state, torch_template, write_json
from backends.megatron import (
    MegatronModel,
    agree,
    as_megatron_model,
    bridge_of,
    chunks_of,
    cpu_safe,
    in_process_write_results,
    library_errors,
    on_rank0,
    sharded_model_state,
)
from backends.megatron_files import hf_config_as_built, write_hf_export, write_transformer_config
from lifecycle.errors import CheckpointError
from lifecycle.jsontree import decode, read_optimizer_json
from lifecycle.optim_identity import OPTIM_JSON
from lifecycle.optim_state import check_scheduler_state



def save_sharded(state: dict[str, Any], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if any(folder.iterdir()):
        raise CheckpointError(f"{folder}: dist_checkpointing writes only into an empty folder")
    with library_errors("megatron dist_checkpointing save", folder), cpu_safe(), in_process_write_results(), \
            _WRITERS.die_with_parent():
        dist_checkpointing.save(state, str(folder))


class _WriterForks:
    """Megatron's torch_dist writer forks processes that write the shards; a rank killed by
    SIGKILL mid-save left them running for good. While a save runs, a child forked by this
    process asks the kernel to kill it when its parent dies (Linux's PR_SET_PDEATHSIG), and
    exits at once if the parent died before it could ask. The hook is registered once and does
    nothing outside a save."""

    _PR_SET_PDEATHSIG = 1

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._saves = 0
        self._parent = 0

    @contextmanager
    def die_with_parent(self) -> Iterator[None]:
        if not sys.platform.startswith("linux"):
            yield
            return
        _register_fork_hook()
        with self._lock:
            self._saves, self._parent = self._saves + 1, os.getpid()
        try:
            yield
        finally:
            with self._lock:
                self._saves -= 1

    def after_fork_in_child(self) -> None:
        if self._saves <= 0:
            return
        self._saves = 0  # this child's own children are not writers of this save
        ctypes.CDLL(None, use_errno=True).prctl(self._PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != self._parent:
            os._exit(1)


_WRITERS = _WriterForks()


@cache
def _register_fork_hook() -> None:
    os.register_at_fork(after_in_child=_WRITERS.after_fork_in_child)


class DistCkptBackend(FormatBackend):
    """Megatron-Core models: every rank calls every method; each writes and reads its own shards.

    With a bridge, the HF `config.json` goes next to the shards, so the folder names its own
    architecture (the converter needs no `--hf-config` for it).
    """

    name: ClassVar[str] = "dist_ckpt"
    capabilities: ClassVar[FormatCapabilities] = DIST_CKPT_CAPABILITIES

    @staticmethod
    def check_model(model: Any, contents: list[str], key: str) -> MegatronModel:
        wrapped = as_megatron_model(model, "dist_ckpt", key)
        if "hf_model" in contents:
            bridge_of(wrapped, "hf_model with the dist_ckpt format (an HF export)", key="checkpoint.save.contents")
        return wrapped

    def save_model(self, model: Any, folder: Path) -> dict[str, str]:
        """Megatron writes the shards itself, unhashed: no digest to hand on."""
        chunks = chunks_of(model)
        save_sharded(sharded_model_state(chunks), folder)

        def write() -> None:
            write_transformer_config(chunks[0].config, folder)
            if getattr(model, "bridge", None) is not None:
                with hf_config_as_built(model):
                    model.bridge.hf_config.save_pretrained(str(folder))

        on_rank0(write, "model config", folder)
        return {}

    def load_model(self, model: Any, folder: Path, *, expected: Mapping[str, str] | None = None) -> set[str]:
        """Megatron reads the shards itself, unhashed: none is reported verified."""
        chunks = chunks_of(model)
        template = sharded_model_state(chunks)
        loaded = load_sharded(template, folder)
        for key, chunk in zip(template, chunks):
            try:
                chunk.load_state_dict(loaded[key])
            except (RuntimeError, KeyError) as exc:
                raise CheckpointError(f"{folder}: {key} does not fit the model: {exc}") from exc
        return set()

    def save_optimizer(
        self, optimizer: Any, lr_scheduler: Any, folder: Path, *, model: Any = None
    ) -> dict[str, str]:
        sched = lr_scheduler.state_dict() if lr_scheduler is not None else None
        if hasattr(optimizer, "sharded_state_dict"):
            model_state = sharded_model_state(chunks_of(model))
            save_sharded({"optimizer": optimizer.sharded_state_dict(model_state)}, folder)
            write_json({"optimizer": {"kind": "megatron"}}, {"lr_scheduler": sched}, folder)
            return {}
        sharded, doc = torch_state(optimizer, model, folder)
        save_sharded(sharded, folder)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]
        write_json(doc, {"param_groups": groups, "lr_scheduler": sched}, folder)
        return {}

    def load_optimizer(
        self, optimizer: Any, lr_scheduler: Any, folder: Path, *, model: Any = None,
        expected: Mapping[str, str] | None = None,
    ) -> set[str]:
        """Megatron's loader reads the files unhashed: none is returned as verified against `expected`.
        Every check runs before the first collective and every rank learns of any rank's refusal."""
        path = folder / OPTIM_JSON
        try:
            doc = decode(read_optimizer_json(path), where=str(path))
            own, saved = own_state(doc, str(path)), doc["optimizer"]
            if lr_scheduler is not None and own["lr_scheduler"] is None:
                raise CheckpointError(f"{path}: holds no lr_scheduler state but a scheduler was given")
            check_scheduler_state(lr_scheduler, own["lr_scheduler"] if lr_scheduler is not None else None, str(path))
            torch_load = None if saved.get("kind") == "megatron" else \
                torch_template(optimizer, model, folder, saved, own["param_groups"])
        except (CheckpointError, ValueError, KeyError, TypeError, AttributeError) as exc:
            agree(str(exc) if isinstance(exc, CheckpointError) else f"{path}: does not fit the optimizer: {exc!r}")
        agree(None)
        try:
            if torch_load is None:
                template = optimizer.sharded_state_dict(sharded_model_state(chunks_of(model)), is_loading=True)
                optimizer.load_state_dict(load_sharded({"optimizer": template}, folder)["optimizer"])
            else:
                load_torch_optimizer(optimizer, folder, saved, own["param_groups"], *torch_load)
            if lr_scheduler is not None:
                lr_scheduler.load_state_dict(own["lr_scheduler"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{path}: does not fit the optimizer or scheduler: {exc!r}") from exc
        return set()

    def export_hf(self, model: Any, folder: Path) -> dict[str, str]:
        return write_hf_export(model, folder)
