"""Bucket checksums: xxh3 on a host, read in place (and, for a packed bucket, each piece where it
was copied from: `xxh3_packed`), a word sum on a device; and handing checksums under way around.

A bucket's checksum covers its data region, is computed while the bucket is on the wire, and
travels after it (`pipeline`). The sender's checksum reads each piece it copied byte for byte where it
copied it from (`Layout.pack` says where), so a bucket scribbled on between packing and the
wire fails the check; on a device it is a word sum queued on the packing stream right behind
the pack (`word_sums`, read once the transfer started by `fold`). Either is keyed by the sync's
plan as it travels (`keyed`).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch
import xxhash

from backends.engines.sources import Copied

_MASK = (1 << 64) - 1
_MEMORY = memoryview((ctypes.c_char * sys.maxsize).from_address(0))
"""This process's memory as one buffer, so a piece is read in place by slicing it: building a
ctypes array type for each piece's length instead costs about 15 us a piece, as much as hashing
the bucket. `xxh3_packed` reads nothing but a bucket and the live tensors it was packed from."""


def xxh3_digest(data: torch.Tensor) -> int:
    """xxh3_64 of a CPU byte tensor, read in place (xxhash releases the GIL while it hashes)."""
    return xxhash.xxh3_64_intdigest(data.numpy())


def xxh3_packed(data: torch.Tensor, copied: Copied) -> int:
    """xxh3_64 of a packed host bucket's data region `data` (the same `xxh3_digest` gives),
    reading each piece of `copied` (see `Layout.pack`) where it was copied from and the rest
    (padding, pieces torch cast or gathered) in `data`. Its sources must not change meanwhile."""
    state, base, at = xxhash.xxh3_64(), data.data_ptr(), 0
    for offset, address, nbytes in copied:
        if offset > at:
            state.update(_MEMORY[base + at:base + offset])
        state.update(_MEMORY[address:address + nbytes])
        at = offset + nbytes
    if data.numel() > at:
        state.update(_MEMORY[base + at:base + data.numel()])
    return state.intdigest()


READERS = max(1, min(4, os.cpu_count() or 1))
"""Threads a receiver checks buckets on: buckets that land together (a shm flip sender writes
several with one copy) are hashed side by side, on as many cores as there are, up to 4."""


class Checksums:
    """An engine's checksum workers: threads (xxh3 releases the GIL while it hashes), started on
    first use and kept from one bucket and one sync to the next, until `close`. A sender hashes
    on one (`worker`), beside its packing; a receiver on up to `READERS` (`later`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._pools: dict[int, ThreadPoolExecutor] = {}

    def worker(self, threads: int = 1) -> ThreadPoolExecutor:
        pool = self._pools.get(threads)
        if pool is None:
            pool = self._pools[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"{self.name}-checksum")
        return pool

    def later(self, data: torch.Tensor) -> Future[int]:
        """A receiver's checksum of a bucket's data region under way: xxh3 on a worker on a host,
        so the caller goes on receiving; a word sum at once on a device (no copy to the host),
        where it runs on the stream anyway."""
        if data.device.type == "cpu":
            return self.worker(READERS).submit(xxh3_digest, data)
        return done(word_sum_digest(data))

    def close(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.shutdown(wait=True)


def keyed(digest: int, plan: str) -> int:
    """A bucket's checksum as it travels (`digest/{k}`) and is compared: keyed by the id of the plan
    it was sent under (XORed with the id's first 64 bits, on a host and on a device alike), so a
    receiver that took another plan than its sender posted (one someone else wrote to the store)
    fails every bucket's check, even where the sender did not see which plan it took."""
    return digest ^ int(plan[:16], 16)


def done(digest: int) -> Future[int]:
    """A checksum computed already, as one under way is handed around."""
    future: Future[int] = Future()
    future.set_result(digest)
    return future


def settle(pending: Iterable[Future[int]]) -> None:
    """Drop checksums not started and wait for those running: once this returns, no worker
    reads a slot or a source any more, so they may be refilled or freed."""
    pending = list(pending)
    for future in pending:
        future.cancel()
    wait(pending)


def word_sum_digest(data: torch.Tensor) -> int:
    """A 64-bit checksum computed on the tensor's own device, for buckets in GPU/NPU memory.

    xxh3 needs host memory; copying a device bucket to the host to hash it would cost more
    than the transfer. This sums the data as 64-bit words (which catches flipped or stale
    bytes) and weights the sum of each 1 MiB block by its position (which catches blocks
    landing in the wrong place). `data` is a whole number of 64-byte blocks.
    """
    return fold(word_sums(data))


def word_sums(data: torch.Tensor) -> torch.Tensor:
    """The two sums `word_sum_digest` folds, queued on the current stream and not waited for:
    the value they read is the data as the stream has it, whatever the host does next."""
    words = data.view(torch.int64)
    block = 1 << 17
    full = words.numel() // block
    sums = words[:full * block].view(full, block).sum(dim=1)
    tail = words[full * block:].sum()
    weights = torch.arange(1, full + 1, dtype=torch.int64, device=data.device)
    return torch.stack([sums.sum() + tail, (sums * weights).sum() + tail * (full + 1)])


def fold(sums: torch.Tensor) -> int:
    """The checksum from `word_sums`; waits for them."""
    a, b = (int(v) & _MASK for v in sums.tolist())
    return ((a * 0x9E37_79B9_7F4A_7C15) & _MASK) ^ b


__all__ = ["Checksums", "done", "fold", "keyed", "settle", "word_sum_digest", "word_sums", "xxh3_digest", "xxh3_packed"]
