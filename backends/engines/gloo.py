"""`gloo`: buckets in CPU memory, broadcast over TCP by a private gloo group. Also the CI path.

The group forms from the peers' addresses in the sync's store, which anyone who reaches it can
write, and gloo reads an address by the lengths it carries: an empty one killed the process
(SIGSEGV), a crafted one raised std::bad_alloc. So the group reads the store through
`CheckedAddresses`, which hands gloo a peer's address only once it is laid out as its own
(`address_problem`), and otherwise fails the sync with a `TransportError` naming rank and key.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import struct
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from backends.engines.base import Topology, TransportError
from backends.engines.collective import GroupEngine
from backends.engines.control import STORE_ERRORS, answer, refusal
from backends.engines.options import EngineCapabilities
from backends.engines.registry import CheckpointEngineRegistry

_LENGTH = struct.Struct("=Q")
"""How gloo writes a length (size_t) and each rank's sequence number (ssize_t): 8 bytes, native order."""
_FAMILY = struct.Struct("=H")
_FAMILIES = (socket.AF_INET, socket.AF_INET6)


@CheckpointEngineRegistry.register("gloo")
class GlooEngine(GroupEngine):
    """CPU tensors over gloo; the sender's buckets go to every receiver in one broadcast each."""

    capabilities = EngineCapabilities(devices=frozenset({"cpu"}), flips=True, lands_in_place=True)

    def _make_device(self, topology: Topology) -> Any:
        # Never None here: StoreLink.begin refuses a topology without a rendezvous before any group forms.
        return _device(topology.rendezvous.host)  # type: ignore[union-attr]

    def _make_group(self, store: Any, topology: Topology, timeout: timedelta) -> Any:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [_device(topology.rendezvous.host)  # type: ignore[union-attr]
                             if self._group_device is None else self._group_device]
        checked = CheckedAddresses(store, topology, self.name, f"sync{self._control().number}/group")
        try:
            return dist.ProcessGroupGloo(checked, topology.rank, topology.world_size, options)
        except BaseException:
            # The device goes with the engine's (`_disconnect`), though the exception's frames keep
            # `options`: a peer that connects to it is refused at once, not held past its timeout.
            options._devices = []
            raise


class CheckedAddresses(dist.Store):
    """The store a gloo group forms from, which hands gloo a peer's address (`<context>/<rank>`)
    only once it is laid out as this rank's own (`address_problem`); a `TransportError` naming
    the rank and the key otherwise, and the peer's reason where it wrote a refusal there (its
    own, or `GroupEngine._group_formed`). gloo calls set, wait and get; the rest pass through."""

    def __init__(self, store: Any, topology: Topology, engine: str, where: str) -> None:
        super().__init__()
        self.store = store
        self.engine = engine
        self.rank = topology.rank
        self.world_size = topology.world_size
        self.where = where
        """The keys' prefix in the rendezvous store, for messages."""
        self.own: bytes | None = None

    def set(self, key: str, value: bytes | str) -> None:
        if _rank_of(key) == self.rank:
            self.own = value.encode() if isinstance(value, str) else bytes(value)
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        raw = bytes(self.store.get(key))
        peer = _rank_of(key)
        if peer is None or peer == self.rank:
            return raw
        if (said := refusal(raw)) is not None:
            raise TransportError(f"{self.engine} engine: rank {peer} refused to form the group: {said}")
        problem = address_problem(raw, self.own, self.world_size)
        if problem is None:
            return raw
        why = (f"rank {self.rank} cannot read rank {peer}'s gloo address under '{self.where}/{key}': {problem} "
               f"({raw[:40]!r}, {len(raw)} bytes; someone else writes the rendezvous store)")
        # In place of its own address, so a peer that has not read it yet fails at once (one that
        # has waits for this rank to connect, as for any rank that left while the group formed).
        with contextlib.suppress(*STORE_ERRORS):  # the refusal below is this rank's error either way
            self.store.set(f"{key.rpartition('/')[0]}/{self.rank}", answer(why))
        raise TransportError(f"{self.engine} engine: {why}")

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.store.wait(keys) if timeout is None else self.store.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self.store.check(keys))

    def add(self, key: str, value: int) -> int:
        return int(self.store.add(key, value))

    def delete_key(self, key: str) -> bool:
        return bool(self.store.delete_key(key))


def _rank_of(key: str) -> int | None:
    """The rank a group key names (`<context>/<rank>`); None for another key."""
    rank = key.rpartition("/")[2]
    return int(rank) if rank.isdigit() and len(rank) < 10 else None


def address_problem(raw: bytes, own: bytes | None, world_size: int) -> str | None:
    """Why `raw` is no gloo address a rank of `world_size` can read; None when it is one.

    gloo (tcp `Rank::bytes`) writes a host name's length and bytes, an address's length and
    bytes (a sockaddr_storage and a sequence number), then a sequence number per rank, or none
    where ranks number their pairs themselves; it reads them back trusting every length. A
    peer's must be laid out as this rank's own (`own`, which gloo writes before it reads any):
    an address of the same size and of an IP family, and a sequence number per rank (none
    only where this rank's own holds none either). A gloo whose own record is laid out otherwise
    (another torch's) is not judged: its peers' records pass as they did."""
    if own is None:
        return "this rank has no address of its own to compare it with"
    if isinstance(mine := _fields(own), str):  # another gloo's layout (an older torch): not ours to judge
        return None
    fields = _fields(raw)
    if isinstance(fields, str):
        return fields
    (family, size, pairs), (_, my_size, my_pairs) = fields, mine
    if size != my_size:
        return f"its address is {size} bytes, gloo's are {my_size}"
    if family not in _FAMILIES:
        return f"its address is of family {family}, not IPv4 or IPv6"
    if pairs != world_size and (pairs or my_pairs):
        return f"it holds {pairs} sequence number(s), the group has {world_size} rank(s)"
    return None


def _fields(raw: bytes) -> tuple[int, int, int] | str:
    """A gloo address's family, its size and its count of sequence numbers; or why it has none."""
    end = _LENGTH.size
    if len(raw) < end:
        return f"{len(raw)} bytes hold no length"
    (host,) = _LENGTH.unpack_from(raw)
    if host > len(raw) - end - _LENGTH.size:
        return f"its host name's length {host} runs past its end"
    start = end + host + _LENGTH.size
    (size,) = _LENGTH.unpack_from(raw, start - _LENGTH.size)
    if size > len(raw) - start:
        return f"its address's length {size} runs past its end"
    if size < _FAMILY.size:
        return f"its address of {size} byte(s) holds no family"
    rest = len(raw) - start - size
    if rest % _LENGTH.size:
        return f"{rest} bytes after its address are no whole sequence numbers"
    return _FAMILY.unpack_from(raw, start)[0], size, rest // _LENGTH.size


def _device(host: str) -> Any:
    """Loopback rendezvous: stay on loopback; otherwise GLOO_SOCKET_IFNAME or the host's name."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        return dist.ProcessGroupGloo.create_device(interface=interface)
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    return dist.ProcessGroupGloo.create_default_device()
