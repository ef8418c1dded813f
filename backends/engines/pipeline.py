"""The double-buffered bucket pipeline every transport engine shares (gloo, nccl, hccl, shm).

The sender has two bucket slots: it packs bucket k into slot k % 2 while bucket k - 1 is on
the wire, and waits for bucket k - 2's transfer before it overwrites that slot. A receiver
has buckets k and k + 1 posted and verifies each as it lands. What it does next is its
`apply` mode:

- `streamed`: two slots, like the sender. It hands out bucket k's tensors and only then
  posts bucket k + 2 into the slot k used, so it never holds more than two buckets; a bad
  bucket k leaves buckets before it applied.
- `atomic` (the default): one buffer per bucket of the sync, each bucket received straight
  into its own (shm copies it out of the shared slot). It hands out the first tensor only
  once the last bucket has verified, so a bad bucket anywhere means nothing is applied.

The small messages (plan, statuses, and for shm the per-bucket signals) go through a
`ControlStore`; a subclass supplies only the data plane: slots, start send / receive, wait.
A receiver that rejects a bucket, or whose rollout stops reading, drains the rest without
applying it and reports why, so the sender fails with the reason instead of a timeout.
"""

from __future__ import annotations

import ctypes
import json
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog
import torch
from torch.profiler import record_function

from backends.engines.base import CheckpointEngine, Incoming, SyncStats, Topology, TransportError
from backends.engines.buckets import (
    HEADER_BYTES, MAGIC, Layout, Plan, TensorMeta, align, make_plan, read_header, write_header, xxh3_digest,
)
from backends.engines.control import ControlStore, StoreLink
from lifecycle.checksum import Hasher
from lifecycle.errors import EngineError

SLOTS = 2


class BucketEngine(CheckpointEngine):
    """A checkpoint engine that moves flat buckets between processes; see the module docstring."""

    device: torch.device = torch.device("cpu")
    keeps_buckets: bool = True
    """Keep the bucket buffers from one sync to the next (until `close()`): first-touching fresh
    host memory costs more than the copy into it, so CPU engines allocate once."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.slots: list[torch.Tensor] = []
        self.control: ControlStore | None = None
        self._link = StoreLink(self)
        self._clean = False
        self._in_flight: list[Any] = []
        """Transfers in progress; dropped before the group, since each one keeps its sockets open."""
        self._layout: Layout | None = None
        self._receiver: _Receiver | None = None
        self._prepared = False
        self._hashing: ThreadPoolExecutor | None = None
        """The one worker that checksums the buckets this engine packs; started on first use."""

    # -- the data plane a subclass supplies ---------------------------------------------------

    def _ensure_slots(self, sizes: Sequence[int]) -> None:
        """One slot per entry of `sizes`, each holding a header and that many data bytes; kept
        when they already are so."""
        if [slot.numel() for slot in self.slots] != [HEADER_BYTES + align(size) for size in sizes]:
            self.slots = []
            self.slots = self._allocate(sizes, self.device)

    def _allocate(self, sizes: Sequence[int], device: torch.device) -> list[torch.Tensor]:
        """Bucket buffers of a header plus `sizes` data bytes each; an `EngineError` that says
        what to change when they do not fit."""
        wanted = [HEADER_BYTES + align(size) for size in sizes]
        try:
            return [torch.empty(size, dtype=torch.uint8, device=device) for size in wanted]
        except RuntimeError as exc:  # torch.OutOfMemoryError on a device, a plain RuntimeError on the host
            raise EngineError(
                f"{self.name} engine: {len(wanted)} bucket buffer(s), {sum(wanted)} bytes, do not fit on "
                f"{device} (engine.apply={self.apply!r}: an atomic receiver holds the whole sync, a "
                f"streamed one two buckets; engine.bucket_bytes sets their size): {exc}"
            ) from exc

    def _staging(self, layout: Layout) -> Layout:
        """Where an atomic receive keeps every bucket until the last one verifies: by default
        the slots themselves, one per bucket (see `_receive_layout`)."""
        return layout

    def _connect(self, topology: Topology) -> None:
        """Form the data plane once the control store is up."""

    def _disconnect(self) -> None:
        """Tear the data plane down; must not raise."""

    def _start_send(self, k: int, nbytes: int) -> Any:
        raise NotImplementedError

    def _start_recv(self, k: int, nbytes: int) -> Any:
        raise NotImplementedError

    def _wait(self, handle: Any, what: str) -> None:
        """Block until the transfer behind `handle` is done; `TransportError` if it failed."""
        raise NotImplementedError

    def _release(self, k: int) -> None:
        """A receiver is done with bucket k: its slot may be refilled."""

    def _digest(self, data: torch.Tensor) -> int:
        """The checksum a receiver computes over a bucket's data region."""
        return xxh3_digest(data)

    def _pack(self, layout: Layout, k: int, tensors: Sequence[torch.Tensor], verify: bool) -> int:
        """Pack bucket k; returns its checksum (0 unverified), the same `_digest` gives.

        xxh3 runs on a worker thread over each slice as soon as it is packed, so on a host
        the checksum costs a second core's time instead of a pass after the copy. The worker
        is the engine's own, from one bucket and one sync to the next, until `close()`.
        """
        if not verify:
            layout.pack(k, tensors)
            return 0
        if self._hashing is None:
            self._hashing = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-checksum")
        hasher = Hasher(self._hashing)
        try:
            layout.pack(k, tensors, lambda region: hasher.feed(region.numpy()))
        except BaseException:
            hasher.abandon()
            raise
        return int(hasher.digest(), 16)

    # -- the protocol -------------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        """Allocates nothing: the buckets' size is known only once the plan is (see `_send_layout`)."""
        self._prepared = True
        return {**super().prepare(), "device": str(self.device)}

    def init_process_group(self) -> None:
        super().init_process_group()
        topology = self._topology()
        self._clean = False
        self.control = self._link.begin(topology)
        self._connect(topology)

    def send_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        topology, control = self._topology(sender=True), self._control()
        start = time.perf_counter()
        pairs = list(named_tensors)
        tensors = [tensor for _, tensor in pairs]
        layout = self._send_layout([TensorMeta(name, self.wire_dtype(t), tuple(t.shape)) for name, t in pairs])
        control.set("version", str(version))
        control.set("plan", layout.raw)
        count = len(layout.plan.buckets)
        in_flight = self._in_flight = [None] * SLOTS
        for k in range(count):
            if in_flight[k % SLOTS] is not None:
                self._wait(in_flight[k % SLOTS], f"bucket {k - SLOTS} of {count}")
            in_flight[k % SLOTS] = self._send_bucket(layout, k, tensors, version)
        for k in range(max(0, count - SLOTS), count):
            self._wait(in_flight[k % SLOTS], f"bucket {k} of {count}")
        self._collect_statuses(topology, version)
        self._clean = True
        return SyncStats(backend=self.name, version=version, bytes=layout.plan.total_bytes, buckets=count,
                         tensors=len(pairs), receivers=len(topology.receivers),
                         seconds=time.perf_counter() - start)

    def receive_weights(self, version: int | None = None) -> Incoming:
        topology, control = self._topology(sender=False), self._control()
        sent = int(control.get("version"))
        layout = self._receive_layout(control.get("plan"))
        incoming = Incoming(sent)
        self._receiver = _Receiver(self, topology, layout, sent, incoming)
        return incoming.feed(self._receiver.run(version))

    def finalize(self) -> None:
        topology = self.topology
        try:
            if self._receiver is not None:
                self._receiver.finish()
        finally:
            if self._receiver is not None:
                self._receiver.inbox.pending.clear()
            self._receiver = None
            self._in_flight.clear()
            self._disconnect()
            if self.control is not None and topology is not None:
                self.control.close(topology, clean=self._clean)
            self.control = None
            self._prepared = False
            if not self.keeps_buckets:
                self._free_buckets()
            super().finalize()

    def close(self) -> None:
        """Finalize, give the buckets back, stop the checksum worker, and leave the rendezvous store."""
        self.finalize()
        self._free_buckets()
        if self._hashing is not None:
            self._hashing.shutdown(wait=True)
            self._hashing = None
        self._link.drop()

    # -- helpers ------------------------------------------------------------------------------

    def _free_buckets(self) -> None:
        self.slots = []
        self._layout = None

    def _send_layout(self, metas: list[TensorMeta]) -> Layout:
        """The sender's buckets take its own `bucket_bytes`; a receiver's, the plan's (`_receive_layout`)."""
        self._ensure_slots([self.bucket_bytes] * SLOTS)
        layout = self._layout
        if (layout is None or not layout.fits(self.slots) or layout.plan.tensors != metas
                or layout.plan.bucket_bytes != self.bucket_bytes or layout.plan.verify != self.verify):
            layout = self._layout = Layout(make_plan(metas, self.bucket_bytes, self.verify), self.slots)
        return layout

    def _receive_layout(self, raw: bytes) -> Layout:
        layout = self._layout
        plan = layout.plan if layout is not None and layout.raw == raw else Plan.from_bytes(raw, self.name)
        self._ensure_slots(receive_sizes(plan, self.apply))
        if layout is None or layout.plan is not plan or not layout.fits(self.slots):
            layout = self._layout = Layout(plan, self.slots)
        layout.reset()
        return layout

    def _send_bucket(self, layout: Layout, k: int, tensors: Sequence[torch.Tensor], version: int) -> Any:
        slot = self.slots[k % SLOTS]
        with record_function(f"pack bucket {k}"):
            digest = self._pack(layout, k, tensors, layout.plan.verify)
            write_header(slot, version, k, layout.plan.used(k), digest)
        return self._start_send(k, HEADER_BYTES + layout.plan.used(k))

    def _collect_statuses(self, topology: Topology, version: int) -> None:
        keys = [f"status/{rank}" for rank in topology.receivers]
        self._control().wait(keys)
        problems = []
        for rank, key in zip(topology.receivers, keys):
            status = json.loads(self._control().get(key))
            if not status["ok"]:
                problems.append(f"rank {rank}: {status['error']}")
        if problems:
            raise EngineError(f"{self.name} engine: {len(problems)} of {len(keys)} receiver(s) rejected "
                              f"weights v{version}: " + "; ".join(problems))

    def _topology(self, sender: bool | None = None) -> Topology:
        topology = self.topology
        if topology is None or not self._prepared:
            raise EngineError(f"{self.name} engine: call prepare() and build_topology() first")
        if sender is not None and topology.is_sender != sender:
            role = "rank 0 (the sender)" if sender else "ranks 1..N (receivers)"
            raise EngineError(f"{self.name} engine: only {role} may do that; this is rank {topology.rank}")
        return topology

    def _control(self) -> ControlStore:
        if self.control is None:
            raise EngineError(f"{self.name} engine: call init_process_group() first")
        return self.control


def receive_sizes(plan: Plan, apply: str) -> list[int]:
    """The data bytes of each slot a receiver needs: two of a whole bucket streamed, each
    bucket's own size atomic (a short last bucket takes only what it uses)."""
    if apply == "atomic":
        return [plan.used(k) for k in range(len(plan.buckets))]
    return [plan.bucket_bytes] * SLOTS


class _Inbox:
    """A receiver's slots: bucket k lands in slot k % len(slots) (two slots streamed, one per
    bucket atomic), and is posted once bucket k - 2 is done."""

    def __init__(self, engine: BucketEngine, plan: Plan) -> None:
        self.engine = engine
        self.plan = plan
        self.count = len(plan.buckets)
        self.pending: dict[int, Any] = {}
        self.next = 0
        self.current: int | None = None
        for _ in range(min(SLOTS, self.count)):
            self._post()

    def _post(self) -> None:
        if self.next < self.count:
            self.pending[self.next] = self.engine._start_recv(self.next, HEADER_BYTES + self.plan.used(self.next))
            self.next += 1

    def take(self, k: int) -> torch.Tensor:
        self.engine._wait(self.pending.pop(k), f"bucket {k} of {self.count}")
        self.current = k
        return self.engine.slots[k % len(self.engine.slots)]

    def done(self, k: int) -> None:
        self.current = None
        self.engine._release(k)
        self._post()

    def drain(self) -> None:
        """Receive the rest without looking at it, so the sender's transfers complete."""
        if self.current is not None:
            self.done(self.current)
        while self.pending:
            k = min(self.pending)
            self.take(k)
            self.done(k)


class _Receiver:
    """One receive: verify each bucket before its tensors are handed out; report the outcome."""

    def __init__(self, engine: BucketEngine, topology: Topology, layout: Layout, version: int,
                 incoming: Incoming) -> None:
        self.engine = engine
        self.rank = topology.rank
        self.layout = layout
        self.plan = layout.plan
        self.version = version
        self.incoming = incoming
        self.inbox = _Inbox(engine, layout.plan)
        self.error: str | None = None
        self.link_failed = False
        self.finished = False

    def run(self, expected: int | None) -> Iterator[tuple[str, torch.Tensor]]:
        """Raises before the first tensor when the sender sends another version than `expected`."""
        try:
            if expected is not None and expected != self.version:
                raise EngineError(f"{self.engine.name} engine: expected weights v{expected}, "
                                  f"the sender sends v{self.version}")
            if self.engine.apply == "atomic":
                layout = self._receive_all()
                for k in range(self.inbox.count):
                    yield from layout.unpack(k)
            else:
                for k in range(self.inbox.count):
                    self._verify(k, self.inbox.take(k))
                    yield from self.layout.unpack(k)
                    self.inbox.done(k)
            self.incoming.complete = True
        except TransportError as exc:
            self.link_failed = True
            self.error = str(exc)
            raise
        except EngineError as exc:
            self.error = str(exc)
            raise
        finally:
            self.finish()

    def _receive_all(self) -> Layout:
        """Every bucket received and verified, kept where the returned layout reads them."""
        staging = self.engine._staging(self.layout)
        for k in range(self.inbox.count):
            slot = self.inbox.take(k)
            self._verify(k, slot)
            if staging is not self.layout:
                nbytes = HEADER_BYTES + self.plan.used(k)
                ctypes.memmove(staging.slots[k].data_ptr(), slot.data_ptr(), nbytes)
            self.inbox.done(k)
        return staging

    def _verify(self, k: int, slot: torch.Tensor) -> None:
        with record_function(f"verify bucket {k}"):
            self._check(k, slot)

    def _check(self, k: int, slot: torch.Tensor) -> None:
        name, count = self.engine.name, self.inbox.count
        magic, version, index, used, digest = read_header(slot)
        expected = (MAGIC, self.version, k, self.plan.used(k))
        if (magic, version, index, used) != expected:
            raise EngineError(f"{name} engine: bucket {k} of {count} arrived with a bad header "
                              f"(magic {magic:#x}, v{version}, bucket {index}, {used} bytes); expected "
                              f"v{expected[1]}, bucket {k}, {expected[3]} bytes; nothing from it was applied")
        if self.plan.verify:
            actual = self.engine._digest(slot[HEADER_BYTES:HEADER_BYTES + used])
            if actual != digest:
                names = self.layout.names(k)
                held = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
                raise EngineError(f"{name} engine: bucket {k} of {count} failed its checksum (sent "
                                  f"{digest:016x}, received {actual:016x}); nothing from it was applied; "
                                  f"it holds {held}")

    def finish(self) -> None:
        """Drain what is left and tell the sender how it went; at most once, never raises."""
        if self.finished:
            return
        self.finished = True
        if self.link_failed:
            return
        ok = self.incoming.complete and self.error is None
        error = self.error or self.incoming.stop_reason or (
            f"the rollout stopped reading after {self.incoming.tensors} of {len(self.plan.tensors)} tensors")
        try:
            if not ok:
                self.inbox.drain()
            self.engine._control().set(f"status/{self.rank}", json.dumps({"ok": ok, "error": None if ok else error}))
        except EngineError as exc:
            structlog.get_logger().warning("engine.status_not_sent", engine=self.engine.name,
                                           rank=self.rank, error=str(exc))
