"""What names a sync's or a layout's tensors: a model, (name, tensor) pairs, or a state dict."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from lifecycle.errors import EngineError


class Parametrized(Protocol):
    """A model that names its parameters and buffers as an `nn.Module` does (`MegatronModel`)."""

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]: ...

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]: ...


Model = nn.Module | Parametrized
Named = Model | Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
"""A model (its parameters, tied names included), `named_parameters()` pairs, or a state dict."""


def is_model(value: object) -> bool:
    """Whether `value` is an `nn.Module`, or names its parameters and buffers as one does."""
    return isinstance(value, nn.Module) or all(callable(getattr(value, method, None))
                                               for method in ("named_parameters", "named_buffers"))


def named_pairs(named: Named) -> Iterable[tuple[str, Any]]:
    """(name, tensor) pairs of a mapping, a model (every name of a tied parameter), or pairs as
    given; `EngineError` naming the type of anything else, or the first item that is no pair."""
    if isinstance(named, Mapping):
        return named.items()
    if is_model(named):
        return named.named_parameters(remove_duplicate=False)  # type: ignore[union-attr]
    if isinstance(named, (str, bytes, torch.Tensor)) or not isinstance(named, Iterable):
        raise EngineError(f"expected a model, a state dict or (name, tensor) pairs, got a {type(named).__name__}")
    return _pairs(named)


def _pairs(items: Iterable[Any]) -> Iterator[tuple[str, Any]]:
    for i, item in enumerate(items):
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise EngineError(f"item {i} is a {type(item).__name__}, not a (name, tensor) pair")
        yield item[0], item[1]


__all__ = ["Model", "Named", "Parametrized", "is_model", "named_pairs"]
