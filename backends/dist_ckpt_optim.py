"""A plain torch optimizer under Megatron's sharding (`dist_ckpt`): each per-parameter tensor laid
out like its parameter, the parameters without state named (`stateless`), frozen ones stacked
with trained layers given zero stand-ins (`stand_ins`), and `optimizer.json` with every rank's
groups and scheduler when they differ (`ranks`). `backends.dist_ckpt` calls it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import structlog
import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
)
from torch import nn

from backends.base import current_rank
from backends.dist_ckpt_load import load_sharded
from backends.megatron import chunks_of, on_rank0, sharded_model_state
from lifecycle.errors import CheckpointError, shorten
from lifecycle.jsontree import encode
from lifecycle.optim_identity import OPTIM_JSON
from lifecycle.optim_state import check_param_groups, state_keys, step_problem

_STATE = "optimizer_state"
_STAND_INS = "optimizer_stand_ins"


def torch_state(optimizer: torch.optim.Optimizer, model: Any, folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A torch optimizer's per-parameter tensors as ShardedTensors placed like their parameters
    (stand-ins included), and what `optimizer.json` says of them. A collective."""
    state = optimizer.state_dict()["state"]
    keys = sorted({k for s in state.values() for k in s if k != "step"})
    placement = _placement(optimizer, model, folder)
    stateless, stand_ins, mine = _stateless_places(optimizer, model, placement)
    sharded = {_STATE: _sharded_torch_state(optimizer, placement, folder, keys), _STAND_INS: _stand_in_state(mine, keys)}
    return sharded, {"optimizer": {"kind": "torch", "state_keys": keys, "step": _common_step(state, folder),
                                   "stateless": stateless, "stand_ins": stand_ins}}


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
    optimizer: torch.optim.Optimizer, placement: dict[int, Any], folder: Path, state_keys: list[str]
) -> dict[str, dict[str, Any]]:
    """Per-parameter tensors of a torch optimizer as ShardedTensors shaped like their params
    (zeros for a parameter without state, which `stateless` names in optimizer.json); on load,
    `state_keys` names the tensors to allocate for every parameter."""
    sharded: dict[str, dict[str, Any]] = {}
    for i, param in enumerate(_params(optimizer)):
        own = optimizer.state.get(param, {})
        tensors = {k: own[k] if k in own else torch.zeros_like(param) for k in state_keys}
        for key, value in tensors.items():
            if not isinstance(value, torch.Tensor) or value.shape != param.shape:
                raise CheckpointError(f"{folder}: optimizer state {key!r} of parameter {i} is not a tensor shaped "
                                      f"like its parameter {list(param.shape)}; dist_ckpt cannot place it")
            sharded.setdefault(str(i), {})[key] = make_sharded_optimizer_tensor(
                placement[i], value, prefix=f"optimizer.state.{key}")
    return sharded


def _place_of(sharded: Any) -> str:
    """A parameter's place in the full model, the same at every TP / PP: its key and, for
    layers stacked into one tensor, the layer's offsets."""
    if isinstance(sharded, ShardedTensorFactory):
        sharded = next(iter(nested_values(sharded.build())))
    return f"{sharded.key}{list(sharded.global_offset[:sharded.prepend_axis_num])}"


def _key_of(sharded: Any) -> str:
    """The parameter's tensor in the checkpoint: one for all layers of a stacked parameter."""
    return str(sharded.key)


def _gathered(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (a collective: every rank calls it); [value] alone
    without a process group of more than one rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def _outside(optimizer: torch.optim.Optimizer, model: Any) -> list[tuple[nn.Parameter, Any]]:
    """The model's parameters the optimizer does not hold (frozen ones), with their ShardedTensors."""
    held = {id(p) for p in _params(optimizer)}
    others = [p for p in dict.fromkeys(p for c in chunks_of(model) for p in c.parameters()) if id(p) not in held]
    placed = get_param_id_to_sharded_param_map(sharded_model_state(chunks_of(model)), others)
    return [(others[i], placed[i]) for i in sorted(placed)]


def _stateless_places(optimizer: torch.optim.Optimizer, model: Any, placement: dict[int, Any]
                      ) -> tuple[list[str], list[str], list[tuple[nn.Parameter, Any]]]:
    """Where the parameters without optimizer state (frozen or unused so far) sit, on every rank:
    restored with zero moments and the common step, their next update would differ from the
    uninterrupted run's. Also the stand-ins: a parameter outside the optimizer stacked into one
    tensor with a layer inside it (any rank's) gets zero state, or Megatron refused the save
    ("Invalid access pattern"); their places (every rank's) are stateless too. A collective."""
    mine = {_place_of(placement[i]) for i, p in enumerate(_params(optimizer)) if not optimizer.state.get(p)}
    outside = _outside(optimizer, model)
    every = _gathered((sorted(mine), sorted({_key_of(s) for s in placement.values()}),
                       [(_place_of(s), _key_of(s)) for _, s in outside]))
    keys = set().union(*(k for _, k, _ in every))
    stand_ins = sorted({place for _, _, candidates in every for place, key in candidates if key in keys})
    stand_in_of_mine = [(p, s) for p, s in outside if _key_of(s) in keys]
    return sorted(set(stand_ins).union(*(m for m, _, _ in every))), stand_ins, stand_in_of_mine


def _stand_in_state(stand_ins: list[tuple[nn.Parameter, Any]], state_keys: list[str]) -> dict[str, dict[str, Any]]:
    return {str(j): {key: make_sharded_optimizer_tensor(sharded, torch.zeros_like(param),
                                                        prefix=f"optimizer.state.{key}") for key in state_keys}
            for j, (param, sharded) in enumerate(stand_ins)}


def _places(saved: dict[str, Any], name: str, where: str) -> set[str]:
    places = saved.get(name, [])
    if not isinstance(places, list) or not all(isinstance(p, str) for p in places):
        raise CheckpointError(f"{where}: {name} must list parameter places, found {shorten(places, 120)}")
    return set(places)


def _stateful(optimizer: torch.optim.Optimizer, placement: dict[int, Any], saved: dict[str, Any],
              where: str) -> list[bool]:
    """Which parameters had state when saved; a save without `stateless` (older) kept it for all."""
    gone = _places(saved, "stateless", where)
    return [bool(saved.get("state_keys")) and _place_of(placement[i]) not in gone
            for i in range(len(_params(optimizer)))]


def _check_saved_state(optimizer: torch.optim.Optimizer, groups: list[Any], stateful: list[bool], saved: dict[str, Any],
                       where: str) -> None:
    """`state_keys` exactly the tensors the optimizer's step reads (`lifecycle.optim_state`'s
    table, by the saved groups' settings), `step` a whole number >= 0: a NaN step made every
    weight NaN, a key too few failed the next step with a raw KeyError."""
    keys, step = saved.get("state_keys"), saved.get("step")
    if not isinstance(keys, list) or not all(isinstance(k, str) and k != "step" for k in keys) \
            or len(set(keys)) != len(keys):
        raise CheckpointError(f"{where}: state_keys must list distinct state names, found {shorten(keys, 120)}")
    needed: set[str] = set()
    flags = iter(stateful)
    for group, saved_group in zip(optimizer.param_groups, groups):
        if any([next(flags) for _ in group["params"]]):
            needed |= state_keys(optimizer, saved_group)
    if needed - {"step"} and set(keys) != needed - {"step"}:
        raise CheckpointError(f"{where}: state_keys {shorten(keys, 120)} are not the "
                              f"{sorted(needed - {'step'})} its step reads")
    if step is None and not ("step" in needed and any(stateful)):
        return
    problem = step_problem(step)
    if problem is None and not float(step).is_integer():
        problem = f"must be a whole number of steps, found {step!r}"
    if problem:
        raise CheckpointError(f"{where}: step {problem}")


def _layout() -> dict[str, int]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    split = parallel_state.model_parallel_is_initialized()
    return {"world": dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1,
            "tp": parallel_state.get_tensor_model_parallel_world_size() if split else 1,
            "pp": parallel_state.get_pipeline_model_parallel_world_size() if split else 1}


def write_json(doc: dict[str, Any], own: dict[str, Any], folder: Path) -> None:
    """`doc` and `own` (this rank's `param_groups`, `lr_scheduler`). `own` is written once when
    every rank holds the same; else rank 0's is, and every rank's under `ranks` with the layout,
    for a resume at that layout only (rank 1 of a PP2 run resumed with rank 0's lr, without a word)."""
    where = str(folder / OPTIM_JSON)
    every = _gathered(own)
    differ = any(json.dumps(encode(o, where=where)) != json.dumps(encode(every[0], where=where)) for o in every)
    doc = {**doc, "ranks": {"layout": _layout(), "states": every} if differ else None}
    doc["optimizer"].update({k: v for k, v in every[0].items() if k == "param_groups"})

    def write() -> None:
        text = json.dumps({"format_version": 1, **encode({**doc, "lr_scheduler": every[0]["lr_scheduler"]},
                                                         where=where)}, indent=1)
        (folder / OPTIM_JSON).write_text(text + "\n", encoding="utf-8")

    on_rank0(write, OPTIM_JSON, folder)


def own_state(doc: dict[str, Any], where: str) -> dict[str, Any]:
    """This rank's `param_groups` and `lr_scheduler`: the ones all ranks share or, when the
    ranks' differed (`ranks`), this rank's, at the layout they were saved at. A file without
    `ranks` (older) holds rank 0's only: loaded as before, with a warning when there are peers."""
    ranks = doc.get("ranks")
    if "ranks" not in doc and _layout()["world"] > 1:
        structlog.get_logger().warning("dist_ckpt.param_groups_of_rank0", file=where, reason=(
            "written before each rank's param_groups and lr_scheduler were kept: every rank resumes with "
            "rank 0's, right only when all ranks had the same"))
    if ranks is None:
        return {"param_groups": doc["optimizer"].get("param_groups"), "lr_scheduler": doc.get("lr_scheduler")}
    now = _layout()
    if not isinstance(ranks, dict) or ranks.get("layout") != now or not isinstance(ranks.get("states"), list) \
            or len(ranks["states"]) != now["world"] or not isinstance(ranks["states"][current_rank()], dict):
        saved = ranks.get("layout") if isinstance(ranks, dict) else ranks
        raise CheckpointError(f"{where}: its ranks' param_groups or lr_scheduler differ, saved per rank at "
                              f"{shorten(saved, 120)}: they can be restored only at that layout, not at {now}")
    return ranks["states"][current_rank()]


def torch_template(optimizer: torch.optim.Optimizer, model: Any, folder: Path, saved: dict[str, Any],
                    groups: Any) -> tuple[dict[str, Any], list[bool]]:
    """What a torch optimizer's load asks Megatron for, once the saved groups and state fit."""
    where = f"{folder / OPTIM_JSON}: does not fit the optimizer"
    check_param_groups(optimizer, groups, where, ids=None)
    placement = _placement(optimizer, model, folder)
    stateful = _stateful(optimizer, placement, saved, where)
    _check_saved_state(optimizer, groups, stateful, saved, where)
    stand_ins = _places(saved, "stand_ins", where)
    mine = [(p, s) for p, s in _outside(optimizer, model) if _place_of(s) in stand_ins] if stand_ins else []
    keys = saved["state_keys"]
    return {_STATE: _sharded_torch_state(optimizer, placement, folder, keys),
            _STAND_INS: _stand_in_state(mine, keys)}, stateful


def load_torch_optimizer(optimizer: torch.optim.Optimizer, folder: Path, saved: dict[str, Any], groups: list[Any],
                          template: dict[str, Any], stateful: list[bool]) -> None:
    step = saved.get("step")
    loaded = load_sharded(template, folder).get(_STATE, {})
    state = {int(i): {**tensors, **({"step": torch.tensor(float(step))} if step is not None else {})}
             for i, tensors in loaded.items() if stateful[int(i)]}
    current = optimizer.state_dict()["param_groups"]
    merged = [{**hyper, "params": group["params"]} for hyper, group in zip(groups, current)]
    optimizer.load_state_dict({"state": state, "param_groups": merged})
