"""`StoreLink`: an engine's connection to the rendezvous store, kept from one sync to the next.

The sender hosts the store and opens each sync in it (`sync{n}/`, see `control`); a receiver
connects, retrying while no sender is there, joins the newest sync that is not closed by
claiming its rank, and agrees with the sender on the engine and the rank count before
anything else (`StoreLink._agree`).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from backends.engines.base import Rendezvous, Topology, TransportError
from backends.engines.control import (
    MAX_SYNC, STORE_ERRORS, ControlStore, answer, digits, disagree, plan_id, sync_number,
)
from backends.engines.liveness import Watch, whoami

if TYPE_CHECKING:
    from backends.engines.base import CheckpointEngine

_RETRY_S = 0.05


class StoreLink:
    """An engine's connection to the rendezvous store, kept from one sync to the next."""

    def __init__(self, engine: CheckpointEngine) -> None:
        self.engine = engine
        self.base: Any = None
        self.address: tuple[str, int] | None = None
        self.number = 0
        self.posted: str | None = None
        """The id of the plan this sender's store holds (`publish`)."""
        self._raw: bytes | None = None
        self.failed: list[ControlStore] = []
        """This sender's failed syncs whose keys the store keeps until a sync is clean (`ControlStore.close`)."""

    def begin(self, topology: Topology) -> ControlStore:
        """The control store of this process's next sync; opens it when this is the sender."""
        rdv = topology.rendezvous
        if rdv is None:
            raise TransportError(f"{self.engine.name} engine: a sync across processes needs a Rendezvous")
        if self.address != (rdv.host, rdv.port):
            self.drop()
        if topology.is_sender:
            return self._open(rdv, topology.world_size)
        while True:
            try:
                control = self._join(rdv, topology.rank)
                break
            except STORE_ERRORS:
                self.drop()
                time.sleep(_RETRY_S)
        self._agree(control, topology)
        return control

    def _agree(self, control: ControlStore, topology: Topology) -> None:
        """A receiver posts its engine and how many ranks its Rendezvous has (`engine/{rank}`,
        `world/{rank}`: a sender forming a group checks them first, `ControlStore.check_worlds`),
        and its process (`pid/{rank}`, which a sender on its host watches: `liveness`), and refuses
        a sync whose sender is another engine or counts otherwise, answering the plan's key in
        the same store command, so a sender without a group hears it too and one forming a group
        sees it before it does: sides that disagree never form a group, nor wait for keys the
        other never writes (gloo overran its timeout several times over on another count;
        another engine waited out timeout_s on both sides)."""
        engine, world = control.get_many(["engine", "world"], watch_closed=True)
        why = disagree(topology.rank, engine, self.engine.name, digits(world), topology.world_size)
        said: dict[str, bytes | str] = {f"engine/{topology.rank}": self.engine.name, f"pid/{topology.rank}": whoami(),
                                        f"world/{topology.rank}": str(topology.world_size)}
        control.set_many(said if why is None else {**said, f"accepted/{topology.rank}": answer(why)})
        if why is not None:
            raise TransportError(f"{self.engine.name} engine: {why}")

    def _open(self, rdv: Rendezvous, world: int) -> ControlStore:
        import torch.distributed as dist

        if self.base is None:
            timeout = timedelta(seconds=self.engine.remaining("opening the rendezvous"))
            try:
                self.base = dist.TCPStore(rdv.host, rdv.port, None, True, timeout, wait_for_workers=False)
            except STORE_ERRORS as exc:
                raise TransportError(f"{self.engine.name} engine: cannot host the rendezvous on "
                                     f"{rdv.host}:{rdv.port}: {exc}") from exc
            self.address = (rdv.host, rdv.port)
        self.number += 1
        control = ControlStore(self.engine, self.base, self.number, Watch(range(1, world)), self.failed)
        self.base.set("latest", str(self.number))
        control.set_many({"engine": self.engine.name, "world": str(world), "open": b"1"})  # one command: all or none
        return control

    def _join(self, rdv: Rendezvous, rank: int) -> ControlStore:
        """Raises the store's own errors, so `begin` reconnects (the sender may have restarted);
        a `TransportError` once the sync's deadline passed, or when `latest` names no sync."""
        import torch.distributed as dist

        what = f"joining a sync at {rdv.host}:{rdv.port}"
        if self.base is None:
            timeout = timedelta(seconds=self.engine.remaining(what))
            self.base = dist.TCPStore(rdv.host, rdv.port, None, False, timeout, wait_for_workers=False)
            self.address = (rdv.host, rdv.port)
            self.number = 0
        if self.number:
            number = self.number + 1
        else:
            self.base.wait(["latest"], timedelta(seconds=self.engine.remaining(what)))
            number = self._latest(rdv)
        while True:
            self.engine.remaining(what)
            control = ControlStore(self.engine, self.base, number)
            if not control.store.check(["closed"]):
                control.store.wait(["open"], timedelta(seconds=self.engine.remaining(what)))
                if control.store.add(f"joined/{rank}", 1) == 1:
                    self.number = number
                    return control
            number += 1

    def _latest(self, rdv: Rendezvous) -> int:
        """The newest sync's number; a `TransportError` naming the key when it is none, since no
        retry can make sense of it (only the sender, or whoever else reaches its store, writes it)."""
        raw = bytes(self.base.get("latest"))
        number = sync_number(raw)
        if number is None:
            raise TransportError(f"{self.engine.name} engine: the rendezvous at {rdv.host}:{rdv.port} holds "
                                 f"{raw[:40]!r} ({len(raw)} bytes) under 'latest', not the number of a sync "
                                 f"(1..{MAX_SYNC})")
        return number

    def publish(self, control: ControlStore, raw: bytes) -> str:
        """The sender's plan, posted under its id unless the store holds it already (the last
        sync's, unchanged: a sync then names it in 55 bytes instead of sending it whole); a
        plan it replaces is dropped. Its id, for the sync's `plan` key (`reference`)."""
        if raw is self._raw and self.posted is not None:  # an unchanged layout's bytes: not hashed again
            return self.posted
        ident = plan_id(raw)
        if ident != self.posted:
            try:
                control.plans.set(ident, raw)
                if self.posted is not None:
                    control.plans.delete_key(self.posted)
            except STORE_ERRORS as exc:
                raise control._lost(f"posting the plan {ident}", exc) from exc
            self.posted = ident
        self._raw = raw
        return ident

    def drop(self) -> None:
        self.failed.clear()
        self.base = None
        self.address = None
        self.number = 0
        self.posted = self._raw = None
