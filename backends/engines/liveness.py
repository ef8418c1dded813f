"""Whether the receivers of a sync that run on the sender's host are still alive.

A receiver that dies leaves its keys unset, and the sender waiting for them used to find out
only at `timeout_s` (five minutes by default), on every engine whose waits are on the store
(shm and cuda_ipc throughout, every engine while a rollout loads the weights). Each receiver
posts, as it joins, its process id and what that id is read in (`pid/{rank}`: the boot and the
pid namespace); the sender opens a pidfd (`os.pidfd_open`) for each receiver that shares its
own, which polls readable the moment that process ends, and a wait for a key of that rank
fails then, naming it. A receiver on another host, in another pid namespace, or on a system
without pidfds is not watched: it fails the sync at `timeout_s`, as before.

A pidfd names the process it was opened for, never a later one with the same id; the id is
read when the sender first needs it, so a receiver that died before and whose id was given to
another process looks alive, and costs `timeout_s`, as an unwatched one does. Whoever else
writes the store can make a receiver look dead (the sync fails, loudly) or alive (it waits out
its timeout), as they can make any receiver refuse.
"""

from __future__ import annotations

import os
import select
from pathlib import Path


def rank_of(key: str) -> int | None:
    """The rank a receiver's key ends in (`accepted/2`, `done/3/2`); None for a key of no rank."""
    head, _, tail = key.rpartition("/")
    return int(tail) if head and tail.isdigit() and len(tail) < 10 else None


def _pid_space() -> str:
    """The boot and the pid namespace this process's id is read in; "" when either is unknown."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except (OSError, UnicodeDecodeError):
        return ""
    return f"{boot}/{namespace}" if boot else ""


def whoami() -> str:
    """What a receiver posts as `pid/{rank}`: its pid space and its pid."""
    return f"{_pid_space()} {os.getpid()}"


class Watch:
    """The sender's pidfds of one sync's receivers on its host, opened as they are first needed."""

    def __init__(self, receivers: range) -> None:
        self._space = _pid_space() if hasattr(os, "pidfd_open") else ""
        self._unread = set(receivers) if self._space else set()
        self._fds: dict[int, tuple[int, int]] = {}
        """rank: (pidfd, pid)."""

    def learn(self, posted: dict[int, bytes]) -> None:
        """Open a pidfd for each rank of `posted` (its `pid/{rank}`, as read) that shares this
        process's pid space; a rank whose value is anything else is not watched."""
        for rank, raw in posted.items():
            self._unread.discard(rank)
            space, _, pid = raw.decode("ascii", errors="replace").partition(" ")
            if space != self._space or not pid.isdigit() or len(pid) > 9 or int(pid) in (0, os.getpid()):
                continue
            try:
                self._fds[rank] = (os.pidfd_open(int(pid)), int(pid))
            except ProcessLookupError:
                self._fds[rank] = (-1, int(pid))
            except OSError:
                continue

    @property
    def unread(self) -> list[int]:
        """Ranks whose `pid/{rank}` this watch has not read yet."""
        return sorted(self._unread)

    def dead(self, keys: list[str]) -> dict[int, int]:
        """The watched receivers that have ended and owe one of `keys` (a key whose last part is
        its rank, `rank_of`): rank to pid."""
        owing = sorted({rank for key in keys if (rank := rank_of(key)) in self._fds})
        if not owing:
            return {}
        poller = select.poll()
        for rank in owing:
            if self._fds[rank][0] >= 0:
                poller.register(self._fds[rank][0], select.POLLIN)
        ended = {fd for fd, _ in poller.poll(0)}
        return {rank: self._fds[rank][1] for rank in owing if self._fds[rank][0] < 0 or self._fds[rank][0] in ended}

    @property
    def watching(self) -> bool:
        """Whether any receiver is, or may yet be, watched."""
        return bool(self._fds or self._unread)

    def close(self) -> None:
        fds, self._fds, self._unread = self._fds, {}, set()
        for fd, _ in fds.values():
            if fd >= 0:
                os.close(fd)
