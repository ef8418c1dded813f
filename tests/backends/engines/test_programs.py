"""A sender works out what packing each bucket takes once, and reuses it while its tensors stay put.

`describe` records, per tensor, all that packing depends on (name, device, dtype, shape,
address, contiguity and a strided tensor's strides, lazy bits); a layout bound to an equal description reuses each bucket's `Program`
(its region, its merged memmoves, the pieces torch copies). These tests prove the reuse
happens, that anything that moves a tensor (a rebound `.data`, a new dtype, a new storage)
makes the sender look again, and that whatever happens between syncs, a reused program
delivers exactly what a fresh layout would.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.engines.buckets import Layout
from backends.engines.slots import HEADER_BYTES, as_slots
from backends.engines.sources import _CODES, Copied, Program, describe
from backends.engines.digests import xxh3_digest, xxh3_packed
from backends.engines.flat import flatten_parameters
from backends.engines.plan import ALIGN, TensorMeta, align, make_plan
from lifecycle.errors import EngineError
from lifecycle.testing import MemoryRollout
from tests.backends.engines.kit import TRANSPORTS, new_engine, sync_threads, tiny_qwen2

Named = list[tuple[str, torch.Tensor]]


def _metas(named: Named) -> list[TensorMeta]:
    return [TensorMeta(name, t.dtype, tuple(t.shape)) for name, t in named]


def _layout(named: Named, bucket_bytes: int) -> Layout:
    plan = make_plan(_metas(named), bucket_bytes, verify=True)
    return Layout(plan, as_slots(torch.zeros(HEADER_BYTES + align(bucket_bytes), dtype=torch.uint8) for _ in range(2)))


def _delivered(layout: Layout, named: Named) -> dict[str, torch.Tensor]:
    """Pack every bucket and read it back as the receiver would, like the pipeline does."""
    receiver = Layout(layout.plan, layout.slots)
    tensors = [t for _, t in named]
    out: dict[str, torch.Tensor] = {}
    for k in range(len(layout.plan.buckets)):
        layout.pack(k, tensors)
        out.update((name, t.clone()) for name, t in receiver.unpack(k))
    return out


def _assert_delivers(layout: Layout, named: Named) -> None:
    out = _delivered(layout, named)
    assert list(out) == [name for name, _ in named]
    for name, tensor in named:
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name


def _separate(count: int = 24) -> Named:
    gen = torch.Generator().manual_seed(0)
    return [(f"t{i}", torch.randn(37 + i, generator=gen)) for i in range(count)]


def test_a_second_bind_to_tensors_that_stayed_put_reuses_every_program_and_sends_their_new_values() -> None:
    named = _separate()
    layout = _layout(named, 1024)
    layout.bind_sources(describe(named))
    _assert_delivers(layout, named)
    programs = dict(layout._programs)
    assert len(programs) == len(layout.plan.buckets)
    for _, tensor in named:
        tensor.mul_(-3).add_(1)  # an optimizer step: in place, same addresses
    layout.bind_sources(describe(named))
    assert all(layout._programs[k] is program for k, program in programs.items())
    _assert_delivers(layout, named)


def test_describe_hands_back_the_last_description_itself_while_nothing_moved_and_a_new_one_once_something_did(
        ) -> None:
    named = _separate()
    first = describe(named)
    assert first is not None and describe(named, first) is first
    named[3] = (named[3][0], named[3][1].clone())
    second = describe(named, first)
    assert second is not first and second == describe(named) and second != first


def _changed(change: str) -> tuple[Named, Named]:
    """Two lists of tensors alike in everything but `change`."""
    base = torch.arange(64, dtype=torch.float32)
    z = torch.randn(8, dtype=torch.complex64)
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {
        "address": (base[:8], base[8:16]),
        "dtype": (base[:8], base[:8].view(torch.int32)),
        "shape, same bytes": (base[:8], base[:8].view(2, 4)),
        "contiguity": (base[:16].view(4, 4), base[:16].view(4, 4).t()),
        "strides of a tensor that is not contiguous": (base.as_strided((2,), (2,)), base.as_strided((2,), (20,))),
        # the same address and bytes, in a storage that holds fewer (one shrunk and given memory again there)
        "how much its storage holds": (torch.from_numpy(base.numpy())[:8], torch.from_numpy(base.numpy()[:8])),
        "lazy negation": (z.imag, z.conj().imag),
        "lazy conjugate": (z, z.conj()),
    }
    if change in pairs:
        a, b = pairs[change]
        return [("x", a)], [("x", b)]
    if change == "name":
        return [("x", base)], [("y", base)]
    if change == "where one name ends and the next begins":
        return [("ab", base[:8]), ("c", base[8:16])], [("a", base[:8]), ("bc", base[8:16])]
    assert change == "count"
    return [("x", base)], [("x", base), ("y", base[:0])]


@pytest.mark.parametrize("change", ["address", "dtype", "shape, same bytes", "contiguity",
                                    "strides of a tensor that is not contiguous", "how much its storage holds",
                                    "lazy negation", "lazy conjugate", "name",
                                    "where one name ends and the next begins", "count"])
def test_describe_tells_apart_tensors_that_differ_in_any_one_fact_packing_depends_on(change: str) -> None:
    before, after = _changed(change)
    first = describe(before)
    assert first is not None and describe(after, first) != first and describe(before, first) is first


def test_describe_tells_apart_chunks_of_one_dtype_from_chunks_of_several() -> None:
    """One code for a chunk all of one dtype and device, one code a tensor otherwise: the two
    never hash alike, whatever the codes."""
    one = [("x", torch.zeros(1)), ("y", torch.zeros(1))]
    two = [("x", torch.zeros(1)), ("y", torch.zeros(1, dtype=torch.float64))]
    assert describe(one) != describe(two) and describe(two) is not None


def _moved_unseen(change: str) -> tuple[Named, Named]:
    """Two lists of the same bytes at the same addresses, differing only in `change`: one packing
    does not depend on (`describe` does not read it)."""
    memory = torch.arange(80, dtype=torch.float32).numpy()  # torch's: its start is aligned, and so is [16]
    base = torch.from_numpy(memory[:64])
    before: Named = [("a", base[16:32]), ("b", base[32:48].view(1, 16))]
    if change == "strides of a size-1 dimension":
        after = [("a", base[16:32]), ("b", base[32:48].as_strided((1, 16), (1, 1)))]
    else:  # a storage as large, starting where "a" does: the region, 64 bytes into base's storage, sits at
        # 0 in this one (and 64 bytes in, it would hold the wrong bytes)
        assert change == "another storage of the same size at the same addresses"
        after = [("a", torch.from_numpy(memory[16:])[:16]), before[1]]
        assert after[0][1].untyped_storage().nbytes() == base.untyped_storage().nbytes()
    for (_, x), (_, y) in zip(before, after):
        assert x.data_ptr() == y.data_ptr() and x.shape == y.shape and y.is_contiguous()
    return before, after


@pytest.mark.parametrize("change", ["strides of a size-1 dimension",
                                    "another storage of the same size at the same addresses"])
def test_what_describe_does_not_read_leaves_the_fingerprint_and_reused_programs_still_deliver_the_bytes(
        change: str) -> None:
    """Strides of size-1 dimensions and offsets in a storage change nothing packing does: a
    contiguous tensor is its bytes at its address, and a region is placed by address, inside the
    storage it is read from or looked for again."""
    before, after = _moved_unseen(change)
    layout = _layout(before, 4096)
    first = describe(before)
    layout.bind_sources(first)
    assert layout.region(0, [t for _, t in before]) is not None  # bucket 0 goes as a region of the storage
    _assert_delivers(layout, before)
    with torch.no_grad():
        before[0][1].add_(100)  # new values, through either list: the same memory
    assert describe(after, first) is first
    layout.bind_sources(first)
    _assert_delivers(layout, after)


def test_describe_tells_apart_chunks_whose_columns_line_up_but_whose_tensor_counts_differ() -> None:
    """Nine 0-dim tensors against one empty tensor of 27 dimensions whose sizes and strides are
    the nine's other columns, word for word (found by a review: the count was not hashed)."""
    import struct

    describe([("warm", torch.zeros(1))])
    k, w = _CODES[torch.float32], _CODES[torch.device("cpu")]
    base = torch.arange(100.0)
    nine = [base[10 * i] for i in range(9)]
    lengths = [0, k, w, 0, 0, 27]
    lengths += [40 - sum(lengths), 0, 0]
    blob, names, at = struct.pack("<5Q", *[1] * 5).decode("latin-1"), [], 0
    for n in lengths:
        names.append(blob[at:at + n])
        at += n
    sizes = lengths[6:] + [1] * 5 + [k] * 9 + [w] * 9 + [nine[0].data_ptr()]
    strides = [t.data_ptr() for t in nine[1:]] + [t.storage_offset() for t in nine] + [0] * 10
    one = torch.empty(0).as_strided(sizes, strides, 0)
    first = describe(list(zip(names, nine)))
    assert first is not None and describe([("", one)], first) != first


@pytest.mark.parametrize("named", [5, None, [("a", torch.ones(1)), ("b", torch.ones(1), "extra")],
                                   [("a", torch.ones(1), "x"), ("b", torch.ones(1), "y")], [("a",)]],
                         ids=["an int", "None", "a pair then a triple", "triples", "a single"])
def test_describe_reads_what_is_no_list_of_pairs_as_none_without_raising(named: Any) -> None:
    assert describe(named) is None


def test_describe_keeps_sixteen_bytes_and_holds_under_256_kib_while_describing_20000_tensors() -> None:
    import tracemalloc

    storage = torch.zeros(20_000)
    named = [(f"model.layers.{i}.mlp.weight", storage[i:i + 1]) for i in range(20_000)]
    tracemalloc.start()
    try:
        found = describe(named)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert found is not None and len(found) == 16
    assert peak < 256 * 1024, f"describing 20000 tensors held {peak} bytes at its peak"


@pytest.mark.parametrize("change", ["rebound .data", "new tensor", "another dtype", "strided", "lazy negation"])
def test_a_tensor_that_moved_makes_the_sender_look_again_and_send_it_from_where_it_is(change: str) -> None:
    named = _separate()
    layout = _layout(named, 1024)
    layout.bind_sources(describe(named))
    _assert_delivers(layout, named)
    name, old = named[5]
    if change == "rebound .data":
        param = torch.nn.Parameter(old.clone())
        named[5] = (name, param)
        layout.bind_sources(describe(named))
        _assert_delivers(layout, named)
        param.data = torch.randn(old.shape)
    elif change == "new tensor":
        named[5] = (name, torch.randn(old.shape))
    elif change == "another dtype":  # the plan's wire dtype is float32: this piece is a cast now
        named[5] = (name, torch.randn(old.shape, dtype=torch.float64))
    elif change == "strided":
        named[5] = (name, torch.randn(old.numel(), 2)[:, 0])
        assert not named[5][1].is_contiguous()
    else:
        complex_ = torch.randn(old.numel(), dtype=torch.complex64)
        named[5] = (name, complex_.conj().imag)  # a real tensor carrying the lazy negation bit
        assert named[5][1].is_neg()
    del old
    layout.bind_sources(describe(named))
    out = _delivered(layout, named)
    want = named[5][1].to(torch.float32)
    assert torch.equal(out[name], want), change
    assert all(torch.equal(out[n], t) for n, t in named if n != name)


def test_pieces_adjacent_in_one_storage_and_in_the_bucket_are_one_memmove() -> None:
    buffer = torch.randn(16 * 10 + 1)
    named = [(f"v{i}", buffer[1 + 16 * i:1 + 16 * (i + 1)]) for i in range(10)]  # 64 bytes each, 4 bytes off alignment
    layout = _layout(named, 4096)
    layout.bind_sources(describe(named))
    program = layout.program(0, [t for _, t in named])
    assert program.region is None  # its base is not aligned, so no region: but one run all the same
    assert program.moves == [(0, named[0][1].data_ptr(), 640)] and program.rest == []
    copied: Copied = []
    layout.pack(0, [t for _, t in named], copied)
    data = layout.slots[0].data[:layout.plan.used(0)]
    assert copied == program.moves and xxh3_packed(data, copied) == xxh3_digest(data)  # the run hashes as the bucket
    _assert_delivers(layout, named)


def test_a_region_whose_storage_no_longer_holds_it_is_looked_for_again_not_viewed_past_its_end() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    flatten_parameters(model)
    named = list(model.named_parameters())
    layout = _layout(named, 4096)
    layout.bind_sources(describe(named))
    tensors = [t for _, t in named]
    found = layout.region(0, tensors)
    assert found is not None
    storage = tensors[0].untyped_storage()
    for address in (storage.data_ptr() + storage.nbytes(), storage.data_ptr() - ALIGN):  # past its end, before it
        layout._programs[0] = Program((0, address), [], [])  # a stale region
        again = layout.region(0, tensors)
        assert again is not None and again.data_ptr() == found.data_ptr() and again.numel() == found.numel()
    _assert_delivers(layout, named)


@pytest.mark.parametrize("how", ["freed", "shrunk"])
@pytest.mark.parametrize("kind", ["contiguous", "strided", "in a region"])
def test_a_tensor_whose_storage_was_freed_is_refused_naming_it_not_read(kind: str, how: str) -> None:
    """FSDP frees an unsharded parameter's memory with `untyped_storage().resize_(0)`; the tensor
    keeps its shape and points at what is no longer its own: copying it reads freed memory.
    Shrunk: given 32 bytes again, often at the same address (so the same data pointer, and
    only the storage's size tells), fewer than each of these reads."""
    base = torch.arange(64, dtype=torch.float32)
    tensor = {"contiguous": base[16:32], "strided": base.as_strided((8,), (2,), 16), "in a region": base[:16]}[kind]
    named: Named = [("before", torch.randn(8)), ("freed", tensor)] if kind != "in a region" else [("freed", tensor)]
    layout = _layout(named, 4096)
    layout.bind_sources(describe(named))
    _assert_delivers(layout, named)
    base.untyped_storage().resize_(0)
    if how == "shrunk":
        base.untyped_storage().resize_(32)
    layout.bind_sources(describe(named))
    held = 0 if how == "freed" else 32
    with pytest.raises(EngineError, match=f"'freed' reads bytes outside its storage, which holds {held}:"):
        layout.pack(0, [t for _, t in named])


def test_tensors_describe_cannot_read_reuse_nothing() -> None:
    class Marked(torch.Tensor):
        pass

    named: Named = [("plain", torch.randn(8)), ("sub", torch.randn(8).as_subclass(Marked))]
    assert describe(named) is None
    layout = _layout(named, 4096)
    found: list[int] = []
    find = layout._find_region

    def counted(k: int, tensors: Any) -> Any:
        found.append(k)
        return find(k, tensors)

    layout._find_region = counted  # type: ignore[method-assign]
    layout.bind_sources(None)
    tensors = [t for _, t in named]
    assert layout.region(0, tensors) is None
    _assert_delivers(layout, named)
    assert found == [0]  # worked out once in the sync, however often it is asked
    layout.bind_sources(None)  # the next sync: nothing kept from the last
    assert layout._programs == {}
    _assert_delivers(layout, named)
    assert found == [0, 0]


@pytest.mark.parametrize("odd", ["sparse", "mkldnn", "nested", "meta", "quantized", "sub-byte"])
def test_describe_reads_a_tensor_that_is_not_plain_memory_as_none_without_raising(odd: str) -> None:
    """It reads no layout: torch refusing the tensor's address or sizes tells, and a meta tensor's
    device never gets a code, however often one is described."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tensor = {"sparse": lambda: torch.eye(3).to_sparse(), "mkldnn": lambda: torch.eye(3).to_mkldnn(),
                  "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
                  "meta": lambda: torch.empty(3, device="meta"),
                  "quantized": lambda: torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8),
                  "sub-byte": lambda: torch.zeros(4, dtype=torch.uint8).view(torch.uint4)}[odd]()
    for _ in range(2):
        assert describe([("plain", torch.randn(8)), ("odd", tensor)]) is None


# -- whatever happens between syncs, a reused program delivers what a fresh layout would --------

_CHANGES = st.sampled_from(["in place", "rebind", "re-dtype", "stride", "flatten", "none"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=12), bucket=st.sampled_from([64, 256, 1024, 4096]),
       rounds=st.lists(st.tuples(st.integers(0, 11), _CHANGES), min_size=1, max_size=6),
       seed=st.integers(0, 2**16))
def test_any_changes_between_syncs_deliver_exactly_what_a_fresh_layout_does(
        sizes: list[int], bucket: int, rounds: list[tuple[int, str]], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    named: Named = [(f"t{i}", torch.randn(n, generator=gen)) for i, n in enumerate(sizes)]
    layout = _layout(named, bucket)
    keep: list[Any] = []  # old tensors stay alive, so new ones get new addresses only when they should
    for which, change in rounds:
        i = which % len(named)
        name, tensor = named[i]
        if change == "in place":
            tensor.add_(1)
        elif change == "rebind":
            keep.append(tensor)
            named[i] = (name, torch.randn(tensor.shape, generator=gen))
        elif change == "re-dtype":
            keep.append(tensor)
            named[i] = (name, torch.randn(tensor.shape, generator=gen, dtype=torch.float64))
        elif change == "stride" and tensor.numel():
            keep.append(tensor)
            named[i] = (name, torch.randn(tensor.numel(), 2, generator=gen)[:, 0])
        elif change == "flatten":
            keep.extend(t for _, t in named)
            module = torch.nn.Module()
            for n, t in named:
                module.register_parameter(n, torch.nn.Parameter(t.detach().to(torch.float32).clone()))
            flatten_parameters(module)
            named = [(n, p.detach()) for n, p in module.named_parameters()]
            keep.append(module)
        layout.bind_sources(describe(named))
        reused = _delivered(layout, named)
        fresh = _delivered(_layout([(n, t.to(torch.float32)) for n, t in named], bucket), named)
        for n, _ in named:
            assert torch.equal(reused[n], fresh[n]), (n, change)


# -- through the engines ----------------------------------------------------------------------

@pytest.mark.parametrize("name", TRANSPORTS)
def test_syncs_of_a_model_whose_parameters_get_new_memory_between_them_deliver_the_new_values(name: str) -> None:
    model = tiny_qwen2(0)
    sender, receiver = new_engine(name, bucket_bytes=4096), new_engine(name, bucket_bytes=4096)
    try:
        for version, act in enumerate(["first", "in place", "rebound", "flattened", "in place"], start=1):
            params = dict(model.named_parameters())
            if act == "in place":
                with torch.no_grad():
                    for p in params.values():
                        p.mul_(0.5)
            elif act == "rebound":
                for p in list(params.values())[::3]:
                    p.data = torch.randn(p.shape)
            elif act == "flattened":
                flatten_parameters(model)
            rollout = MemoryRollout()
            named = [(n, p.detach()) for n, p in model.named_parameters()]
            run = sync_threads(sender, [receiver], named, [rollout], version=version)
            assert run.error is None and run.errors == [None], (act, run.error, run.errors)
            for n, p in named:
                assert torch.equal(rollout.weights[n], p), (act, n)
    finally:
        sender.close()
        receiver.close()


def test_a_view_is_refused_where_a_slot_is_shorter_than_its_bucket_and_long_shapes_are_not_kept() -> None:
    from backends.engines.buckets import _contiguous

    named = [("long", torch.arange(6, dtype=torch.float32).view((1,) * 10 + (2, 3))), ("flat", torch.randn(5))]
    layout = _layout(named, 4096)
    _contiguous.cache_clear()
    _assert_delivers(layout, named)
    assert _contiguous.cache_info().currsize == 1  # (5,) kept; the 12 dimensions of "long" are not
    short = Layout(layout.plan, as_slots([torch.zeros(HEADER_BYTES + 16, dtype=torch.uint8)]))
    with pytest.raises(EngineError, match=r"bucket 0 takes \d+ bytes and its slot's data region holds 16"):
        short.bucket_views(0)
