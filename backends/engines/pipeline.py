"""The double-buffered bucket pipeline every transport engine shares (gloo, nccl, hccl, shm, cuda_ipc).

The sender has two bucket slots: it packs bucket k into slot k % 2 while bucket k - 1 is on
the wire, and waits for bucket k - 2's transfer before it overwrites that slot (a shm flip
sender writes each bucket to its own place in the weight set, so it waits for none until the
last is written). Bucket k starts as soon as it is packed; its checksum is computed while it
is on the wire (on a host by the engine's checksum worker, `digests.Checksums`) and sent after
it as `digest/{k}` (16 lowercase hex digits), as soon as it is ready and at the latest once
bucket k + 1 has started. A receiver has buckets k and k + 1 posted; it checks bucket k's
header as it lands, hashes it on its own worker while k + 1 arrives, and counts it verified
only once its hash matches `digest/{k}`. What it does next is its `apply` mode:

- `streamed`: two slots, like the sender. It hands out bucket k's tensors once k verified
  and only then posts bucket k + 2 into the slot k used, so it never holds more than two
  buckets; a bad bucket k leaves buckets before it applied. With `into=` it holds none: each
  bucket lands straight in the rollout's flattened storage (`inplace`), before it verifies.
- `atomic` (the default): one slot per bucket of the sync, all `join`ed in one buffer (every
  bucket's data back to back, so a tensor split across buckets is one view), each bucket
  received straight into its own (shm copies it out of the shared slot, then lets the sender
  refill it), so bucket k is checked while later ones land. It hands out the first tensor only once the
  last bucket has verified, so a bad bucket anywhere means nothing is applied.
- `flip`: as atomic, into the one of two weight sets (`sets`) its rollout does not serve,
  whose views the rollout adopts: no copy on the receiving side.

The small messages (plan, answers, checksums, shm's per-bucket signals) go through a
`ControlStore`; a subclass supplies only the data plane: slots, start send / receive, wait.
The receiver decides (`receiver.receivable`): it checks the plan against its own settings,
allocates for it, and answers `accepted/{rank}`, naming the plan it took; the sender waits for
every answer before bucket 0 moves, so a refused plan (or one that is not the sender's) fails
both sides at once and applies nothing. A receiver
that rejects a bucket, or whose rollout stops reading, drains the rest without applying it
and reports why (`status/{rank}`), so the sender fails with the reason, not a timeout.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from backends.engines.base import (
    CheckpointEngine, Incoming, SyncStats, Topology, check_version,
)
from backends.engines.buckets import Layout
from backends.engines.slots import SLOTS, Slot, as_slots, join, joined_bytes, slot_bytes
from backends.engines.sources import Source, describe, metas_of, pairs_of
from backends.engines.digests import Checksums, keyed
from backends.engines.flat import Named
from backends.engines.inplace import Landing
from backends.engines.control import ControlStore, answer, clip, echoed, reference
from backends.engines.link import StoreLink
from backends.engines.plan import Plan, PlanRefused, TensorMeta, align, check_plan, make_plan
from backends.engines.receiver import Receiver, accept, receivable, receive_sizes
from backends.engines.sender import Packed, send_bucket, send_buckets
from backends.engines.sets import WeightSets, private_sets
from lifecycle.errors import EngineError
from lifecycle.records import say


class BucketEngine(CheckpointEngine):
    """A checkpoint engine that moves flat buckets between processes; see the module docstring."""

    device: torch.device = torch.device("cpu")
    keeps_buckets: bool = True
    """Keep the bucket buffers from one sync to the next (until `close()`): first-touching fresh
    host memory costs more than the copy into it, so CPU engines allocate once."""
    sends_regions: bool = False
    """Send a bucket whose pieces already sit in one storage straight from there, unpacked
    (`Layout.region`): only for a data plane that sends header and data apart (group engines);
    shm and cuda_ipc hand the receiver the slot itself, so they always pack."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.slots: list[Slot] = []
        self.control: ControlStore | None = None
        self._link = StoreLink(self)
        self._clean = False
        self._in_flight: list[Any] = []
        """Transfers in progress; dropped before the group, since each one keeps its sockets open."""
        self._layout: Layout | None = None
        self._receiver: Receiver | None = None
        self._prepared = False
        self.checksums = Checksums(self.name)
        """The one worker that checksums the buckets this engine sends or receives."""
        self._regions: list[torch.Tensor | None] = [None] * SLOTS
        """The sender's data region of the bucket in each slot, None where it was packed into the slot."""
        self._flip = WeightSets()
        """A flip receiver's two weight sets (`sets`); shm's sender keeps the shared ones here too."""
        self._phases: dict[str, float] = {}
        """The current send's phase timings (`SyncStats.phases`)."""
        self._described: tuple[Source | None, torch.dtype | None, list[TensorMeta]] = (None, None, [])
        """The sender's last tensors as `describe` found them, the rollout dtype then, and their plan metadata."""
        self._sent: int | None = None
        """The version this session sent, once `send_weights` was called (reset as a session opens)."""
        self._plan = ""
        """The id of the plan this sender's buckets go under, which keys their checksums (`digests.keyed`)."""
        self._landed = False
        """Whether `slots` are ranges of a rollout's storage (`into`), which no later receive may land in."""
        self._landing = Landing()
        self._plans: dict[str, bytes] = {}
        """A receiver's last plans by id (`receiver.resolve_plan`)."""

    # -- the data plane a subclass supplies ---------------------------------------------------

    def _ensure_slots(self, sizes: Sequence[int], *, joined: bool = False) -> None:
        """One slot per entry of `sizes`, each holding a header and that many data bytes, carved
        from one buffer when `joined` (`slots.join`); kept when they already are so."""
        if [slot.data.numel() for slot in self.slots] != [align(size) for size in sizes]:
            self.slots = []
            self.slots = self._allocate(sizes, self.device, joined=joined)

    def _allocate(self, sizes: Sequence[int], device: torch.device, *, joined: bool = False) -> list[Slot]:
        """Slots of a header plus `sizes` data bytes each: one buffer each, or, `joined`, carved
        from one buffer with the data back to back (`slots.join`)."""
        if joined:
            return join(sizes, self._buffers([joined_bytes(sizes)], device)[0])
        return as_slots(self._buffers([slot_bytes(size) for size in sizes], device))

    def _buffers(self, sizes: Sequence[int], device: torch.device) -> list[torch.Tensor]:
        """Byte buffers of `sizes`; an `EngineError` that says what to change when they do not fit."""
        try:
            return [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes]
        except RuntimeError as exc:  # torch.OutOfMemoryError on a device, a plain RuntimeError on the host
            raise EngineError(
                f"{self.name} engine: {len(sizes)} bucket buffer(s), {sum(sizes)} bytes, do not fit on "
                f"{device} (engine.apply={self.apply!r}: an atomic receiver holds the whole sync, a "
                f"streamed one two buckets; engine.bucket_bytes sets their size): {exc}"
            ) from exc

    def _staging(self, layout: Layout) -> Layout:
        """Where an atomic receive keeps every bucket until the last one verifies: by default
        the slots themselves, one per bucket, `join`ed (see `_receive_slots`). Called once per receive,
        before the plan is accepted, so buffers that do not fit refuse it."""
        return layout

    def _connect(self, topology: Topology) -> None:
        """Form the data plane once the control store is up."""

    def _disconnect(self) -> None:
        """Tear the data plane down; must not raise."""

    def _start_send(self, k: int, nbytes: int) -> Any:
        """Start bucket k's `nbytes` (header and data) from its slot; an engine that
        `sends_regions` takes the data from `_regions[k % len(_regions)]` where that is not None."""
        raise NotImplementedError

    def _start_recv(self, k: int, nbytes: int) -> Any:
        raise NotImplementedError

    def _wait(self, handle: Any, what: str) -> None:
        """Block until the transfer behind `handle` is done; `TransportError` if it failed."""
        raise NotImplementedError

    def _release(self, k: int) -> None:
        """A receiver is done with bucket k: its slot may be refilled."""

    # -- the protocol -------------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        """Allocates nothing: the buckets' size is known only once the plan is (see `_send_layout`)."""
        self._prepared = True
        return {**super().prepare(), "device": str(self.device)}

    def init_process_group(self) -> None:
        super().init_process_group()
        topology = self._topology()
        self._clean = False
        self._sent = None
        self.control = self._link.begin(topology)
        self._connect(topology)

    def send_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        topology, control = self._topology(sender=True), self._control()
        if self._sent is not None:  # the sync's keys (answers, digests) are the last send's: they would answer this one
            raise EngineError(f"{self.name} engine: weights v{self._sent} were sent in this session already; "
                              "a session carries one sync: open a new one for the next")
        version = check_version(self.name, version)
        start = time.perf_counter()
        phases = self._phases = dict.fromkeys(("plan", "pack", "wire", "apply", "hash"), 0.0)
        pairs = pairs_of(self.name, named_tensors)
        held: list[torch.UntypedStorage] = []  # read by address until the last bucket is hashed: memory a
        # tensor gives back meanwhile (set_) is not freed under a memmove
        sources = describe(pairs, self._described[0], held)
        layout = self._send_layout(self._metas(pairs, sources))
        tensors = [tensor for _, tensor in pairs]
        if sources is None:  # describe stopped early; `_metas` has refused any tensor that is not plain
            held = list(map(torch.Tensor.untyped_storage, tensors))  # memory, so each has a storage
        self._sent = version  # from here the sync's keys are this send's: a retry in the session is refused
        ident = self._plan = self._link.publish(control, layout.raw)
        control.set("version", str(version))
        control.set("plan", reference(ident))
        answers = control.await_answers(topology.receivers, "accepted", f"refused the plan of weights v{version}")
        if others := [f"rank {rank} accepted {clip(repr(echoed(raw, 'plan')), 40)}"
                      for rank, raw in zip(topology.receivers, answers) if echoed(raw, "plan") != ident]:
            raise EngineError(f"{self.name} engine: {'; '.join(others)}, not the plan {ident} of weights v{version} "
                              "this sender posted (someone else wrote the sync's 'plan'); nothing was sent")
        layout = self._bind(layout)
        layout.bind_sources(sources)
        phases["plan"] = (sent := time.perf_counter()) - start
        send_buckets(self, layout, tensors, version)
        phases["wire"] = (landed := time.perf_counter()) - sent - phases["pack"]
        control.await_answers(topology.receivers, "status", f"rejected weights v{version}", acknowledge=True)
        phases["apply"] = time.perf_counter() - landed
        self._clean = True
        return SyncStats(backend=self.name, version=version, bytes=layout.total_bytes,
                         buckets=len(layout.plan.buckets), tensors=len(pairs), receivers=len(topology.receivers),
                         seconds=time.perf_counter() - start, phases=phases)

    def receive_weights(self, version: int | None = None, *, expected: Collection[str] | None = None,
                        into: Named | None = None) -> Incoming:
        """`into`: the rollout's tensors (a module, pairs or a state dict), when they sit in one
        storage laid out as the sender's plan lays out its buckets: a streamed receive of an
        engine whose capabilities say `lands_in_place` receives every bucket straight there
        (`inplace`), and hands out views of that storage. A plan they cannot take is refused,
        and the sender told."""
        topology = self._topology(sender=False)
        if self._receiver is not None:  # this session's keys carry the sync it already received
            raise EngineError(f"{self.name} engine: rank {topology.rank} received weights v{self._receiver.version} in "
                              "this session already; a session carries one sync: open a new one for the next")
        self._forget_landing()
        sent, ident, accepted, staging = accept(self, topology.rank, version, expected, into)
        layout = self._bind(accepted)
        incoming = Incoming(sent)
        incoming.adoptable = self.apply == "flip" or self._landed
        self._receiver = Receiver(self, topology, layout, layout if staging is accepted else staging, sent, incoming,
                                  ident)
        return incoming.feed(self._receiver.run())

    def refuse(self, reason: str) -> None:
        """Answer the sender's plan with `reason`, as `receiver.accept` refuses one: before bucket 0 moves."""
        topology = self._topology(sender=False)
        self._control().wait(["version", "plan"], watch_closed=True)  # posted: the sender now waits for answers
        self._answer(f"accepted/{topology.rank}", reason)

    def finalize(self) -> None:
        """Tear the sync down; a receive held (`Incoming.hold`) that answered the sender it took the
        weights, but whose answer the sender did not read in time, raises here, after the teardown."""
        topology, receiver = self.topology, self._receiver
        try:
            if receiver is not None:
                receiver.finish()
                incoming = receiver.incoming
                read = incoming.complete and incoming.stop_reason is None and receiver.error is None
                if incoming.adopted if incoming.adopted is not None else read:
                    self._handed_out()
        finally:
            if self._receiver is not None:
                self._receiver.inbox.pending.clear()
            self._receiver = None
            self._forget_landing()
            if not self.keeps_buckets:  # a device engine lets the rollout's memory go between syncs
                self._landing = Landing()
            self._in_flight.clear()
            self._disconnect()
            if self.control is not None and topology is not None:
                self.control.close(topology, clean=self._clean)
            self.control = None
            self._prepared = False
            if not self.keeps_buckets:
                self._free_buckets()
            super().finalize()
        if receiver is not None and receiver.unheard is not None:
            raise EngineError(receiver.unheard)

    def close(self) -> None:
        """Finalize, give the buckets back (and any rollout's storage a landing kept), stop the
        checksum worker, and leave the rendezvous store; refused while another thread's sync is
        under way (`_refuse_close`)."""
        self._refuse_close()
        self.finalize()
        self._free_buckets()
        self._flip.forget()
        self._landing = Landing()
        self.checksums.close()
        self._link.drop()

    # -- helpers ------------------------------------------------------------------------------

    def _free_buckets(self) -> None:
        """Give the buckets back; a flip receiver's weight sets stay (`close()` gives them back)."""
        self.slots = []
        self._layout = None

    def _forget_landing(self) -> None:
        """Drop slots that are ranges of a rollout's storage (`into`): no later receive lands there."""
        if self._landed:
            self.slots, self._layout, self._landed = [], None, False

    def _send_layout(self, metas: list[TensorMeta]) -> Layout:
        """The sender's buckets take its own `bucket_bytes`; a receiver's, the plan's (`_receive_layout`)."""
        self._ensure_slots([self.bucket_bytes] * SLOTS)
        layout = self._layout
        if layout is None or not layout.fits(self.slots) or not self._same_plan(layout.plan, metas):
            plan = self._make_plan(metas)
            layout = self._layout = Layout(plan, self.slots, raw=plan.to_bytes())
        return layout

    def _metas(self, pairs: list[tuple[str, torch.Tensor]], sources: Source | None) -> list[TensorMeta]:
        """The plan's metadata of these tensors: those of the last sync when `describe` found them
        as they were then (the same list, so `_same_plan` compares each entry by identity)."""
        last, dtype, metas = self._described
        if sources is None or sources is not last or dtype != self.rollout_dtype:
            metas = metas_of(self.name, pairs, self.wire_dtype, checked=sources is not None)
            self._described = (sources, self.rollout_dtype, metas)
        return metas

    def _same_plan(self, plan: Plan, metas: list[TensorMeta]) -> bool:
        """Whether `plan` is the one `_make_plan(metas)` would make now."""
        return plan.tensors == metas and plan.bucket_bytes == self.bucket_bytes and plan.verify == self.verify

    def _make_plan(self, metas: list[TensorMeta]) -> Plan:
        plan = make_plan(metas, self.bucket_bytes, self.verify)
        try:
            check_plan(plan)
        except PlanRefused as exc:
            raise EngineError(f"{self.name} engine: these weights cannot travel: {exc}") from None
        return plan

    def _bind(self, layout: Layout) -> Layout:
        """Once every receiver accepted the plan (a receiver: once it did), the layout the buckets
        travel in: `layout` itself, but for shm's flip, which picks a weight set here."""
        return layout

    def _handed_out(self) -> None:
        """A receiver, as the sync ends: its rollout adopted the tensors (`Incoming.adopted`), or,
        when it did not say, read every one and did not abort."""
        if self.apply == "flip":
            self._flip.handed_out()

    def _receive_layout(self, raw: bytes, expected: Collection[str] | None) -> Layout:
        """Check the plan (a plan of the very bytes of the last one was checked then) against this
        receiver's own settings before allocating for it: its `verify` wins over the plan's."""
        layout = self._layout
        known = layout.plan if layout is not None and layout.raw == raw else self._flip.plan_of(raw)
        plan = receivable(self, raw, known, expected)
        if self.apply == "flip":  # the set the rollout does not serve, of two this receiver holds
            layout = private_sets(self._flip, plan, raw, lambda size: self._buffers([size], self.device)[0])
            self.slots = layout.slots
            layout.reset()
            return layout
        self._receive_slots(plan)
        if layout is None or layout.plan is not plan or not layout.fits(self.slots):
            layout = self._layout = Layout(plan, self.slots, raw=raw)
        layout.reset()
        return layout

    def _land(self, raw: bytes, expected: Collection[str] | None, into: Named) -> Layout:
        """A streamed receive straight into the rollout's storage (`inplace`; `receiver.accept` checked the mode)."""
        plan = receivable(self, raw, self._landing.plan_of(raw), expected)
        layout = self._landing.layout_for(plan, raw, into, self.device)
        self.slots, self._layout, self._landed = layout.slots, None, True
        layout.reset()
        return layout

    def _receive_slots(self, plan: Plan) -> None:
        """Have the slots a receive of `plan` lands in; shm maps and checks the sender's instead.
        A `PlanRefused` here is answered like any other refusal (`receiver.accept`)."""
        self._ensure_slots(receive_sizes(plan, self.apply), joined=self.apply == "atomic")

    def _answer(self, key: str, error: str | None) -> None:
        """Tell the sender; a receiver whose link is gone logs that the answer was lost."""
        try:
            self._control().set(key, answer(error))
        except EngineError as exc:
            say("warning", "engine.answer_not_sent", engine=self.name, key=key, error=str(exc))

    def _send_bucket(self, layout: Layout, k: int, tensors: Sequence[torch.Tensor], version: int,
                     packed: Packed | None = None) -> tuple[Any, Future[int] | None]:
        """Pack bucket k (unless `packed`: see `sender.pack_together`) and start its transfer;
        its checksum under way (`sender.send_bucket`)."""
        return send_bucket(self, layout, k, tensors, version, packed)

    def _send_digest(self, k: int, digest: int) -> None:
        self._control().set(f"digest/{k}", f"{keyed(digest, self._plan):016x}")

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
