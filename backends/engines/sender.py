"""The sender's side of one sync once every receiver accepted the plan: buckets in order, as many
in flight as the sender has slots, each packed (or sent from its sources' storage) and its
checksum started while it is on the wire, and sent after it (see `pipeline` for the pipeline
as a whole).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import record_function

from backends.engines.buckets import HEADER_BYTES, SLOTS, Layout, write_header
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
    its own place in the weight set) waits for no receiver until the last bucket is written."""
    count, window = len(layout.plan.buckets), max(SLOTS, len(engine.slots))
    in_flight: list[Any] = [None] * window
    engine._in_flight, engine._regions = in_flight, [None] * window
    digests: dict[int, Future[int]] = {}
    try:
        for k in range(count):
            if in_flight[k % window] is not None:
                engine._wait(in_flight[k % window], f"bucket {k - window} of {count}")
            _send_digests(engine, digests, upto=k - window)
            in_flight[k % window], digest = engine._send_bucket(layout, k, tensors, version)
            if digest is not None:
                digests[k] = digest
            _send_digests(engine, digests, upto=k - 1)
        _send_digests(engine, digests, upto=count - 1)
        for k in range(max(0, count - window), count):
            engine._wait(in_flight[k % window], f"bucket {k} of {count}")
    finally:
        settle(digests.values())
        engine._regions = [None] * SLOTS


def _send_digests(engine: BucketEngine, digests: dict[int, Future[int]], upto: int) -> None:
    """Send, in bucket order, the checksums of buckets up to `upto` (waiting for them), then those
    of later buckets already computed."""
    while digests:
        k = min(digests)
        if k > upto and not digests[k].done():
            return
        engine._send_digest(k, digests.pop(k).result())


def send_bucket(engine: BucketEngine, layout: Layout, k: int, tensors: Sequence[torch.Tensor],
                version: int) -> tuple[Any, Future[int] | None]:
    """Pack bucket k (with one copy when it is a region of its sources' storage; not at all
    when the engine `sends_regions` too: only its header goes into the slot) and start its
    transfer at once; returns the transfer and, when the plan verifies, its checksum under
    way (sent by `sender.send_buckets`).

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
    copied: Copied | None = [] if verify and host else None
    packing = time.perf_counter()
    with record_function(f"pack bucket {k}"):
        if in_place is None:
            layout.pack(k, tensors, copied)
        write_header(slot.head, version, k, used)
        sums = word_sums(data) if verify and not host else None
    engine._phases["pack"] += time.perf_counter() - packing
    handle = engine._start_send(k, HEADER_BYTES + used)
    if copied is not None:
        return handle, engine.checksums.worker().submit(_hash_sent, engine, data, copied)
    return handle, None if sums is None else done(fold(sums))


def _hash_sent(engine: BucketEngine, data: torch.Tensor, copied: Copied) -> int:
    """`xxh3_packed` on the checksum worker, its time counted as the sync's `hash` phase."""
    start = time.perf_counter()
    digest = xxh3_packed(data, copied)
    engine._phases["hash"] += time.perf_counter() - start
    return digest
