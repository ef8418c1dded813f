"""A receiver's side of one sync once it accepted the plan: its slots, and verifying each bucket
before any tensor of it is handed out (see `pipeline` for the pipeline as a whole).

Bucket k's header is checked as it lands (a bad one fails at once); its checksum runs on the
engine's worker while bucket k + 1 arrives, and is compared with the sender's, the control
key `digest/{k}`, once both are there. A streamed receiver waits for that before it hands
bucket k out; an atomic one lets later buckets land meanwhile and checks each in order.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Collection, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import record_function

from backends.engines.base import Incoming, Topology, TransportError, missing
from backends.engines.buckets import Layout
from backends.engines.flat import Named
from backends.engines.slots import HEADER_BYTES, MAGIC, SLOTS, Slot, read_header
from backends.engines.digests import keyed, settle
from backends.engines.control import ControlStore, answer, clip, digits, plan_id, referenced
from backends.engines.plan import Plan, PlanRefused, parse_plan
from lifecycle.errors import EngineError
from lifecycle.records import say

if TYPE_CHECKING:
    from backends.engines.pipeline import BucketEngine


def sent_version(raw: bytes) -> int:
    """The version the sender published: plain decimal digits, nothing else."""
    version = digits(raw)
    if version is None:
        raise PlanRefused(f"the sender's version {raw[:40]!r} is not a non-negative integer")
    return version


def accept(engine: BucketEngine, rank: int, version: int | None, expected: Collection[str] | None,
           into: Named | None = None) -> tuple[int, str, Layout, Layout]:
    """Take the sender's version and plan, or refuse them, and answer `accepted/{rank}` either
    way before any bucket moves: the sender waits for every answer (`ControlStore.await_answers`).
    An acceptance names the plan's id, and the sender refuses one of another plan than it posted.

    Returns the version, the plan's id, the layout, and where an atomic receive stages
    (`BucketEngine._staging`)."""
    control, sent = engine._control(), None
    try:
        raw_version, posted = control.get_many(["version", "plan"], watch_closed=True)
        sent = sent_version(raw_version)
        if version is not None and version != sent:
            raise PlanRefused(f"expected weights v{version}, the sender sends v{sent}")
        if into is not None and not (engine.capabilities.lands_in_place and engine.apply == "streamed"):
            raise PlanRefused(f"into= lands every bucket in the rollout's weights as it arrives: that takes "
                              f"engine.apply 'streamed' (this receiver: {engine.apply!r}) on an engine whose "
                              f"capabilities say lands_in_place (this package's gloo, nccl and hccl; this is {engine.name})")
        ident, raw_plan = resolve_plan(control, posted, engine._plans)
        layout = engine._receive_layout(raw_plan, expected) if into is None else engine._land(raw_plan, expected, into)
        staging = engine._staging(layout) if engine.apply == "atomic" else layout
    except TransportError:
        raise
    except Exception as exc:
        engine._answer(f"accepted/{rank}", str(exc))
        if isinstance(exc, PlanRefused):
            what = "the sender's plan" if sent is None else f"the plan of weights v{sent}"
            raise EngineError(f"{engine.name} engine: rank {rank} refuses {what}: {exc}") from None
        raise
    control.set(f"accepted/{rank}", answer(None, plan=ident))
    return sent, ident, layout, staging


_KEPT_PLANS = 2
"""Plans a receiver keeps by id (`resolve_plan`), the newest ones."""


def resolve_plan(control: ControlStore, posted: bytes, kept: dict[str, bytes]) -> tuple[str, bytes]:
    """The id and bytes of the plan a receiver's sync names (`control.referenced`): from `kept`
    (the bytes of the plans it read before, by id), or read from the store and checked against
    its id, and kept; `posted` itself when it is no reference."""
    ident = referenced(posted)
    if ident is None:
        return plan_id(posted), posted
    raw = kept.get(ident)
    if raw is None:
        raw = control.read_plan(ident)
        if plan_id(raw) != ident:
            raise PlanRefused(f"the plan stored under its id {ident} has another id ({plan_id(raw)})")
        kept[ident] = raw
        for old in list(kept)[:-_KEPT_PLANS]:
            del kept[old]
    return ident, raw


_DIGEST = re.compile(rb"[0-9a-f]{16}")
"""A sender's checksum as it travels (`digest/{k}`): 16 lowercase hex digits, nothing else."""


def receivable(engine: BucketEngine, raw: bytes, known: Plan | None, expected: Collection[str] | None) -> Plan:
    """The sender's plan (its bytes `raw`) once this receiver's own settings take it: `known`, a
    plan it parsed from these very bytes before and took then, or `raw` parsed now, whose
    floating weights must travel in the receiver's `engine.rollout_dtype` when it sets one.
    Its `verify` wins over the plan's, and the plan must name every tensor in `expected`."""
    plan = known
    if plan is None:
        plan, wanted = parse_plan(raw), engine.rollout_dtype
        odd = None if wanted is None else next((m for m in plan.tensors if m.dtype.is_floating_point and m.dtype != wanted),
                                               None)
        if odd is not None:
            raise PlanRefused(f"it sends {odd.name[:80]!r} as {odd.dtype} and this receiver's engine.rollout_dtype is "
                              f"{str(wanted).removeprefix('torch.')}: set the same rollout_dtype on both sides")
    if engine.verify and not plan.verify:
        raise PlanRefused("it sends no checksums (the sender's engine.verify is false) and this receiver "
                          "verifies every bucket (its engine.verify is true)")
    gaps = missing(expected, (meta.name for meta in plan.tensors))
    if gaps is not None:
        raise PlanRefused(gaps)
    return plan


def receive_sizes(plan: Plan, apply: str) -> list[int]:
    """The data bytes of each slot a receiver needs: two of a whole bucket streamed, each
    bucket's own size atomic (a short last bucket takes only what it uses)."""
    if apply == "atomic":
        return plan.sizes()
    return [plan.bucket_bytes] * SLOTS


class Inbox:
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

    def take(self, k: int) -> Slot:
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


class Receiver:
    """One receive: verify each bucket before its tensors are handed out; report the outcome.

    `staging`: where an atomic receive keeps every bucket until the last one verifies (the
    engine's `_staging`, prepared before the plan was accepted); `layout` itself when streamed."""

    def __init__(self, engine: BucketEngine, topology: Topology, layout: Layout, staging: Layout, version: int,
                 incoming: Incoming, plan: str) -> None:
        """`plan`: the id of the plan this receiver accepted, which keys the checksums (`digests.keyed`)."""
        self.engine = engine
        self.rank = topology.rank
        self.layout = layout
        self.staging = staging
        self.plan = layout.plan
        self.version = version
        self.incoming = incoming
        self.plan_id = plan
        self.inbox = Inbox(engine, layout.plan)
        self.checks: dict[int, Future[int]] = {}
        """Checksums under way, by bucket, until each is compared with the sender's."""
        self.error: str | None = None
        self.link_failed = False
        self.finished = False
        self.unheard: str | None = None
        """Why a held receive that answered it took the weights must count as failed: the sender
        did not read that answer (it gave up first); `finalize` raises it."""

    def run(self) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            if self.engine.apply != "streamed":
                layout = self._receive_all()
                for k in range(self.inbox.count):
                    yield from layout.unpack(k)
            else:
                for k in range(self.inbox.count):
                    self._land(k, self.inbox.take(k))
                    self._verify(k)
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
            settle(self.checks.values())
            self.checks.clear()
            if not (self.incoming.held and self.incoming.complete):
                self.finish()  # a held receive read to the end answers in `finalize`

    def _receive_all(self) -> Layout:
        """Every bucket received and verified, kept where the returned layout reads them.

        Bucket k is in a slot of its own once it landed (or was copied out of the shared
        slot), so its slot is given back at once and k is checked while later buckets land."""
        staging = self.staging
        for k in range(self.inbox.count):
            slot = self.inbox.take(k)
            if staging is not self.layout:
                kept, used = staging.slots[k], self.plan.used(k)
                if slot.data.device.type == "cpu":
                    ctypes.memmove(kept.head.data_ptr(), slot.head.data_ptr(), HEADER_BYTES)
                    ctypes.memmove(kept.data.data_ptr(), slot.data.data_ptr(), used)
                else:
                    kept.head.copy_(slot.head)
                    kept.data[:used].copy_(slot.data[:used])
            self.inbox.done(k)
            self._land(k, staging.slots[k])
            if k:
                self._verify(k - 1)
        if self.inbox.count:
            self._verify(self.inbox.count - 1)
        return staging

    def _land(self, k: int, slot: Slot) -> None:
        """Bucket k is in `slot`: check its header now, and start its checksum when this receiver verifies."""
        self._header(k, slot)
        if self.engine.verify:
            self.checks[k] = self.engine.checksums.later(slot.data[:self.plan.used(k)])

    def _drain_aside(self) -> None:
        """A failed landing receive drains the rest into one buffer of the engine's (what drains is
        thrown away), so no bucket posted from now on lands in the rollout's weights."""
        engine = self.engine
        if not engine._landed:
            return
        try:
            engine.slots = engine._allocate([self.plan.bucket_bytes], engine.device)
        except EngineError as exc:
            say("warning", "engine.drain_in_place", engine=engine.name, rank=self.rank, error=str(exc),
                reason="no buffer to drain into: the rest lands in the rollout's weights")

    def _fate(self) -> str:
        """What became of a bucket refused once it landed: nothing of it was applied, unless it landed
        in the rollout's own weights (`into=`)."""
        if self.engine._landed:
            return "its bytes landed in the rollout's weights (into=): the rollout stays stale until a sync completes"
        return "nothing from it was applied"

    def _header(self, k: int, slot: Slot) -> None:
        magic, version, index, used = read_header(slot.head)
        expected = (MAGIC, self.version, k, self.plan.used(k))
        if (magic, version, index, used) != expected:
            raise EngineError(f"{self.engine.name} engine: bucket {k} of {self.inbox.count} arrived with a bad header "
                              f"(magic {magic:#x}, v{version}, bucket {index}, {used} bytes); expected "
                              f"v{expected[1]}, bucket {k}, {expected[3]} bytes; {self._fate()}")

    def _verify(self, k: int) -> None:
        """Compare bucket k's checksum with the sender's, waiting for both."""
        check = self.checks.pop(k, None)
        if check is None:
            return
        with record_function(f"verify bucket {k}"):
            sent = self._sent_digest(k)
            actual = keyed(check.result(), self.plan_id)
        if actual != sent:
            names = self.layout.names(k)
            held = clip(", ".join(names[:4])) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            raise EngineError(f"{self.engine.name} engine: bucket {k} of {self.inbox.count} failed its checksum "
                              f"(sent {sent:016x}, received {actual:016x}); {self._fate()}; "
                              f"it holds {held}")

    def _sent_digest(self, k: int) -> int:
        """The sender's checksum of bucket k; it comes after the bucket, by the sync's deadline."""
        raw = self.engine._control().get(f"digest/{k}", watch_closed=True)
        if not _DIGEST.fullmatch(raw):
            raise EngineError(f"{self.engine.name} engine: bucket {k} of {self.inbox.count}: the sender's checksum "
                              f"{raw[:40]!r} ({len(raw)} bytes) is not 16 lowercase hex digits; {self._fate()}")
        return int(raw, 16)

    def finish(self) -> None:
        """Drain what is left and tell the sender how it went; at most once, never raises."""
        if self.finished:
            return
        self.finished = True
        if self.link_failed:
            return
        ok = self.incoming.complete and self.error is None and self.incoming.stop_reason is None
        error = self.error or self.incoming.stop_reason or (
            f"the rollout stopped reading after {self.incoming.tensors} of {len(self.plan.tensors)} tensors")
        try:
            if not ok:
                self._drain_aside()
                self.inbox.drain()
        except EngineError as exc:
            say("warning", "engine.drain_failed", engine=self.engine.name, rank=self.rank, error=str(exc))
            return
        self.engine._answer(f"status/{self.rank}", None if ok else error)
        if ok and self.incoming.held:
            self._await_heard()

    def _await_heard(self) -> None:
        """A held receive answered that it took the weights, after its rollout's `load_weights`
        returned: it counts only once the sender read that answer (`heard`, or the sync closed
        clean); a sender that gave up first, or the deadline, make it `unheard`."""
        control = self.engine._control()
        try:
            control.wait(["heard"], watch_closed=True)  # a clean close drops `heard` with the sync's other keys
            return
        except EngineError as exc:
            reason = str(exc)
        try:
            if control.closed_clean():
                return
        except EngineError:
            pass
        self.unheard = (f"{self.engine.name} engine: rank {self.rank} took weights v{self.version}, but the sender "
                        f"did not read its answer before it gave up ({reason}); the update counts as failed")
