"""Optimizer state reaches the parameter, optimizer class and scheduler class it was saved for,
in the hf and torch_dcp formats; saving or refusing never steps the running optimizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs
from torch import nn

from backends.hf import HFBackend
from backends.safetensors_io import write_file
from backends.torch_dcp import TorchDCPBackend
from lifecycle.errors import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

Backend = HFBackend | TorchDCPBackend


class EncDec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.dec = nn.Linear(4, 4)


class DecEnc(EncDec):
    """The same module, its submodules declared in the other order (same names and shapes)."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.dec = nn.Linear(4, 4)
        self.enc = nn.Linear(4, 4)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model.dec(model.enc(torch.randn(2, 4, generator=gen))).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def exp_avgs(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {name: optimizer.state[p]["exp_avg"].clone() for name, p in model.named_parameters()}


def saved_trained(backend: Backend, folder: Path, **kw: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = EncDec()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **kw)
    train(model, optimizer)
    backend.save_optimizer(optimizer, None, folder, model=model)
    return model, optimizer


@pytest.mark.parametrize("backend", [HFBackend(), TorchDCPBackend()], ids=["hf", "torch_dcp"])
def test_optimizer_state_goes_to_the_parameter_of_its_name_when_modules_are_declared_in_another_order(
    tmp_path: Path, backend: Backend
) -> None:
    model, optimizer = saved_trained(backend, tmp_path)
    other = DecEnc()
    running = torch.optim.AdamW(other.parameters(), lr=1e-2)
    backend.load_optimizer(running, None, tmp_path, model=other)
    loaded = exp_avgs(other, running)
    assert all(torch.equal(loaded[name], want) for name, want in exp_avgs(model, optimizer).items())


def test_hf_optimizer_state_goes_to_the_parameter_of_its_name_when_the_optimizer_lists_them_in_another_order(
    tmp_path: Path,
) -> None:
    model, optimizer = saved_trained(HFBackend(), tmp_path)
    torch.manual_seed(5)
    other = EncDec()
    params = list(other.parameters())
    running = torch.optim.AdamW([params[2], params[3], params[0], params[1]], lr=1e-2)
    HFBackend().load_optimizer(running, None, tmp_path, model=other)
    loaded = exp_avgs(other, running)
    assert all(torch.equal(loaded[name], want) for name, want in exp_avgs(model, optimizer).items())


def test_hf_optimizer_groups_saved_in_another_order_go_to_the_group_holding_their_parameters(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = EncDec()
    optimizer = torch.optim.AdamW([{"params": model.enc.parameters(), "weight_decay": 0.0},
                                   {"params": model.dec.parameters(), "weight_decay": 0.5}], lr=1e-2)
    train(model, optimizer)
    HFBackend().save_optimizer(optimizer, None, tmp_path, model=model)
    other = EncDec()
    running = torch.optim.AdamW([{"params": other.dec.parameters(), "weight_decay": 0.1},
                                 {"params": other.enc.parameters(), "weight_decay": 0.1}], lr=1e-2)
    HFBackend().load_optimizer(running, None, tmp_path, model=other)
    assert [g["weight_decay"] for g in running.param_groups] == [0.5, 0.0]
    loaded = exp_avgs(other, running)
    assert all(torch.equal(loaded[name], want) for name, want in exp_avgs(model, optimizer).items())


def test_hf_optimizer_built_over_named_parameters_gets_each_parameter_s_own_state(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = EncDec()
    optimizer = torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    train(model, optimizer)
    HFBackend().save_optimizer(optimizer, None, tmp_path, model=model)
    other = DecEnc()
    running = torch.optim.AdamW(other.named_parameters(), lr=1e-2)
    HFBackend().load_optimizer(running, None, tmp_path, model=other)
    assert running.param_groups[0]["param_names"] == ["dec.weight", "dec.bias", "enc.weight", "enc.bias"]
    loaded = exp_avgs(other, running)
    assert all(torch.equal(loaded[name], want) for name, want in exp_avgs(model, optimizer).items())


def test_hf_optimizer_of_a_parameter_the_model_no_longer_has_is_refused_naming_it(tmp_path: Path) -> None:
    saved_trained(HFBackend(), tmp_path)

    class Renamed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Linear(4, 4)
            self.decoder = nn.Linear(4, 4)

    other = Renamed()
    running = torch.optim.AdamW(other.parameters(), lr=1e-2)
    with pytest.raises(CheckpointError, match=r"optimizer.json.*'dec.weight'"):
        HFBackend().load_optimizer(running, None, tmp_path, model=other)
    assert not running.state


def test_hf_optimizer_saved_without_parameter_names_loads_by_position_with_a_warning(tmp_path: Path) -> None:
    model, optimizer = saved_trained(HFBackend(), tmp_path)
    path = tmp_path / "optimizer.json"
    doc = json.loads(path.read_text())
    for key in ("param_names", "optimizer_class", "lr_scheduler_class"):
        doc.pop(key, None)
    path.write_text(json.dumps(doc))
    torch.manual_seed(0)
    other = EncDec()
    running = torch.optim.AdamW(other.parameters(), lr=1e-2)
    with capture_logs() as logs:
        HFBackend().load_optimizer(running, None, tmp_path, model=other)
    assert any(log["event"] == "checkpoint.optimizer.loaded_by_position" for log in logs)
    loaded = exp_avgs(other, running)
    assert all(torch.equal(loaded[name], want) for name, want in exp_avgs(model, optimizer).items())


def test_torch_dcp_save_before_the_first_step_leaves_the_optimizer_unstepped(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = EncDec()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-1)
    before = [p.detach().clone() for p in model.parameters()]
    TorchDCPBackend().save_optimizer(optimizer, None, tmp_path, model=model)
    assert not optimizer.state
    assert all(p.grad is None and torch.equal(p, b) for p, b in zip(model.parameters(), before))
    other = EncDec()
    running = torch.optim.AdamW(other.parameters(), lr=1e-1)
    TorchDCPBackend().load_optimizer(running, None, tmp_path, model=other)
    assert not running.state


def test_torch_dcp_refused_load_leaves_a_fresh_optimizer_without_state(tmp_path: Path) -> None:
    saved_trained(TorchDCPBackend(), tmp_path)
    other = EncDec()
    running = torch.optim.AdamW(other.dec.parameters(), lr=1e-2)  # the restarted job freezes enc
    with pytest.raises(CheckpointError, match="enc"):
        TorchDCPBackend().load_optimizer(running, None, tmp_path, model=other)
    assert not running.state
    assert all(p.grad is None for p in other.parameters())


def test_torch_dcp_load_into_a_fresh_optimizer_never_steps_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer = saved_trained(TorchDCPBackend(), tmp_path)
    other = EncDec()
    running = torch.optim.AdamW(other.parameters(), lr=1e-2)
    monkeypatch.setattr(running, "step", lambda *a, **k: pytest.fail("the running optimizer was stepped"))
    TorchDCPBackend().load_optimizer(running, None, tmp_path, model=other)
    loaded = exp_avgs(other, running)
    assert all(torch.equal(loaded[name], want) for name, want in exp_avgs(model, optimizer).items())


@pytest.mark.parametrize("backend", [HFBackend(), TorchDCPBackend()], ids=["hf", "torch_dcp"])
def test_adamw_state_resumed_into_adam_is_refused_naming_both_classes(tmp_path: Path, backend: Backend) -> None:
    saved_trained(backend, tmp_path, weight_decay=0.1)
    other = EncDec()
    running = torch.optim.Adam(other.parameters(), lr=1e-2, weight_decay=0.1)
    with pytest.raises(CheckpointError, match=r"torch\.optim\.adamw\.AdamW.*torch\.optim\.adam\.Adam\b"):
        backend.load_optimizer(running, None, tmp_path, model=other)
    assert running.param_groups[0]["decoupled_weight_decay"] is False


@pytest.mark.parametrize("backend", [HFBackend(), TorchDCPBackend()], ids=["hf", "torch_dcp"])
def test_a_scheduler_of_another_class_is_refused_naming_both_classes(tmp_path: Path, backend: Backend) -> None:
    torch.manual_seed(0)
    model = EncDec()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    train(model, optimizer)
    backend.save_optimizer(optimizer, scheduler, tmp_path, model=model)
    other = EncDec()
    running = torch.optim.AdamW(other.parameters(), lr=1e-2)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(running, T_max=10)
    with pytest.raises(CheckpointError, match=r"StepLR.*CosineAnnealingLR"):
        backend.load_optimizer(running, cosine, tmp_path, model=other)
    assert not hasattr(cosine, "step_size")


def test_hf_tensor_of_another_shape_is_reported_once_not_also_as_missing(tmp_path: Path) -> None:
    write_file(tmp_path / "model.safetensors", {"weight": torch.zeros(4, 4), "bias": torch.zeros(4)})
    with pytest.raises(CheckpointError) as info:
        HFBackend().load_model(nn.Linear(4, 5), tmp_path)
    message = str(info.value)
    assert "tensor 'weight' has shape [4, 4], the model expects [5, 4]" in message
    assert "missing" not in message


def test_torch_dcp_state_saved_before_the_first_step_empties_a_trained_optimizer_on_load(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = EncDec()
    TorchDCPBackend().save_optimizer(torch.optim.AdamW(model.parameters(), lr=0.5), None, tmp_path, model=model)
    running = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, running)
    TorchDCPBackend().load_optimizer(running, None, tmp_path, model=model)
    assert not running.state
    assert running.param_groups[0]["lr"] == 0.5


def _edit_state(path: Path, name: str, edit: Any) -> None:
    doc = json.loads(path.read_text())
    edit(doc["optimizer"]["state"][name])
    path.write_text(json.dumps(doc))


def test_torch_dcp_state_lacking_a_key_the_step_reads_is_refused_by_a_fresh_optimizer(tmp_path: Path) -> None:
    saved_trained(TorchDCPBackend(), tmp_path)
    _edit_state(tmp_path / "optimizer.json", "enc.weight", lambda entry: entry.pop("exp_avg_sq"))
    other = EncDec()
    running = torch.optim.AdamW(other.parameters(), lr=1e-2)
    with pytest.raises(CheckpointError, match=r"state of 'enc.weight' lacks \['exp_avg_sq'\]"):
        TorchDCPBackend().load_optimizer(running, None, tmp_path, model=other)
    assert not running.state


def test_torch_dcp_buffer_of_another_shape_than_its_parameter_is_refused_by_a_fresh_optimizer(tmp_path: Path) -> None:
    saved_trained(TorchDCPBackend(), tmp_path)

    class Wider(EncDec):
        def __init__(self) -> None:
            nn.Module.__init__(self)
            self.enc = nn.Linear(4, 6)
            self.dec = nn.Linear(6, 4)

    other = Wider()
    running = torch.optim.AdamW(other.parameters(), lr=1e-2)
    with pytest.raises(CheckpointError, match=r"'optimizer.state.enc.weight.exp_avg' has shape \[4, 4\], the model "
                                              r"expects \[6, 4\]"):
        TorchDCPBackend().load_optimizer(running, None, tmp_path, model=other)
    assert not running.state


def test_an_optimizer_class_moved_to_another_module_is_still_taken_for_the_same_class(tmp_path: Path) -> None:
    model, _ = saved_trained(HFBackend(), tmp_path)
    path = tmp_path / "optimizer.json"
    doc = json.loads(path.read_text())
    doc["optimizer_class"] = "__main__.AdamW"
    path.write_text(json.dumps(doc))
    HFBackend().load_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), None, tmp_path, model=model)


def test_hf_parameter_moved_to_another_param_group_is_refused_naming_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = EncDec()
    optimizer = torch.optim.AdamW([{"params": model.enc.parameters()}, {"params": model.dec.parameters()}], lr=1e-2)
    train(model, optimizer)
    HFBackend().save_optimizer(optimizer, None, tmp_path, model=model)
    other = EncDec()
    running = torch.optim.AdamW([{"params": [other.enc.weight, other.dec.bias]},
                                 {"params": [other.dec.weight, other.enc.bias]}], lr=1e-2)
    needle = r"param_groups\[0\] of the running optimizer holds 'dec.bias', which was saved in another group"
    with pytest.raises(CheckpointError, match=needle):
        HFBackend().load_optimizer(running, None, tmp_path, model=other)
    assert not running.state


def test_hf_param_names_that_are_not_one_name_per_saved_parameter_are_refused(tmp_path: Path) -> None:
    model, _ = saved_trained(HFBackend(), tmp_path)
    path = tmp_path / "optimizer.json"
    doc = json.loads(path.read_text())
    doc["param_names"] = ["enc.weight", "enc.weight", "dec.weight", "dec.bias"]
    path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="param_names must list 4 distinct parameter names"):
        HFBackend().load_optimizer(torch.optim.AdamW(model.parameters()), None, tmp_path, model=model)


def test_a_model_whose_named_parameters_takes_no_arguments_still_gets_its_optimizer_s_names_recorded() -> None:
    """A model that is no nn.Module (MegatronModel's kind) may name its parameters without
    `remove_duplicate`: the names are still recorded, from what it gives."""
    from lifecycle.optim_identity import parameter_names

    class Plain:
        def __init__(self) -> None:
            self.inner = torch.nn.Linear(2, 2)

        def named_parameters(self) -> Any:
            return self.inner.named_parameters()

    model = Plain()
    optimizer = torch.optim.AdamW(model.inner.parameters())
    assert parameter_names(model, optimizer) == ["weight", "bias"]
