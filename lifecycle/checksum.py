"""File checksums, and the one check a reader's second pass may still need.

Every file of a checkpoint is checksummed in its manifest. The checksum (`ALGORITHM`) is a
tree: the file is cut by offset into pieces of `PIECE_BYTES`, each piece gets its own
xxh3_64, and the file's digest is the xxh3_64 of those piece digests. One xxh3 stream runs
on one core at a time; pieces hash on every core, and a reader can hash each piece right
after reading it, while its bytes are still in cache. Manifests written before the tree
name the plain stream (`PLAIN`) and still verify.

Digests travel as values, never through this module: a writer that hashed a file while
writing it returns the digest (a format's `save_model` returns them all), and the commit
takes them from there; on resume the expected digests are handed to the reader, which
returns the files it verified, and `check_unverified` hashes the rest. Nothing here keeps
state between calls.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import xxhash

from lifecycle.boundary import open_regular
from lifecycle.errors import CheckpointError

PIECE_BYTES = 4 * 1024 * 1024
"""Large enough that handing pieces to threads costs nothing, small enough to hash from cache
(by hand during development, with 1 GiB of 200 tensors: 4 MiB resumed a little faster than
2 or 8 MiB; no benchmark varies it)."""
ALGORITHM = f"xxh3_64-tree-{PIECE_BYTES >> 20}MiB"
PLAIN = "xxh3_64"
ALGORITHMS = (ALGORITHM, PLAIN)
"""Every algorithm a manifest may name, the one written first."""
THREADS = max(1, min(8, os.cpu_count() or 1))
"""Threads that move and hash pieces: every core, up to 8, past which memory bandwidth bounds a copy."""
CHUNK_BYTES = 64 * 1024 * 1024


def submitted(pool: ThreadPoolExecutor, work: Callable[..., Any], *args: Any) -> Future[Any] | None:
    """`pool.submit(work, *args)`, or None when the pool takes no more work: the interpreter is
    exiting (once its exit hooks have run, as in an `atexit` hook, `concurrent.futures` refuses
    new work) or no thread can start. The caller then does the work in its own thread."""
    try:
        return pool.submit(work, *args)
    except RuntimeError:
        return None


def piece_digest(buffers: Iterable[memoryview | bytes]) -> int:
    """xxh3_64 of one piece, given as the buffers that hold its bytes in order."""
    state = xxhash.xxh3_64()
    for buffer in buffers:
        state.update(buffer)
    return state.intdigest()


def tree_digest(count: int, piece: Callable[[int], int]) -> str:
    """The file digest from `piece(i)`, the digest of piece i, run for every piece on THREADS threads.

    The calling thread is one of them. Each takes the next piece not taken yet, so a thread
    slowed by others on its core does less; digests are combined in file order. After a
    failure the pieces not started are dropped, and this returns only once no piece runs.
    """
    digests = [0] * count
    order = itertools.count()
    failed = threading.Event()

    def work() -> None:
        while not failed.is_set() and (index := next(order)) < count:
            try:
                digests[index] = piece(index)
            except BaseException:
                failed.set()
                raise

    with ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="checksum") as pool:
        helpers = [helper for _ in range(min(THREADS, count) - 1) if (helper := submitted(pool, work)) is not None]
        work()  # takes every piece no helper does: all of them when no helper could start
        for helper in helpers:
            helper.result()
    return xxhash.xxh3_64(b"".join(d.to_bytes(8, "little") for d in digests)).hexdigest()


def file_digest(path: Path, *, fsync: bool = False, algorithm: str = ALGORITHM) -> str:
    """The digest of a whole file, hashed through a read-only mapping: no copy out of the page cache."""
    if algorithm not in ALGORITHMS:
        raise CheckpointError(f"{path}: unknown checksum algorithm {algorithm!r}")
    with open_regular(path) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size:
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                digest = _hash_mapped(mapped, size, algorithm)
        else:
            digest = _hash_mapped(b"", 0, algorithm)
        if fsync:
            os.fsync(fh.fileno())
    return digest


def _hash_mapped(mapped: mmap.mmap | bytes, size: int, algorithm: str) -> str:
    """Each view is released before the mapping closes: an exported buffer would keep it open."""
    if algorithm == PLAIN:
        state = xxhash.xxh3_64()
        for offset in range(0, size, CHUNK_BYTES):
            with memoryview(mapped)[offset:offset + CHUNK_BYTES] as chunk:
                state.update(chunk)
        return state.hexdigest()

    def piece(index: int) -> int:
        with memoryview(mapped)[index * PIECE_BYTES:(index + 1) * PIECE_BYTES] as view:
            return xxhash.xxh3_64_intdigest(view)

    return tree_digest(-(-size // PIECE_BYTES), piece)


def side_by_side(work: Callable[[str], str], items: Sequence[str], threads: int) -> Iterator[tuple[str, str]]:
    """`(item, work(item))` for every item, each as it is done, on up to `threads` threads; an item
    no thread takes (see `submitted`) is done in the calling thread. After a failure, this returns
    only once no work runs."""
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(items))), thread_name_prefix="checksum") as pool:
        futures: dict[Future[str], str] = {}
        for item in items:
            if (future := submitted(pool, work, item)) is None:
                yield item, work(item)
            else:
                futures[future] = item
        for future in as_completed(futures):
            yield futures[future], future.result()


def check_unverified(folder: Path, expected: Mapping[str, str], verified: Collection[str]) -> None:
    """Hash, after loading, each file of `expected` (path relative to `folder`: digest) that is
    not in `verified`: the ones no reader checked while reading them."""
    for rel, want in expected.items():
        if rel not in verified and (got := file_digest(folder / rel)) != want:
            raise CheckpointError(f"{folder / rel}: checksum {got} != manifest {want}")
