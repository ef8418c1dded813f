"""One writer per role and root: an advisory `fcntl.flock` held from staging to commit.

Two jobs saving the same role into one root would write into one staging folder and rename
each other's files away. The lock file `root/.lock-<role>` is taken without waiting: the
second writer is refused at once with the holder's host and pid, which the holder writes
into the file once it has the lock. The kernel drops the lock when its holder exits, however
it exits, so a crashed writer never leaves a stale lock behind.

What it guarantees: on one host, and on network filesystems whose `flock` reaches the server
(NFSv4, and NFSv3 with a working lock manager: Linux emulates `flock` there with byte-range
locks), two writers of one role never overlap. What it does not: filesystems that keep
`flock` local to each client (some FUSE and object-store mounts, NFS mounted with
`local_lock=all` or `nolock`) let writers on two hosts through; there, run one writer per
role by construction (the driver does).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
import weakref
from pathlib import Path

from lifecycle.boundary import kind, os_error, os_errors
from lifecycle.errors import CheckpointError
from lifecycle.records import say

_HOLDER_LIMIT = 4096


LOCK_PREFIX = ".lock-"


def lock_path(root: Path, role: str) -> Path:
    return root / f"{LOCK_PREFIX}{role}"


class LockHeld(CheckpointError):
    """Another writer holds the role's lock (a save of it is in flight elsewhere), as opposed to
    a lock that cannot be taken at all (ENOLCK: a network filesystem without a lock manager)."""


def lock_errno(exc: BaseException) -> str | None:
    """The errno name (`ENOLCK`) of the `OSError` behind a lock that could not be taken, if any."""
    cause = exc.__cause__
    return errno.errorcode.get(cause.errno or 0) if isinstance(cause, OSError) else None


_LOCKS: weakref.WeakSet[WriterLock] = weakref.WeakSet()
_HELD: set[int] = set()
"""This process's open lock descriptors. A forked child closes its copies at once (a lock
belongs to the open file, which a fork shares, and O_CLOEXEC acts only on exec): else a data
loader's worker forked during a save would hold the role's lock for as long as it lives, and
every later save would be refused as another writer's. Closing a copy leaves the parent's lock."""


def _close_in_child() -> None:
    for fd in list(_HELD):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()
    for lock in list(_LOCKS):
        lock._fd = None


os.register_at_fork(after_in_child=_close_in_child)


class WriterLock:
    """The lock of one role under one root; `acquire` and `release` pair up, once each."""

    def __init__(self, root: Path, role: str) -> None:
        self.path = lock_path(root, role)
        self.role = role
        self._fd: int | None = None
        _LOCKS.add(self)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock now, or raise `LockHeld` naming who holds it (another `CheckpointError`
        when it cannot be taken at all)."""
        if self._fd is not None:
            return
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        with os_errors(f"cannot open the writer lock of role {self.role!r}", self.path):
            try:
                fd = os.open(self.path, flags, 0o644)
                _HELD.add(fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise CheckpointError(f"{self.path}: the writer lock is a symlink; refusing to follow it") from exc
                raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{self.path}: the writer lock is a {kind(st.st_mode)}, not a regular file")
            if st.st_nlink != 1:
                raise CheckpointError(f"{self.path}: the writer lock has {st.st_nlink} names (a hard link planted "
                                      "to another file?); remove it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LockHeld(
                    f"{self.path}: role {self.role!r} is being saved into this root by {_holder(fd)}; one "
                    "writer per role and root at a time (a second job, or two workers given one role?)"
                ) from None
            except OSError as exc:  # ENOLCK: NFSv3 without a lock manager; typed, so callers can skip or refuse
                raise os_error(exc, f"cannot lock the writer lock of role {self.role!r}", self.path) from exc
            with os_errors("cannot write the writer lock", self.path):
                record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()})
                os.ftruncate(fd, 0)
                os.pwrite(fd, record.encode(), 0)
        except BaseException:
            _HELD.discard(fd)
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Give the lock up; never raises (closing the descriptor drops the lock in any case)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            _HELD.discard(fd)
            try:
                os.close(fd)
            except OSError as exc:  # NFS reports a deferred write error (EIO) at close; the lock is gone anyway
                say("warning", "checkpoint.writer_lock_close_failed", path=str(self.path), role=self.role,
                    error=str(exc))


def _holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote it; partly written or unreadable says so."""
    try:
        data = json.loads(os.pread(fd, _HOLDER_LIMIT, 0).decode("utf-8"))
        return f"host {data['host']} pid {data['pid']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (host and pid not yet written)"
