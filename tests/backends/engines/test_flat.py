"""flatten_parameters and contiguous_layout: parameters rehomed in place into one aligned storage
per dtype, training and checkpoint round trips that keep them there, and layouts found (or
refused) by storage arithmetic."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from backends.base import FORMATS, PLAIN_TORCH, format_capabilities
from backends.engines.flat import FlatLayout, FlattenRefused, contiguous_layout, flatten_parameters
from backends.engines.plan import ALIGN
from lifecycle import Lifecycle
from lifecycle.errors import EngineError
from tests.backends.megatron_util import TINY_QWEN2

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.transformers, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

ADAMW = [{}, {"foreach": True}, {"foreach": False}, {"fused": True}]
"""AdamW's three implementations on the CPU: single-tensor (the CPU default), foreach, fused."""


def qwen2(seed: int = 0) -> nn.Module:
    """A tiny Qwen2 with tied embeddings (lm_head.weight is embed_tokens.weight)."""
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY_QWEN2, tie_word_embeddings=True))


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, TINY_QWEN2["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(seed))


def step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    batch = tokens(seed)
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def differing(model: nn.Module, expected: dict[str, torch.Tensor]) -> list[str]:
    """Names whose parameter differs from `expected` in any bit; empty when identical."""
    got = dict(model.named_parameters())
    return [n for n in expected if n not in got or not torch.equal(got[n].detach(), expected[n])] + \
        [n for n in got if n not in expected]


def storages(model: nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def views_of(base: torch.Tensor, shapes: list[tuple[int, ...]], offsets: list[int]) -> nn.Module:
    """A module whose parameters are views of `base` (not a parameter) at element offsets."""
    module = nn.Module()
    for i, (shape, at) in enumerate(zip(shapes, offsets)):
        numel = 1
        for size in shape:
            numel *= size
        module.register_parameter(f"p{i}", nn.Parameter(base[at:at + numel].view(shape)))
    return module


# ---------------------------------------------------------------- flattening


def test_flattening_keeps_names_objects_values_and_requires_grad_in_one_aligned_storage() -> None:
    model = qwen2()
    model.model.norm.weight.requires_grad_(False)
    before = list(model.named_parameters(remove_duplicate=False))
    values, grads = snapshot(model), {n: p.requires_grad for n, p in before}

    layout = flatten_parameters(model)

    after = list(model.named_parameters(remove_duplicate=False))
    assert [n for n, _ in after] == [n for n, _ in before]
    assert all(a is b for (_, a), (_, b) in zip(after, before))
    assert differing(model, values) == []
    assert {n: p.requires_grad for n, p in after} == grads
    assert all(type(p) is nn.Parameter and p.is_contiguous() for _, p in after)
    (group,) = layout.groups
    assert (group.dtype, group.device, group.aligned) == (torch.float32, torch.device("cpu"), True)
    assert storages(model) == {group.flat.untyped_storage().data_ptr()}
    assert all(slot.offset % ALIGN == 0 for slot in group.slots)
    assert [slot.name for slot in group.slots] == [n for n, _ in model.named_parameters()]
    for slot in group.slots:
        param = model.get_parameter(slot.name)
        assert param.data_ptr() == group.flat.data_ptr() + slot.offset and param.shape == slot.shape
    covered = torch.zeros(group.nbytes, dtype=torch.bool)
    for slot in group.slots:
        covered[slot.offset:slot.end] = True
    assert not group.data[~covered].any(), "padding between slots is zeroed"


def test_tied_weights_occupy_one_slot_under_both_names() -> None:
    model = qwen2()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    layout = flatten_parameters(model)
    group, slot = layout.find("lm_head.weight")
    assert layout.find("model.embed_tokens.weight") == (group, slot)
    assert (slot.name, slot.aliases) == ("model.embed_tokens.weight", ("lm_head.weight",))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(s.nbytes for s in group.slots) == sum(p.numel() * 4 for p in model.parameters())


def test_each_dtype_gets_its_own_storage_in_order_of_first_appearance() -> None:
    model = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 7).to(torch.bfloat16), nn.Linear(7, 2))
    model.register_parameter("empty", nn.Parameter(torch.empty(0, 4)))
    values = snapshot(model)
    layout = flatten_parameters(model)
    assert [(g.dtype, [s.name for s in g.slots]) for g in layout.groups] == [
        (torch.float32, ["empty", "0.weight", "0.bias", "2.weight", "2.bias"]),
        (torch.bfloat16, ["1.weight", "1.bias"]),
    ]
    for group in layout.groups:
        assert group.aligned
        assert {p.untyped_storage().data_ptr() for p in model.parameters() if p.dtype == group.dtype and p.numel()} \
            == {group.flat.untyped_storage().data_ptr()}
    assert differing(model, values) == []
    assert flatten_parameters(model) == layout


def test_flattening_a_flat_model_copies_nothing_and_returns_an_equal_layout() -> None:
    model = qwen2()
    first = flatten_parameters(model)
    pointers = [p.data_ptr() for p in model.parameters()]
    again = flatten_parameters(model)
    assert again == first
    assert [p.data_ptr() for p in model.parameters()] == pointers
    assert contiguous_layout(model) == first


def test_flattened_model_still_flows_gradients_into_param_grad() -> None:
    model = qwen2()
    layout = flatten_parameters(model)
    batch = tokens(0)
    model(input_ids=batch, labels=batch).loss.backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    assert layout.describes(model)


# ---------------------------------------------------------------- training


@pytest.mark.parametrize("optimizer_first", [False, True], ids=["optimizer-after", "optimizer-before"])
@pytest.mark.parametrize("kwargs", ADAMW, ids=["default", "foreach", "for-loop", "fused"])
def test_flattened_model_trains_to_the_same_bits_as_an_unflattened_copy(
    kwargs: dict[str, Any], optimizer_first: bool,
) -> None:
    plain, flat = qwen2(), qwen2()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, **kwargs)
    if optimizer_first:
        flat_opt = torch.optim.AdamW(flat.parameters(), lr=1e-2, weight_decay=0.1, **kwargs)
        layout = flatten_parameters(flat)
    else:
        layout = flatten_parameters(flat)
        flat_opt = torch.optim.AdamW(flat.parameters(), lr=1e-2, weight_decay=0.1, **kwargs)
    start = snapshot(flat)
    for seed in range(4):
        step(plain, plain_opt, seed)
        step(flat, flat_opt, seed)
    assert differing(flat, snapshot(plain)) == []
    assert differing(flat, start) != [], "the steps moved the weights"
    assert layout.describes(flat) and contiguous_layout(flat) == layout
    assert all(torch.equal(flat_opt.state[f]["exp_avg"], plain_opt.state[p]["exp_avg"])
               for f, p in zip(flat.parameters(), plain.parameters()))


# ---------------------------------------------------------------- checkpoints


def plain_torch_formats() -> list[str]:
    return [name for name in FORMATS.builtin_names() if format_capabilities(name).family == PLAIN_TORCH]


def test_the_round_trip_below_covers_every_plain_torch_format() -> None:
    assert sorted(plain_torch_formats()) == ["hf", "torch_dcp"]


@pytest.mark.parametrize("fmt", ["hf", "torch_dcp"])
def test_flattened_model_saves_and_resumes_in_place_bit_identical(tmp_path: Path, fmt: str) -> None:
    config = {"checkpoint": {"root": str(tmp_path), "save": {"format": fmt}}}
    model = qwen2(seed=0)
    flatten_parameters(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    lc = Lifecycle(config, role="actor", model=model, optimizer=optimizer)
    lc.init_load()
    for seed in range(2):
        with lc.train_step(seed + 1):
            step(model, optimizer, seed)
    lc.save(2)
    lc.close()
    saved = snapshot(model)

    fresh = qwen2(seed=1)
    layout = flatten_parameters(fresh)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1)
    lc2 = Lifecycle(config, role="actor", model=fresh, optimizer=fresh_opt)
    assert lc2.resume() == 2
    assert layout.describes(fresh), f"{fmt} load moved a parameter out of the flat storage"
    assert contiguous_layout(fresh) == layout
    assert differing(fresh, saved) == []
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert fresh_opt.state[a].keys() == optimizer.state[b].keys()
        assert all(torch.equal(fresh_opt.state[a][k], optimizer.state[b][k]) for k in optimizer.state[b])
    with lc2.train_step(3):
        step(fresh, fresh_opt, seed=7)
    step(model, optimizer, seed=7)
    assert differing(fresh, snapshot(model)) == []
    assert layout.describes(fresh)
    lc2.close()


# ---------------------------------------------------------------- detection


def test_replacing_a_parameters_data_makes_the_model_not_contiguous() -> None:
    model = qwen2()
    layout = flatten_parameters(model)
    model.model.norm.weight.data = model.model.norm.weight.data.clone()
    assert contiguous_layout(model) is None
    assert not layout.describes(model)
    assert not layout.describes(model.state_dict())


def test_load_state_dict_with_assign_breaks_flatness_and_flattening_again_restores_it() -> None:
    model = qwen2()
    layout = flatten_parameters(model)
    state = {k: v.clone() for k, v in qwen2(seed=3).state_dict().items()}
    model.load_state_dict(state, assign=True)
    assert contiguous_layout(model) is None and not layout.describes(model)
    again = flatten_parameters(model)
    assert again.describes(model) and contiguous_layout(model) == again
    assert again.groups[0].flat.data_ptr() != layout.groups[0].flat.data_ptr()
    assert differing(model, state) == []  # assign=True made new Parameter objects, each its own slot


def test_flattening_again_after_one_parameter_got_new_data_moves_the_rest_out_with_it() -> None:
    """The parameters left in the storage flattening made share it only with each other: they
    were refused as 'sharing storage' with one another."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    old = flatten_parameters(model)
    model[1].weight.data = torch.randn(8, 8)
    expected = snapshot(model)
    again = flatten_parameters(model)
    assert again.describes(model) and contiguous_layout(model) == again and again.groups[0].aligned
    assert len(storages(model)) == 1 and again.groups[0].flat.data_ptr() != old.groups[0].flat.data_ptr()
    assert differing(model, expected) == []


def test_a_buffer_in_a_flattened_storage_still_keeps_its_parameter_from_moving() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    flatten_parameters(model)
    model[0].register_buffer("mirror", model[0].weight.data)
    model[1].weight.data = torch.randn(8, 8)
    with pytest.raises(FlattenRefused, match=r"'0.weight'.*buffer '0.mirror'"):
        flatten_parameters(model)


def test_a_parameter_whose_storage_was_freed_is_refused_naming_it_not_taken_as_flat() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    flatten_parameters(model)
    model[0].weight.untyped_storage().resize_(0)
    assert contiguous_layout(model) is None
    with pytest.raises(FlattenRefused, match=r"'0.weight'.*reads past its storage's 0 bytes: freed or shrunk"):
        flatten_parameters(model)


def test_load_state_dict_without_assign_copies_in_place() -> None:
    model = qwen2()
    layout = flatten_parameters(model)
    model.load_state_dict(qwen2(seed=3).state_dict())
    assert layout.describes(model)


def test_parameters_built_as_views_of_one_tensor_are_detected_in_storage_order() -> None:
    base = torch.randn(256)
    shapes = [(4, 4), (8,), (3, 5)]
    module = views_of(base, shapes, offsets=[160, 80, 0])  # back to front, as Megatron DDP's buffers
    layout = contiguous_layout(module)
    assert isinstance(layout, FlatLayout)
    (group,) = layout.groups
    assert [(s.name, s.offset, s.shape) for s in group.slots] == [
        ("p2", 0, (3, 5)), ("p1", 320, (8,)), ("p0", 640, (4, 4))]
    assert group.aligned and group.flat.data_ptr() == base.data_ptr()
    assert torch.equal(group.tensor(group.slots[2]), module.p0)
    pointers = [p.data_ptr() for p in module.parameters()]
    assert flatten_parameters(module) == layout, "an aligned layout is taken as it is"
    assert [p.data_ptr() for p in module.parameters()] == pointers


def test_unaligned_views_are_detected_but_not_moved_away_from_their_tensor() -> None:
    base = torch.randn(64)
    module = views_of(base, [(3,), (5,)], offsets=[0, 3])
    layout = contiguous_layout(module)
    assert layout is not None and not layout.groups[0].aligned
    with pytest.raises(FlattenRefused, match="'p0'.*shares its storage with parameter 'p1'"):
        flatten_parameters(module)
    assert module.p1.data_ptr() == base.data_ptr() + 12


def test_overlapping_views_are_not_a_layout() -> None:
    base = torch.randn(64)
    assert contiguous_layout(views_of(base, [(8,), (8,)], offsets=[0, 4])) is None


def test_a_state_dict_names_tied_weights_as_one_slot() -> None:
    model = qwen2()
    flatten_parameters(model)
    layout = contiguous_layout(model.state_dict())
    assert layout is not None and layout == contiguous_layout(model)
    assert layout.find("lm_head.weight")[1].name == "model.embed_tokens.weight"


# ---------------------------------------------------------------- refusals


def with_private(*named: tuple[str, nn.Parameter]) -> nn.Module:
    """A module with a private parameter first, so the group must move."""
    module = nn.Module()
    module.own = nn.Parameter(torch.randn(4))
    for name, param in named:
        module.register_parameter(name, param)
    return module


def test_a_view_of_a_tensor_that_is_not_a_parameter_is_refused_naming_it_before_anything_moves() -> None:
    module = with_private(("window", nn.Parameter(torch.randn(10)[2:6])))
    own = module.own.data_ptr()
    with pytest.raises(FlattenRefused, match=r"'window'.*view of a larger tensor.*16 of its storage's 40 bytes"):
        flatten_parameters(module)
    assert module.own.data_ptr() == own


def test_an_expanded_parameter_is_refused_as_one_not_as_a_view_of_a_larger_tensor() -> None:
    """A stride-0 view reads more bytes than its storage holds: the message said '20 of its
    storage's 4 bytes' of 'a larger tensor'."""
    module = with_private(("spread", nn.Parameter(torch.ones(1).expand(5))))
    with pytest.raises(FlattenRefused, match=r"'spread'.*expanded view whose 20 bytes repeat its storage's 4"):
        flatten_parameters(module)


def test_a_parameter_sharing_storage_with_a_buffer_is_refused_naming_both() -> None:
    module = with_private(("weight", nn.Parameter(torch.randn(4))))
    module.register_buffer("mirror", module.weight.data)
    with pytest.raises(FlattenRefused, match=r"'weight'.*buffer 'mirror'"):
        flatten_parameters(module)


@pytest.mark.parametrize("param, why", [
    (nn.Parameter(torch.randn(3, 3).to_sparse()), "not a strided tensor"),
    (nn.Parameter(torch.empty(3, 3, device="meta")), "meta device"),
    (nn.parameter.UninitializedParameter(), "uninitialized lazy parameter.*run a forward first"),
])
def test_what_has_no_flat_place_is_refused_naming_the_parameter(param: nn.Parameter, why: str) -> None:
    module = with_private(("odd", param))
    with pytest.raises(FlattenRefused, match=f"'odd'.*{why}"):
        flatten_parameters(module)
    assert contiguous_layout(module) is None


def test_refusals_are_engine_errors_and_an_unknown_name_is_one_too() -> None:
    assert issubclass(FlattenRefused, EngineError)
    layout = flatten_parameters(nn.Linear(2, 2))
    with pytest.raises(EngineError, match="'nope'"):
        layout.find("nope")


@pytest.mark.parametrize("value", [5, "weights", None, object(), torch.tensor(1.0), torch.ones(2, 2)])
def test_what_is_no_model_state_dict_or_pairs_is_refused_naming_its_type(value: Any) -> None:
    for call in (contiguous_layout, FlatLayout(()).describes):
        with pytest.raises(EngineError, match=f"expected a model, a state dict or \\(name, tensor\\) pairs, "
                                              f"got a {type(value).__name__}"):
            call(value)
    with pytest.raises(FlattenRefused, match=f"flatten_parameters takes a model .* not a {type(value).__name__}"):
        flatten_parameters(value)


def test_flatten_parameters_refuses_pairs_and_state_dicts_naming_their_type() -> None:
    weights = {"w": nn.Parameter(torch.ones(3))}
    for value in (weights, list(weights.items())):
        with pytest.raises(FlattenRefused, match=f"not a {type(value).__name__}"):
            flatten_parameters(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("items, why", [
    ({"a": 1}.keys(), "item 0 is a str, not a \\(name, tensor\\) pair"),
    ([("w", torch.ones(2), "extra")], "item 0 is a tuple, not a \\(name, tensor\\) pair"),
    ([torch.ones(2)], "item 0 is a Tensor, not a \\(name, tensor\\) pair"),
])
def test_an_item_that_is_no_name_and_tensor_pair_is_refused_naming_it(items: Any, why: str) -> None:
    for call in (contiguous_layout, FlatLayout(()).describes):
        with pytest.raises(EngineError, match=why):
            call(items)
