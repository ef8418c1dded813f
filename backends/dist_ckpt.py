"""Megatron-Core `dist_checkpointing`: sharded tensors keyed by their place in the full model.

Each rank writes the pieces it owns and the checkpoint records where each piece sits in the
global tensor, so a step saved at TP2 PP2 loads at TP4 PP1. The model is nested the way
Megatron-LM nests it (`model`, or `model0`... with virtual pipelines), so checkpoints of either
read in the other. Optimizer state is placed by the model's sharding too: a Megatron optimizer
brings its own `sharded_state_dict`; a plain torch optimizer's per-parameter tensors are laid
out like the parameters they belong to. Hyper-parameters, the optimizer step and the lr
scheduler go to `optimizer.json` (no pickle).

Megatron's sharded format is DCP underneath and keeps DCP's pickled `.metadata`. Every load
here reads it through `backends.dcp_metadata` (Megatron's reader factory is swapped for the
load call only), whose unpickler hands out only the DCP metadata classes, `torch.Size` and
torch dtypes and layouts: a crafted file is refused before anything in it runs, verified by the
manifest or not. `common.pt` is read by Megatron with `torch.load`'s default `weights_only=True`.
Entries DCP stores as bytes (the layers' `_extra_state`) are read with `torch.load`'s
`weights_only=True` first, and refused when that refuses them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
)
from torch import nn

from backends.base import DIST_CKPT_CAPABILITIES, FormatBackend, FormatCapabilities, current_rank
from backends.megatron import (
    bridge_of,
    MegatronModel,
    as_megatron_model,
    chunks_of,
    load_sharded,
    save_sharded,
    sharded_model_state,
    write_hf_export,
    write_transformer_config,
)
from lifecycle.errors import CheckpointError
from lifecycle.jsontree import decode, encode, read_optimizer_json
from lifecycle.optim_state import check_param_groups, check_scheduler_state

OPTIM_JSON = "optimizer.json"
_STATE = "optimizer_state"


def _params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _placement(optimizer: torch.optim.Optimizer, model: Any, folder: Path) -> dict[int, Any]:
    """Each optimizer parameter's ShardedTensor in the model: where its state belongs globally."""
    if model is None:
        raise CheckpointError(f"{folder}: dist_ckpt places optimizer state by the model's sharding; "
                              "the worker has no model")
    params = _params(optimizer)
    placement = get_param_id_to_sharded_param_map(sharded_model_state(chunks_of(model)), params)
    missing = [i for i in range(len(params)) if i not in placement]
    if missing:
        raise CheckpointError(f"{folder}: optimizer parameters {missing[:10]} are not parameters of the model")
    return placement


def _common_step(state: dict[int, dict[str, Any]], folder: Path) -> float | None:
    steps = {float(s["step"]) for s in state.values() if "step" in s}
    if len(steps) > 1:
        raise CheckpointError(f"{folder}: the optimizer's step differs between parameters ({sorted(steps)[:5]}); "
                              "dist_ckpt keeps one step for all")
    return steps.pop() if steps else None


def _sharded_torch_state(
    optimizer: torch.optim.Optimizer, model: Any, folder: Path, state_keys: list[str]
) -> dict[str, dict[str, Any]]:
    """Per-parameter tensors of a torch optimizer as ShardedTensors shaped like their params;
    on load, `state_keys` names the tensors to allocate for every parameter."""
    placement = _placement(optimizer, model, folder)
    params = _params(optimizer)
    sharded: dict[str, dict[str, Any]] = {}
    for i, param in enumerate(params):
        own = optimizer.state.get(param, {})
        tensors = {k: own[k] if k in own else torch.zeros_like(param) for k in state_keys}
        for key, value in tensors.items():
            if not isinstance(value, torch.Tensor) or value.shape != param.shape:
                raise CheckpointError(f"{folder}: optimizer state {key!r} of parameter {i} is not a tensor shaped "
                                      f"like its parameter {list(param.shape)}; dist_ckpt cannot place it")
            sharded.setdefault(str(i), {})[key] = make_sharded_optimizer_tensor(
                placement[i], value, prefix=f"optimizer.state.{key}")
    return sharded


def _write_json(doc: dict[str, Any], folder: Path) -> None:
    if current_rank() == 0:
        text = json.dumps({"format_version": 1, **encode(doc, where=str(folder / OPTIM_JSON))}, indent=1)
        (folder / OPTIM_JSON).write_text(text + "\n", encoding="utf-8")


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
        if current_rank() == 0:
            write_transformer_config(chunks[0].config, folder)
            bridge = getattr(model, "bridge", None)
            if bridge is not None:
                bridge.hf_config.save_pretrained(str(folder))
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
            _write_json({"optimizer": {"kind": "megatron"}, "lr_scheduler": sched}, folder)
            return {}
        state = optimizer.state_dict()["state"]
        keys = sorted({k for s in state.values() for k in s if k != "step"})
        save_sharded({_STATE: _sharded_torch_state(optimizer, model, folder, keys)}, folder)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]
        _write_json({"optimizer": {"kind": "torch", "state_keys": keys, "step": _common_step(state, folder),
                                   "param_groups": groups}, "lr_scheduler": sched}, folder)
        return {}

    def load_optimizer(
        self, optimizer: Any, lr_scheduler: Any, folder: Path, *, model: Any = None,
        expected: Mapping[str, str] | None = None,
    ) -> set[str]:
        """Megatron's loader reads the files unhashed: none is returned as verified against `expected`."""
        path = folder / OPTIM_JSON
        doc = decode(read_optimizer_json(path), where=str(path))
        if lr_scheduler is not None and doc.get("lr_scheduler") is None:
            raise CheckpointError(f"{path}: holds no lr_scheduler state but a scheduler was given")
        saved = doc["optimizer"]
        check_scheduler_state(lr_scheduler, doc["lr_scheduler"] if lr_scheduler is not None else None, str(path))
        try:
            if saved.get("kind") == "megatron":
                template = optimizer.sharded_state_dict(sharded_model_state(chunks_of(model)), is_loading=True)
                optimizer.load_state_dict(load_sharded({"optimizer": template}, folder)["optimizer"])
            else:
                _load_torch_optimizer(optimizer, model, folder, saved)
            if lr_scheduler is not None:
                lr_scheduler.load_state_dict(doc["lr_scheduler"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{path}: does not fit the optimizer or scheduler: {exc!r}") from exc
        return set()

    def export_hf(self, model: Any, folder: Path) -> dict[str, str]:
        return write_hf_export(model, folder)


def _load_torch_optimizer(optimizer: torch.optim.Optimizer, model: Any, folder: Path, saved: dict[str, Any]) -> None:
    groups = saved.get("param_groups")
    check_param_groups(optimizer, groups, f"{folder / OPTIM_JSON}: does not fit the optimizer", ids=None)
    template = {_STATE: _sharded_torch_state(optimizer, model, folder, list(saved["state_keys"]))}
    loaded = load_sharded(template, folder)[_STATE]
    step = saved.get("step")
    state: dict[int, dict[str, Any]] = {}
    for i, tensors in loaded.items():
        state[int(i)] = {**tensors, **({"step": torch.tensor(float(step))} if step is not None else {})}
    current = optimizer.state_dict()["param_groups"]
    merged = [{**hyper, "params": group["params"]} for hyper, group in zip(groups, current)]
    optimizer.load_state_dict({"state": state, "param_groups": merged})

