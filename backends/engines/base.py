"""The checkpoint-engine protocol, and what one sync takes and reports.

Every engine is driven the same way on both sides of a sync:

    engine.prepare()                          # get ready, return metadata
    engine.build_topology(rendezvous, rank)   # rank 0 sends, ranks 1..N receive
    engine.init_process_group()               # meet this sync's peers; its clock starts
    engine.send_weights(named, version)       # rank 0
    for name, tensor in engine.receive_weights(version): ...   # ranks 1..N
    engine.finalize()                         # always, in a finally: tear the group down

`session()` runs that bracket. Process groups live for one sync only, so a sync that failed
half-way leaves nothing behind that could poison the next one.
"""

from __future__ import annotations

import numbers
import threading
import time
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from backends.engines.options import (
    APPLY_MODES, DEFAULT_BUCKET_BYTES, ROLLOUT_DTYPES, EngineCapabilities, EngineOptions, EngineSource, shown,
)
from lifecycle.errors import EngineError
from lifecycle.types import MAX_VERSION, is_version


_TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in ROLLOUT_DTYPES}


class TransportError(EngineError):
    """The link itself failed: a peer died, a group could not form, or time ran out."""


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where the peers of one sync meet: the sender (rank 0) listens on host:port."""

    host: str
    port: int
    receivers: int = 1
    """How many rollout processes receive; they take ranks 1..receivers."""

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise EngineError(f"rendezvous host must be a host name or address, got {shown(self.host)}")
        if not _whole(self.port) or not 0 < self.port < 65536:
            raise EngineError(f"rendezvous port must be an int in 1..65535, got {shown(self.port)}")
        if not _whole(self.receivers) or self.receivers < 1:
            raise EngineError(f"a rendezvous needs an int of at least one receiver, got {shown(self.receivers)}")


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class Topology:
    """This process's place in one sync: rank 0 sends, every other rank receives."""

    rank: int
    world_size: int
    rendezvous: Rendezvous | None

    @property
    def is_sender(self) -> bool:
        return self.rank == 0

    @property
    def receivers(self) -> range:
        return range(1, self.world_size)


@dataclass(kw_only=True, slots=True)
class SyncStats:
    """What one send delivered; the weight-sync transition's figures."""

    backend: str
    version: int
    bytes: int
    buckets: int
    tensors: int
    receivers: int
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    """Where the sender's time went, in seconds (a bucket engine's: `plan`, `pack`, `wire`,
    `apply`, which add up to about `seconds`, and `hash`, on the checksum worker alongside)."""

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def figures(self) -> dict[str, Any]:
        figures = {"backend": self.backend, "bytes": self.bytes, "buckets": self.buckets,
                   "tensors": self.tensors, "receivers": self.receivers,
                   "seconds": round(self.seconds, 6), "gbps": round(self.gbps, 3), "version": self.version}
        if self.phases:
            figures["phases"] = {name: round(seconds, 6) for name, seconds in self.phases.items()}
        return figures


class Incoming(Iterator[tuple[str, torch.Tensor]]):
    """The named tensors of one sync: with `apply="atomic"`, the first arrives once every
    bucket has verified; with `"streamed"`, bucket by bucket as each verifies.

    A tensor is a view into the engine's buffer (streamed, only one that fitted in one bucket;
    a larger one is rejoined in a copy): streamed, valid until the iteration moves on to the
    next bucket; atomic, until the sync ends. A consumer copies it (as `load_weights` does).
    With `"flip"` the views are into the weight set this sync filled (`sets`), handed out once
    every bucket verified, and stay valid until a later sync has completed into the other set:
    a rollout adopts them (`adopt_weights`) instead of copying, and the sync after next lands
    in the set it no longer serves. `complete` turns true once the last tensor was read.

    The receiver tells the sender how the sync went as the last tensor is read, or, once
    `hold()` was called, when its session ends (`finalize`): then what the consumer does after
    reading (a `load_weights` that checks or applies at the end) is part of the answer, and an
    `abort` before then is what the sender hears. `receive_into` holds every receive.
    """

    def __init__(self, version: int) -> None:
        self.version = version
        self.tensors = 0
        self.complete = False
        self.stop_reason: str | None = None
        self.adopted: bool | None = None
        """Whether the rollout took the tensors as its weights (`adopt_weights` says, True or
        False); None: it did not say, and a flip receiver counts a sync read to the end without
        an abort as adopted."""
        self.held = False
        self.adoptable = False
        """Whether a rollout may keep the tensors as its weights (`adopt_weights`): views into a
        flip weight set, or into the rollout's own storage (`into=`); never views of buffers the
        engine reuses, or (naive) the sender's own tensors."""
        self._source: Iterator[tuple[str, torch.Tensor]] = iter(())

    def hold(self) -> Incoming:
        """Answer the sender when the session ends, not as the last tensor is read (see the class)."""
        self.held = True
        return self

    def feed(self, source: Iterator[tuple[str, torch.Tensor]]) -> Incoming:
        self._source = source
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        item = next(self._source)
        self.tensors += 1
        return item

    def abort(self, reason: str) -> None:
        """Stop reading; the engine drains what is still in flight and tells the sender why."""
        self.stop_reason = reason
        close = getattr(self._source, "close", None)
        if close is not None:
            close()


_SESSIONS = threading.Lock()
"""Guards each engine's `_in_session`: the id of the thread whose session is under way, or None (a
plain value, not a lock per engine, keeps engines picklable)."""


class CheckpointEngine:
    """Moves named tensors from one sender to any number of receivers, bucket by bucket.

    A subclass sets `capabilities`, and `Options` (a subclass of `EngineOptions`) when it takes
    keys of its own; `name` is the one it was registered under.
    """

    name: ClassVar[str] = "engine"
    capabilities: ClassVar[EngineCapabilities] = EngineCapabilities()
    Options: ClassVar[type[EngineOptions]] = EngineOptions

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """An engine nobody named (one given by import path) answers to its import path in
        figures and messages, not to "engine"; a subclass of a named engine keeps that name."""
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__ and cls.name == CheckpointEngine.name:
            cls.name = f"{cls.__module__}:{cls.__qualname__}"

    def __init__(self, *, options: EngineOptions | None = None, **values: Any) -> None:
        """`options`, or its fields as keyword values (`rollout_dtype` may be a torch dtype)."""
        if options is not None and values:
            raise EngineError(f"{self.name} engine: give options= or keyword values, not both")
        if options is not None and not isinstance(options, EngineOptions):
            raise EngineError(f"{self.name} engine: options= takes an EngineOptions, got {shown(options)}")
        options = self._options(values) if options is None else options
        if found := options.problem():
            raise EngineError(f"{self.name} engine: {found[0]} {found[1]}")
        if options.apply not in self.applies():
            raise EngineError(f"{self.name} engine: does not take apply={options.apply!r}; it takes "
                              f"{', '.join(map(repr, self.applies()))}")
        self.options = options
        self.bucket_bytes = options.bucket_bytes
        self.verify = options.verify
        self.apply = options.apply
        self.timeout_s = float(options.timeout_s)
        self.rollout_dtype = None if options.rollout_dtype is None else _TORCH_DTYPES[options.rollout_dtype]
        self.topology: Topology | None = None
        self.deadline = 0.0

    @classmethod
    def _options(cls, values: dict[str, Any]) -> EngineOptions:
        dtype = values.get("rollout_dtype")
        if isinstance(dtype, torch.dtype):
            values = {**values, "rollout_dtype": next((n for n, d in _TORCH_DTYPES.items() if d == dtype), str(dtype))}
        try:
            return cls.Options(**values)
        except TypeError as exc:
            raise EngineError(f"{cls.name} engine: {exc}") from None

    @classmethod
    def applies(cls) -> tuple[str, ...]:
        """The `apply` modes this engine takes, read from its class (the config checks a mode
        before any engine is built): `flip` only where its capabilities say it flips."""
        return tuple(mode for mode in APPLY_MODES if mode != "flip" or cls.capabilities.flips)

    @classmethod
    def check_available(cls) -> None:
        """Raise `ConfigError` naming the missing package when this engine cannot run here."""

    @classmethod
    def from_config(cls, config: EngineSource, **kwargs: Any) -> CheckpointEngine:
        """The engine with the options `config` holds for it (its own keys included)."""
        return cls(options=config.options_for(cls.Options), **kwargs)

    def prepare(self) -> dict[str, Any]:
        """Allocate what the engine holds across a sync; returns metadata for logs."""
        return {"backend": self.name, "bucket_bytes": self.bucket_bytes, "verify": self.verify, "apply": self.apply}

    def build_topology(self, rendezvous: Rendezvous | None, rank: int) -> Topology:
        world_size = 1 if rendezvous is None else rendezvous.receivers + 1
        if rendezvous is None and not self.capabilities.in_process:
            raise EngineError(f"{self.name} engine: needs a Rendezvous(host, port, receivers) to meet its peers")
        if not 0 <= rank < world_size and not self.capabilities.in_process:
            raise EngineError(f"{self.name} engine: rank {rank} is outside 0..{world_size - 1} "
                              f"(rank 0 sends, 1..{world_size - 1} receive)")
        self.topology = Topology(rank, world_size, rendezvous)
        return self.topology

    def init_process_group(self) -> None:
        """Join this sync's peers; starts the sync's clock (`timeout_s` from here)."""
        self.deadline = time.monotonic() + self.timeout_s

    def send_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        """Send weights `version`: `named_tensors` is (name, tensor) pairs, a state dict, or an
        `nn.Module` (its state dict, each tied tensor once: `sources.state_weights`); anything
        else is an `EngineError` before a byte moves (`sources.pairs_of`)."""
        raise NotImplementedError

    def receive_weights(self, version: int | None = None, *, expected: Collection[str] | None = None) -> Incoming:
        """The sync's named tensors. `expected`: names the rollout must get; a sync that leaves
        any out is refused before the first tensor is handed out (see `missing`)."""
        raise NotImplementedError

    def refuse(self, reason: str) -> None:
        """Inside a session, join the sync under way only to fail it with `reason`, so the sender
        hears it now rather than at its timeout. This default receives and aborts at once
        (`Incoming.abort`); an engine with a plan answers the plan instead, before any byte moves."""
        self.receive_weights().hold().abort(reason)

    def finalize(self) -> None:
        """Tear down everything of this sync; safe to call twice and after a failure."""
        self.topology = None

    def close(self) -> None:
        """Release everything kept between syncs; the engine may be used again after. Refused
        while another thread's sync is under way (`_refuse_close`)."""
        self._refuse_close()
        self.finalize()

    def _refuse_close(self) -> None:
        """An `EngineError` while another thread runs a session on this engine: closing tears down
        what that sync reads and writes (its store, group, buckets and receiver), which failed it
        with raw errors, or told the sender it failed while its rollout took the weights. The
        session's own thread may close (its `finally` finalizes again, which is safe), and so may
        anyone once that thread has ended."""
        owner = self.__dict__.get("_in_session")
        if not owner or owner == threading.get_ident():
            return
        thread = next((thread for thread in threading.enumerate() if thread.ident == owner), None)
        if thread is not None:
            raise EngineError(f"{self.name} engine: close() while a sync is under way on this engine (in thread "
                              f"{thread.name!r}); close it once that sync has ended")

    def busy(self) -> bool:
        """Whether a session is under way on this engine, which refuses a second one (`session`)."""
        return bool(self.__dict__.get("_in_session"))

    @contextmanager
    def session(self, rendezvous: Rendezvous | None, rank: int) -> Iterator[Topology]:
        """prepare -> build_topology -> init_process_group, and finalize however it ends. One at
        a time: a second session while one is under way (two receives on one engine, from two
        threads) is an `EngineError`; it would take over the first's topology, store and group."""
        with _SESSIONS:
            if self.busy():
                raise EngineError(f"{self.name} engine: a sync is under way on this engine already; one engine "
                                  "carries one sync at a time (give each concurrent sync an engine of its own)")
            self._in_session = threading.get_ident()
        try:
            self.prepare()
            topology = self.build_topology(rendezvous, rank)
            self.init_process_group()
            yield topology
        finally:
            try:
                self.finalize()
            finally:
                self._in_session = None

    def remaining(self, what: str) -> float:
        """Seconds left of this sync; a `TransportError` naming `what` once none are."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TransportError(f"{self.name} engine: {what} did not finish within timeout_s={self.timeout_s:g}")
        return left

    def wire_dtype(self, tensor: torch.Tensor) -> torch.dtype:
        """The dtype a tensor travels in: floating tensors take the rollout dtype when set."""
        if self.rollout_dtype is not None and tensor.is_floating_point():
            return self.rollout_dtype
        return tensor.dtype

    def __repr__(self) -> str:
        return f"{type(self).__name__}(bucket_bytes={self.bucket_bytes}, verify={self.verify})"


def check_version(engine: str, version: Any) -> int:
    """`version` as an int, or `EngineError` unless `is_version`: the sender checks before it
    posts anything, rather than each receiver refusing what it posted."""
    if not is_version(version):
        raise EngineError(f"{engine} engine: the version to send must be an int in 0..{MAX_VERSION}, got "
                          f"{shown(version, numbers.Integral)}")
    return int(version)


def missing(expected: Collection[str] | None, names: Iterable[str]) -> str | None:
    """Why a sync of `names` does not do for a rollout that expects `expected`; None when it does."""
    if expected is None:
        return None
    have = set(names)
    absent = [name for name in expected if name not in have]
    if not absent:
        return None
    listed = ", ".join(repr(name) for name in absent[:5]) + (f" and {len(absent) - 5} more" if len(absent) > 5 else "")
    return f"it leaves out {len(absent)} of the {len(expected)} weight(s) this rollout expects: {listed}"


__all__ = [
    "DEFAULT_BUCKET_BYTES", "CheckpointEngine", "EngineCapabilities", "EngineOptions", "Incoming", "Rendezvous",
    "SyncStats", "Topology", "TransportError",
]
