"""The stand-ins an async save's host copy puts where the worker's own objects were: a module,
an optimizer and any other state frozen at save time, so the backends read what stood then
while training goes on (`lifecycle.async_save.HostCopier` builds them)."""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, TypeVar

import torch
from torch import nn

from lifecycle.errors import CheckpointError
from lifecycle.optim_identity import STANDS_FOR, class_name

_T = TypeVar("_T")


def keeps_its_own_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `param_groups` and `state` are the instance's own attributes, which a copy of its class
    can hold too; a wrapper's (accelerate's `AcceleratedOptimizer`, torch's `PostLocalSGDOptimizer`)
    forward to the optimizer it wraps, so setting them on a copy would set that live one's."""
    cls = type(optimizer)
    own = vars(optimizer) if hasattr(optimizer, "__dict__") else {}
    return cls.__setattr__ is object.__setattr__ and all(
        name in own and not hasattr(inspect.getattr_static(cls, name, None), "__set__")
        for name in ("param_groups", "state"))


class FrozenOptimizer(torch.optim.Optimizer):
    """A host copy of a wrapped optimizer: what the formats read (`param_groups`, `state` and
    `state_dict()`, the wrapper's own as it stood at save time), of this class, never the
    worker's, so nothing set on it reaches the live optimizer."""

    def __init__(self, groups: list[dict[str, Any]], state: defaultdict[Any, Any], saved: dict[str, Any],
                 defaults: dict[str, Any]) -> None:
        # Not `Optimizer.__init__`: it would rebuild the groups the live optimizer already checked.
        self.param_groups, self.state, self.defaults, self._saved = groups, state, defaults, saved

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return self._saved

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Only torch's state-dict helper steps a copy, to create the state of an optimizer never
        stepped; the algorithm is the wrapped optimizer's, which this copy does not have."""
        raise CheckpointError(f"async save of a {type(self).__name__} that has no state yet: its copy cannot step to "
                              "create it (torch_dcp does); save after the first step, or set "
                              "checkpoint.save.async to false")


def standing_for(copy: _T, live: Any) -> _T:
    """`copy`, marked with the class of `live` (`optim_identity.STANDS_FOR`): the formats record the
    optimizer's and lr scheduler's class, and a resume compares it with the running one's."""
    setattr(copy, STANDS_FOR, class_name(live))
    return copy


class StateOnly:
    """Stands in for an object whose state is all a backend reads: `state_dict()` returns it."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def state_dict(self) -> Any:
        return self._state


class FrozenModule(nn.Module):
    """A host copy of a module: the same parameter and buffer names, tensors frozen at save time.

    `state_dict()` returns the copied state dict itself, so entries that are not tensors
    (extra states) and the order of names survive exactly.
    """

    def __init__(self, state: dict[str, Any], params: Mapping[str, bool]) -> None:
        """`params`: which names are parameters, and whether each requires grad."""
        super().__init__()
        self._frozen: dict[str, Any] = state
        self._shared: dict[tuple[Any, ...], nn.Parameter] = {}
        """One Parameter per copied view: tied weights stay one parameter, as in the live module,
        so name-keyed optimizer state (torch_dcp) finds each parameter under its first name."""
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                self._attach(name, value, params.get(name))

    def _parameter(self, value: torch.Tensor, grad: bool) -> nn.Parameter:
        if isinstance(value, nn.Parameter):
            return value
        if value.numel() == 0:  # empty tensors share data_ptr 0 without being tied
            return nn.Parameter(value, requires_grad=grad)
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.stride(),
               value.dtype)
        if key not in self._shared:
            self._shared[key] = nn.Parameter(value, requires_grad=grad)
        return self._shared[key]

    def _attach(self, name: str, value: torch.Tensor, grad: bool | None) -> None:
        *path, leaf = name.split(".")
        owner: nn.Module = self
        for part in path:
            child = owner._modules.get(part)
            if child is None:
                child = nn.Module()
                owner.add_module(part, child)
            owner = child
        if grad is not None:
            owner.register_parameter(leaf, self._parameter(value, grad))
        else:
            owner.register_buffer(leaf, value)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return dict(self._frozen)
