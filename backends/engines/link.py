"""`StoreLink`: an engine's connection to the rendezvous store, kept from one sync to the next.

The sender hosts the store and opens each sync in it (`sync{n}/`, see `control`); a receiver
connects, retrying while no sender is there, joins the newest sync that is not closed by
claiming its rank, and agrees with the sender on the engine and the rank count before
anything else (`StoreLink._agree`).

Every store call of a receiver ends by the sync's deadline, also when the sender's process is
alive but does not answer (stopped by SIGSTOP or a debugger, a frozen node, anything that
accepts connections on the port and says nothing). torch's TCPStore client reads a reply with
no limit of its own (torch 2.13: `wait` bounds only the wait for its keys, then reads the
answer to its cancel without one; `get`, `check` and `add` read theirs without one, as does
the handshake of its constructor; `set_timeout` changes none of these). So a receiver tells its
own connection apart (the one to the rendezvous port that opened while its store connected,
`_client`) and, before each call, sets that socket's receive and send timeouts to what is left
of the sync (`store`): a reply that does not come in time fails the call in torch ("Socket
Timeout"), which `control` reports as a `TransportError`. While the store connects, a watchdog
shuts the new connection down at the deadline instead. A connection whose reply did not come
may be out of step with the server, so the receiver's next sync connects again (`broken`).

The sender listens on a socket of its own that torch's store serves (`master_listen_fd`): on
the Rendezvous's address when that is an IP address (a host name: on every interface, as torch
itself binds, since a name may stand for a loopback alias on its own host). `drop` shuts it
down, so `close()` frees the port whatever still holds the store (the frames of a kept
exception).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import threading
import time
from datetime import timedelta
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from backends.engines.base import Rendezvous, Topology, TransportError
from backends.engines.control import (
    MAX_SYNC, STORE_ERRORS, ControlStore, answer, digits, disagree, plan_id, sync_number,
)
from backends.engines.liveness import Watch, whoami

if TYPE_CHECKING:
    from backends.engines.base import CheckpointEngine

_RETRY_S = 0.05
_LEAST_S = 0.1
"""The least time a receiver's store call is given to be answered, also once the sync's deadline passed."""
_MAX_CLAIMS = (1 << 63) - 2
"""The largest count of a rank's claims (`_claim`) that torch's store can add 1 to: it counts in an int64."""
_CONNECTING: dict[int, threading.Lock] = {}
"""One lock per rendezvous port: this process's store connections to a port open one at a time,
so a receiver can tell its own apart (`_client`)."""


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
        self.broken = False
        """A store call failed: a receiver connects again for its next sync (module docstring)."""
        self._listener: socket.socket | None = None
        """The sender's listening socket, which its store serves (module docstring)."""
        self._socket: socket.socket | None = None
        """A receiver's handle on its store connection, whose timeouts bound each call (`store`)."""
        self.ready: Callable[[Topology], str | None] = _ready
        """Why this process cannot take part in a sync (a group engine: its device cannot be made,
        `GroupEngine._ready`); None when it can. A receiver asks before it agrees (`_agree`)."""

    def store(self, prefix: str = "") -> Any:
        """The store, or its keys under `prefix/`, for one call; on a receiver, that call is given
        what is left of the sync to be answered (module docstring). A `TransportError` once the
        engine left the store (`drop`), so a `ControlStore` kept after `close()` holds no store."""
        import torch.distributed as dist

        base = self.base
        if base is None:
            raise TransportError(f"{self.engine.name} engine: this engine left the rendezvous store (close())")
        if self._socket is not None:
            seconds = max(self.engine.deadline - time.monotonic(), _LEAST_S)
            limit = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
        return dist.PrefixStore(prefix, base) if prefix else base

    def begin(self, topology: Topology) -> ControlStore:
        """The control store of this process's next sync; opens it when this is the sender."""
        rdv = topology.rendezvous
        if rdv is None:
            raise TransportError(f"{self.engine.name} engine: a sync across processes needs a Rendezvous")
        if self.address != (rdv.host, rdv.port) or (self.broken and not topology.is_sender):
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
        a sync whose sender is another engine or counts otherwise, or one this process cannot take
        part in (`ready`: a gloo device it cannot make), answering the plan's key in
        the same store command, so a sender without a group hears it too and one forming a group
        sees it before it does: sides that disagree never form a group, nor wait for keys the
        other never writes (gloo overran its timeout several times over on another count;
        another engine waited out timeout_s on both sides)."""
        engine, world = control.get_many(["engine", "world"], watch_closed=True)
        why = disagree(topology.rank, engine, self.engine.name, digits(world), topology.world_size)
        if why is None:
            why = self.ready(topology)
        said: dict[str, bytes | str] = {f"engine/{topology.rank}": self.engine.name, f"pid/{topology.rank}": whoami(),
                                        f"world/{topology.rank}": str(topology.world_size)}
        control.set_many(said if why is None else {**said, f"accepted/{topology.rank}": answer(why)})
        if why is not None:
            raise TransportError(f"{self.engine.name} engine: {why}")

    def _open(self, rdv: Rendezvous, world: int) -> ControlStore:
        if self.base is None:
            timeout = timedelta(seconds=self.engine.remaining("opening the rendezvous"))
            try:
                self.base, self._listener = _host(rdv, timeout)
            except STORE_ERRORS as exc:
                raise TransportError(f"{self.engine.name} engine: cannot host the rendezvous on "
                                     f"{rdv.host}:{rdv.port}: {exc}") from exc
            self.address = (rdv.host, rdv.port)
        self.number += 1
        control = ControlStore(self.engine, self, self.number, Watch(range(1, world)))
        self.base.set("latest", str(self.number))
        control.set_many({"engine": self.engine.name, "world": str(world), "open": b"1"})  # one command: all or none
        return control

    def _join(self, rdv: Rendezvous, rank: int) -> ControlStore:
        """Raises the store's own errors, so `begin` reconnects (the sender may have restarted);
        a `TransportError` once the sync's deadline passed, or when `latest` names no sync."""
        what = f"joining a sync at {rdv.host}:{rdv.port}"
        self.engine.remaining(what)
        if self.base is None:
            self.base, self._socket = _client(rdv, self.engine.deadline)
            self.address = (rdv.host, rdv.port)
            self.number = 0
        if self.number:
            number = self.number + 1
        else:
            self.store().wait(["latest"], timedelta(seconds=self.engine.remaining(what)))
            number = self._latest(rdv)
        while True:
            self.engine.remaining(what)
            control = ControlStore(self.engine, self, number)
            if not control.store.check(["closed"]):
                control.store.wait(["open"], timedelta(seconds=self.engine.remaining(what)))
                if self._claim(control, rank):
                    self.number = number
                    return control
            number += 1

    def _claim(self, control: ControlStore, rank: int) -> bool:
        """Claim `rank` in the sync (`joined/{rank}`, counted atomically): whether this receiver came
        first. A count that is no number, or one the store cannot add 1 to within its int64
        (`_MAX_CLAIMS`), is a `TransportError` naming the key: torch's store cannot add to it and
        drops the connection, which `begin` would take for a lost one and retry."""
        key = f"joined/{rank}"
        if control.store.check([key]):
            raw = bytes(control.store.get(key))
            count = digits(raw)
            if count is None or count > _MAX_CLAIMS:
                raise TransportError(f"{self.engine.name} engine: sync {control.number} holds {raw[:40]!r} "
                                     f"({len(raw)} bytes) under {key!r}, not a count of the receivers that "
                                     f"claimed the rank (0..{_MAX_CLAIMS}; someone else writes the rendezvous store)")
        return bool(control.store.add(key, 1) == 1)

    def _latest(self, rdv: Rendezvous) -> int:
        """The newest sync's number; a `TransportError` naming the key when it is none, since no
        retry can make sense of it (only the sender, or whoever else reaches its store, writes it)."""
        raw = bytes(self.store().get("latest"))
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
        """Leave the store: a receiver closes its connection; a sender stops listening, which frees
        the port at once (only torch's libuv server survives that: its other one aborts the
        process), and the store itself goes once nothing else holds it."""
        base, listener, own = self.base, self._listener, self._socket
        self.failed.clear()
        self.base = self._listener = self._socket = None
        self.address = None
        self.number = 0
        self.posted = self._raw = None
        self.broken = False
        if own is not None:
            own.close()
        if listener is not None:
            try:
                if getattr(base, "libuvBackend", False):
                    listener.shutdown(socket.SHUT_RDWR)
            except OSError:  # not listening any more: nothing to free
                pass
            listener.close()


def _ready(topology: Topology) -> str | None:
    """An engine with nothing to make before it agrees to a sync (`StoreLink.ready`)."""
    return None


def _host(rdv: Rendezvous, timeout: timedelta) -> tuple[Any, socket.socket]:
    """The sender's store, served from a listening socket of its own (module docstring). It starts
    listening and connects to itself under the port's lock: a receiver in this process that found
    the port listening would otherwise hold the lock in a handshake no server answers yet."""
    import torch.distributed as dist

    with _CONNECTING.setdefault(rdv.port, threading.Lock()):
        listener = _listen(rdv)
        try:
            store = dist.TCPStore(rdv.host, rdv.port, None, True, timeout, wait_for_workers=False,
                                  master_listen_fd=os.dup(listener.fileno()))
        except BaseException:
            listener.close()
            raise
    return store, listener


def _listen(rdv: Rendezvous) -> socket.socket:
    """A socket listening on the Rendezvous's address when that is an IP address, else on every interface."""
    try:
        version = ipaddress.ip_address(rdv.host).version
    except ValueError:  # a host name
        dual = socket.has_dualstack_ipv6()
        return socket.create_server(("", rdv.port), family=socket.AF_INET6 if dual else socket.AF_INET,
                                    dualstack_ipv6=dual)
    return socket.create_server((rdv.host, rdv.port), family=socket.AF_INET6 if version == 6 else socket.AF_INET)


def _client(rdv: Rendezvous, deadline: float) -> tuple[Any, socket.socket | None]:
    """A receiver's store, and a handle on its connection (None when it cannot be told apart):
    connected once something listens at the rendezvous, and shut down from `deadline` on while
    its handshake waits for an answer (module docstring)."""
    import torch.distributed as dist

    left = deadline - time.monotonic()
    with _CONNECTING.setdefault(rdv.port, threading.Lock()):
        with socket.create_connection((rdv.host, rdv.port), timeout=min(max(left, 0.001), 1.0)):
            pass  # something listens: torch's client retries a refused connection, holding the lock meanwhile
        before = _connections(rdv.port)
        connected = threading.Event()
        watchdog = threading.Thread(target=_cut, args=(rdv.port, before, deadline, connected), daemon=True,
                                    name="engine-connect-watchdog")
        watchdog.start()
        try:  # a connection refused after all (the sender went) is retried by `begin`, not here under the lock
            store = dist.TCPStore(rdv.host, rdv.port, None, False, timedelta(seconds=min(max(left, 0.001), 1.0)),
                                  wait_for_workers=False)
        finally:
            connected.set()
            watchdog.join()
        opened = [fd for fd, inode in _connections(rdv.port).items() if before.get(fd) != inode]
    store.set_timeout(timedelta(seconds=max(left, 0.001)))  # the default wait, as a process group's rendezvous waits
    return store, socket.socket(fileno=os.dup(opened[0])) if len(opened) == 1 else None


def _cut(port: int, before: dict[int, str], deadline: float, connected: threading.Event) -> None:
    """From `deadline` until `connected`, shut down this process's connections to `port` that are
    not in `before`: the one a store's handshake waits on, and any it retries on."""
    wait = deadline - time.monotonic()
    while not connected.wait(max(wait, 0.0)):
        for fd, inode in _connections(port).items():
            if before.get(fd) != inode:
                try:
                    with socket.socket(fileno=os.dup(fd)) as sock:
                        sock.shutdown(socket.SHUT_RDWR)
                except OSError:  # closed meanwhile
                    pass
        wait = 0.1


def _connections(port: int) -> dict[int, str]:
    """This process's TCP connections to `port`: each fd and its socket (`socket:[inode]`, which
    tells a socket from a later one given the same fd); empty where /proc cannot be read."""
    found: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            inode = os.readlink(f"/proc/self/fd/{name}")
            if not inode.startswith("socket:"):
                continue
            with socket.socket(fileno=os.dup(int(name))) as sock:
                if (sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
                        and sock.getpeername()[1] == port):
                    found[int(name)] = inode
        except OSError:  # closed meanwhile, or not connected
            continue
    return found
