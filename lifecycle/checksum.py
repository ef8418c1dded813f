"""File checksums (xxh3_64) and the bookkeeping that lets writers and readers skip a second pass.

Every file of a checkpoint is checksummed in its manifest. A writer that hashed a file's
bytes while writing them `remember`s the digest, and the manifest takes it from there
instead of reading the file again. On resume, the files' expected digests are published
with `expecting`; a reader that verifies a file while reading it reports it with
`mark_verified`, and only the files nobody verified are hashed separately.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import xxhash

from lifecycle.errors import CheckpointError

ALGORITHM = "xxh3_64"
CHUNK_BYTES = 64 * 1024 * 1024

_written: dict[str, tuple[int, int, str]] = {}
_expected: ContextVar[tuple[Mapping[str, str], set[str]] | None] = ContextVar("lifecycle_expected", default=None)


class Hasher:
    """Feeds buffers, in order, to one xxh3 state on a worker thread (xxh3 releases the GIL).

    Without `executor` each hasher starts a worker of its own and stops it when done. A caller
    that hashes run after run (an engine, one bucket at a time) passes its own executor
    instead of starting and joining a thread per run, and shuts it down itself. That
    executor must run one task at a time, in order (`ThreadPoolExecutor(max_workers=1)`).
    """

    def __init__(self, executor: ThreadPoolExecutor | None = None) -> None:
        self._state = xxhash.xxh3_64()
        self._owned = executor is None
        self._pool = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="checksum")
        self._pending: list[Future[None]] = []

    def feed(self, buffer: memoryview | bytes) -> None:
        """The buffer must not change until `digest()` or `abandon()` returns."""
        self._pending.append(self._pool.submit(self._state.update, buffer))

    def digest(self) -> str:
        try:
            for future in self._pending:
                future.result()
        finally:
            self._done(cancel=False)
        return self._state.hexdigest()

    def abandon(self) -> None:
        """Drop what was not hashed yet; returns once the worker no longer reads any buffer."""
        self._done(cancel=True)

    def _done(self, cancel: bool) -> None:
        if cancel:
            for future in self._pending:
                future.cancel()
        wait(self._pending)
        self._pending.clear()
        if self._owned:
            self._pool.shutdown(wait=True)


def file_digest(path: Path, *, fsync: bool = False) -> str:
    """xxh3_64 of a whole file, hashed through a read-only mapping: no copy out of the page cache."""
    state = xxhash.xxh3_64()
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size:
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                for offset in range(0, size, CHUNK_BYTES):
                    with memoryview(mapped)[offset:offset + CHUNK_BYTES] as chunk:
                        state.update(chunk)
        if fsync:
            os.fsync(fh.fileno())
    return state.hexdigest()


def _key(path: Path) -> str:
    return os.path.realpath(path)


def remember(path: Path, digest: str) -> None:
    """Record the digest of a file this process just wrote, tied to its size and mtime."""
    st = os.stat(path)
    _written[_key(path)] = (st.st_size, st.st_mtime_ns, digest)


def known_digest(path: Path) -> str | None:
    """The remembered digest, if the file is still exactly as it was written; forgets it after."""
    entry = _written.pop(_key(path), None)
    if entry is None:
        return None
    st = os.stat(path)
    return entry[2] if (st.st_size, st.st_mtime_ns) == entry[:2] else None


@contextmanager
def expecting(digests: Mapping[Path, str]) -> Iterator[set[str]]:
    """Publish expected digests for readers; yields the set of files they verified."""
    verified: set[str] = set()
    token = _expected.set(({_key(p): d for p, d in digests.items()}, verified))
    try:
        yield verified
    finally:
        _expected.reset(token)


def expected_digest(path: Path) -> str | None:
    current = _expected.get()
    return None if current is None else current[0].get(_key(path))


def check_unverified(digests: Mapping[Path, str], verified: set[str]) -> None:
    """Hash, after the fact, the files published with `expecting` that no reader verified."""
    for path, want in digests.items():
        if _key(path) not in verified and (got := file_digest(path)) != want:
            raise CheckpointError(f"{path}: checksum {got} != manifest {want}")


def mark_verified(path: Path) -> None:
    current = _expected.get()
    if current is not None:
        current[1].add(_key(path))
