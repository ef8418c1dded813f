"""The small messages of a sync (version, plan, answers, checksums, bucket signals) over a TCPStore.

The sender hosts one store on the rendezvous address for as long as its engine lives; each
sync writes under its own prefix `sync{n}/`, opened with an `open` key and marked `closed`
when the sender is done with it. A receiver remembers the last sync it took part in and
joins the next one; a receiver that is new (or whose sender restarted) joins the newest sync
that is not closed. Joining claims the receiver's rank in that sync atomically: a process
that replaces a dead rollout finds the rank claimed by its predecessor and waits for the next
sync instead of walking into the middle of one. Keeping the store avoids reconnecting, and
with it racing a closing store, on every sync. The plan is posted once under its id
(`plan/<id>`, outside every sync's prefix) while it stays the same, and each sync's `plan`
key names that id (`reference`); a receiver reads a plan it has not seen from there and
checks it against its id.

Anyone who reaches the store can write to it, so every value is read strictly: one that is
unreadable fails the sync as an `EngineError` naming the key (and the rank), and a message
shows at most `SHOWN_CHARS` of a peer's string.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import structlog
import xxhash

from backends.engines.base import Topology, TransportError
from backends.engines.liveness import Watch, rank_of
from backends.engines.plan import FORMAT, PlanRefused
from lifecycle.errors import EngineError

if TYPE_CHECKING:
    from backends.engines.base import CheckpointEngine
    from backends.engines.link import StoreLink

_POLL_S = 0.25
_BLOCK_S = 1.0
STORE_ERRORS = (RuntimeError, OSError)
PARSE_ERRORS = (ValueError, TypeError, RecursionError)
"""What reading a peer's bytes can raise: JSONDecodeError and UnicodeDecodeError are ValueErrors,
and JSON nested deeper than the interpreter's stack is a RecursionError."""
SHOWN_CHARS = 500
"""The most characters of a peer's string a message shows: a message never grows with a peer's."""
MAX_SYNC = (1 << 63) - 1
_PLAN_ID = re.compile(r"[0-9a-f]{32}")


def clip(text: str, limit: int = SHOWN_CHARS) -> str:
    """A peer's string as a message shows it: its first `limit` characters, and how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}... [{len(text)} characters in all]"


def answer(error: str | None, **said: str) -> bytes:
    """A receiver's answer to the sender (`accepted/{rank}`, `status/{rank}`): ok, or the reason
    it is not; `said`: what it answers about, echoed for the sender to check (`echoed`)."""
    return json.dumps({"ok": error is None, "error": None if error is None else clip(error), **said}).encode()


def echoed(raw: bytes, key: str) -> str | None:
    """What an answer (`answer`) echoes under `key`; None when it echoes no string there."""
    try:
        data = json.loads(raw)
    except PARSE_ERRORS:
        return None
    value = data.get(key) if isinstance(data, dict) else None
    return value if isinstance(value, str) else None


def read_answer(raw: bytes) -> str | None:
    """The reason in an answer, None when it says ok; an unreadable answer is a reason too.

    An answer is a receiver's word, so it is read like any other peer's bytes: a refusal must
    carry its reason as a string, and the reason is cut to `SHOWN_CHARS`."""
    try:
        data = json.loads(raw)
    except PARSE_ERRORS:
        data = None
    if not (isinstance(data, dict) and type(data.get("ok")) is bool
            and (data["ok"] or isinstance(data.get("error"), str))):
        return _unreadable(raw)
    return None if data["ok"] else clip(data["error"])


def refusal(raw: bytes) -> str | None:
    """The reason of an answer that says no; None for one that says ok, and for bytes that are no answer."""
    why = read_answer(raw)
    return None if why == _unreadable(raw) else why


def _unreadable(raw: bytes) -> str:
    return f"sent an unreadable answer {raw[:80]!r} ({len(raw)} bytes)"


def digits(raw: bytes) -> int | None:
    """A number a peer wrote: plain decimal digits, at most 19 of them (no sign, no spaces, no
    exponent, nothing Python's `int` would also take); None for anything else."""
    return int(raw) if raw.isdigit() and len(raw) <= 19 else None


def sync_number(raw: bytes) -> int | None:
    """A sync's number as the store holds it (1 or more); None for anything else."""
    number = digits(raw)
    return number if number is not None and 0 < number <= MAX_SYNC else None


def plan_id(raw: bytes) -> str:
    """A plan's id: the xxh3-128 of its bytes, in 32 lowercase hex digits."""
    return xxhash.xxh3_128_hexdigest(raw)


def reference(ident: str) -> bytes:
    """What a sync's `plan` key holds: the plan's id, the plan itself posted once (`StoreLink.publish`)."""
    return json.dumps({"format": FORMAT, "id": ident}).encode()


def referenced(posted: bytes) -> str | None:
    """The id a sync's `plan` key names its plan by; None when it holds anything else, which is
    then read as a whole plan (`plan.parse_plan` refuses another format or shape, naming it)."""
    if len(posted) > 128:
        return None
    try:
        data = json.loads(posted)
    except PARSE_ERRORS:
        return None
    if not (isinstance(data, dict) and sorted(data) == ["format", "id"] and type(data["format"]) is int
            and data["format"] == FORMAT):
        return None
    ident = data["id"]
    if not (isinstance(ident, str) and _PLAN_ID.fullmatch(ident)):
        raise PlanRefused(f"it names its plan by {clip(repr(ident), 80)}, not by 32 lowercase hex digits")
    return ident


_ANSWERS = ("accepted", "bound", "sets", "status", "target")
"""Keys a receiver writes under its rank in a sync (`accepted/{rank}`...), besides its claims."""


class ControlStore:
    """One sync's keys: every wait ends by the sync's deadline, every failure is a `TransportError`.

    It reaches the store through its engine's link for each call (`StoreLink.store`), never holds
    it: one kept after the engine closed (by the frames of a failed sync's exception) keeps no
    store, and no port, alive."""

    def __init__(self, engine: CheckpointEngine, link: StoreLink, number: int, watch: Watch | None = None) -> None:
        self.engine = engine
        self.link = link
        self.number = number
        self.watch = watch
        """The sender's: its receivers on this host, whose death fails a wait for their keys (`liveness`)."""
        self._written: list[str] = []

    @property
    def store(self) -> Any:
        """This sync's keys (`sync{n}/`), for one call."""
        return self.link.store(f"sync{self.number}")

    @property
    def plans(self) -> Any:
        """Plans by id, outside every sync's keys (a plan is posted once while it stays the same), for one call."""
        return self.link.store("plan")

    def drop_at_close(self, keys: list[str]) -> None:
        """Keys others wrote (a process group's rendezvous) that the sender drops with its own."""
        self._written.extend(keys)

    def set(self, key: str, value: bytes | str) -> None:
        try:
            self.store.set(key, value)
        except STORE_ERRORS as exc:
            raise self._lost(f"setting {key!r}", exc) from exc
        self._written.append(key)

    def set_many(self, pairs: dict[str, bytes | str]) -> None:
        """Every key at once (one store command): a peer reads all of them or none."""
        try:
            self.store.multi_set(list(pairs), list(pairs.values()))
        except STORE_ERRORS as exc:
            raise self._lost(f"setting {_listed(list(pairs))}", exc) from exc
        self._written.extend(pairs)

    def get(self, key: str, *, watch_closed: bool = False) -> bytes:
        return self.get_many([key], watch_closed=watch_closed)[0]

    def get_many(self, keys: list[str], *, watch_closed: bool = False) -> list[bytes]:
        """Every key's value, in order: one wait for them all (see `wait`), then one read."""
        self.wait(keys, watch_closed=watch_closed)
        try:
            return [bytes(value) for value in self.store.multi_get(keys)]
        except STORE_ERRORS as exc:
            raise self._lost(f"reading {_listed(keys)}", exc) from exc

    def await_answers(self, receivers: range, key: str, what: str, *, acknowledge: bool = False) -> list[bytes]:
        """The sender: wait for every receiver's `{key}/{rank}`; an `EngineError` naming each that
        said no, else the answers as read. `acknowledge`: once every answer is read, say so
        (`heard`), which a receiver that holds its answer waits for (`Receiver.finish`)."""
        keys = [f"{key}/{rank}" for rank in receivers]
        answers = self.get_many(keys)
        if acknowledge:
            self.set("heard", b"1")
        problems = [f"rank {rank}: {error}" for rank, raw in zip(receivers, answers)
                    if (error := read_answer(raw)) is not None]
        if problems:
            raise EngineError(f"{self.engine.name} engine: {len(problems)} of {len(keys)} receiver(s) {what}: "
                              + "; ".join(problems))
        return answers

    def check_worlds(self, topology: Topology, unready: str | None = None) -> None:
        """The sender, before it forms a group: every receiver is the same engine, its Rendezvous
        has as many ranks as the sender's, and it did not refuse the sync (`StoreLink._agree`
        posts all three at once). Then it tells the receivers to form the group, or why not
        (`forming`), and raises a `TransportError` naming the first receiver that disagreed, as
        soon as it has said: receivers wait for that word before they form the group
        (`GroupEngine._group_formed`), so none waits out its timeout in a group that never forms.
        `unready`: why the sender itself cannot form it (`GroupEngine._ready`), said once every
        receiver joined (one that joins a closed sync waits for the next), and raised whoever came."""
        if unready is not None:
            with contextlib.suppress(TransportError):  # a receiver that never came: the sender's reason stands
                self.wait([f"engine/{rank}" for rank in topology.receivers])
            self.set("forming", answer(unready))
            raise TransportError(f"{self.engine.name} engine: {unready}")
        for rank in topology.receivers:
            engine, world = self.get_many([f"engine/{rank}", f"world/{rank}"])
            why = disagree(rank, self.engine.name, engine, topology.world_size, digits(world))
            if why is None and self.is_set(f"accepted/{rank}") and (said := read_answer(self.get(f"accepted/{rank}"))):
                why = f"rank {rank} refused the sync: {said}"
            if why is not None:
                self.set("forming", answer(why))
                raise TransportError(f"{self.engine.name} engine: {why}")
        self.set("forming", answer(None))

    def _lost(self, what: str, exc: BaseException) -> TransportError:
        self.link.broken = True  # a reply that did not come may yet: a receiver's next sync connects again
        if self.engine.deadline - time.monotonic() < 0.05:  # the call's socket timeout is the sync's time left
            return TransportError(f"{self.engine.name} engine: {what} did not finish within "
                                  f"timeout_s={self.engine.timeout_s:g} (the rendezvous answered nothing)")
        return TransportError(f"{self.engine.name} engine: lost the rendezvous of sync {self.number} while "
                              f"{what}: {exc}")

    def wait(self, keys: list[str], *, watch_closed: bool = False, prefix: str | None = None) -> None:
        """Block until every key is set, at most until the sync's deadline.

        With `watch_closed` (a receiver waiting on the sender), also stop once the sender has
        closed this sync (it gave up and will set nothing more): a blocking wait of up to
        `_BLOCK_S` (the store wakes it the moment the keys are set), then, for a longer wait,
        `_poll`. Blocking waits cut into short slices made torch log two warnings each time one
        ran out (eight lines a second while a receiver waited on a slow sender). A sender that
        watches receivers on its host (`watch`) waits in the same way, and stops once one of
        them ended without setting its keys (`_ended`). `prefix`: keys outside this sync's.
        """
        what = f"waiting for {_listed(keys)}"
        left = self.engine.remaining(what)
        watching = not watch_closed and self.watch is not None and self.watch.watching
        if watching:
            self._learn()
        try:
            self._keys(prefix).wait(keys, timedelta(seconds=min(left, _BLOCK_S) if watch_closed or watching else left))
        except STORE_ERRORS as exc:
            self.engine.remaining(what)
            if not (watch_closed or watching):
                raise self._lost(what, exc) from exc
            self._poll(prefix, keys, what, sender=watching)
        if prefix is None:
            self._written.extend(keys)

    def _keys(self, prefix: str | None) -> Any:
        """This sync's keys, or those under `prefix/`, for one call."""
        return self.store if prefix is None else self.link.store(prefix)

    def _poll(self, prefix: str | None, keys: list[str], what: str, *, sender: bool = False) -> None:
        """`wait` past its first `_BLOCK_S`: whether every key is set (`check`, which never blocks,
        so nothing is logged) after pauses of a fiftieth of the time waited, so a key is seen at
        most 2% late; and every `_POLL_S`, for a receiver, whether the sender closed the sync,
        for a sender, whether a receiver it watches ended without setting its keys (`_ended`)."""
        start, looked = time.monotonic() - _BLOCK_S, 0.0
        while True:
            try:
                if self._keys(prefix).check(keys):
                    return
                if time.monotonic() - looked >= _POLL_S:
                    looked = time.monotonic()
                    why = self._ended(keys) if sender else self._closed()
                    if why is not None:
                        raise TransportError(f"{self.engine.name} engine: {why} while "
                                             f"{'the sender' if sender else 'this receiver'} was {what}")
            except STORE_ERRORS as exc:
                raise self._lost(what, exc) from exc
            self.engine.remaining(what)
            time.sleep(min((time.monotonic() - start) / 50, _POLL_S / 5))

    def _closed(self) -> str | None:
        return f"the sender gave up on sync {self.number}" if self.is_set("closed") else None

    def _learn(self) -> None:
        """The sender: read the `pid/{rank}` of receivers that posted theirs since it last looked."""
        assert self.watch is not None
        try:
            if unread := self.watch.unread:
                self.watch.learn({rank: bytes(self.store.get(f"pid/{rank}")) for rank in unread
                                  if self.store.check([f"pid/{rank}"])})
        except STORE_ERRORS as exc:
            raise self._lost("reading the receivers' pid", exc) from exc

    def _ended(self, keys: list[str]) -> str | None:
        """Why a wait for `keys` cannot end: a receiver on this host (`watch`) whose process
        ended without setting the keys it owes; None while there is none."""
        assert self.watch is not None
        self._learn()
        for rank, pid in self.watch.dead(keys).items():
            if owed := [key for key in keys if rank_of(key) == rank and not self.store.check([key])]:
                return f"rank {rank} (pid {pid}, on this host) exited or was killed without setting {_listed(owed)}"
        return None

    def read_plan(self, ident: str) -> bytes:
        """The bytes posted under plan id `ident` (`StoreLink.publish`), once they are there;
        unchecked (`receiver.resolve_plan` holds them to the id)."""
        self.wait([ident], watch_closed=True, prefix="plan")
        try:
            return bytes(self.plans.get(ident))
        except STORE_ERRORS as exc:
            raise self._lost(f"reading the plan {ident}", exc) from exc

    def closed_clean(self) -> bool:
        """Whether the sender closed this sync after every receiver answered that it took it."""
        try:
            return bool(self.store.check(["closed"])) and bytes(self.store.get("closed")) == b"clean"
        except STORE_ERRORS as exc:
            raise self._lost("checking 'closed'", exc) from exc

    def is_set(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except STORE_ERRORS as exc:
            raise self._lost(f"checking {key!r}", exc) from exc

    def close(self, topology: Topology, *, clean: bool) -> None:
        """The sender marks the sync closed (`clean` once every receiver took it: `closed_clean`);
        after a clean sync it also drops the sync's keys.

        A failed sync keeps its keys (but for `closed`) until a later sync is clean: a receiver
        still reading one must fail by itself, not wait, and once every receiver took a later
        sync none reads them. So a store does not grow by a failed sync's keys, sync after sync.
        """
        if self.watch is not None:
            self.watch.close()
        if not topology.is_sender:
            return
        self._written.extend(f"{key}/{rank}" for rank in topology.receivers for key in ("joined", "engine", "world", "pid"))
        try:
            self.store.set("closed", b"clean" if clean else b"1")
            if not clean:  # with whatever its receivers wrote that it never waited for
                self._written.extend(f"{key}/{rank}" for rank in topology.receivers for key in _ANSWERS)
                self._written.extend(f"done/{key[6:]}/{rank}" for key in list(self._written)
                                     if key.startswith("ready/") for rank in topology.receivers)
                self.link.failed.append(self)
                return
            for control in [*self.link.failed, self]:
                for key in dict.fromkeys(control._written):
                    control.store.delete_key(key)
            self.link.failed.clear()
        except STORE_ERRORS as exc:
            structlog.get_logger().warning("engine.close_not_marked", engine=self.engine.name, sync=self.number,
                                           error=str(exc))


def disagree(rank: int, senders_engine: bytes | str, receivers_engine: bytes | str, senders_world: int | None,
              receivers_world: int | None) -> str | None:
    """Why sender and receiver `rank` cannot sync (`StoreLink._agree`): another engine, or another
    count of ranks in their Rendezvous; None when they agree."""
    engines = [e if isinstance(e, str) else e.decode(errors="replace") for e in (senders_engine, receivers_engine)]
    if engines[0] != engines[1]:
        sender, receiver = (clip(repr(e), 60) for e in engines)
        return f"the sender is a {sender} engine and rank {rank} a {receiver} one: sender and receivers must be the same engine"
    if senders_world != receivers_world:
        return _worlds(rank, receivers_world, senders_world)
    return None


def _worlds(rank: int, theirs: int | None, senders: int | None) -> str:
    def count(world: int | None) -> str:
        return "an unreadable count of ranks" if world is None or world < 1 else f"{world - 1} receiver(s)"

    return (f"rank {rank}'s Rendezvous has {count(theirs)} and the sender's has {count(senders)}: "
            "give every side the same Rendezvous")


def _listed(keys: list[str]) -> str:
    return repr(keys[0]) + (f" and {len(keys) - 1} more" if len(keys) > 1 else "")
