"""verl checkpoint engines backed by this library's `gloo` and `shm` engines.

Importing this module registers `trainer_lifecycle_gloo` and `trainer_lifecycle_shm` in verl's
`CheckpointEngineRegistry`; verl imports it on every worker when a config names it as
`checkpoint_engine.custom_backend_module`. verl's own manager and workers then drive an
adapter exactly as they drive their engines (prepare on every worker, `build_topology` on the
driver, `init_process_group`, `send_weights` / `receive_weights`, `finalize`), and the adapter
runs one of our engines underneath, with its checks: a checksum per bucket, a receiver that
checks the sender's plan against its own settings before allocating anything, and atomic
apply, so `receive_weights` yields nothing until every bucket of the version has verified and
verl's server adapter never loads part of a version. A receive that fails leaves the adapter
`stale` with its `version` unchanged and raises our `EngineError`, naming the bucket and the
tensors in it. `stale` means the rollout does not hold the version it was asked for: when the
receive failed before anything was yielded (a bucket failed its checksum, the plan was refused,
the sender gave up) the rollout still holds `version` whole; once tensors were yielded it may
hold part of the new one. Either way it must not serve as the new version; the next sync that
succeeds clears it.

What a sync costs and needs:

- Memory: actor rank 0 collects the whole model in host memory before it sends anything (each
  tensor is copied off the device as the generator yields it, so the device holds one at a
  time), and each rollout worker stages a full copy of the version it receives, since the
  atomic receive yields nothing until every bucket has verified. Budget one model's size of
  host memory on actor rank 0's node and on every rollout worker, beyond the buckets.
- Tensors the generator yields in host memory are kept as they are, not copied: they must
  stay unchanged until `send_weights` returns. A generator that refills one CPU buffer for
  every name would send the last contents under every name; yield a fresh tensor per name
  (device tensors are copied to the host as they arrive, so they may be reused at once).
- Time: `timeout_s` runs from `init_process_group`, and on the actor that includes walking the
  generator (the FSDP gather of the whole model) before the first bucket goes out: set it to
  cover the gather and the transfer, or the rollout gives up first.
- `trainer_lifecycle_shm` moves buckets through shared memory on one host: actor rank 0 and
  every rollout worker must run there. `build_topology` refuses, naming the worker and both
  hosts, a rollout worker on another host (`prepare()` reports each worker's host name); use
  `trainer_lifecycle_gloo` across hosts.

Without verl this module still imports (it registers nothing), and building an adapter raises
a `ConfigError` naming the missing module.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar, TypeVar

import structlog
import torch

from backends.base import free_port
from backends.engines.base import CheckpointEngine, Incoming, Rendezvous
from backends.engines.registry import CheckpointEngineRegistry
from backends.engines.sync import profiled
from lifecycle.errors import ConfigError, EngineError, shorten
from lifecycle.integrations.verl_checks import (
    KEY, Weights, check_folder, check_one_host, check_worker, collect, engine_key, engine_options, integer,
    refuse_after_walk, rendezvous, rollout_holds, weights_version,
)

_VerlBase: type
_MISSING: ImportError | None
try:
    from verl.checkpoint_engine import CheckpointEngine as _VerlBase
    from verl.checkpoint_engine import CheckpointEngineRegistry as _VerlRegistry
except ImportError as exc:
    _VerlBase, _VerlRegistry, _MISSING = object, None, exc
else:
    _MISSING = None

T = TypeVar("T")

BYSTANDER = -1
"""The rank `build_topology` gives actor ranks other than 0: they join no group, and their
`send_weights` only walks the weights (producing them is collective over the actor group)."""
_GRACE_S = 5.0


class LifecycleCheckpointEngine(_VerlBase):  # type: ignore[misc,valid-type]
    """One of our engines behind verl's `CheckpointEngine`; a subclass names which.

    Actor rank 0 sends (our rank 0), rollout worker i receives (our rank i + 1); other actor
    ranks are bystanders. verl builds the adapter with `bucket_size` (bytes, from
    `update_weights_bucket_megabytes`), `is_master` (true on actor rank 0 only) and
    `engine_kwargs[<backend>]`: our engine's options other than `bucket_bytes` (`verify`,
    `timeout_s`, `rollout_dtype`, `profile`, `profile_dir`, created when the adapter is built,
    `apply`, which must stay `atomic`), the engine's own keys (`shm_dir`, an existing folder),
    and where actor rank 0 hosts the rendezvous (`host`, `port`: by default this node's address
    and a free port, picked once and kept; a host it cannot listen on is refused by `prepare`).
    """

    verl_name: ClassVar[str] = ""
    engine_name: ClassVar[str] = ""
    extra_kwargs: ClassVar[tuple[str, ...]] = ()
    """Keyword arguments of the engine's constructor beyond its options."""
    default_host: ClassVar[str | None] = None
    """The rendezvous host when engine_kwargs names none; None: this node's address as Ray sees it."""
    one_host: ClassVar[bool] = False
    """Whether actor rank 0 and every rollout worker must share a host (`build_topology` checks)."""
    folders: ClassVar[tuple[str, ...]] = ()
    """The engine's attributes naming folders that must exist on every worker (checked when built)."""

    def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs: Any) -> None:
        if _MISSING is not None:
            package = _MISSING.name or "verl"
            raise ConfigError(f"{KEY}.backend", f"{self.verl_name} is a verl checkpoint engine and needs the package "
                                                f"{package!r}: importing verl.checkpoint_engine failed: {_MISSING}")
        self.is_master = is_master is True
        """Only `True` itself: a truthy string in a config is no master."""
        self.host: str | None = engine_kwargs.pop("host", None)
        self.port: int | None = engine_kwargs.pop("port", None)
        self._check_address()
        self.engine = self._build(bucket_size, engine_kwargs)
        self.rank: int | None = None
        self.version: int | None = None
        """The last version this adapter sent, or received whole and verified."""
        self.stale = False
        """A receiver's: its last receive failed, so the rollout does not hold the version asked
        for (still `version` whole when nothing was yielded; perhaps part of the new one after)."""
        self._profile_dir = self.engine.options.profile_dir if self.engine.options.profile else None
        self._check_folders()
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._worker: concurrent.futures.Future[Any] | None = None
        self._taking: tuple[Incoming, list[int]] | None = None
        """A receive whose tensors are being handed out, and how many were: verl's server
        adapter may stop taking them (its load raised) without closing the generator."""

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def _key(cls, name: str) -> str:
        return engine_key(cls.verl_name, name)

    def _check_address(self) -> None:
        if self.host is not None and not (isinstance(self.host, str) and self.host):
            raise ConfigError(self._key("host"), f"must be a host name or address, got {shorten(self.host)}")
        if self.port is not None:
            if (port := integer(self.port)) is None or not 0 < port < 65536:
                raise ConfigError(self._key("port"), f"must be a TCP port in 1..65535, got {shorten(self.port)}")
            self.port = port

    def _check_folders(self) -> None:
        """The folders a sync uses, checked now (the profile's created): a bad one would fail every sync."""
        if self._profile_dir is not None:
            check_folder(self._key("profile_dir"), self._profile_dir, create=True)
        for name in self.folders:
            check_folder(self._key(name), getattr(self.engine, name), create=False)

    def _build(self, bucket_size: int, kwargs: dict[str, Any]) -> CheckpointEngine:
        """Our engine with verl's bucket size and the engine_kwargs mapped onto its options."""
        engine_class = CheckpointEngineRegistry.get(self.engine_name)
        options = engine_options(self.verl_name, engine_class.Options, bucket_size, kwargs, self.extra_kwargs)
        extras = {key: value for key, value in kwargs.items() if key in self.extra_kwargs}
        return engine_class(options=options, **extras)

    # -- verl's protocol ----------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        """Metadata for `build_topology`; actor rank 0 adds the rendezvous it will host.

        Ends first whatever is left of the last sync: verl skips `finalize` when a worker's
        `update_weights` raised."""
        self._end_session()
        metadata: dict[str, Any] = {"backend": self.verl_name, "is_master": self.is_master,
                                    "hostname": socket.gethostname()}
        if self.is_master:
            if self.host is None:
                self.host = self.default_host or _node_address()
            if self.port is None:
                self.port = self._free_port(self.host)
            metadata.update(host=self.host, port=self.port)
        return metadata

    def _free_port(self, host: str) -> int:
        """A free port on `host`, which must be an address of this node: actor rank 0 hosts the rendezvous."""
        try:
            return free_port(host)
        except OSError as exc:
            raise ConfigError(self._key("host"), f"{host!r}: actor rank 0 cannot listen there for the rendezvous "
                                                 f"({type(exc).__name__}: {exc}); give a host name or address of "
                                                 "actor rank 0's node") from exc

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict[str, Any]]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Actor rank 0 sends as our rank 0, rollout worker i receives as rank i + 1, and every
        other actor rank is a `BYSTANDER`; `metadata` lists the actor ranks' first. Whatever
        `prepare()` returned is checked here (it crossed processes), and a bad entry is an
        `EngineError` naming the worker, rather than a failure later or a wait for a timeout."""
        actors, rollouts = integer(actor_wg_world_size), integer(rollout_world_size)
        if actors is None or rollouts is None or actors < 1 or rollouts < 1:
            raise EngineError(f"{cls.verl_name}: a weight sync needs an actor and a rollout worker; got "
                              f"{shorten(actor_wg_world_size)} actor and {shorten(rollout_world_size)} rollout "
                              "worker(s)")
        if not isinstance(metadata, list) or len(metadata) != actors + rollouts:
            count = f"{len(metadata)} workers" if isinstance(metadata, list) else shorten(metadata)
            raise EngineError(f"{cls.verl_name}: got metadata from {count}, expected a list from {actors} actor + "
                              f"{rollouts} rollout workers")
        for i, meta in enumerate(metadata):
            check_worker(cls.verl_name, f"actor rank {i}" if i < actors else f"rollout rank {i - actors}", meta,
                         master=i == 0)
        host, port = rendezvous(cls.verl_name, metadata[0])
        if cls.one_host:
            check_one_host(cls.verl_name, metadata[0], metadata[actors:])
        shared = {"host": host, "port": port, "receivers": rollouts}
        actor_kwargs = {"rank": [0] + [BYSTANDER] * (actors - 1), **{k: [v] * actors for k, v in shared.items()}}
        rollout_kwargs = {"rank": list(range(1, rollouts + 1)), **{k: [v] * rollouts for k, v in shared.items()}}
        return actor_kwargs, rollout_kwargs

    def init_process_group(self, rank: int, host: str, port: int, receivers: int) -> None:
        """Meet this sync's peers (a bystander meets none); the engine's clock starts here."""
        our_rank, our_port, count = integer(rank), integer(port), integer(receivers)
        if our_rank is None or our_port is None or count is None or not (isinstance(host, str) and host):
            raise EngineError(f"{self.verl_name}: init_process_group takes what build_topology returned; got "
                              f"rank={shorten(rank)}, host={shorten(host)}, port={shorten(port)}, "
                              f"receivers={shorten(receivers)}")
        self.rank = our_rank
        if our_rank == BYSTANDER:
            return
        try:
            self.engine.prepare()
            self.engine.build_topology(Rendezvous(host, our_port, count), our_rank)
            self.engine.init_process_group()
        except BaseException:
            self.engine.finalize()
            raise

    async def send_weights(self, weights: Weights, global_steps: int | None = None) -> dict[str, float]:
        """Actor rank 0 sends `weights` as version `global_steps` (one more than the last sent
        when None) and returns the sync's figures; other actor ranks only walk `weights`. A
        refusal on actor rank 0 comes once it has walked `weights` whole, as the others do
        (producing each item is collective over the actor ranks; see `collect`)."""
        if self.rank == BYSTANDER:
            await collect(weights, keep=False)
            return {}
        try:
            version = self._version_to_send(global_steps)
        except EngineError as refused:
            if self.rank == 0:
                self._fail(None)  # the rollout workers hear it now, not after the walk
            await refuse_after_walk(weights, refused)
        try:
            pairs = await collect(weights, keep=True)
            stats = await self._in_thread(self._send, pairs, version)
        except BaseException:
            self._fail(None)
            raise
        self.version = version
        return {f"trainer_lifecycle/{key}": value for key, value in stats.figures().items() if key != "backend"}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """The tensors of version `global_steps` (whatever the sender sends when None), the first
        once every bucket has verified. A tensor may be a view into the engine's buffers, valid
        until the next sync: the consumer copies it (verl's server adapters do)."""
        rank = self._joined("receive_weights")
        if rank < 1:
            raise EngineError(f"{self.verl_name}: this is an actor rank; receive_weights runs on rollout workers")
        incoming: Incoming | None = None
        yielded = [0]  # shared with `_taking`: how many were handed out, the one in the consumer's hands included
        try:
            version = None if global_steps is None else weights_version(global_steps)
            incoming, item = await self._in_thread(self._receive_first, version)
            self._taking = (incoming, yielded)
            if item is not None:
                self.stale = True  # partly loaded from the first tensor handed out to the last
            while item is not None:
                yielded[0] += 1
                yield item
                item = next(incoming, None)
            if not incoming.complete:
                raise EngineError(f"{self.verl_name}: the receive of weights v{incoming.version} ended after "
                                  f"{incoming.tensors} tensors, before the last one")
        except BaseException as exc:
            self._taking = None
            self._fail(incoming, exc, yielded[0])
            raise
        self._taking = None
        self.version, self.stale = incoming.version, False

    def finalize(self) -> None:
        """Tear this sync down (the group, the sync's keys); buckets and the rendezvous stay."""
        self._end_session()
        self.rank = None

    def close(self) -> None:
        """Give back everything: buckets, the rendezvous store, shared-memory files, the thread."""
        self.finalize()
        self.engine.close()
        if self._threads is not None:
            self._threads.shutdown(wait=True)
            self._threads = None

    # -- helpers ------------------------------------------------------------------------------

    def _joined(self, what: str) -> int:
        if self.rank is None:
            raise EngineError(f"{self.verl_name}: {what} before init_process_group (verl's order: prepare, "
                              "build_topology, init_process_group, then send_weights / receive_weights)")
        return self.rank

    def _version_to_send(self, global_steps: object) -> int:
        """The version actor rank 0 sends; an `EngineError` on any other rank but a bystander."""
        rank = self._joined("send_weights")
        if rank > 0:
            raise EngineError(f"{self.verl_name}: rank {rank} is a rollout worker; only actor ranks send_weights")
        return weights_version(global_steps) if global_steps is not None else (self.version or 0) + 1

    def _send(self, pairs: list[tuple[str, torch.Tensor]], version: int) -> Any:
        with profiled(self._profile_dir, f"weight_sync_{self.verl_name}_v{version}_send"):
            return self.engine.send_weights(pairs, version)

    def _receive_first(self, version: int | None) -> tuple[Incoming, tuple[str, torch.Tensor] | None]:
        """Check the plan, receive and verify every bucket; returns the tensors and the first one."""
        with profiled(self._profile_dir, f"weight_sync_{self.verl_name}_receive_rank{self.rank}"):
            incoming = self.engine.receive_weights(version)
            return incoming, next(incoming, None)

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run the engine's blocking part off verl's event loop, on this adapter's one thread."""
        if self._threads is None:
            self._threads = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=self.verl_name)
        self._worker = self._threads.submit(fn, *args)
        return await asyncio.wrap_future(self._worker)

    def _fail(self, incoming: Incoming | None, exc: BaseException | None = None, yielded: int = 0) -> None:
        """A sync that failed: a receiver is stale; the group goes at once, so peers fail fast.

        While the engine's thread still runs (verl cancelled the task), `finalize` or the next
        `prepare` ends the sync once it is done."""
        self._mark_stale(incoming, exc, yielded)
        if self._worker is None or self._worker.done():
            self._end_session()

    def _mark_stale(self, incoming: Incoming | None, exc: BaseException | None, yielded: int) -> None:
        """A receiver's failed sync: stale, logged, and its receive aborted, which tells the sender."""
        if self.rank is not None and self.rank > 0:
            self.stale = True
            reason = ("verl's server adapter stopped reading" if isinstance(exc, GeneratorExit)
                      else f"{type(exc).__name__}: {exc}" if exc is not None else "the receive failed")
            structlog.get_logger().warning("engine.verl_rollout_stale", engine=self.verl_name, rank=self.rank,
                                           version=self.version, yielded=yielded, error=reason,
                                           rollout=rollout_holds(self.version, yielded))
            if incoming is not None and not incoming.complete:
                incoming.abort(f"verl's server adapter stopped reading ({reason})")

    def _end_session(self) -> None:
        """Finalize the engine once its thread is done (every wait in it has a deadline); a
        receive whose tensors verl stopped taking fails first, telling the sender."""
        if (taking := self._taking) is not None:
            self._taking = None
            self._mark_stale(taking[0], EngineError("verl's server adapter stopped taking tensors before the last "
                                                    "one"), taking[1][0])
        worker, self._worker = self._worker, None
        if worker is not None and not worker.done():
            concurrent.futures.wait([worker], timeout=self.engine.timeout_s + _GRACE_S)
        self.engine.finalize()


class LifecycleGlooCheckpointEngine(LifecycleCheckpointEngine):
    """`trainer_lifecycle_gloo`: buckets in host memory over a private gloo group (TCP)."""

    verl_name = "trainer_lifecycle_gloo"
    engine_name = "gloo"


class LifecycleShmCheckpointEngine(LifecycleCheckpointEngine):
    """`trainer_lifecycle_shm`: actor rank 0 and every rollout worker on one host, buckets in
    shared memory; the rendezvous defaults to loopback."""

    verl_name = "trainer_lifecycle_shm"
    engine_name = "shm"
    extra_kwargs = ("shm_dir",)
    folders = ("shm_dir",)
    default_host = "127.0.0.1"
    one_host = True


ADAPTERS: dict[str, type[LifecycleCheckpointEngine]] = {
    cls.verl_name: cls for cls in (LifecycleGlooCheckpointEngine, LifecycleShmCheckpointEngine)
}
"""verl backend name -> adapter; registered in verl's registry when verl imports."""

if _VerlRegistry is not None:
    for _name, _adapter in ADAPTERS.items():
        _VerlRegistry.register(_name)(_adapter)


def _node_address() -> str:
    """This node's address as Ray reports it (verl runs on Ray; its own engines do the same)."""
    import ray.util

    return str(ray.util.get_node_ip_address()).strip("[]")


__all__ = ["ADAPTERS", "BYSTANDER", "LifecycleCheckpointEngine", "LifecycleGlooCheckpointEngine",
           "LifecycleShmCheckpointEngine"]
