"""Engines whose data plane is a torch.distributed process group: one broadcast per bucket.

A bucket's data region travels as a broadcast of its own, so it need not follow its header in
memory: a sender whose weights already sit in one storage at the plan's offsets broadcasts
that storage's bytes without packing them (`buckets.Layout.region`). Every bucket's 64-byte
header goes before bucket 0, all in one broadcast (`header_table`): a small broadcast between
two large ones costs a process group as much as a large one (gloo over loopback moved 16
buckets of 64 MiB with a header broadcast each at half the speed of the same buckets alone).
A receiver posts the table and then its buckets, puts each bucket's header from the table in
its slot once the bucket landed, and checks it there as before (`Receiver._header`); a bucket
with no data bytes (only empty tensors) is its header alone. Receivers cannot tell a region
from a packed bucket (an atomic receiver's slots are `join`ed: every bucket's data back to
back, headers apart).

The group is private to one sync: built on a prefix of the sync's own store (never the
default group a trainer uses for training), and aborted in `finalize`, so a sync that failed
half-way cannot leave a broken group behind for the next one.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from backends.engines.base import Topology, TransportError
from backends.engines.buckets import Layout
from backends.engines.control import answer, read_answer, refusal
from backends.engines.slots import HEADER_BYTES, write_header
from backends.engines.pipeline import BucketEngine
from backends.engines.plan import Plan
from lifecycle.errors import EngineError


class GroupEngine(BucketEngine):
    """A `BucketEngine` over a process group that a subclass builds for its device."""

    sends_regions = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.group: Any = None
        self._table: torch.Tensor | None = None
        """This sync's header table (`_bind`): the sender's, or where a receiver's lands."""
        self._group_device: Any = None
        """The device this sync's group forms on, made before this side agreed to form it (`_ready`)."""
        self._link.ready = self._ready

    def _make_group(self, store: Any, topology: Topology, timeout: timedelta) -> Any:
        """A backend object (ProcessGroupGloo, ProcessGroupNCCL, ...) with `broadcast`."""
        raise NotImplementedError

    def _make_device(self, topology: Topology) -> Any:
        """The device `_make_group` forms the group on; None where the group makes its own."""
        return None

    def _ready(self, topology: Topology) -> str | None:
        """Why this side cannot form the group (its device cannot be made); None when it can.
        Asked before it agrees to form one (a receiver: `StoreLink._agree`, the sender:
        `check_worlds`), so the other side hears a refusal instead of waiting out its timeout
        in a group that never forms."""
        try:
            self._group_device = self._make_device(topology)
        except (RuntimeError, ValueError) as exc:
            return f"rank {topology.rank} cannot make its {self.name} device: {exc}"
        return None

    def _connect(self, topology: Topology) -> None:
        import torch.distributed as dist

        if topology.is_sender:
            self._control().check_worlds(topology, self._ready(topology))
        else:
            self._group_formed(topology.rank)
        store = dist.PrefixStore("group", self._control().store)
        timeout = timedelta(seconds=self.remaining("forming the process group"))
        if topology.is_sender:
            self._control().drop_at_close([_address(rank) for rank in range(topology.world_size)])
        try:
            self.group = self._make_group(store, topology, timeout)
        except (RuntimeError, ValueError, MemoryError) as exc:
            self.remaining("forming the process group")
            raise TransportError(f"{self.name} engine: rank {topology.rank} could not form the process "
                                 f"group of {topology.world_size}: {exc}") from exc

    def _group_formed(self, rank: int) -> None:
        """A receiver, before it forms the group: the sender's word that it forms it
        (`ControlStore.check_worlds`). A word it cannot read is refused, and the refusal written
        in place of this rank's address (`_address`): the sender may be forming the group by then,
        and reads that key, not this rank's answers, until the group forms."""
        control = self._control()
        raw = control.get("forming", watch_closed=True)
        why = read_answer(raw)
        if why is not None and refusal(raw) is None:
            why = f"rank {rank} cannot read the sender's word under 'forming': {why}"
            control.set(_address(rank), answer(why))
        elif why is not None:
            why = f"rank {rank}: the sender formed no group: {why}"
        if why is not None:
            raise TransportError(f"{self.name} engine: {why}")

    def _disconnect(self) -> None:
        """Abort the group and drop it: gloo closes its connections, so peers fail at once,
        only when the last reference (the group's, and each transfer's) goes."""
        group, self.group = self.group, None
        self._group_device = None
        if group is not None:
            group.abort()

    def _bind(self, layout: Layout) -> Layout:
        """The sync's header table, once its plan is bound on this side: the sender's, or zeros
        where a receiver's lands (a row a short table leaves out reads as no header)."""
        layout = super()._bind(layout)
        plan, topology = layout.plan, self._topology()
        if topology.is_sender:
            if self._sent is None:
                raise EngineError(f"{self.name} engine: a plan was bound before its version was sent")
            self._table = self.header_table(plan, self._sent)
        else:
            self._table = torch.zeros(len(plan.buckets) * HEADER_BYTES, dtype=torch.uint8, device=self.device)
        return layout

    def header_table(self, plan: Plan, version: int) -> torch.Tensor:
        """The sender's headers of every bucket of `plan`, back to back (`write_header`)."""
        table = torch.empty(len(plan.buckets) * HEADER_BYTES, dtype=torch.uint8)
        for k in range(len(plan.buckets)):
            write_header(table[k * HEADER_BYTES:(k + 1) * HEADER_BYTES], version, k, plan.used(k))
        return table.to(self.device)

    def _broadcast(self, k: int, data: torch.Tensor) -> tuple[int, tuple[Any, ...]]:
        """Bucket k's data, after the header table when k is 0: k and the works, in that order."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        try:
            works = [self.group.broadcast([self._table], options)] if k == 0 else []
            if data.numel():
                works.append(self.group.broadcast([data], options))
        except RuntimeError as exc:
            raise TransportError(f"{self.name} engine: bucket {k} could not start: {exc}") from exc
        return k, tuple(works)

    def _start_send(self, k: int, nbytes: int) -> Any:
        slot, region = self.slots[k % len(self.slots)], self._regions[k % len(self._regions)]
        return self._broadcast(k, slot.data[:nbytes - HEADER_BYTES] if region is None else region)

    def _start_recv(self, k: int, nbytes: int) -> Any:
        return self._broadcast(k, self.slots[k % len(self.slots)].data[:nbytes - HEADER_BYTES])

    def _wait(self, handle: Any, what: str) -> None:
        """Wait for each of a bucket's works in turn, all within what is left of the sync's time;
        then put its header from the table in its slot (the sender's is there already)."""
        k, works = handle
        for work in works:
            left = self.remaining(what)
            try:
                done = work.wait(timedelta(seconds=left))
            except RuntimeError as exc:
                self.remaining(what)
                raise TransportError(f"{self.name} engine: {what} failed: {exc}") from exc
            if done is False:
                raise TransportError(f"{self.name} engine: {what} did not finish within timeout_s={self.timeout_s:g}")
        table = self._table
        if table is not None and not self._topology().is_sender:
            self.slots[k % len(self.slots)].head.copy_(table[k * HEADER_BYTES:(k + 1) * HEADER_BYTES])


def _address(rank: int) -> str:
    """Where a rank's address for the group's rendezvous sits in the sync's keys: torch's
    "<context>/<rank>" under the group's prefix, context 0 (each sync's first)."""
    return f"group/0/{rank}"


class DeviceGroupEngine(GroupEngine):
    """Buckets in accelerator memory; checksums are computed on the device, with no host copy.

    The buckets go back to the caching allocator after each sync, where re-allocating them is
    cheap, so a colocated rollout has that memory between syncs.
    """

    keeps_buckets = False

    def __init__(self, *, device: int | str | torch.device | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._requested = device

    def _current_device(self) -> torch.device:
        raise NotImplementedError

    def _group_class(self) -> Any:
        """The device library's process-group class (ProcessGroupNCCL, ProcessGroupHCCL), imported here."""
        raise NotImplementedError

    def _make_group(self, store: Any, topology: Topology, timeout: timedelta) -> Any:
        group_class = self._group_class()
        options = group_class.Options()
        options._timeout = timeout
        return group_class(store, topology.rank, topology.world_size, options)

    def prepare(self) -> dict[str, Any]:
        self.device = self._current_device() if self._requested is None else torch.device(self._requested)
        return super().prepare()
