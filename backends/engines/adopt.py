"""A rollout that takes received tensors as its weights instead of copying them (`apply: flip`).

With shm's `apply: flip` a sync hands out views into the shared weight set it filled, valid
until a later sync has completed into the other set (see `Incoming`). `adopt_weights` points a
torch module's parameters and buffers at those views: no copy, and every one or none, so a
sync that fails anywhere (a bad bucket, a name the model lacks, a shape that differs) leaves
the module on the weights it had.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from backends.engines.base import Incoming
from backends.engines.slots import refilled
from lifecycle.errors import EngineError


_UNKEPT = ("which a rollout cannot keep as its weights; set engine.apply to 'flip' (on both sides for shm) or copy "
           "them in load_weights; nothing was adopted")


def adopt_weights(module: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                  complete: bool = True) -> int:
    """Rebind each named parameter's (or buffer's) `.data` to the tensor received for it, once
    every tensor has arrived and matches; returns how many were adopted.

    The tensors must have the module's shapes, dtypes and devices: a rollout that wants another
    dtype asks the sender for it (`engine.rollout_dtype`). A tensor not in the module is an
    `EngineError` naming it; so is a tied tensor sent under two names (two values for one
    tensor), a view of a buffer the engine refills (an atomic or streamed sync's, however the
    tensors were handed on: renamed by a generator, say), and, with `complete` (the default),
    a parameter or persistent buffer the sync left out (a tied one counts as sent under any of
    its names): one left out would keep viewing the set it was adopted from, which a later
    flip sync overwrites. Pass `complete=False`
    only for weights not served from a sync. Autograd and a parameter's identity are
    untouched (only `.data` changes).
    """
    if isinstance(named_tensors, Incoming):
        if not named_tensors.adoptable:  # views the engine writes over next (or the sender's own tensors)
            raise EngineError(f"adopt_weights: this sync hands out tensors the engine reuses, {_UNKEPT}")
        named_tensors.adopted = False  # until every tensor is rebound: a flip engine then counts its set served
    owned: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    owned.update(module.named_buffers(remove_duplicate=False))
    pending: dict[int, tuple[str, torch.Tensor, torch.Tensor]] = {}  # by the rollout's tensor: one value each
    for name, tensor in named_tensors:
        mine = owned.get(name)
        if mine is None:
            raise EngineError(f"adopt_weights: the sync sends {name!r}, which the rollout's "
                              f"{type(module).__name__} has no parameter or buffer of; nothing was adopted")
        if (first := pending.get(id(mine))) is not None:
            raise EngineError(f"adopt_weights: the sync sends {first[0]!r} and {name!r}, which the rollout ties (one "
                              "tensor under two names): one of them would silently win; nothing was adopted")
        if (mine.shape, mine.dtype, mine.device) != (tensor.shape, tensor.dtype, tensor.device):
            raise EngineError(f"adopt_weights: {name!r} arrives as {tuple(tensor.shape)} {tensor.dtype} on "
                              f"{tensor.device}; the rollout holds {tuple(mine.shape)} {mine.dtype} on {mine.device}; "
                              "nothing was adopted")
        if refilled(tensor):
            raise EngineError(f"adopt_weights: {name!r} arrives as a view of a buffer the engine refills, {_UNKEPT}")
        pending[id(mine)] = (name, mine, tensor)
    if complete:
        served = {name: tensor for name, tensor in module.state_dict(keep_vars=True).items()
                  if name in owned}  # parameters and persistent buffers (not a state dict's extra state)
        left = [name for name, tensor in served.items() if id(tensor) not in pending]
        if left:
            shown = ", ".join(repr(name) for name in left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
            raise EngineError(f"adopt_weights: the sync leaves out {len(left)} weight(s) of the rollout's "
                              f"{type(module).__name__}: {shown}; nothing was adopted (complete=False adopts a part)")
    for _, mine, tensor in pending.values():
        mine.data = tensor
    if isinstance(named_tensors, Incoming):
        named_tensors.adopted = True
    return len(pending)


__all__ = ["adopt_weights"]
