"""The plan checker on its own: strict parsing, exact cover, and a fuzz of plans and their mutations.

A receiver trusts nothing in the sender's plan, so every plan that passes `parse_plan` must
describe each tensor covered exactly once by pieces that fit their buckets, and every plan
that does not must be refused with `PlanRefused` (an `EngineError`), never another exception.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from backends.engines.buckets import Layout
from backends.engines.slots import HEADER_BYTES
from backends.engines.plan import (
    ALIGN, FORMAT, Piece, Plan, PlanRefused, TensorMeta, check_plan, make_plan, parse_plan, travels,
)
from lifecycle.config import MAX_BUCKET_BYTES, MIN_BUCKET_BYTES
from lifecycle.errors import EngineError
from tests.backends.engines.kit import DEEP

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.bool,
          torch.uint8, torch.complex64, torch.int16]


def _plan_json(plan: Plan) -> dict[str, Any]:
    return json.loads(plan.to_bytes())


def _base() -> dict[str, Any]:
    metas = [TensorMeta("a", torch.float32, (40,)), TensorMeta("empty", torch.float16, (0, 3)),
             TensorMeta("b", torch.int64, (3,))]
    return _plan_json(make_plan(metas, 64, verify=True))


def _refused(data: Any, match: str) -> None:
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    with pytest.raises(PlanRefused, match=match):
        parse_plan(raw)


def test_the_base_plan_chunks_a_over_three_buckets_and_passes() -> None:
    data = _base()
    assert [[p[0] for p in bucket] for bucket in data["buckets"]] == [[0], [0], [0], [1, 2]]
    assert parse_plan(json.dumps(data).encode()) == make_plan(
        [TensorMeta("a", torch.float32, (40,)), TensorMeta("empty", torch.float16, (0, 3)),
         TensorMeta("b", torch.int64, (3,))], 64, verify=True)


@pytest.mark.parametrize(("edit", "match"), [
    (lambda d: d.update(bucket_bytes=64.0), r"bucket_bytes must be an integer in 64\.\.\d+, got 64\.0"),
    (lambda d: d.update(bucket_bytes="64"), r"bucket_bytes must be an integer .* got '64'"),
    (lambda d: d.update(bucket_bytes=True), r"bucket_bytes must be an integer .* got True"),
    (lambda d: d.update(bucket_bytes=32), r"bucket_bytes must be an integer in 64\.\..*got 32"),
    (lambda d: d.update(bucket_bytes=MAX_BUCKET_BYTES + 1), rf"bucket_bytes .* got {MAX_BUCKET_BYTES + 1}"),
    (lambda d: d.update(verify=1), r"verify must be true or false, got 1"),
    (lambda d: d.update(extra=1), r"exactly the keys format, bucket_bytes, verify, tensors, buckets"),
    (lambda d: d.pop("buckets"), r"exactly the keys"),
    (lambda d: d["tensors"][0].__setitem__(0, ""), r"tensor 0 has no name"),
    (lambda d: d["tensors"][0].__setitem__(0, 7), r"tensor 0 has no name"),
    (lambda d: d["tensors"][2].__setitem__(0, "a"), r"tensors 0 and 2 are both named 'a'"),
    (lambda d: d["tensors"][0].__setitem__(1, "float33"), r"'float33' is not a torch dtype"),
    (lambda d: d["tensors"][0].__setitem__(1, "Tensor"), r"'Tensor' is not a torch dtype"),
    (lambda d: d["tensors"][0].__setitem__(1, "qint8"), r"dtype torch\.qint8, which cannot travel"),
    (lambda d: d["tensors"][0].__setitem__(2, [-40]), r"tensor 0 'a' size 0 must be an integer in 0\.\."),
    (lambda d: d["tensors"][0].__setitem__(2, ["40"]), r"tensor 0 'a' size 0 must be an integer .* got '40'"),
    (lambda d: d["tensors"][0].__setitem__(2, [40.0]), r"size 0 must be an integer .* got 40\.0"),
    (lambda d: d["tensors"][1].__setitem__(2, [0, 1 << 62, 4]), r"tensor 1 'empty' has shape .* too large"),
    (lambda d: d["tensors"][0].__setitem__(2, 40), r"tensor 0 'a' shape must be a list"),
    (lambda d: d["buckets"][0][0].__setitem__(0, True), r"bucket 0 piece 0 index must be an integer .* got True"),
    (lambda d: d["buckets"][0][0].__setitem__(3, 64.0), r"bucket 0 piece 0 nbytes must be an integer"),
    (lambda d: d["buckets"][0][0].append(0), r"bucket 0 piece 0 must be \[index, offset, start, nbytes\]"),
    (lambda d: d["buckets"].insert(1, []), r"bucket 1 of 5 is empty"),
    (lambda d: d["buckets"].append([]), r"bucket 4 of 5 is empty"),
    (lambda d: d["buckets"][3][0].__setitem__(0, 3), r"bucket 3 piece 0 names tensor 3; the plan has 3"),
    (lambda d: d["buckets"].pop(3), r"tensor 1 'empty' is in no bucket"),
    (lambda d: d["buckets"].pop(1), r"bucket 1 piece 0 \(tensor 0 'a'\) carries its bytes 128\.\.160, which leaves a gap"),
    (lambda d: d["buckets"].insert(1, d["buckets"][0]), r"bucket 1 piece 0 .* carries its bytes 0\.\.64, which overlaps"),
    (lambda d: d["buckets"].insert(0, d["buckets"].pop(1)), r"bucket 0 piece 0 .* bytes 64\.\.128, which leaves a gap"),
    (lambda d: d["buckets"].pop(2), r"tensor 0 'a' is covered up to byte 128 of 160"),
    (lambda d: d["buckets"][0][0].__setitem__(3, 62), r"carries 62 bytes, not a whole number of torch\.float32"),
    (lambda d: d["buckets"][0][0].__setitem__(3, 128), r"ends at byte 128 of its bucket, past bucket_bytes=64"),
    (lambda d: d["buckets"][3][1].__setitem__(1, 16), r"bucket 3 piece 1 \(tensor 2 'b'\) sits at offset 16 of"),
    (lambda d: d["buckets"][2].append(d["buckets"][3].pop(1)),
     r"bucket 2 piece 1 \(tensor 2 'b'\) at offset 0 overlaps the piece before it in its bucket, which ends at 32"),
    (lambda d: d["buckets"][3].append([1, 64, 0, 0]), r"bucket 3 piece 2 .* carries no bytes: only a zero-byte"),
    (lambda d: d["buckets"][3].append([0, 64, 160, 0]), r"bucket 3 piece 2 \(tensor 0 'a'\) carries no bytes"),
    (lambda d: d["buckets"][3].pop(0), r"tensor 1 'empty' is in no bucket"),
])
def test_each_kind_of_bad_plan_is_refused_naming_what_is_wrong(edit: Any, match: str) -> None:
    data = _base()
    edit(data)
    _refused(data, match)


@pytest.mark.parametrize(("raw", "match"), [
    (b"{", r"it is not JSON \(JSONDecodeError"),
    (b"\xff\xfe\x00", r"it is not JSON"),
    (DEEP, r"it is not JSON \(RecursionError"),
    (b"[]", r"exactly the keys .* got 'list'"),
    (b'{"bucket_bytes": 1' + b"0" * 5000 + b"}", r"it is not JSON \(ValueError"),
    (b'{"format": 6, "bucket_bytes": NaN, "verify": true, "tensors": [], "buckets": []}', r"bucket_bytes .* got nan"),
    (b'{"bucket_bytes": 4096, "verify": true, "tensors": [], "buckets": []}',
     r"wire format older than 3 \(it has no 'format' key\) and this receiver reads format 6: run the same version"),
    (b'{"format": 2, "bucket_bytes": 4096, "verify": true, "tensors": [], "buckets": []}', r"wire format 2 and"),
    (b'{"format": 5, "bucket_bytes": 4096, "verify": true, "tensors": [], "buckets": []}', r"wire format 5 and"),
    (b'{"format": 6.0, "bucket_bytes": 4096, "verify": true, "tensors": [], "buckets": []}', r"wire format 6.0 and"),
    (b'{"format": true, "bucket_bytes": 4096, "verify": true, "tensors": [], "buckets": []}', r"wire format True and"),
])
def test_what_is_not_a_plan_at_all_is_refused(raw: bytes, match: str) -> None:
    _refused(raw, match)


def test_a_refusal_is_an_engine_error_carrying_the_bare_reason() -> None:
    """The engine adds who refuses (`receiver.accept`); the sender is sent the reason alone."""
    data = _base()
    data["buckets"].insert(1, [])
    assert issubclass(PlanRefused, EngineError)
    with pytest.raises(PlanRefused, match=r"^bucket 1 of 5 is empty$"):
        parse_plan(json.dumps(data).encode())


def test_an_empty_plan_passes_and_a_zero_byte_tensor_travels_in_one_zero_byte_piece() -> None:
    assert parse_plan(make_plan([], 64, verify=False).to_bytes()).buckets == []
    plan = make_plan([TensorMeta("e", torch.float32, (0,))], 64, verify=True)
    assert plan.buckets == [[Piece(0, 0, 0, 0)]] and parse_plan(plan.to_bytes()) == plan


def test_only_sub_byte_and_quantized_dtypes_cannot_travel() -> None:
    dtypes = {getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}
    refused = {str(d).removeprefix("torch.") for d in dtypes if not travels(d)}
    assert {"qint8", "quint8", "uint4", "int1"} <= refused
    assert not refused & {"float32", "bfloat16", "float8_e4m3fn", "complex64", "bool", "uint16", "int64"}


# -- the fuzz -------------------------------------------------------------------------------

_names = st.lists(st.text(min_size=1, max_size=6), min_size=0, max_size=7, unique=True)
_shapes = st.lists(st.integers(0, 24), min_size=0, max_size=3).map(tuple)


@st.composite
def _plans(draw: st.DrawFn) -> Plan:
    names = draw(_names)
    metas = [TensorMeta(name, draw(st.sampled_from(DTYPES)), draw(_shapes)) for name in names]
    return make_plan(metas, draw(st.integers(MIN_BUCKET_BYTES, 700)), verify=draw(st.booleans()))


def _round_trip(plan: Plan) -> None:
    """Pack random tensors by the plan and rejoin them on a receiver's layout of the same slots:
    every tensor comes out once, byte for byte."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randint(0, 2 if m.dtype == torch.bool else 256, (m.nbytes,), dtype=torch.uint8,
                             generator=gen).view(m.dtype).view(m.shape) for m in plan.tensors]
    room = max((plan.used(k) for k in range(len(plan.buckets))), default=0)
    slots = [torch.zeros(HEADER_BYTES + room, dtype=torch.uint8) for _ in range(2)]
    sender, receiver = Layout(plan, slots), Layout(plan, slots)
    out: dict[str, torch.Tensor] = {}
    for k in range(len(plan.buckets)):
        sender.pack(k, tensors)
        for name, tensor in receiver.unpack(k):
            assert name not in out, name
            out[name] = tensor.clone()
    assert sorted(out) == sorted(m.name for m in plan.tensors)
    for meta, tensor in zip(plan.tensors, tensors):
        got = out[meta.name]
        assert got.dtype == meta.dtype and got.shape == meta.shape, meta.name
        assert torch.equal(got.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), meta.name


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_plans())
def test_every_plan_make_plan_makes_passes_the_checker_round_trips_and_packs(plan: Plan) -> None:
    check_plan(plan)
    assert parse_plan(plan.to_bytes()) == plan
    _round_trip(plan)


def _covers_exactly(plan: Plan) -> None:
    """The oracle, written apart from the checker: byte counts per tensor, intervals per bucket."""
    counts = [bytearray(m.nbytes) for m in plan.tensors]
    pieces = [0] * len(plan.tensors)
    assert len({m.name for m in plan.tensors}) == len(plan.tensors)
    assert all(isinstance(m.name, str) and m.name for m in plan.tensors)
    for bucket in plan.buckets:
        assert bucket
        taken: list[tuple[int, int]] = []
        for p in bucket:
            meta = plan.tensors[p.index]
            assert p.offset % ALIGN == 0 and 0 <= p.offset and p.offset + p.nbytes <= plan.bucket_bytes
            assert p.nbytes % meta.dtype.itemsize == 0 and p.start % meta.dtype.itemsize == 0
            assert all(p.offset + p.nbytes <= a or b <= p.offset for a, b in taken if p.nbytes and b > a)
            taken.append((p.offset, p.offset + p.nbytes))
            assert p.start + p.nbytes <= meta.nbytes
            for i in range(p.start, p.start + p.nbytes):
                counts[p.index][i] += 1
            pieces[p.index] += 1
    for meta, count, n in zip(plan.tensors, counts, pieces):
        assert all(c == 1 for c in count), meta.name
        assert n == 1 if meta.nbytes == 0 else n >= 1


_ODD = st.sampled_from([1.0, "1", True, False, None, [], {}, -1, -64, 2**63, 2**70, 0.5])


@st.composite
def _mutation(draw: st.DrawFn) -> tuple[str, list[int], Any]:
    kind = draw(st.sampled_from(["drop", "dup", "shift", "odd", "index", "swap", "empty", "drop_bucket",
                                 "bucket_bytes", "name", "dtype", "shape", "move", "verify"]))
    where = draw(st.lists(st.integers(0, 1000), min_size=3, max_size=3))
    value = draw(st.one_of(st.integers(-130, 130), st.sampled_from([ALIGN, -ALIGN, 1, -1, 2, 4, 8]), _ODD))
    return kind, where, value


def _pieces(data: dict[str, Any]) -> list[tuple[int, int]]:
    return [(k, j) for k, bucket in enumerate(data["buckets"]) for j in range(len(bucket))]


def _mutate(data: dict[str, Any], kind: str, where: list[int], value: Any) -> None:
    """One hostile edit of a plan's JSON; edits that find nothing to change do nothing."""
    pieces, tensors, buckets = _pieces(data), data["tensors"], data["buckets"]
    if kind == "empty":
        buckets.insert(where[0] % (len(buckets) + 1), [])
    elif kind == "drop_bucket" and buckets:
        buckets.pop(where[0] % len(buckets))
    elif kind == "bucket_bytes":
        size = data["bucket_bytes"]  # an earlier edit may have made it a non-number already
        numbers = all(isinstance(n, int) and not isinstance(n, bool) for n in (value, size))
        data["bucket_bytes"] = size + value if numbers else value
    elif kind == "verify":
        data["verify"] = value if not isinstance(value, int) else not data["verify"]
    elif kind in ("name", "dtype", "shape") and tensors:
        entry = tensors[where[0] % len(tensors)]
        if kind == "name":
            entry[0] = tensors[where[1] % len(tensors)][0] if isinstance(value, int) else value
        elif kind == "dtype":
            entry[1] = ["float32", "int8", "float64", "qint8", "uint4", "nope", "__class__"][where[1] % 7]
        elif not isinstance(entry[2], list):  # an earlier edit made the shape a non-list already
            entry[2] = value
        elif entry[2] and isinstance(value, int) and not isinstance(value, bool):
            entry[2][where[1] % len(entry[2])] += value
        else:
            entry[2] = value if not isinstance(value, int) else [*entry[2], 1 + where[1] % 3]
    elif pieces:
        k, j = pieces[where[0] % len(pieces)]
        piece = buckets[k][j]
        if kind == "drop":
            buckets[k].pop(j)
        elif kind == "dup":
            k2 = where[1] % len(buckets)
            buckets[k2].insert(where[2] % (len(buckets[k2]) + 1), list(piece))
        elif kind == "shift" and isinstance(value, int):
            field = where[1] % 4  # an earlier "odd" edit may have made it a non-number already
            numbers = all(isinstance(n, int) and not isinstance(n, bool) for n in (value, piece[field]))
            piece[field] = piece[field] + value if numbers else value
        elif kind == "odd":
            piece[where[1] % 4] = value
        elif kind == "index":
            piece[0] = where[1] % (len(tensors) + 2) - 1
        elif kind == "swap":
            k2, j2 = pieces[where[1] % len(pieces)]
            buckets[k][j], buckets[k2][j2] = buckets[k2][j2], piece
        elif kind == "move":
            buckets[k].pop(j)
            k2 = where[1] % len(buckets)
            buckets[k2].insert(where[2] % (len(buckets[k2]) + 1), piece)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_plans(), st.lists(_mutation(), min_size=1, max_size=3))
@example(Plan(64, False, [TensorMeta("0", torch.float32, ())], [[Piece(0, 0, 0, 4)]]),
         [("odd", [0, 0, 0], "1"), ("shift", [0, 0, 0], 0)])  # a shift after an edit made the field a string
def test_a_mutated_plan_passes_only_as_a_full_exact_cover_and_is_otherwise_an_engine_error(
    plan: Plan, mutations: list[tuple[str, list[int], Any]],
) -> None:
    data = _plan_json(plan)
    for kind, where, value in mutations:
        _mutate(data, kind, where, value)
    try:
        accepted = parse_plan(json.dumps(data).encode())
    except EngineError:
        return
    _covers_exactly(accepted)
    _round_trip(accepted)


def test_a_plan_whose_shape_multiplies_past_any_tensor_is_refused_before_anything_sums_its_sizes() -> None:
    """60000 sizes of 2**62: multiplying them all out (as a sum of sizes would) takes tens of
    seconds; the checker stops at the first product past 2**63 - 1."""
    raw = json.dumps({"format": FORMAT, "bucket_bytes": 1 << 20, "verify": True,
                      "tensors": [["w", "float32", [1 << 62] * 60_000]], "buckets": [[[0, 0, 0, 64]]]}).encode()
    started = time.monotonic()
    with pytest.raises(PlanRefused, match="too large for any tensor"):
        parse_plan(raw)
    assert time.monotonic() - started < 5.0  # a hang guard: it takes milliseconds


@pytest.mark.parametrize("collector_on", [True, False])
def test_making_and_reading_a_plan_hold_the_collector_off_and_leave_it_as_it_was_even_when_refused(
        collector_on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    from backends.engines import plan as plan_module

    seen: list[bool] = []
    read: list[bool] = []
    check = plan_module.check_plan

    def checking(plan: Plan) -> None:  # what parse_plan calls once it has read the plan's objects
        read.append(gc.isenabled())
        check(plan)

    monkeypatch.setattr(plan_module, "check_plan", checking)

    class Spy(TensorMeta):
        @property
        def nbytes(self) -> int:
            seen.append(gc.isenabled())
            return math.prod(self.shape) * self.dtype.itemsize

    metas = [Spy(f"t{i}", torch.float32, (3,)) for i in range(4)]
    was = gc.isenabled()
    (gc.enable if collector_on else gc.disable)()
    try:
        plan = make_plan(metas, 4096, verify=True)
        assert gc.isenabled() is collector_on
        assert parse_plan(plan.to_bytes()).tensors == [TensorMeta(m.name, m.dtype, m.shape) for m in metas]
        assert gc.isenabled() is collector_on
        with pytest.raises(PlanRefused, match="not JSON"):
            parse_plan(b"[1")
        assert gc.isenabled() is collector_on
    finally:
        (gc.enable if was else gc.disable)()
    assert seen and not any(seen)  # off while the plan was made
    assert read and not any(read)  # and while it was read


def _fields_as_json(plan: Plan) -> bytes:
    """What `Plan.to_bytes` must give: json.dumps of its fields, compact, in this key order."""
    return json.dumps({
        "format": FORMAT, "bucket_bytes": plan.bucket_bytes, "verify": plan.verify,
        "tensors": [[m.name, str(m.dtype).removeprefix("torch."), list(m.shape)] for m in plan.tensors],
        "buckets": [[[p.index, p.offset, p.start, p.nbytes] for p in bucket] for bucket in plan.buckets],
    }, separators=(",", ":")).encode()


@pytest.mark.parametrize("count", [0, 1, 4095, 4096, 4097, 9000])
def test_a_plan_written_a_batch_at_a_time_is_the_json_of_its_fields_byte_for_byte(count: int) -> None:
    """Batches of 4096 entries, so the counts around one batch; names that JSON escapes (a quote,
    a backslash, a non-ASCII letter, a lone surrogate); one bucket or many."""
    metas = [TensorMeta(f'l.{i}."w\\é\ud800', torch.float16 if i % 3 else torch.int8, (i % 7, 3) if i % 5 else ())
             for i in range(count)]
    for bucket_bytes, verify in ((MIN_BUCKET_BYTES, True), (1 << 24, False)):
        plan = make_plan(metas, bucket_bytes, verify)
        raw = plan.to_bytes()
        assert raw == _fields_as_json(plan)
        assert parse_plan(raw) == plan


@pytest.mark.parametrize("count, shape, bucket_bytes, bound", [
    (20000, None, 1 << 20, 1.7),  # a piece a tensor: the tensors' entries are most of it (1.75 if kept)
    (4000, (64, 16), 256, 1.5),  # eight pieces a tensor: the buckets' entries are (1.80 if kept)
])
def test_writing_a_plan_peaks_under_three_times_its_bytes_and_reading_it_well_under_twice_what_it_holds(
        count: int, shape: tuple[int, ...] | None, bucket_bytes: int, bound: float) -> None:
    """Writing built one nested list of the whole plan first (7.2 times its bytes at its peak,
    measured); reading held all of the parsed JSON and the plan read from it at once (2.2 times
    what the plan holds, one piece a tensor). Now each entry goes as soon as it is written or
    read (2.1 and 1.6; 1.3 with eight pieces a tensor)."""
    import tracemalloc

    metas = [TensorMeta(f"model.layers.{i}.mlp.weight", torch.bfloat16, shape or (64, i % 97 + 1)) for i in range(count)]
    plan = make_plan(metas, bucket_bytes, True)
    tracemalloc.start()
    try:
        raw = plan.to_bytes()
        written = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        tracemalloc.start()
        read = parse_plan(raw)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert read == plan
    assert written < 3 * len(raw), f"writing {len(raw)} bytes of plan peaked at {written} bytes"
    assert peak < bound * held, f"reading a plan that holds {held} bytes peaked at {peak} bytes"
