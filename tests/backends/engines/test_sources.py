"""`sources.state_weights`: what a sync sends of a module, each tied tensor once. Tied means one
place (device, dtype, address, shape, strides); an empty tensor, a view of another shape at the
same address, and what is not plain memory are weights of their own."""

from __future__ import annotations

import warnings

import torch

from backends.engines.sources import state_weights


class _Holder(torch.nn.Module):
    def __init__(self, **tensors: torch.Tensor) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            if isinstance(tensor, torch.nn.Parameter):
                self.register_parameter(name, tensor)
            else:
                self.register_buffer(name, tensor)


def _names(model: torch.nn.Module) -> list[str]:
    return [name for name, _ in state_weights(model)]


def test_a_tied_parameter_goes_once_under_its_first_name() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False))
    model[1].weight = model[0].weight
    assert _names(model) == ["0.weight"]


def test_views_of_one_storage_at_other_places_or_shapes_are_weights_of_their_own() -> None:
    base = torch.arange(16.0)
    model = _Holder(a=base[:8], b=base[8:], c=base[:8].view(2, 4), d=base[:8].view(4, 2).t(), e=base[:8])
    assert _names(model) == ["a", "b", "c", "d"]


def test_empty_tensors_are_never_taken_for_tied_ones() -> None:
    base = torch.zeros(4)
    model = _Holder(a=torch.empty(0), b=torch.empty(0), c=base[2:2], d=base[2:2], e=torch.empty(0, 3))
    assert _names(model) == ["a", "b", "c", "d", "e"]


def test_another_dtype_at_the_same_address_is_a_weight_of_its_own() -> None:
    base = torch.zeros(4)
    model = _Holder(a=base, b=base.view(torch.int32))
    assert _names(model) == ["a", "b"]


def test_a_parameter_subclass_tied_twice_goes_once() -> None:
    class Weight(torch.nn.Parameter):
        pass

    weight = Weight(torch.randn(3))
    model = _Holder(a=weight)
    model.register_parameter("b", weight)
    assert _names(model) == ["a"]


def test_tensors_that_are_not_plain_memory_each_go_as_they_are_for_the_sender_to_refuse() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sparse = torch.eye(3).to_sparse()
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    meta = torch.empty(3, device="meta")
    model = _Holder(a=sparse, b=meta, c=torch.ones(2))
    model.register_buffer("d", meta)
    model.register_buffer("e", nested)
    model.register_buffer("f", nested)  # one address twice, but no place to compare: each goes
    got = list(state_weights(model))
    assert [name for name, _ in got] == ["a", "b", "c", "d", "e", "f"]
    assert got[0][1] is not None and got[1][1].device.type == "meta"


def test_a_nested_tensor_registered_twice_goes_twice_without_raising() -> None:
    """Its address can be read, so it shares one with itself, but it has no place to compare."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    model = _Holder(a=nested, b=torch.ones(2))
    model.register_buffer("c", nested)
    assert _names(model) == ["a", "b", "c"]
