"""`shm`: one host; the sender packs into shared-memory buckets that every receiver maps.

No byte of weights goes through a socket. A streamed receiver verifies and reads the
sender's bucket in place; an atomic one (the default) verifies it and copies it into private
memory, handed out once every bucket has verified. The two shared buckets are files in /dev/shm, reserved up front with
`posix_fallocate` (a full /dev/shm is an error when the sync starts, not a SIGBUS half-way),
kept from one sync to the next, and unlinked by the sender's `close()` or at its exit; files
of a sender that was killed are removed by the next sender on this host. The per-bucket
signals ("bucket k is ready", "rank r is done with bucket k") are keys of the sync's control
store.
"""

from __future__ import annotations

import json
import mmap
import os
import tempfile
import uuid
import weakref
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import torch

from backends.engines.base import Topology
from backends.engines.buckets import HEADER_BYTES, Layout, align
from backends.engines.pipeline import SLOTS, BucketEngine, receive_sizes
from backends.engines.registry import CheckpointEngineRegistry
from lifecycle.errors import EngineError


@CheckpointEngineRegistry.register("shm")
class ShmEngine(BucketEngine):
    """Sender and receivers on one host; `shm_dir` defaults to /dev/shm."""

    def __init__(self, *, shm_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.shm_dir = Path(shm_dir) if shm_dir is not None else _default_dir()
        self._paths: list[str] = []
        self._unlink: weakref.finalize | None = None
        self._staged: Layout | None = None

    def _ensure_slots(self, sizes: Sequence[int]) -> None:
        """Nothing here: the sender creates the shared buckets once the group forms, receivers map them."""

    def _staging(self, layout: Layout) -> Layout:
        """An atomic receiver's private buffers, one per bucket: the shared slots are the
        sender's to refill. Kept from one sync to the next while the plan stays the same."""
        staged = self._staged
        if staged is None or staged.plan is not layout.plan:
            self._staged = None
            buffers = self._allocate(receive_sizes(layout.plan, "atomic"), torch.device("cpu"))
            staged = self._staged = Layout(layout.plan, buffers)
        staged.reset()
        return staged

    def _connect(self, topology: Topology) -> None:
        control = self._control()
        if topology.is_sender:
            if not self.slots or self.slots[0].numel() != HEADER_BYTES + align(self.bucket_bytes):
                self._create(HEADER_BYTES + align(self.bucket_bytes))
            control.set("slots", json.dumps(self._paths))
            control.wait([f"mapped/{rank}" for rank in topology.receivers])
            return
        paths = json.loads(control.get("slots"))
        if paths != self._paths:
            self.slots = [_map(Path(path)) for path in paths]
            self._paths = paths
        control.set(f"mapped/{topology.rank}", b"1")

    def _create(self, size: int) -> None:
        self._free_buckets()
        _remove_orphans(self.shm_dir)
        stat = os.statvfs(self.shm_dir)
        free = stat.f_bavail * stat.f_frsize
        if free < size * SLOTS:
            raise EngineError(f"shm engine: {self.shm_dir} has {free} bytes free, two buckets need {size * SLOTS}; "
                              "lower engine.bucket_bytes or give the container more shared memory")
        token = f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._paths = [str(self.shm_dir / f"{token}-{i}") for i in range(SLOTS)]
        self._unlink = weakref.finalize(self, _unlink, list(self._paths))
        self.slots = [_map(Path(path), size) for path in self._paths]

    def _free_buckets(self) -> None:
        super()._free_buckets()
        self._staged = None
        if self._unlink is not None:
            self._unlink()
        self._unlink = None
        self._paths = []

    def _start_send(self, k: int, nbytes: int) -> int:
        self._control().set(f"ready/{k}", b"")
        return k

    def _start_recv(self, k: int, nbytes: int) -> int:
        return k

    def _wait(self, handle: Any, what: str) -> None:
        topology = self._topology()
        if topology.is_sender:
            self._control().wait([f"done/{handle}/{rank}" for rank in topology.receivers])
        else:
            self._control().wait([f"ready/{handle}"], watch_closed=True)

    def _release(self, k: int) -> None:
        self._control().set(f"done/{k}/{self._topology().rank}", b"")


_PREFIX = "trainer-lifecycle-shm-"


def _map(path: Path, create_size: int = 0) -> torch.Tensor:
    """Map a shared bucket read-write; with `create_size`, create it and reserve its pages first."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create_size else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise EngineError(f"shm engine: cannot open the shared bucket {path}: {exc}") from exc
    try:
        if create_size:
            os.posix_fallocate(fd, 0, create_size)
        mapped = mmap.mmap(fd, create_size or os.fstat(fd).st_size)
    except OSError as exc:
        raise EngineError(f"shm engine: cannot reserve the shared bucket {path} ({create_size or '?'} bytes): "
                          f"{exc}; lower engine.bucket_bytes or free space in {path.parent}") from exc
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=torch.uint8)


def _unlink(paths: list[str]) -> None:
    for path in paths:
        Path(path).unlink(missing_ok=True)


def _remove_orphans(folder: Path) -> None:
    """Unlink buckets left by senders that died without closing (SIGKILL, OOM)."""
    for path in folder.glob(f"{_PREFIX}*"):
        pid = path.name.removeprefix(_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _default_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())
