"""`shm`: one host; the sender packs into shared-memory buckets that every receiver maps.

The data plane is `shared.SharedSlotEngine`'s. The two shared buckets are files in /dev/shm,
reserved up front with `posix_fallocate` (a full /dev/shm is an error when the sync starts,
not a SIGBUS half-way), kept from one sync to the next, and unlinked by the sender's
`close()` or at its exit; files of a sender that was killed are removed by the next sender
in its pid namespace on this host. A file's name carries its sender's pid namespace and pid:
whether that pid lives can be told only in its own namespace, so files of others (another
container sharing /dev/shm) are left alone.

A receiver maps what the sender publishes read-write, so it maps nothing else: a published
path must name a regular file (no link, no device) directly inside the receiver's own
`shm_dir`, named as this engine names its buckets, and of the size the plan's buckets need.
The sender publishes its buckets (`slots`) as the sync opens, and a receiver maps them while
it checks the plan, so buckets it refuses are one more reason in its answer to the plan
(`accepted/{rank}`), and the sender fails at once.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import stat
import tempfile
import uuid
import weakref
from pathlib import Path
from typing import Any

import torch

from backends.engines.slots import HEADER_BYTES, SLOTS
from backends.engines.control import PARSE_ERRORS, clip
from backends.engines.options import MIN_BUCKET_BYTES, EngineCapabilities, is_path
from backends.engines.plan import ALIGN, PlanRefused
from backends.engines.registry import CheckpointEngineRegistry
from backends.engines.shared import SharedSlotEngine
from lifecycle.boundary import PATH_MAX
from lifecycle.errors import EngineError, shorten
from lifecycle.records import say


@CheckpointEngineRegistry.register("shm")
class ShmEngine(SharedSlotEngine):
    """Sender and receivers on one host; `shm_dir` defaults to /dev/shm."""

    capabilities = EngineCapabilities(devices=frozenset({"cpu"}), flips=True)

    def __init__(self, *, shm_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if shm_dir is not None and not is_path(shm_dir):
            raise EngineError(f"shm engine: shm_dir must name a folder (a path, not empty), got {shorten(shm_dir, 60)}")
        self.shm_dir = Path(shm_dir) if shm_dir is not None else _default_dir()
        self._paths: list[str] = []
        """The sender's bucket files, as it publishes them."""
        self._unlink: weakref.finalize | None = None
        self._files: list[tuple[int, int]] = []
        """A receiver's: (device, inode) of each bucket or set file it mapped last."""

    def _publish(self) -> bytes:
        return json.dumps(self._paths).encode()

    def _open(self, raw: bytes) -> list[torch.Tensor]:
        mapped = [_map_published(path, self.shm_dir) for path in _published(raw, self.shm_dir)]
        self._files = [identity for _, identity in mapped]
        return [region for region, _ in mapped]

    def _identity(self, index: int) -> object:
        return self._files[index] if index < len(self._files) else None

    def _create(self, size: int) -> list[torch.Tensor]:
        self._free_buckets()
        _remove_orphans(self.shm_dir)
        try:
            info = os.statvfs(self.shm_dir)
        except OSError as exc:
            raise EngineError(f"shm engine: cannot read the free space of shm_dir {self.shm_dir}: {exc}") from exc
        free = info.f_bavail * info.f_frsize
        if free < size * SLOTS:
            raise EngineError(f"shm engine: {self.shm_dir} has {free} bytes free, its two shared "
                              f"{'weight sets' if self.apply == 'flip' else 'buckets'} need {size * SLOTS}; lower "
                              "engine.bucket_bytes (or leave apply 'flip') or give the container more shared memory")
        token = f"{_PREFIX}ns{_PID_NS}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._paths = [str(self.shm_dir / f"{token}-{i}") for i in range(SLOTS)]
        self._unlink = weakref.finalize(self, _unlink, list(self._paths))
        return [_create_bucket(Path(path), size) for path in self._paths]

    def _free_buckets(self) -> None:
        super()._free_buckets()
        if self._unlink is not None:
            self._unlink()
        self._unlink = None
        self._paths = []


_PREFIX = "trainer-lifecycle-shm-"
_PID_LIMIT = 1 << 22
"""Linux's pid_max is at most 2**22: a bigger number in a name is no process of this host."""


_NAME = re.compile(re.escape(_PREFIX) + r"(?:ns([0-9]{1,20})-)?([0-9]{1,7})-[0-9a-f]{12}-[0-9]")
"""A bucket's name: its sender's pid namespace (absent from names made before they had one), pid, token, slot."""


def _pid_namespace() -> int:
    """This process's pid namespace, by its inode; 0 where /proc cannot tell (a sender without
    /proc then sweeps only files of senders that could not tell either)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


_PID_NS = _pid_namespace()


def _published(raw: bytes, folder: Path) -> list[Path]:
    """The sender's bucket paths, each named as `_create` names them directly inside `folder`
    (this receiver's own shm_dir, however the sender spells it), as paths in `folder`."""
    try:
        paths = json.loads(raw)
    except PARSE_ERRORS:
        paths = None
    if not (isinstance(paths, list) and len(paths) == SLOTS and all(isinstance(p, str) for p in paths)
            and len({Path(p).name for p in paths}) == SLOTS):  # one file named twice, however spelled
        raise PlanRefused(f"the sender published {raw[:120]!r} ({len(raw)} bytes) as its buckets, "
                          f"not {SLOTS} distinct paths")
    for path in paths:
        if not (len(path) <= PATH_MAX and _NAME.fullmatch(Path(path).name)
                and _same_folder(Path(path).parent, folder)):
            raise PlanRefused(f"{clip(repr(path), 200)} is not a bucket of this engine directly inside {folder} "
                              f"(named {_PREFIX}ns<pid namespace>-<pid>-<token>-<slot>)")
    return [folder / Path(path).name for path in paths]


def _same_folder(published: Path, folder: Path) -> bool:
    try:
        return os.path.realpath(published) == os.path.realpath(folder)
    except (OSError, ValueError):  # a NUL byte in the name is a ValueError
        return False


def _create_bucket(path: Path, size: int) -> torch.Tensor:
    """Create a shared bucket and reserve its pages first, so a full /dev/shm fails here and
    not as a SIGBUS half-way through a sync."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise EngineError(f"shm engine: cannot create the shared bucket {path}: {exc}") from exc
    try:
        os.posix_fallocate(fd, 0, size)
        return torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)
    except OSError as exc:
        raise EngineError(f"shm engine: cannot reserve the shared bucket {path} ({size} bytes): {exc}; "
                          f"lower engine.bucket_bytes or free space in {path.parent}") from exc
    finally:
        os.close(fd)


def _map_published(path: Path, folder: Path) -> tuple[torch.Tensor, tuple[int, int]]:
    """Map a bucket the sender published in `folder` read-write (see `_open_shared`), with the
    file's (device, inode); `PlanRefused` says why not."""
    try:
        fd, info = _open_shared(path, folder)
    except OSError as exc:
        raise PlanRefused(f"cannot open the shared bucket {path}: {exc}") from None
    try:
        return torch.frombuffer(mmap.mmap(fd, info.st_size), dtype=torch.uint8), (info.st_dev, info.st_ino)
    except OSError as exc:
        raise PlanRefused(f"cannot map the shared bucket {path}: {exc}") from None
    finally:
        os.close(fd)


def _open_shared(path: Path, folder: Path) -> tuple[int, os.stat_result]:
    """Open a published bucket read-write through `folder` itself, refusing a link, anything but
    a regular file, a file with other names (hard links), another user's file (another user of
    a world-writable /dev/shm could write the set a rollout serves), and a size no bucket has; returns the
    descriptor and what `fstat` says of it. The descriptor is closed on every way out but the return."""
    folder_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        before = os.stat(path.name, dir_fd=folder_fd, follow_symlinks=False)
        if not stat.S_ISREG(before.st_mode):
            raise PlanRefused(f"{path} is not a regular file (a link, a folder or a device)")
        fd = os.open(path.name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder_fd)
    finally:
        os.close(folder_fd)
    try:
        info = os.fstat(fd)
        size = info.st_size - HEADER_BYTES
        problem = ("it changed while it was opened" if (info.st_dev, info.st_ino) != (before.st_dev, before.st_ino)
                   else f"it has {info.st_nlink} names" if info.st_nlink != 1
                   else f"it belongs to uid {info.st_uid}, not to this process's {os.geteuid()}"
                   if info.st_uid != os.geteuid()
                   else f"its {info.st_size} bytes are no bucket's size" if size < MIN_BUCKET_BYTES or size % ALIGN
                   else None)
        if problem is not None:
            raise PlanRefused(f"{path}: {problem}")
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def _unlink(paths: list[str]) -> None:
    """Also run at exit (a `weakref.finalize`), so it logs what it cannot remove and never raises."""
    for path in paths:
        try:
            Path(path).unlink(missing_ok=True)
        except NotADirectoryError:  # shm_dir is no folder: no bucket was ever created in it
            continue
        except OSError as exc:
            say("warning", "engine.shm_bucket_kept", path=path, error=str(exc))


def _remove_orphans(folder: Path) -> None:
    """Unlink buckets left by senders that died without closing (SIGKILL, OOM).

    Housekeeping that must never fail a sync, in a folder others write to: it removes only
    this user's regular files named as this engine names its buckets (looked at with lstat,
    never through a link) whose sender is gone, and logs an entry it cannot remove and goes on.
    Gone: of this pid namespace, and its pid names no process here; a pid of another namespace
    says nothing here, so those files stay. A name without a namespace (made before names had
    one) is judged by its pid, as it was then.
    """
    try:
        names = [name for name in os.listdir(folder) if name.startswith(_PREFIX)]
        folder_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        say("warning", "engine.shm_sweep_skipped", folder=str(folder), error=str(exc))
        return
    try:
        for name in names:
            match = _NAME.fullmatch(name)
            if match is None or match.group(1) not in (None, str(_PID_NS)) or _alive(int(match.group(2))):
                continue
            try:
                info = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
                if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
                    os.unlink(name, dir_fd=folder_fd)
            except OSError as exc:
                say("warning", "engine.shm_orphan_kept", path=str(folder / name), error=str(exc))
    finally:
        os.close(folder_fd)


def _alive(pid: int) -> bool:
    """Whether `pid` may be a live process: a pid outside 1..pid_max, or one that cannot be
    asked, counts as alive, so its buckets are left alone."""
    if not 0 < pid < _PID_LIMIT:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _default_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())
