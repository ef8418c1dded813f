"""Hostile optimizer and lr-scheduler states that loaded and broke the first step: nested
scheduler states, floats where the scheduler keeps integers, integer step tensors, and DCP
metadata whose sizes a fresh optimizer's template would have been built from."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import TensorStorageMetadata
from torch.distributed.checkpoint.metadata import TensorProperties
from torch.optim import lr_scheduler as sched

from backends.torch_dcp import METADATA, TorchDCPBackend
from lifecycle.errors import CheckpointError
from lifecycle.optim_state import check_optimizer_state, check_scheduler_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled", "ignore::UserWarning")
WHERE = "ckpt/optimizer.json"


class Warmup:
    """A LambdaLR lambda that is an object: LambdaLR saves and restores its `__dict__`."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __call__(self, epoch: int) -> float:
        return min(1.0, (epoch + 1) / self.steps)


def stepped(make: Any, steps: int = 3, epochs: list[float] | None = None) -> tuple[Any, dict[str, Any]]:
    """A fresh scheduler from `make`, and the JSON round trip of one stepped `steps` times."""
    def build() -> Any:
        torch.manual_seed(0)
        return make(torch.optim.AdamW(nn.Linear(4, 3).parameters(), lr=0.1))
    trained = build()
    for epoch in epochs or [None] * steps:
        trained.optimizer.step()
        trained.step() if epoch is None else trained.step(epoch)
    return build(), json.loads(json.dumps(trained.state_dict()))


def sequential(o: torch.optim.Optimizer) -> Any:
    return sched.SequentialLR(o, [sched.LinearLR(o, 0.5, total_iters=2), sched.StepLR(o, 1, 0.5)], milestones=[2])


def refused(scheduler: Any, saved: dict[str, Any], needle: str) -> None:
    with pytest.raises(CheckpointError, match=needle) as info:
        check_scheduler_state(scheduler, saved, WHERE)
    assert WHERE in str(info.value)


def test_sequential_lr_nested_state_holding_an_optimizer_key_is_refused_naming_its_position() -> None:
    scheduler, saved = stepped(sequential)
    saved["_schedulers"][1]["optimizer"] = 0
    refused(scheduler, saved, r"lr_scheduler\._schedulers\[1\] holds \['optimizer'\]")


def test_sequential_lr_nested_state_with_a_string_gamma_is_refused_naming_the_key() -> None:
    scheduler, saved = stepped(sequential)
    saved["_schedulers"][1]["gamma"] = "half"
    refused(scheduler, saved, r"lr_scheduler\._schedulers\[1\]\.gamma: must be a finite number")


def test_lambda_lr_object_state_with_a_string_where_an_int_was_is_refused() -> None:
    scheduler, saved = stepped(lambda o: sched.LambdaLR(o, Warmup(10)))
    saved["lr_lambdas"][0]["steps"] = "10"
    refused(scheduler, saved, r"lr_scheduler\.lr_lambdas\[0\]\.steps: must be a finite number")


def test_lambda_lr_object_state_shadowing_a_method_is_refused() -> None:
    scheduler, saved = stepped(lambda o: sched.LambdaLR(o, Warmup(10)))
    saved["lr_lambdas"][0]["__call__"] = 1
    refused(scheduler, saved, r"lr_scheduler\.lr_lambdas\[0\] holds \['__call__'\]")


def test_nested_scheduler_and_lambda_states_written_by_the_current_code_still_load() -> None:
    for make in (sequential, lambda o: sched.LambdaLR(o, Warmup(10)), lambda o: sched.LambdaLR(o, lambda e: 1.0),
                 lambda o: sched.ChainedScheduler([sched.ConstantLR(o), sched.ExponentialLR(o, 0.9)])):
        scheduler, saved = stepped(make)
        check_scheduler_state(scheduler, saved, WHERE)
        scheduler.load_state_dict(saved)
        scheduler.optimizer.step()
        scheduler.step()


def test_lambda_lr_state_of_a_plain_function_still_loads_into_a_callable_object() -> None:
    _, saved = stepped(lambda o: sched.LambdaLR(o, lambda e: 1.0))
    scheduler, _ = stepped(lambda o: sched.LambdaLR(o, Warmup(10)))
    check_scheduler_state(scheduler, saved, WHERE)


def test_sequential_lr_nested_state_that_is_none_is_refused() -> None:
    scheduler, saved = stepped(sequential)
    saved["_schedulers"][0] = None
    refused(scheduler, saved, r"lr_scheduler\._schedulers\[0\] must be a mapping, found None")


@pytest.mark.parametrize(("make", "key", "value"), [
    (lambda o: sched.StepLR(o, 1, 0.5), "last_epoch", 2.5),
    (lambda o: sched.StepLR(o, 2, 0.5), "step_size", -0.0),
    (lambda o: sched.CosineAnnealingWarmRestarts(o, 3), "T_i", -0.0),
    (lambda o: sched.OneCycleLR(o, 1.0, total_steps=100), "total_steps", 2.5),
])
def test_a_float_where_the_running_scheduler_keeps_an_integer_is_refused(make: Any, key: str, value: float) -> None:
    scheduler, saved = stepped(make)
    saved[key] = value
    refused(scheduler, saved, rf"lr_scheduler\.{key}: must be an integer like the running")


def test_a_bool_where_the_running_scheduler_keeps_an_integer_is_refused() -> None:
    scheduler, saved = stepped(lambda o: sched.StepLR(o, 2, 0.5))
    saved["step_size"] = True
    refused(scheduler, saved, r"lr_scheduler\.step_size: must be a finite number")


def test_warm_restarts_stepped_by_fractional_epochs_still_loads_its_fractional_t_cur() -> None:
    scheduler, saved = stepped(lambda o: sched.CosineAnnealingWarmRestarts(o, 3), epochs=[0.5, 1.2, 1.9])
    assert type(saved["T_cur"]) is float
    check_scheduler_state(scheduler, saved, WHERE)


def trained_adam() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize(("dtype", "value"), [(torch.uint8, 255), (torch.int8, 127), (torch.int32, 5)])
def test_an_integer_adam_step_tensor_is_refused_naming_its_dtype(dtype: torch.dtype, value: int) -> None:
    _, optimizer = trained_adam()
    saved = optimizer.state_dict()
    for entry in saved["state"].values():
        entry["step"] = torch.tensor(value, dtype=dtype)
    fresh = torch.optim.AdamW(nn.Linear(4, 3).parameters(), lr=0.01)
    with pytest.raises(CheckpointError, match=rf"key 'step': is a tensor of dtype {dtype}") as info:
        check_optimizer_state(fresh, saved, Path(WHERE))
    assert WHERE in str(info.value)


def test_a_float_step_tensor_and_an_integer_one_the_running_optimizer_keeps_still_load() -> None:
    _, optimizer = trained_adam()
    fresh = torch.optim.AdamW(nn.Linear(4, 3).parameters(), lr=0.01)
    check_optimizer_state(fresh, optimizer.state_dict(), Path(WHERE))
    for entry in optimizer.state.values():
        entry["step"] = torch.tensor(7, dtype=torch.int64)
    check_optimizer_state(optimizer, optimizer.state_dict(), Path(WHERE))


def test_dcp_integer_step_tensor_is_refused_by_a_fresh_optimizer_naming_its_dtype(tmp_path: Path) -> None:
    dcp_saved(tmp_path, {"step": torch.tensor(255, dtype=torch.uint8)})
    with pytest.raises(CheckpointError, match=r"optimizer\.state\.weight\.step: is a tensor of dtype torch\.uint8"):
        load_fresh(tmp_path)


def dcp_saved(folder: Path, extra: dict[str, torch.Tensor] | None = None) -> None:
    """A torch_dcp optimizer checkpoint of a stepped AdamW, with `extra` added to the state of
    its parameter `weight`."""
    model, optimizer = trained_adam()
    optimizer.state[model.weight].update(extra or {})
    TorchDCPBackend().save_optimizer(optimizer, None, folder, model=model)


def load_fresh(folder: Path) -> None:
    fresh = nn.Linear(4, 3)
    TorchDCPBackend().load_optimizer(torch.optim.AdamW(fresh.parameters()), None, folder, model=fresh)


def add_metadata_entry(folder: Path, key: str, size: tuple[int, ...]) -> None:
    metadata = pickle.loads((folder / METADATA).read_bytes())
    metadata.state_dict_metadata[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                                              torch.Size(size), [])
    (folder / METADATA).write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("key", ["optimizer.state.weight.bogus", "optimizer.state.bogus"])
def test_dcp_entry_whose_shape_overflows_strides_is_refused_by_a_fresh_optimizer_naming_it(
        tmp_path: Path, key: str) -> None:
    dcp_saved(tmp_path)
    add_metadata_entry(tmp_path, key, (0, 2**40, 2**40))
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")) as info:
        load_fresh(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_dcp_state_tensor_larger_than_its_parameter_group_is_refused_before_it_is_built(tmp_path: Path) -> None:
    dcp_saved(tmp_path, {"foo": torch.zeros(16)})  # the Linear(4, 3)'s one group holds 15 elements
    with pytest.raises(CheckpointError, match=r"entry 'optimizer\.state\.weight\.foo' of \.metadata has shape "
                                              r"\[16\], more elements than the group of parameter 'weight'") as info:
        load_fresh(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_dcp_state_tensor_flat_over_its_parameter_group_still_loads_into_a_fresh_optimizer(tmp_path: Path) -> None:
    dcp_saved(tmp_path, {"foo": torch.arange(15.0)})
    fresh = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(fresh.parameters())
    TorchDCPBackend().load_optimizer(optimizer, None, tmp_path, model=fresh)
    assert torch.equal(optimizer.state[fresh.weight]["foo"], torch.arange(15.0))
