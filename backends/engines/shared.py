"""Engines whose two bucket slots are memory the sender shares with every receiver (shm, cuda_ipc).

No byte of weights goes through a socket: the sender packs bucket k into shared slot k % 2,
and every receiver reads it where it lies. The per-bucket signals ("bucket k is ready", "rank
r is done with bucket k") are keys of the sync's control store. A subclass supplies only how
slots are made and published (`_create`, `_publish`) and how a receiver opens what was
published (`_open`); what is published is checked by the receiver as it checks the plan, so
a refusal is one more reason in its answer (`accepted/{rank}`) and the sender fails at once.

A streamed receiver verifies and hands out the sender's bucket in place; an atomic one (the
default) copies it into private buffers (`_staging`) and verifies the copy, handed out once
every bucket has verified. Shared slots are kept from one sync to the next (mapping them is the
expensive part), until the sender's `close()`.
"""

from __future__ import annotations

from typing import Any

import torch

from backends.engines.base import Topology
from backends.engines.buckets import HEADER_BYTES, SLOTS, Layout
from backends.engines.pipeline import BucketEngine
from backends.engines.plan import Plan, PlanRefused, align
from backends.engines.receiver import receive_sizes


class SharedSlotEngine(BucketEngine):
    """A `BucketEngine` whose slots the sender shares; see the module docstring."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._staged: Layout | None = None
        self._mapped_from: bytes | None = None
        """A receiver's: the published value its open slots came from; the same bytes open nothing again."""

    # -- what a subclass supplies -------------------------------------------------------------

    def _create(self, size: int) -> None:
        """The sender: replace `self.slots` with `SLOTS` shared slots of `size` bytes each."""
        raise NotImplementedError

    def _publish(self) -> bytes:
        """The sender: what a receiver needs to open its slots (read back by `_open`)."""
        raise NotImplementedError

    def _open(self, raw: bytes) -> list[torch.Tensor]:
        """A receiver: the sender's slots, from what it published; `PlanRefused` says why not."""
        raise NotImplementedError

    def _fence(self) -> None:
        """Wait until this process's writes to, and reads of, the slots are done (device work
        is asynchronous); called before each signal to the other side."""

    # -- the data plane -----------------------------------------------------------------------

    def _ensure_slots(self, sizes: list[int]) -> None:
        """Nothing here: the sender creates the shared slots once the group forms (`_connect`),
        receivers open them (`_receive_slots`)."""

    def _connect(self, topology: Topology) -> None:
        """The sender publishes its slots (created once, kept while bucket_bytes stays)."""
        if topology.is_sender:
            if not self.slots or self.slots[0].numel() != HEADER_BYTES + align(self.bucket_bytes):
                self._create(HEADER_BYTES + align(self.bucket_bytes))
            self._control().set("slots", self._publish())

    def _receive_slots(self, plan: Plan) -> None:
        """Open the sender's slots, unless they are the ones opened last sync; they must hold
        the plan's buckets: a receiver reads them up to `bucket_bytes`."""
        raw = self._control().get("slots", watch_closed=True)
        if raw != self._mapped_from:
            self.slots, self._mapped_from = [], None
            self.slots = self._open(raw)
            self._mapped_from = raw
        wanted = HEADER_BYTES + align(plan.bucket_bytes)
        held = [slot.numel() for slot in self.slots]
        if held != [wanted] * SLOTS:
            raise PlanRefused(f"its bucket_bytes={plan.bucket_bytes} needs shared buckets of {wanted} bytes; "
                              f"the sender's hold {held}")

    def _staging(self, layout: Layout) -> Layout:
        """An atomic receiver's private buffers, one per bucket: the shared slots are the
        sender's to refill. Kept from one sync to the next while the plan stays the same."""
        staged = self._staged
        if staged is None or staged.plan is not layout.plan:
            self._staged = None
            buffers = self._allocate(receive_sizes(layout.plan, "atomic"), self.device)
            staged = self._staged = Layout(layout.plan, buffers)
        staged.reset()
        return staged

    def _free_buckets(self) -> None:
        super()._free_buckets()
        self._staged = None
        self._mapped_from = None

    def _start_send(self, k: int, nbytes: int) -> int:
        self._fence()
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
        self._fence()
        self._control().set(f"done/{k}/{self._topology().rank}", b"")
