"""TorchDCPBackend in one process: round trips, optimizer state keyed by parameter name,
errors that name the folder and key, no pickled entries, HF export, through Lifecycle.
Two gloo ranks and FSDP2, both ways: tests/backends/test_dcp_reshard.py."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from backends.base import backend_class
from backends.hf import HFBackend
from backends.torch_dcp import METADATA, OPTIM_JSON, TorchDCPBackend
from lifecycle import Lifecycle
from lifecycle.errors import CheckpointError

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


def by_fqn(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """{'fqn': {'exp_avg': t}} -> {'fqn/exp_avg': t}: comparable across layouts and storable flat."""
    return {f"{prefix}{fqn}/{k}": v for fqn, s in state.items() for k, v in s.items()}


def _optim_by_fqn(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return by_fqn(get_optimizer_state_dict(model, optimizer)["state"])


def saved_then_edited(tmp_path: Path, edit: Any) -> Path:
    """A trained optimizer saved to tmp_path/optimizer, its optimizer.json changed by `edit(doc)`."""
    model, optimizer, scheduler = trained_parts()
    TorchDCPBackend().save_optimizer(optimizer, scheduler, tmp_path / "optimizer", model=model)
    path = tmp_path / "optimizer" / OPTIM_JSON
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    return path


# ---------------------------------------------------------------- one process, no process group


def test_registry_resolves_torch_dcp_with_its_capabilities() -> None:
    cls = backend_class("torch_dcp")
    assert cls is TorchDCPBackend
    caps = cls.capabilities
    assert cls.name == "torch_dcp"
    assert (caps.parallel_invariant, caps.collective_save, caps.supports_async, caps.native_hf,
            caps.verifies_reads, caps.reads_pickles) == (True, True, True, False, False, True)


def test_model_round_trip_restores_perturbed_weights_and_buffers(tmp_path: Path) -> None:
    model, _, _ = trained_parts()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    assert TorchDCPBackend().save_model(model, tmp_path / "model") == {}
    with torch.no_grad():
        for t in model.state_dict().values():
            t.add_(1) if t.is_floating_point() else t.fill_(99)
    assert TorchDCPBackend().load_model(model, tmp_path / "model") == set()
    assert same_state(model.state_dict(), expected)


def test_optimizer_and_step_lr_round_trip_into_fresh_objects(tmp_path: Path) -> None:
    model, optimizer, scheduler = trained_parts()
    TorchDCPBackend().save_optimizer(optimizer, scheduler, tmp_path / "optimizer", model=model)
    fresh_model = mlp()
    fresh_opt, fresh_sched = optimizer_for(fresh_model)
    TorchDCPBackend().load_optimizer(fresh_opt, fresh_sched, tmp_path / "optimizer", model=fresh_model)
    assert same_optimizer(optimizer, fresh_opt)
    assert fresh_sched.state_dict() == scheduler.state_dict()
    assert fresh_opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)


def test_saved_checkpoint_holds_only_tensors_and_json(tmp_path: Path) -> None:
    """Non-tensor entries would be unpickled by DCP with weights_only=False; none are written."""
    model, optimizer, scheduler = trained_parts()
    backend = TorchDCPBackend()
    backend.save_model(model, tmp_path / "model")
    backend.save_optimizer(optimizer, scheduler, tmp_path / "optimizer", model=model)
    for sub in ("model", "optimizer"):
        saved = FileSystemReader(str(tmp_path / sub)).read_metadata().state_dict_metadata
        assert saved and all(isinstance(m, TensorStorageMetadata) for m in saved.values())
    doc = json.loads((tmp_path / "optimizer" / OPTIM_JSON).read_text())
    assert doc["format_version"] == 2 and doc["lr_scheduler"]["last_epoch"] == 2


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
    model, optimizer, scheduler = trained_parts()
    TorchDCPBackend().save_optimizer(optimizer, scheduler, tmp_path / "optimizer", model=model)
    (tmp_path / "optimizer" / OPTIM_JSON).unlink()
    with pytest.raises(CheckpointError, match=rf"{OPTIM_JSON}: file missing"):
        TorchDCPBackend().load_optimizer(optimizer, scheduler, tmp_path / "optimizer", model=model)


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda g: g[0].update(lr={"__float__": "nan"}), "param_groups[0].lr: must be a finite number like"),
    (lambda g: g[0].update(betas=["a", 0.999]), "param_groups[0].betas: must be 2 finite numbers"),
    (lambda g: g[0].pop("eps"), "param_groups[0].eps: missing"),
    (lambda g: g[0].update(params=g[0]["params"][:-1]), "param_groups[0].params lacks ['3.bias']"),
    (lambda g: g[0].update(params=g[0]["params"][:-1] + [5]), "param_groups[0].params must list 6 distinct parameter ids"),
    (lambda g: g.append(dict(g[0])), "optimizer.param_groups must list 1 group(s)"),
], ids=["lr-nan", "betas-string", "eps-missing", "a-parameter-short", "a-number-for-a-name", "a-group-more"])
def test_param_groups_that_do_not_fit_the_optimizer_are_refused_naming_the_key(
    tmp_path: Path, edit: Any, needle: str
) -> None:
    """`set_optimizer_state_dict` would take them, and the first step fail or train on NaN."""
    path = saved_then_edited(tmp_path, lambda doc: edit(doc["optimizer"]["param_groups"]))
    fresh_opt, fresh_sched = refused_leaving_a_fresh_optimizer_untouched(tmp_path, path, needle)
    assert fresh_opt.param_groups[0]["lr"] == 1e-2 and fresh_sched.last_epoch == 0


def refused_leaving_a_fresh_optimizer_untouched(tmp_path: Path, path: Path, needle: str) -> tuple[Any, Any]:
    """Loading tmp_path/optimizer into fresh parts is refused naming `path` and `needle`, and
    the fresh optimizer's state is as it was; returns the optimizer and scheduler."""
    fresh, fresh_opt, fresh_sched = fresh_parts(seed=1)
    untouched = {k: v.clone() for k, v in _optim_by_fqn(fresh, fresh_opt).items()}
    with pytest.raises(CheckpointError) as caught:
        TorchDCPBackend().load_optimizer(fresh_opt, fresh_sched, tmp_path / "optimizer", model=fresh)
    assert str(caught.value).startswith(f"{path}: does not fit the optimizer: ") and needle in str(caught.value)
    assert same_state(_optim_by_fqn(fresh, fresh_opt), untouched)
    return fresh_opt, fresh_sched


STATE_EDITS = {  # optimizer.json's state, keyed by parameter name; each tensor named by its place
    "another-parameters-buffer": (lambda st: st["0.weight"].update(exp_avg=st["0.bias"]["exp_avg"]),
                                  "state of '0.weight', key 'exp_avg': optimizer.json gives it another tensor"),
    "one-tensor-twice": (lambda st: st["0.bias"].update(exp_avg_sq=st["0.bias"]["exp_avg"]),
                         "state of '0.bias', key 'exp_avg_sq': optimizer.json gives it another tensor"),
    "missing-buffer": (lambda st: st["0.bias"].pop("exp_avg_sq"), "state of '0.bias' lacks ['exp_avg_sq']"),
}


@pytest.mark.parametrize("edit", STATE_EDITS)
def test_state_tensors_named_for_another_place_or_missing_are_refused_before_dcp_reads(tmp_path: Path,
                                                                                       edit: str) -> None:
    """`set_optimizer_state_dict` took each: bytes of another shape (a raw RuntimeError at the
    first step), two moments aliased (trained on silently), or a KeyError at the first step."""
    change, needle = STATE_EDITS[edit]
    path = saved_then_edited(tmp_path, lambda doc: change(doc["optimizer"]["state"]))
    refused_leaving_a_fresh_optimizer_untouched(tmp_path, path, needle)


@pytest.mark.parametrize("step", [math.nan, -1.0])
def test_a_step_that_is_not_a_finite_number_at_least_zero_is_refused(tmp_path: Path, step: float) -> None:
    """NaN made every weight NaN after one AdamW step; -1 divided by zero in its bias correction.
    The steps are read into copies first, so the refused load changes nothing."""
    model, optimizer, scheduler = trained_parts()
    next(iter(optimizer.state.values()))["step"].fill_(step)
    TorchDCPBackend().save_optimizer(optimizer, scheduler, tmp_path / "optimizer", model=model)
    fresh, fresh_opt, fresh_sched = fresh_parts(seed=1)
    untouched = {k: v.clone() for k, v in _optim_by_fqn(fresh, fresh_opt).items()}
    with pytest.raises(CheckpointError, match=r"optimizer\.state\.0\.weight\.step: must be one finite number >= 0"):
        TorchDCPBackend().load_optimizer(fresh_opt, fresh_sched, tmp_path / "optimizer", model=fresh)
    assert same_state(_optim_by_fqn(fresh, fresh_opt), untouched), "checked before a byte reached the optimizer"


class _IntStepSGD(torch.optim.SGD):
    """Keeps its step as a plain int, as some optimizers (transformers' Adafactor) do."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["step"] = self.state[p].get("step", 0) + 1
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
        return super().step(closure)


def test_a_step_kept_as_a_plain_number_is_checked_too(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    optimizer = _IntStepSGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    path = tmp_path / "optimizer" / OPTIM_JSON
    TorchDCPBackend().save_optimizer(optimizer, None, tmp_path / "optimizer", model=model)
    doc = json.loads(path.read_text())
    doc["optimizer"]["state"]["weight"]["step"] = -1
    path.write_text(json.dumps(doc))
    fresh = nn.Linear(3, 2)
    with pytest.raises(CheckpointError, match="state of 'weight', key 'step': must be one finite number >= 0"):
        TorchDCPBackend().load_optimizer(_IntStepSGD(fresh.parameters(), lr=0.1), None, tmp_path / "optimizer",
                                         model=fresh)


def test_a_scheduler_built_since_the_save_does_not_make_its_initial_lr_a_missing_hyper_parameter(
    tmp_path: Path,
) -> None:
    model, _, _ = trained_parts()
    saved_opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    train(model, saved_opt)
    TorchDCPBackend().save_optimizer(saved_opt, None, tmp_path / "optimizer", model=model)
    fresh_opt, _ = optimizer_for(model)
    assert "initial_lr" in fresh_opt.param_groups[0]
    TorchDCPBackend().load_optimizer(fresh_opt, None, tmp_path / "optimizer", model=model)
    assert same_optimizer(saved_opt, fresh_opt)


def test_optimizer_state_is_written_under_parameter_names_as_torchtitan_keys_it(tmp_path: Path) -> None:
    model, optimizer, scheduler = trained_parts()
    assert TorchDCPBackend().save_optimizer(optimizer, scheduler, tmp_path / "optimizer", model=model) == {}
    keys = set(FileSystemReader(str(tmp_path / "optimizer")).read_metadata().state_dict_metadata)
    names = [n for n, _ in model.named_parameters()]
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]
    assert keys == {f"optimizer.state.{n}.{k}" for n in names for k in ("step", "exp_avg", "exp_avg_sq")}
    doc = json.loads((tmp_path / "optimizer" / OPTIM_JSON).read_text())
    assert doc["optimizer"]["param_groups"][0]["params"] == names
    assert sorted(doc["optimizer"]["state"]) == sorted(names)


def test_optimizer_state_follows_parameter_names_not_positions(tmp_path: Path) -> None:
    """The same parameters handed to the optimizer in another order load by name."""
    model, optimizer, scheduler = trained_parts()
    TorchDCPBackend().save_optimizer(optimizer, scheduler, tmp_path / "optimizer", model=model)
    fresh = mlp()
    reordered = torch.optim.AdamW(list(fresh.parameters())[::-1], lr=1e-2, weight_decay=0.1)
    TorchDCPBackend().load_optimizer(reordered, None, tmp_path / "optimizer", model=fresh)
    assert same_state(_optim_by_fqn(fresh, reordered), _optim_by_fqn(model, optimizer))


def test_optimizer_calls_without_the_model_are_refused_naming_the_folder(tmp_path: Path) -> None:
    model, optimizer, scheduler = trained_parts()
    with pytest.raises(CheckpointError, match=r"keys optimizer state by parameter name and needs the model") as err:
        TorchDCPBackend().save_optimizer(optimizer, scheduler, tmp_path / "optimizer")
    assert str(tmp_path / "optimizer") in str(err.value) and not (tmp_path / "optimizer").exists()
    TorchDCPBackend().save_optimizer(optimizer, scheduler, tmp_path / "optimizer", model=model)
    with pytest.raises(CheckpointError, match=r"needs the model"):
        TorchDCPBackend().load_optimizer(optimizer, scheduler, tmp_path / "optimizer")


def test_an_optimizer_stepping_a_parameter_outside_the_model_is_refused(tmp_path: Path) -> None:
    _, optimizer, scheduler = trained_parts()
    with pytest.raises(CheckpointError, match="not one of the model's"):
        TorchDCPBackend().save_optimizer(optimizer, scheduler, tmp_path / "optimizer", model=mlp())


@pytest.mark.parametrize(("model", "needle"), [
    (lambda: nn.Sequential(*mlp(), nn.Linear(4, 2)), r"param_groups\[0\]\.params lacks \['4\.bias', '4\.weight'\]$"),
    (lambda: nn.Sequential(*list(mlp())[:3]), r"params has \['3\.bias', '3\.weight'\], which the running optimizer"),
], ids=["a-parameter-more", "a-parameter-less"])
def test_optimizer_state_of_other_parameters_is_refused_naming_the_key(tmp_path: Path, model: Any, needle: str) -> None:
    saved, optimizer, _ = trained_parts()
    TorchDCPBackend().save_optimizer(optimizer, None, tmp_path / "optimizer", model=saved)
    other = model()
    with pytest.raises(CheckpointError, match=needle) as err:
        TorchDCPBackend().load_optimizer(torch.optim.AdamW(other.parameters(), lr=1e-2, weight_decay=0.1), None,
                                         tmp_path / "optimizer", model=other)
    assert str(tmp_path / "optimizer") in str(err.value)


def test_state_of_another_optimizer_kind_is_refused_naming_both_classes(tmp_path: Path) -> None:
    model, optimizer, _ = trained_parts()
    TorchDCPBackend().save_optimizer(optimizer, None, tmp_path / "optimizer", model=model)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    with pytest.raises(CheckpointError) as err:
        TorchDCPBackend().load_optimizer(sgd, None, tmp_path / "optimizer", model=model)
    message = str(err.value)
    assert "saved by 'torch.optim.adamw.AdamW'" in message and "'torch.optim.sgd.SGD'" in message
    assert sgd.state_dict()["state"] == {}  # refused before anything was loaded into it


def _rename(doc: dict[str, Any], where: str) -> None:
    optimizer = doc["optimizer"]
    if where == "group":
        optimizer["param_groups"][0]["params"][0] = "0.renamed"
    else:
        optimizer["state"]["0.renamed"] = optimizer["state"].pop("0.weight")


@pytest.mark.parametrize(("where", "needle"), [
    ("group", "param_groups[0].params lacks ['0.weight'] and has ['0.renamed'], which the running optimizer does not"),
    ("state", "optimizer.state lacks ['0.weight'] and has ['0.renamed'], which the running optimizer does not"),
])
def test_saved_names_the_model_does_not_have_are_refused_before_anything_loads(
    tmp_path: Path, where: str, needle: str
) -> None:
    """`set_optimizer_state_dict` would pass over them: a group without its hyper-parameters."""
    path = saved_then_edited(tmp_path, lambda doc: _rename(doc, where))
    fresh, fresh_opt, fresh_sched = fresh_parts(seed=1)
    untouched = {k: v.clone() for k, v in _optim_by_fqn(fresh, fresh_opt).items()}
    with pytest.raises(CheckpointError) as caught:
        TorchDCPBackend().load_optimizer(fresh_opt, fresh_sched, tmp_path / "optimizer", model=fresh)
    assert str(caught.value) == f"{path}: does not fit the optimizer: {needle}"
    assert same_state(_optim_by_fqn(fresh, fresh_opt), untouched) and fresh_sched.last_epoch == 0


def test_an_optimizer_json_keyed_by_position_is_refused_by_its_version(tmp_path: Path) -> None:
    path = saved_then_edited(tmp_path, lambda doc: doc.update(format_version=1))
    fresh, fresh_opt, _ = fresh_parts(seed=1)
    with pytest.raises(CheckpointError, match=r"format_version 1 keys optimizer state by position") as err:
        TorchDCPBackend().load_optimizer(fresh_opt, None, tmp_path / "optimizer", model=fresh)
    assert str(err.value).startswith(f"{path}: ")


def test_export_hf_writes_a_folder_the_hf_backend_loads_back_equal(tmp_path: Path) -> None:
    model, _, _ = trained_parts()
    assert set(TorchDCPBackend().export_hf(model, tmp_path / "hf_model")) == {"model.safetensors"}
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
