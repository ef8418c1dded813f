"""torch_dcp across layouts, on 2 gloo ranks with FSDP2 (`fully_shard` on CPU) and in one process.

Saved at 2 ranks (replicated and FSDP2-sharded), the checkpoint loads back on both ranks and
into one process with no process group, weights and optimizer state (by parameter name) equal
to the full tensors. Saved in one process, it loads into FSDP2 at 2 ranks: each rank's shards
of weights and optimizer state are the slices of the saved full tensors, and a further step
gives what the unsharded model gives. One 2-rank job serves every test: spawning costs seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from backends.hf import HFBackend
from backends.torch_dcp import TorchDCPBackend
from tests.backends.dist_util import run_ranks
from tests.backends.test_torch_dcp import (
    _optim_by_fqn,
    by_fqn,
    fresh_parts,
    mlp,
    optimizer_for,
    same_optimizer,
    same_state,
    train,
    trained_parts,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TOLERANCE = 1e-6
"""Of a step taken sharded against the same step unsharded: the gradients are averaged over
ranks that computed them from the same batch, so they agree to rounding at most."""


def _fsdp2(model: nn.Sequential, world_size: int) -> nn.Sequential:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Weights and optimizer state as full tensors, flat: {'model/<name>', 'optim/<name>/<key>'}.
    Every rank of a sharded model must call it (it gathers); every rank gets the full tensors."""
    options = StateDictOptions(full_state_dict=True)
    weights = get_model_state_dict(model, options=options)
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    return {f"model/{k}": v.contiguous() for k, v in weights.items()} | by_fqn(optim["state"], prefix="optim/")


def _split(flat: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    weights = {k.removeprefix("model/"): v for k, v in flat.items() if k.startswith("model/")}
    return weights, {k.removeprefix("optim/"): v for k, v in flat.items() if k.startswith("optim/")}


def _local(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.to_local() if hasattr(v, "to_local") else v for k, v in state.items()}


def _slices_of(sharded: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> dict[str, bool]:
    """Whether each of this rank's shards is exactly its slice of the full tensor (cut locally,
    `src_data_rank=None`: no collective) and each replicated tensor the full tensor itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    out = {}
    for key, value in sharded.items():
        if isinstance(value, DTensor):
            want = distribute_tensor(full[key], value.device_mesh, value.placements, src_data_rank=None)
            out[key] = torch.equal(value.to_local(), want.to_local())
        else:
            out[key] = torch.equal(value, full[key])
    return out


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _two_ranks_to_one_and_back(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    """Replicated and FSDP2-sharded saves (loaded back here and, later, in one process); then
    the one-process save of `_single` loaded into FSDP2 and stepped once more."""
    backend = TorchDCPBackend()
    model, optimizer, scheduler = trained_parts(seed=0)
    backend.save_model(model, tmp / "replicated" / "model")
    backend.save_optimizer(optimizer, scheduler, tmp / "replicated" / "optimizer", model=model)
    if rank == 0:
        save_file(_full(model, optimizer), str(tmp / "replicated.expected.safetensors"))
    model2, optimizer2, scheduler2 = fresh_parts(seed=1)
    backend.load_model(model2, tmp / "replicated" / "model")
    backend.load_optimizer(optimizer2, scheduler2, tmp / "replicated" / "optimizer", model=model2)
    replicated = (same_state(model2.state_dict(), model.state_dict()) and same_optimizer(optimizer2, optimizer)
                  and scheduler2.state_dict() == scheduler.state_dict())

    torch.manual_seed(0)
    sharded = _fsdp2(mlp(), world_size)
    sharded_opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    train(sharded, sharded_opt)
    backend.save_model(sharded, tmp / "sharded" / "model")
    backend.save_optimizer(sharded_opt, None, tmp / "sharded" / "optimizer", model=sharded)
    backend.export_hf(sharded, tmp / "sharded" / "hf_model")
    full = _full(sharded, sharded_opt)
    if rank == 0:
        save_file(full, str(tmp / "sharded.expected.safetensors"))
    torch.manual_seed(1)
    sharded2 = _fsdp2(mlp(), world_size)
    sharded_opt2 = torch.optim.AdamW(sharded2.parameters(), lr=1e-2)
    backend.load_model(sharded2, tmp / "sharded" / "model")
    backend.load_optimizer(sharded_opt2, None, tmp / "sharded" / "optimizer", model=sharded2)
    same_shards = (same_state(_local(sharded2.state_dict()), _local(sharded.state_dict()))
                   and same_state(_local(_optim_by_fqn(sharded2, sharded_opt2)), _local(_optim_by_fqn(sharded, sharded_opt))))

    torch.manual_seed(2)
    resharded = _fsdp2(mlp(), world_size)
    resharded_opt, resharded_sched = optimizer_for(resharded)
    backend.load_model(resharded, tmp / "single" / "model")
    backend.load_optimizer(resharded_opt, resharded_sched, tmp / "single" / "optimizer", model=resharded)
    weights, optim = _split(load_file(str(tmp / "single.saved.safetensors")))
    slices = _slices_of(resharded.state_dict(), weights) | _slices_of(_optim_by_fqn(resharded, resharded_opt), optim)
    sharded_kinds = sorted({type(v).__name__ for v in resharded.state_dict().values()})
    train(resharded, resharded_opt, resharded_sched, steps=1)
    stepped = _max_difference(_full(resharded, resharded_opt), load_file(str(tmp / "single.stepped.safetensors")))
    return {"replicated": replicated, "sharded": same_shards, "slices": slices, "kinds": sharded_kinds,
            "stepped": stepped, "lr": resharded_opt.param_groups[0]["lr"]}


def _single(tmp: Path) -> float:
    """One process saves a trained model; its full tensors then, and after one more step, are
    what the 2 ranks must find and reach. Returns the learning rate after that step."""
    model, optimizer, scheduler = trained_parts(seed=3)
    TorchDCPBackend().save_model(model, tmp / "single" / "model")
    TorchDCPBackend().save_optimizer(optimizer, scheduler, tmp / "single" / "optimizer", model=model)
    save_file(_full(model, optimizer), str(tmp / "single.saved.safetensors"))
    train(model, optimizer, scheduler, steps=1)
    save_file(_full(model, optimizer), str(tmp / "single.stepped.safetensors"))
    return optimizer.param_groups[0]["lr"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]], float]:
    tmp = tmp_path_factory.mktemp("two_ranks")
    lr = _single(tmp)
    return tmp, run_ranks(_two_ranks_to_one_and_back, tmp, world_size=2, timeout_s=120), lr


def test_two_ranks_save_one_folder_and_both_load_it_back_equal(two_ranks: Any) -> None:
    _, results, _ = two_ranks
    assert [r["replicated"] for r in results] == [True, True]


def test_fsdp2_shards_saved_by_two_ranks_load_back_equal_on_both(two_ranks: Any) -> None:
    _, results, _ = two_ranks
    assert [r["sharded"] for r in results] == [True, True]


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_checkpoint_saved_by_two_ranks_loads_in_one_process_without_process_group(
    two_ranks: Any, layout: str
) -> None:
    tmp, _, _ = two_ranks
    weights, optim = _split(load_file(str(tmp / f"{layout}.expected.safetensors")))
    model, optimizer, _ = fresh_parts(seed=7)
    TorchDCPBackend().load_model(model, tmp / layout / "model")
    TorchDCPBackend().load_optimizer(optimizer, None, tmp / layout / "optimizer", model=model)
    assert same_state(model.state_dict(), weights)
    assert same_state(_optim_by_fqn(model, optimizer), optim)


def test_export_hf_from_fsdp2_shards_writes_full_weights(two_ranks: Any) -> None:
    tmp, _, _ = two_ranks
    weights, _ = _split(load_file(str(tmp / "sharded.expected.safetensors")))
    model = mlp()
    HFBackend().load_model(model, tmp / "sharded" / "hf_model")
    assert same_state(model.state_dict(), weights)


def test_one_process_checkpoint_loads_into_fsdp2_shards_that_are_slices_of_the_saved_tensors(two_ranks: Any) -> None:
    _, results, _ = two_ranks
    for rank, result in enumerate(results):
        assert result["kinds"] == ["DTensor", "Tensor"], rank  # sharded parameters, replicated BatchNorm buffers
        assert result["slices"] and all(result["slices"].values()), (rank, result["slices"])
        assert {k.split("/")[-1] for k in result["slices"] if "/" in k} == {"step", "exp_avg", "exp_avg_sq"}


def test_a_step_after_loading_into_fsdp2_matches_the_step_of_the_unsharded_model(two_ranks: Any) -> None:
    _, results, lr = two_ranks
    assert [r["lr"] for r in results] == [lr, lr]
    assert all(r["stepped"] <= TOLERANCE for r in results), [r["stepped"] for r in results]
