"""The sender's side of one sync once every receiver accepted the plan: buckets in order, as many
in flight as the sender has slots, each packed (or sent from its sources' storage) and its
checksum started while it is on the wire, and sent after it (see `pipeline` for the pipeline
as a whole).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import record_function

from backends.engines.buckets import Layout
from backends.engines.slots import HEADER_BYTES, SLOTS, write_header
from backends.engines.sources import Copied
from backends.engines.digests import done, fold, settle, word_sums, xxh3_packed

if TYPE_CHECKING:
    from backends.engines.pipeline import BucketEngine


def send_buckets(engine: BucketEngine, layout: Layout, tensors: Sequence[torch.Tensor], version: int) -> None:
    """Every bucket, as many in flight as the sender has slots, each checksum sent after its
    bucket; returns once the last transfer is done, and, however it ends, once no checksum
    reads a bucket any more.

    With two slots, bucket k waits for bucket k - 2's transfer (its slot) and for its checksum's
    being sent, so digest k - 2 goes out at the latest before bucket k is packed; later digests
    go as soon as they are ready. A sender with a slot per bucket (shm's flip: each bucket has
    its own place in the weight set) waits for no receiver until the last bucket is written,
    and on a host copies buckets that lie in its weights' storage as they lie in the set
    together, with one memmove (`pack_together`)."""
    count, window = len(layout.plan.buckets), max(SLOTS, len(engine.slots))
    in_flight: list[Any] = [None] * window
    engine._in_flight, engine._regions = in_flight, [None] * window
    digests: dict[int, Future[int]] = {}
    packed: dict[int, Packed] = {}
    together = window >= count and not engine.sends_regions  # no slot is written twice in this sync
    try:
        for k in range(count):
            if in_flight[k % window] is not None:
                engine._wait(in_flight[k % window], f"bucket {k - window} of {count}")
            _send_digests(engine, digests, upto=k - window)
            if together and k not in packed:
                packed = pack_together(engine, layout, k, tensors)
            ready = packed.pop(k, None)
            if ready is not None and ready.digest is not None:  # settled however the send of k ends
                digests[k] = ready.digest
            in_flight[k % window], digest = engine._send_bucket(layout, k, tensors, version, ready)
            if digest is not None:
                digests[k] = digest
            _send_digests(engine, digests, upto=k - 1)
        _send_digests(engine, digests, upto=count - 1)
        for k in range(max(0, count - window), count):
            engine._wait(in_flight[k % window], f"bucket {k} of {count}")
    finally:
        settle([*digests.values(), *(p.digest for p in packed.values() if p.digest is not None)])
        engine._regions = [None] * SLOTS


def _send_digests(engine: BucketEngine, digests: dict[int, Future[int]], upto: int) -> None:
    """Send, in bucket order, the checksums of buckets up to `upto` (waiting for them), then those
    of later buckets already computed."""
    while digests:
        k = min(digests)
        if k > upto and not digests[k].done():
            return
        engine._send_digest(k, digests.pop(k).result())


@dataclass(frozen=True)
class Packed:
    """A bucket `pack_together` put in its slot already, with its checksum under way (None unverified)."""

    digest: Future[int] | None


def pack_together(engine: BucketEngine, layout: Layout, k: int, tensors: Sequence[torch.Tensor]) -> dict[int, Packed]:
    """Buckets k, k + 1, ... packed with one memmove, where each is a region of its sources'
    storage (`Layout.region`: a flattened model) and the regions lie in one storage exactly as
    the buckets' slots lie in memory, back to back (shm's flip set, `join`ed); by bucket, each
    with its checksum, started before the copy: it reads the sources, so it runs beside it.
    Empty, and nothing copied, when fewer than two buckets go together (each is packed alone).

    One large copy instead of one a bucket: glibc's memcpy writes around the caches only above
    a size it derives from the cache sizes (the tunable `glibc.cpu.x86_non_temporal_threshold`:
    192 MiB on the VM of the README's figures); below it every line written is read first,
    which halves the copy's speed there. The receivers hear of these buckets only once all
    are written, which a sender that never waits for a slot (flip) can afford: it waits for
    no receiver before the last bucket anyway."""
    runs: dict[int, int] = {}  # bucket: the address its region starts at
    source = target = storage = end = 0
    for b in range(k, len(layout.plan.buckets)):
        data = engine.slots[b % len(engine.slots)].data
        region = layout.region(b, tensors) if data.device.type == "cpu" else None
        if region is None:
            break
        if b == k:
            source, target, storage = region.data_ptr(), data.data_ptr(), region.untyped_storage().data_ptr()
        elif (region.data_ptr() - source != data.data_ptr() - target or region.untyped_storage().data_ptr() != storage
              or data.data_ptr() != end):
            break
        end = data.data_ptr() + data.numel()  # the next bucket's data must start here: no header between
        runs[b] = region.data_ptr()
    if len(runs) < 2:
        return {}
    packing, last = time.perf_counter(), max(runs)
    packed: dict[int, Packed] = {}
    try:
        for b, address in runs.items():
            packed[b] = Packed(_hash_later(engine, layout, b, [(0, address, layout.plan.used(b))]))
    finally:
        if len(packed) < len(runs):  # a checksum could not be started: none of them may outlive this call
            settle([p.digest for p in packed.values() if p.digest is not None])
    with record_function(f"pack buckets {k}-{last}"):
        ctypes.memmove(target, source, runs[last] + layout.plan.used(last) - source)
    engine._phases["pack"] += time.perf_counter() - packing
    return packed


def _hash_later(engine: BucketEngine, layout: Layout, k: int, copied: Copied) -> Future[int] | None:
    """Bucket k's checksum on the checksum worker, reading `copied` where it was copied from (None unverified)."""
    if not layout.plan.verify:
        return None
    data = engine.slots[k % len(engine.slots)].data[:layout.plan.used(k)]
    return engine.checksums.worker().submit(_hash_sent, engine, data, copied)


def send_bucket(engine: BucketEngine, layout: Layout, k: int, tensors: Sequence[torch.Tensor],
                version: int, packed: Packed | None = None) -> tuple[Any, Future[int] | None]:
    """Pack bucket k (with one copy when it is a region of its sources' storage; not at all
    when the engine `sends_regions` too: only its header goes into the slot) and start its
    transfer at once; returns the transfer and, when the plan verifies, its checksum under
    way (sent by `sender.send_buckets`). `packed`: the bucket is in its slot already, and its
    checksum under way (`pack_together`).

    On a host the checksum worker hashes the bucket while it is on the wire, reading each
    piece packed byte for byte where it was packed from, and a region in place (nothing
    copied: `xxh3_packed` reads it all, as `xxh3_digest` does): until it is done neither
    those tensors nor the slot may change, which the pipeline keeps by sending digest k
    before it writes bucket k + 2 into k's slot, and by settling every checksum before the
    send returns. On a device the word sums are queued on the stream behind the pack, so
    they see the bucket as packed, and read once the transfer started."""
    slot, used, verify = engine.slots[k % len(engine.slots)], layout.plan.used(k), layout.plan.verify
    host = slot.data.device.type == "cpu"
    in_place = layout.region(k, tensors) if engine.sends_regions else None
    engine._regions[k % len(engine._regions)] = in_place
    data = slot.data[:used] if in_place is None else in_place
    copied: Copied | None = [] if verify and host and packed is None else None
    packing = time.perf_counter()
    with record_function(f"pack bucket {k}"):
        if in_place is None and packed is None:
            layout.pack(k, tensors, copied)
        write_header(slot.head, version, k, used)
        sums = word_sums(data) if verify and not host else None
    engine._phases["pack"] += time.perf_counter() - packing
    handle = engine._start_send(k, HEADER_BYTES + used)
    if packed is not None:
        return handle, packed.digest
    if copied is not None:
        return handle, engine.checksums.worker().submit(_hash_sent, engine, data, copied)
    return handle, None if sums is None else done(fold(sums))


def _hash_sent(engine: BucketEngine, data: torch.Tensor, copied: Copied) -> int:
    """`xxh3_packed` on the checksum worker, its time counted as the sync's `hash` phase."""
    start = time.perf_counter()
    digest = xxh3_packed(data, copied)
    engine._phases["hash"] += time.perf_counter() - start
    return digest
