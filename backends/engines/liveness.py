"""Whether the receivers of a sync that run on the sender's host are still alive.

A receiver that dies leaves its keys unset, and the sender waiting for them used to find out
only at `timeout_s` (five minutes by default), on every engine whose waits are on the store
(shm and cuda_ipc throughout, every engine while a rollout loads the weights). Each receiver
posts, as it joins, who it is (`pid/{rank}`: the boot and pid namespace its process id is
read in, the id, and the process's start time); the sender opens a pidfd (`os.pidfd_open`) for
each receiver that shares its boot and namespace and whose id names a process that started at
that time, which polls readable the moment that process ends, and a wait for a key of that
rank fails then, naming it. A receiver on another host, in another pid namespace, or on a
system without pidfds is not watched: it fails the sync at `timeout_s`, as before.

Only a live process can be told to be the receiver (its start time): an id that names no
process when the sender reads it is not watched, since a receiver that died cannot be told
from one on another machine that shares the boot id (a clone of one memory snapshot). The
sender reads the ids at the start of each of its waits and then every 0.25 s, so a receiver
that dies between posting and that read costs `timeout_s`, as an unwatched one does. A pidfd
names the process it was opened for, never a later one with the same id. Whoever else writes
the store can make a receiver look dead (the sync fails, loudly) or alive (it waits out its
timeout), as they can make any receiver refuse.
"""

from __future__ import annotations

import functools
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


def _started(pid: int | str) -> str | None:
    """When process `pid` started, in clock ticks after boot (`/proc/<pid>/stat`, field 22);
    None when there is no such process or it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
        return stat.rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def whoami() -> str:
    """What a receiver posts as `pid/{rank}`: its pid space, its pid and its start time."""
    return _who(os.getpid())


@functools.cache
def _who(pid: int) -> str:
    """`whoami` of process `pid` (this one), read once: none of it changes while it lives (a
    forked child has a pid of its own, so reads its own)."""
    return f"{_pid_space()} {pid} {_started(pid) or ''}"


class Watch:
    """The sender's pidfds of one sync's receivers on its host, opened as they are first needed."""

    def __init__(self, receivers: range) -> None:
        self._space = _pid_space() if hasattr(os, "pidfd_open") else ""
        self._unread = set(receivers) if self._space else set()
        self._fds: dict[int, tuple[int, int]] = {}
        """rank: (pidfd, pid)."""

    def learn(self, posted: dict[int, bytes]) -> None:
        """Open a pidfd for each rank of `posted` (its `pid/{rank}`, as read) that names a live
        process of this boot and pid namespace, started when it says; any other is not watched."""
        for rank, raw in posted.items():
            self._unread.discard(rank)
            space, pid, started = (raw.decode("ascii", errors="replace").split(" ") + ["", ""])[:3]
            if space != self._space or not pid.isdigit() or len(pid) > 9 or int(pid) in (0, os.getpid()):
                continue
            try:
                fd = os.pidfd_open(int(pid))
            except OSError:  # no such process (see the module docstring), or no pidfds here
                continue
            if started and _started(pid) == started:  # read after the pidfd opened: the very process
                self._fds[rank] = (fd, int(pid))
            else:
                os.close(fd)

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
            poller.register(self._fds[rank][0], select.POLLIN)
        ended = {fd for fd, _ in poller.poll(0)}
        return {rank: self._fds[rank][1] for rank in owing if self._fds[rank][0] in ended}

    @property
    def watching(self) -> bool:
        """Whether any receiver is, or may yet be, watched."""
        return bool(self._fds or self._unread)

    def close(self) -> None:
        fds, self._fds, self._unread = self._fds, {}, set()
        for fd, _ in fds.values():
            os.close(fd)
