"""TorchDCPBackend: round trips, errors that name the folder and key, no pickled entries,
HF export, two gloo ranks (replicated and FSDP2-sharded) and loading their checkpoint in one process."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from backends.base import backend_class
from backends.hf import HFBackend
from backends.torch_dcp import METADATA, OPTIM_JSON, TorchDCPBackend
from lifecycle import Lifecycle
from lifecycle.errors import CheckpointError
from tests.backends.dist_util import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

Parts = tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]


def mlp(hidden: int = 16) -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 4))


def optimizer_for(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def fresh_parts(seed: int, hidden: int = 16) -> Parts:
    torch.manual_seed(seed)
    model = mlp(hidden)
    return (model, *optimizer_for(model))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None, steps: int = 2) -> None:
    gen = torch.Generator().manual_seed(123)
    for _ in range(steps):
        model(torch.randn(6, 8, generator=gen)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()


def trained_parts(seed: int = 0) -> Parts:
    model, optimizer, scheduler = fresh_parts(seed)
    train(model, optimizer, scheduler)
    return model, optimizer, scheduler


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return (sa["param_groups"] == sb["param_groups"] and sa["state"].keys() == sb["state"].keys()
            and all(same_state(sa["state"][i], sb["state"][i]) for i in sa["state"]))


# ---------------------------------------------------------------- one process, no process group


def test_registry_resolves_torch_dcp_with_its_capabilities() -> None:
    cls = backend_class("torch_dcp")
    assert cls is TorchDCPBackend
    assert (cls.name, cls.parallel_invariant, cls.supports_async, cls.native_hf) == ("torch_dcp", True, True, False)


def test_model_round_trip_restores_perturbed_weights_and_buffers(tmp_path: Path) -> None:
    model, _, _ = trained_parts()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    TorchDCPBackend().save_model(model, tmp_path / "model")
    with torch.no_grad():
        for t in model.state_dict().values():
            t.add_(1) if t.is_floating_point() else t.fill_(99)
    TorchDCPBackend().load_model(model, tmp_path / "model")
    assert same_state(model.state_dict(), expected)


def test_optimizer_and_step_lr_round_trip_into_fresh_objects(tmp_path: Path) -> None:
    model, optimizer, scheduler = trained_parts()
    TorchDCPBackend().save_optimizer(optimizer, scheduler, tmp_path / "optimizer")
    fresh_opt, fresh_sched = optimizer_for(model)
    TorchDCPBackend().load_optimizer(fresh_opt, fresh_sched, tmp_path / "optimizer")
    assert same_optimizer(optimizer, fresh_opt)
    assert fresh_sched.state_dict() == scheduler.state_dict()
    assert fresh_opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)


def test_saved_checkpoint_holds_only_tensors_and_json(tmp_path: Path) -> None:
    """Non-tensor entries would be unpickled by DCP with weights_only=False; none are written."""
    model, optimizer, scheduler = trained_parts()
    backend = TorchDCPBackend()
    backend.save_model(model, tmp_path / "model")
    backend.save_optimizer(optimizer, scheduler, tmp_path / "optimizer")
    for sub in ("model", "optimizer"):
        saved = FileSystemReader(str(tmp_path / sub)).read_metadata().state_dict_metadata
        assert saved and all(isinstance(m, TensorStorageMetadata) for m in saved.values())
    doc = json.loads((tmp_path / "optimizer" / OPTIM_JSON).read_text())
    assert doc["format_version"] == 1 and doc["lr_scheduler"]["last_epoch"] == 2


def test_shape_mismatch_raises_checkpoint_error_naming_folder_and_key(tmp_path: Path) -> None:
    TorchDCPBackend().save_model(mlp(hidden=16), tmp_path / "model")
    with pytest.raises(CheckpointError) as err:
        TorchDCPBackend().load_model(mlp(hidden=12), tmp_path / "model")
    message = str(err.value)
    assert str(tmp_path / "model") in message and "'0.weight'" in message
    assert "[16, 8]" in message and "[12, 8]" in message


def test_missing_or_unexpected_tensor_raises_checkpoint_error_naming_the_key(tmp_path: Path) -> None:
    TorchDCPBackend().save_model(mlp(), tmp_path / "model")
    bigger = nn.Sequential(*mlp(), nn.Linear(4, 2))
    with pytest.raises(CheckpointError, match=r"tensor '4\.weight' missing"):
        TorchDCPBackend().load_model(bigger, tmp_path / "model")
    smaller = nn.Sequential(*list(mlp())[:3])
    with pytest.raises(CheckpointError, match=r"unexpected entry '3\.bias'"):
        TorchDCPBackend().load_model(smaller, tmp_path / "model")


def test_missing_folder_raises_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such folder") as err:
        TorchDCPBackend().load_model(mlp(), tmp_path / "absent")
    assert str(tmp_path / "absent") in str(err.value)


def test_missing_metadata_raises_checkpoint_error(tmp_path: Path) -> None:
    TorchDCPBackend().save_model(mlp(), tmp_path / "model")
    (tmp_path / "model" / METADATA).unlink()
    with pytest.raises(CheckpointError, match=rf"no \{METADATA} file"):
        TorchDCPBackend().load_model(mlp(), tmp_path / "model")


def test_truncated_metadata_raises_checkpoint_error(tmp_path: Path) -> None:
    TorchDCPBackend().save_model(mlp(), tmp_path / "model")
    meta = tmp_path / "model" / METADATA
    meta.write_bytes(meta.read_bytes()[:40])
    with pytest.raises(CheckpointError, match="unreadable DCP metadata"):
        TorchDCPBackend().load_model(mlp(), tmp_path / "model")


def test_metadata_pointing_outside_the_folder_is_refused(tmp_path: Path) -> None:
    TorchDCPBackend().save_model(mlp(), tmp_path / "model")
    meta = tmp_path / "model" / METADATA
    metadata = FileSystemReader(str(tmp_path / "model")).read_metadata()
    for info in metadata.storage_data.values():
        info.relative_path = "../elsewhere.distcp"
    meta.write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="is not a file in"):
        TorchDCPBackend().load_model(mlp(), tmp_path / "model")


def test_optimizer_load_without_json_raises_checkpoint_error(tmp_path: Path) -> None:
    _, optimizer, scheduler = trained_parts()
    TorchDCPBackend().save_optimizer(optimizer, scheduler, tmp_path / "optimizer")
    (tmp_path / "optimizer" / OPTIM_JSON).unlink()
    with pytest.raises(CheckpointError, match=rf"{OPTIM_JSON}: file missing"):
        TorchDCPBackend().load_optimizer(optimizer, scheduler, tmp_path / "optimizer")


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda g: g[0].update(lr={"__float__": "nan"}), "param_groups[0].lr: must be a finite number like"),
    (lambda g: g[0].update(betas=["a", 0.999]), "param_groups[0].betas: must be 2 finite numbers"),
    (lambda g: g[0].pop("eps"), "param_groups[0].eps: missing"),
    (lambda g: g[0].update(params=g[0]["params"][:-1]), "param_groups[0].params must list 6 distinct parameter ids (str)"),
    (lambda g: g.append(dict(g[0])), "optimizer.param_groups must list 1 group(s)"),
], ids=["lr-nan", "betas-string", "eps-missing", "a-parameter-short", "a-group-more"])
def test_param_groups_that_do_not_fit_the_optimizer_are_refused_naming_the_key(
    tmp_path: Path, edit: Any, needle: str
) -> None:
    """`set_optimizer_state_dict` would take them, and the first step fail or train on NaN."""
    _, optimizer, scheduler = trained_parts()
    TorchDCPBackend().save_optimizer(optimizer, scheduler, tmp_path / "optimizer")
    path = tmp_path / "optimizer" / OPTIM_JSON
    doc = json.loads(path.read_text())
    edit(doc["optimizer"]["param_groups"])
    path.write_text(json.dumps(doc))
    fresh_opt, fresh_sched = optimizer_for(mlp())
    with pytest.raises(CheckpointError) as caught:
        TorchDCPBackend().load_optimizer(fresh_opt, fresh_sched, tmp_path / "optimizer")
    assert str(caught.value).startswith(f"{path}: does not fit the optimizer: ") and needle in str(caught.value)
    assert fresh_opt.param_groups[0]["lr"] == 1e-2 and fresh_sched.last_epoch == 0


def test_a_scheduler_built_since_the_save_does_not_make_its_initial_lr_a_missing_hyper_parameter(
    tmp_path: Path,
) -> None:
    model, _, _ = trained_parts()
    saved_opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    train(model, saved_opt)
    TorchDCPBackend().save_optimizer(saved_opt, None, tmp_path / "optimizer")
    fresh_opt, _ = optimizer_for(model)
    assert "initial_lr" in fresh_opt.param_groups[0]
    TorchDCPBackend().load_optimizer(fresh_opt, None, tmp_path / "optimizer")
    assert same_optimizer(saved_opt, fresh_opt)


def test_export_hf_writes_a_folder_the_hf_backend_loads_back_equal(tmp_path: Path) -> None:
    model, _, _ = trained_parts()
    TorchDCPBackend().export_hf(model, tmp_path / "hf_model")
    loaded = mlp()
    HFBackend().load_model(loaded, tmp_path / "hf_model")
    assert same_state(loaded.state_dict(), model.state_dict())


def test_lifecycle_saves_and_resumes_with_torch_dcp_format(tmp_path: Path) -> None:
    config = {"checkpoint": {"root": str(tmp_path), "save": {"format": "torch_dcp"}}}
    model, optimizer, scheduler = fresh_parts(seed=0)
    lc = Lifecycle(config, role="actor", model=model, optimizer=optimizer, lr_scheduler=scheduler)
    lc.init_load()
    with lc.train_step(1):
        train(model, optimizer, scheduler, steps=1)
    info = lc.save(1)
    assert info.backend == "torch_dcp" and (info.path / "model" / METADATA).is_file()
    lc.close()

    model2, optimizer2, scheduler2 = fresh_parts(seed=1)
    lc2 = Lifecycle(config, role="actor", model=model2, optimizer=optimizer2, lr_scheduler=scheduler2)
    assert lc2.resume() == 1
    assert same_state(model2.state_dict(), model.state_dict())
    assert same_optimizer(optimizer2, optimizer)
    assert scheduler2.state_dict() == scheduler.state_dict()
    lc2.close()


# ---------------------------------------------------------------- two gloo ranks


def _fsdp2(model: nn.Sequential, world_size: int) -> nn.Sequential:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full_expected(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Rank 0 writes the gathered weights and optimizer state for the one-process tests."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    if torch.distributed.get_rank() == 0:
        flat: dict[str, Any] = {f"model/{k}": v for k, v in weights.items()}
        flat |= _by_fqn(optim["state"], prefix="optim/")
        save_file({k: v.contiguous() for k, v in flat.items()}, str(path))


def _by_fqn(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """{'fqn': {'exp_avg': t}} -> {'fqn/exp_avg': t}: comparable across layouts and storable flat."""
    return {f"{prefix}{fqn}/{k}": v for fqn, s in state.items() for k, v in s.items()}


def _two_rank_job(rank: int, world_size: int, tmp: Path) -> dict[str, bool]:
    """Replicated and FSDP2-sharded save + load on every rank; leaves folders for one-process loads."""
    backend = TorchDCPBackend()
    model, optimizer, scheduler = trained_parts(seed=0)
    backend.save_model(model, tmp / "replicated" / "model")
    backend.save_optimizer(optimizer, scheduler, tmp / "replicated" / "optimizer")
    _full_expected(model, optimizer, tmp / "replicated.expected.safetensors")
    model2, optimizer2, scheduler2 = fresh_parts(seed=1)
    backend.load_model(model2, tmp / "replicated" / "model")
    backend.load_optimizer(optimizer2, scheduler2, tmp / "replicated" / "optimizer")
    replicated = (same_state(model2.state_dict(), model.state_dict()) and same_optimizer(optimizer2, optimizer)
                  and scheduler2.state_dict() == scheduler.state_dict())

    torch.manual_seed(0)
    sharded = _fsdp2(mlp(), world_size)
    sharded_opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    train(sharded, sharded_opt)
    backend.save_model(sharded, tmp / "sharded" / "model")
    backend.save_optimizer(sharded_opt, None, tmp / "sharded" / "optimizer")
    backend.export_hf(sharded, tmp / "sharded" / "hf_model")
    _full_expected(sharded, sharded_opt, tmp / "sharded.expected.safetensors")
    torch.manual_seed(1)
    sharded2 = _fsdp2(mlp(), world_size)
    sharded_opt2 = torch.optim.AdamW(sharded2.parameters(), lr=1e-2)
    backend.load_model(sharded2, tmp / "sharded" / "model")
    backend.load_optimizer(sharded_opt2, None, tmp / "sharded" / "optimizer")
    local = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in sharded.state_dict().items()}
    local2 = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in sharded2.state_dict().items()}
    return {"replicated": replicated, "sharded": same_state(local2, local)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, bool]]]:
    """One 2-rank job serves every multi-process test: spawning ranks costs seconds each time."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    return tmp, run_ranks(_two_rank_job, tmp, world_size=2, timeout_s=60)


def _load_expected(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    flat = load_file(str(path))
    weights = {k.removeprefix("model/"): v for k, v in flat.items() if k.startswith("model/")}
    return weights, {k.removeprefix("optim/"): v for k, v in flat.items() if k.startswith("optim/")}


def _optim_by_fqn(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return _by_fqn(get_optimizer_state_dict(model, optimizer)["state"])


def test_two_ranks_save_one_folder_and_both_load_it_back_equal(two_ranks: Any) -> None:
    _, results = two_ranks
    assert [r["replicated"] for r in results] == [True, True]


def test_fsdp2_shards_saved_by_two_ranks_load_back_equal_on_both(two_ranks: Any) -> None:
    _, results = two_ranks
    assert [r["sharded"] for r in results] == [True, True]


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_checkpoint_saved_by_two_ranks_loads_in_one_process_without_process_group(
    two_ranks: Any, layout: str
) -> None:
    tmp, _ = two_ranks
    weights, optim = _load_expected(tmp / f"{layout}.expected.safetensors")
    model, optimizer, _ = fresh_parts(seed=7)
    TorchDCPBackend().load_model(model, tmp / layout / "model")
    TorchDCPBackend().load_optimizer(optimizer, None, tmp / layout / "optimizer")
    assert same_state(model.state_dict(), weights)
    assert same_state(_optim_by_fqn(model, optimizer), optim)


def test_export_hf_from_fsdp2_shards_writes_full_weights(two_ranks: Any) -> None:
    tmp, _ = two_ranks
    weights, _ = _load_expected(tmp / "sharded.expected.safetensors")
    model = mlp()
    HFBackend().load_model(model, tmp / "sharded" / "hf_model")
    assert same_state(model.state_dict(), weights)
