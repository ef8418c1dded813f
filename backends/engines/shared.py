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
expensive part), until the sender's `close()`; a flip sender's weight sets also until it syncs
another rendezvous address (another group, whose receivers cannot say which set the first serves).

`apply: flip` (set on both sides, for an engine whose capabilities say `flips`) shares two
weight sets instead of two slots: each holds every bucket of the plan, back to back. Each
receiver picks the set its rollout does not serve (`target/{rank}`, answered before it
accepts the plan); the sender writes the sync straight into it, once all receivers agree,
without waiting for any receiver's check before the last bucket (no slot is reused),
and every receiver verifies each bucket in place and hands out views into the set once all
have verified: one copy per byte end to end, and a bad bucket leaves the rollout on the set
it serves. The set a rollout serves becomes writable again only once a later sync completed
into the other one. The cost is memory: two weight sets, shared by the sender and every
receiver of the host, in place of the rollout's own weights.

An engine whose `rollout_owns_sets` (cuda_ipc) has each receiver create its two sets instead
and publish them (`sets/{rank}`, with the set it asks for in `target/{rank}`); the sender
opens them and writes the sync into the one asked for, once the receiver has confirmed which
set, of which publication, the sender names. Memory the rollout serves is then its own: what
the sender does with its memory, or whether it lives, cannot change it. It takes one receiver
a sync (each would need the bytes written into its own sets).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch

from backends.engines.base import Topology
from backends.engines.buckets import Layout
from backends.engines.slots import SLOTS, Slot, as_slots, join, joined_bytes, slot_bytes
from backends.engines.pipeline import BucketEngine
from backends.engines.receiver import receivable
from backends.engines.control import answer, clip, echoed, plan_id
from backends.engines.plan import ALIGN, Plan, PlanRefused, TensorMeta
from lifecycle.errors import EngineError


def _pick(asked: dict[int, bytes]) -> int | str:
    """The set a flip sync writes, from each receiver's `target/{rank}`; why none, as text."""
    if bad := {rank: raw for rank, raw in asked.items() if raw not in (b"0", b"1", b"any")}:
        return "receiver(s) asked for no weight set: " + ", ".join(f"rank {r}: {clip(repr(v), 20)}" for r, v in bad.items())
    wanted = {int(raw) for raw in asked.values() if raw != b"any"}
    if len(wanted) > 1:
        serving = ", ".join(f"rank {r} serves set {1 - int(v)}" for r, v in asked.items() if v != b"any")
        return (f"the receivers serve different weight sets ({serving}; a sync completed on some of them only): "
                "restart the receivers on one side; a restarted one takes either set")
    return wanted.pop() if wanted else 0


def _naming(target: int, sets: bytes) -> str:
    """How a sender writing into the rollout's sets names them (`target`): the set, and the
    publication of both it opened (`sets/{rank}`), so a receiver confirms the very memory."""
    return f"{target} {plan_id(sets)}"


def set_bytes(plan: Plan) -> int:
    """The bytes of one flip weight set: every bucket of `plan` `join`ed (data back to back, then
    the headers); never less than a slot of `ALIGN` data bytes (what a shared file may be)."""
    return max(joined_bytes(plan.sizes()), slot_bytes(ALIGN))


class SharedSlotEngine(BucketEngine):
    """A `BucketEngine` whose slots the sender shares; see the module docstring."""

    rollout_owns_sets: bool = False
    """Flip: each receiver creates and publishes its two weight sets, and the sender writes
    into them (one receiver a sync); otherwise the sender creates and shares them."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._staged: Layout | None = None
        self._served: object = None
        """A flip receiver: the identity (`_identity`) of the set its rollout adopted last;
        kept through `close()` and new publications, so opening the same files again does not
        forget which one is served."""
        self._mapped_from: bytes | None = None
        """A receiver's: the published value its open slots came from; the same bytes open nothing again
        (with `rollout_owns_sets`, the sender's: the receiver's sets it opened)."""
        self._own_sets: bytes = b""
        """With `rollout_owns_sets`, a receiver's publication of the sets it created."""
        self._sets_for: tuple[str, int] | None = None
        """A flip sender's: the rendezvous address (its group of receivers) its weight sets were
        created for; another group's receivers cannot know which set the first group serves."""

    # -- what a subclass supplies -------------------------------------------------------------

    def _create(self, size: int) -> list[torch.Tensor]:
        """The sender: `SLOTS` new shared buffers of `size` bytes each (slots, or flip's weight
        sets), in place of those it shared before."""
        raise NotImplementedError

    def _publish(self) -> bytes:
        """The sender: what a receiver needs to open its slots (read back by `_open`)."""
        raise NotImplementedError

    def _open(self, raw: bytes) -> list[torch.Tensor]:
        """A receiver: the sender's slots, from what it published; `PlanRefused` says why not."""
        raise NotImplementedError

    def _identity(self, index: int) -> object:
        """A receiver: what names shared region `index` as opened last, for as long as the memory
        lives (shm: the file's device and inode); None when it cannot be told."""
        return None

    def _fence(self) -> None:
        """Wait until this process's writes to, and reads of, the slots are done (device work
        is asynchronous); called before each signal to the other side."""

    # -- the data plane -----------------------------------------------------------------------

    def _ensure_slots(self, sizes: Sequence[int], *, joined: bool = False) -> None:
        """Nothing here: the sender creates the shared slots once the group forms (`_connect`),
        receivers open them (`_receive_slots`)."""

    def _connect(self, topology: Topology) -> None:
        """The sender publishes its slots (created once, kept while bucket_bytes stays); a flip
        sender its weight sets, once it knows the plan (`_send_layout`); one that writes into the
        rollout's sets publishes none (`slots` empty: a receiver reads both keys at once)."""
        if topology.is_sender:
            self._control().set("shares", self._shares() if self.apply == "flip" else b"buckets")
        if topology.is_sender and self.apply == "flip" and self.rollout_owns_sets:
            self._control().set("slots", b"")
        if topology.is_sender and self.apply != "flip":
            if not self.slots or self.slots[0].nbytes != slot_bytes(self.bucket_bytes):
                self.slots = as_slots(self._create(slot_bytes(self.bucket_bytes)))
            self._control().set("slots", self._publish())

    def _receive_slots(self, plan: Plan) -> None:
        """Open the sender's slots, unless they are the ones opened last sync; they must hold
        the plan's buckets: a receiver reads them up to `bucket_bytes`."""
        self._open_regions(plan, slot_bytes(plan.bucket_bytes), "buckets")

    def _open_regions(self, plan: Plan, wanted: int, kind: str) -> None:
        """The sender's two shared regions (slots or weight sets), opened unless they are the ones
        opened last; `PlanRefused` unless they are `kind` and of `wanted` bytes each."""
        shares, raw = self._control().get_many(["shares", "slots"], watch_closed=True)
        self._check_shares(kind, shares)
        if raw != self._mapped_from:
            self._forget_shared()
            opened = self._open(raw)
            self._mapped_from = raw
            if kind == "sets":
                self._flip.hold(opened)
                self._flip.serving = next((i for i in range(SLOTS) if self._served is not None
                                           and self._identity(i) == self._served), None)
            else:
                self.slots = as_slots(opened)
        held = [memory.numel() for memory in self._flip.memory] if kind == "sets" else [s.nbytes for s in self.slots]
        if held != [wanted] * SLOTS:
            raise PlanRefused(f"its bucket_bytes={plan.bucket_bytes} needs shared {kind} of {wanted} bytes; "
                              f"the sender's hold {held}")

    def _shares(self) -> bytes:
        """What a flip sender shares (`shares`): weight sets of its own, or the rollout's."""
        return b"rollout-sets" if self.rollout_owns_sets else b"sets"

    def _check_shares(self, kind: str, shares: bytes) -> None:
        """`PlanRefused` unless what the sender shares (`shares`, as read) is `kind` (slots,
        weight sets, or the rollout's sets), as this receiver takes."""
        if {shares, kind.encode()} == {b"sets", b"rollout-sets"}:
            how = ("the sender writes into weight sets of the rollout's and this receiver takes the sender's"
                   if shares == b"rollout-sets" else
                   "the sender shares weight sets of its own and this receiver keeps its own")
            raise PlanRefused(f"{how}: sender and receivers must be the same engine")
        if shares != kind.encode():
            mine = "flip" if kind != "buckets" else self.apply
            raise PlanRefused(f"the sender shares {clip(repr(shares.decode(errors='replace')), 40)} and this receiver (engine.apply={mine!r}) "
                              f"takes {kind}: set engine.apply to 'flip' on both sides or on neither")

    # -- flip: two weight sets ----------------------------------------------------------------

    def _send_layout(self, metas: list[TensorMeta]) -> Layout:
        """A flip sender's plan, with both weight sets created for it and published."""
        if self.apply != "flip":
            return super()._send_layout(metas)
        cached = self._flip.layouts[0] or self._flip.layouts[1]
        plan = cached.plan if cached is not None and self._same_plan(cached.plan, metas) else self._make_plan(metas)
        raw = cached.raw if cached is not None and cached.plan is plan else plan.to_bytes()
        if self.rollout_owns_sets:  # the sets are the receiver's: bound once it names them (`_bind`)
            return Layout(plan, [], raw=raw)
        size, group = set_bytes(plan), self._group()
        if not self._flip.memory or self._flip.memory[0].numel() != size or self._sets_for != group:
            self._flip.hold(self._create(size))  # the old files stay mapped by the receivers serving them
            self._sets_for = group
        self._control().set("slots", self._publish())
        return self._flip.layout(0, plan, raw, self._carve)

    def _group(self) -> tuple[str, int] | None:
        """The address of this sync's rendezvous: one sender's store, so one group of receivers."""
        rendezvous = self._topology().rendezvous
        return None if rendezvous is None else (rendezvous.host, rendezvous.port)

    def _bind(self, layout: Layout) -> Layout:
        """Flip: the layout in the set this sync writes. The sender picks it from what every
        receiver asked (`target/{rank}`: the set its rollout does not serve, or `any`), publishes
        it (`target`), and writes nothing until every receiver has confirmed it is the set it
        asked for (`bound/{rank}`): a receiver that finds another set named refuses there, so a
        set a rollout serves is never written, whoever wrote the store."""
        if self.apply != "flip":
            return layout
        topology, control = self._topology(), self._control()
        if topology.is_sender:
            if self.rollout_owns_sets:
                target = self._open_rollout_sets(layout.plan)
                named = _naming(target, self._mapped_from or b"")
            else:
                target = _pick(dict(zip(topology.receivers,
                                        control.get_many([f"target/{r}" for r in topology.receivers]))))
                if isinstance(target, str):
                    raise EngineError(f"{self.name} engine: {target}")
                named = str(target)
            control.set("target", named)
            confirmed = control.await_answers(topology.receivers, "bound", f"refused to take weight set {target}")
            if others := [rank for rank, raw in zip(topology.receivers, confirmed) if echoed(raw, "target") != named]:
                raise EngineError(f"{self.name} engine: receiver(s) {others} confirmed another weight set than the "
                                  f"{named!r} this sender named (another writer of the store set 'target'); "
                                  "nothing was written")
        else:
            raw = control.get("target", watch_closed=True)
            if self.rollout_owns_sets:  # the very set, of the very publication, it asked for
                asked = self._flip.target
                target = asked if asked is not None and raw == _naming(asked, self._own_sets).encode() else None
            else:
                target = int(raw) if raw in (b"0", b"1") else None
            if target is None or self._flip.target not in (None, target):
                reason = self._unbound(raw)
                self._answer(f"bound/{topology.rank}", reason)
                raise EngineError(f"{self.name} engine: rank {topology.rank}: {reason}")
            control.set(f"bound/{topology.rank}", answer(None, target=raw.decode()))
        self._flip.target = target
        bound = self._flip.layout(target, layout.plan, layout.raw, self._carve)
        self.slots = bound.slots
        bound.reset()
        return bound

    def _unbound(self, raw: bytes) -> str:
        """Why a receiver refuses the set the sender names (`target`, as read)."""
        asked, named = self._flip.target, clip(repr(raw), 40)
        if self.rollout_owns_sets:
            return (f"the sender names {named}, not {_naming(asked or 0, self._own_sets)!r}: set {asked} of the two "
                    "weight sets this receiver published, the set this receiver asked for; nothing was received")
        sender = (f"the sender writes weight set {int(raw)}," if raw in (b"0", b"1") else
                  f"the sender names {named}, no weight set (0 or 1),")
        wants = ("while this receiver takes either set (its rollout serves none of this sender's)" if asked is None
                 else f"not the set {asked} this receiver asked for (its rollout serves the other)")
        return f"{sender} {wants}; nothing was received"

    def _receive_layout(self, raw: bytes, expected: Collection[str] | None) -> Layout:
        """A flip receiver: the plan checked, the sets opened and checked against it, and the
        set its rollout does not serve asked for (`target/{rank}`) before it accepts."""
        if self.apply != "flip":
            return super()._receive_layout(raw, expected)
        plan = receivable(self, raw, self._flip.plan_of(raw), expected)
        rank, control = self._topology().rank, self._control()
        if self.rollout_owns_sets:
            self._check_shares("rollout-sets", control.get("shares", watch_closed=True))
            size = set_bytes(plan)
            if len(self._flip.memory) != SLOTS or any(memory.numel() != size for memory in self._flip.memory):
                sets = self._create(size)
                self._flip.hold(sets)
                self._own_sets = self._publish()
            target = self._flip.ask()
            self._flip.target = target = 0 if target is None else target
            control.set(f"sets/{rank}", self._own_sets)
            control.set(f"target/{rank}", str(target))
            return self._flip.layout(target, plan, raw, self._carve)
        self._open_regions(plan, set_bytes(plan), "sets")
        target = self._flip.ask()
        control.set(f"target/{rank}", "any" if target is None else str(target))
        return self._flip.layout(target or 0, plan, raw, self._carve)

    def _open_rollout_sets(self, plan: Plan) -> int:
        """The sender, `rollout_owns_sets`: the one receiver's two sets opened (unless opened
        last sync) and checked against the plan; the set it asked for."""
        topology, control = self._topology(), self._control()
        if len(topology.receivers) != 1:
            raise EngineError(f"{self.name} engine: apply 'flip' writes into the rollout's own weight sets, for one "
                              f"receiver a sync; this sync has {len(topology.receivers)}")
        rank = topology.receivers[0]
        raw, asked = control.get_many([f"sets/{rank}", f"target/{rank}"])
        if asked not in (b"0", b"1"):
            raise EngineError(f"{self.name} engine: rank {rank} asked for no weight set: {clip(repr(asked), 20)}")
        if raw != self._mapped_from:
            self._forget_shared()
            try:
                opened = self._open(raw)
            except PlanRefused as exc:
                raise EngineError(f"{self.name} engine: rank {rank}'s weight sets: {exc}") from None
            self._flip.hold(opened)
            self._mapped_from = raw
        held, wanted = [memory.numel() for memory in self._flip.memory], set_bytes(plan)
        if held != [wanted] * SLOTS:
            raise EngineError(f"{self.name} engine: rank {rank} published weight sets of {held} bytes; the plan "
                              f"needs {wanted} each")
        return int(asked)

    def _handed_out(self) -> None:
        super()._handed_out()
        if self.apply == "flip" and self._flip.target is not None:
            self._served = self._identity(self._flip.target)

    def _carve(self, index: int, plan: Plan) -> list[Slot]:
        """Set `index` cut into `plan`'s buckets (`set_bytes`)."""
        return join(plan.sizes(), self._flip.memory[index])

    def _forget_shared(self) -> None:
        """Drop what was opened from the sender's last publication: a flip receiver serves no set
        of the new one."""
        self.slots, self._mapped_from = [], None
        self._flip.forget()

    def _staging(self, layout: Layout) -> Layout:
        """An atomic receiver's private slots, one per bucket `join`ed in one buffer: the shared
        slots are the sender's to refill. Kept from one sync to the next while the plan stays the same."""
        staged = self._staged
        if staged is None or staged.plan is not layout.plan:
            self._staged = None
            slots = self._allocate(layout.plan.sizes(), self.device, joined=True)
            staged = self._staged = Layout(layout.plan, slots)
        staged.reset()
        return staged

    def _free_buckets(self) -> None:
        super()._free_buckets()
        self._staged = None
        self._forget_shared()

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
