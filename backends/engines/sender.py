"""The sender's side of one sync once every receiver accepted the plan: buckets in order, two in
flight, each checksum sent after its bucket (see `pipeline` for the pipeline as a whole).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from backends.engines.buckets import SLOTS, Layout, settle

if TYPE_CHECKING:
    from backends.engines.pipeline import BucketEngine


def send_buckets(engine: BucketEngine, layout: Layout, tensors: Sequence[torch.Tensor], version: int) -> None:
    """Every bucket, two in flight, each checksum sent after its bucket; returns once the last
    transfer is done, and, however it ends, once no checksum reads a bucket any more.

    Bucket k waits for bucket k - 2's transfer (its slot) and for its checksum's being sent, so
    digest k - 2 goes out at the latest before bucket k is packed; later digests go as soon as
    they are ready."""
    count = len(layout.plan.buckets)
    in_flight: list[Any] = [None] * SLOTS
    engine._in_flight = in_flight
    digests: dict[int, Future[int]] = {}
    try:
        for k in range(count):
            if in_flight[k % SLOTS] is not None:
                engine._wait(in_flight[k % SLOTS], f"bucket {k - SLOTS} of {count}")
            _send_digests(engine, digests, upto=k - SLOTS)
            in_flight[k % SLOTS], digest = engine._send_bucket(layout, k, tensors, version)
            if digest is not None:
                digests[k] = digest
            _send_digests(engine, digests, upto=k - 1)
        _send_digests(engine, digests, upto=count - 1)
        for k in range(max(0, count - SLOTS), count):
            engine._wait(in_flight[k % SLOTS], f"bucket {k} of {count}")
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
