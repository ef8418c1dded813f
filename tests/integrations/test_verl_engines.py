"""The verl adapters (`lifecycle.integrations.verl`) against the real verl package.

verl's own pieces drive them: its `CheckpointEngineConfig`, `import_external_libs` of
`custom_backend_module`, `CheckpointEngineRegistry.new(backend, bucket_size=..., **engine_kwargs)`
as its workers build engines, and `CheckpointEngineManager`'s order (prepare on every worker,
`build_topology` with the actor ranks' metadata first, `init_process_group` everywhere, then
`send_weights` / `receive_weights`, and `finalize` only when every worker's update returned).

Importing verl takes seconds per process, so the two-process syncs run once for the module:
an actor process (rank 0) and a rollout process (rank 1) run every sync of both adapters in
turn, each outcome recorded, and the tests read the outcomes. Both processes are reaped, and
killed at `RANKS_TIMEOUT_S` if they hang.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from backends.engines.base import TransportError
from lifecycle.errors import ConfigError, EngineError
from tests.backends.dist_util import run_ranks
from tests.backends.engines.kit import mixed_tensors
from tests.guards import within

BACKENDS = ["trainer_lifecycle_gloo", "trainer_lifecycle_shm"]
ROOT = Path(__file__).resolve().parents[2]
RANKS_TIMEOUT_S = 240.0
"""Hang guard for the two processes, verl's import (seconds each) and every sync included."""
SYNC_TIMEOUT_S = 20.0
"""The adapters' timeout_s: a failure that fell back to waiting it out would show in the run time."""
CORRUPT_BUCKET = 1


@pytest.fixture(scope="module")
def verl() -> Any:
    return pytest.importorskip("verl.checkpoint_engine")


def _config(backend: str, **engine_kwargs: Any) -> Any:
    from verl.workers.config import CheckpointEngineConfig

    kwargs = {"host": "127.0.0.1", "timeout_s": SYNC_TIMEOUT_S, **engine_kwargs}
    return CheckpointEngineConfig(backend=backend, update_weights_bucket_megabytes=1,
                                  engine_kwargs={backend: kwargs}, custom_backend_module="lifecycle.integrations.verl")


def _new(config: Any, **worker: Any) -> Any:
    """An engine built as verl's workers build one (`is_master=` only on the actor side)."""
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs(config.custom_backend_module or None)
    return CheckpointEngineRegistry.new(config.backend, **worker, bucket_size=config.update_weights_bucket_megabytes
                                        << 20, **config.engine_kwargs.get(config.backend, {}))


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Every dtype and shape of `mixed_tensors`, and one tensor chunked over three 1 MiB buckets."""
    gen = torch.Generator().manual_seed(seed)
    return [*mixed_tensors(seed), ("big", torch.randn(600_000, generator=gen))]


def _raw(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


# -- the two processes ------------------------------------------------------------------------


def _sync(rank: int, adapter: Any, version: int, seed: int, *, asynchronous: bool = False,
          receive: Callable[..., Any] | None = None) -> dict[str, Any]:
    """One `CheckpointEngineManager.update_weights` between this actor (rank 0) and rollout (rank 1)."""
    import torch.distributed as dist

    metadata: list[Any] = [None, None]
    dist.all_gather_object(metadata, adapter.prepare())
    actor_kwargs, rollout_kwargs = type(adapter).build_topology(1, 1, metadata)
    adapter.init_process_group(**{key: value[0] for key, value in (rollout_kwargs if rank else actor_kwargs).items()})
    dist.barrier()
    outcome = asyncio.run((receive or _receive)(adapter, version, seed) if rank
                          else _send(adapter, version, seed, asynchronous))
    finished: list[Any] = [None, None]
    dist.all_gather_object(finished, outcome["error"] is None)
    if all(finished):
        adapter.finalize()
    outcome.update(version=adapter.version, stale=adapter.stale)
    return outcome


async def _send(adapter: Any, version: int, seed: int, asynchronous: bool) -> dict[str, Any]:
    async def produce() -> AsyncIterator[tuple[str, torch.Tensor]]:
        for pair in _weights(seed):
            yield pair

    weights = produce() if asynchronous else iter(_weights(seed))
    try:
        return {"error": None, "metrics": await adapter.send_weights(weights, global_steps=version)}
    except EngineError as exc:
        return {"error": str(exc), "metrics": None}


async def _receive(adapter: Any, version: int, seed: int) -> dict[str, Any]:
    """As verl's server adapter: copy each tensor as it comes."""
    got: dict[str, torch.Tensor] = {}
    error = None
    try:
        async for name, tensor in adapter.receive_weights(global_steps=version):
            got[name] = tensor.clone()
    except EngineError as exc:
        error = str(exc)
    sent = dict(_weights(seed))
    wrong = sorted(name for name, tensor in got.items()
                   if name not in sent or tensor.dtype != sent[name].dtype or tensor.shape != sent[name].shape
                   or _raw(tensor) != _raw(sent[name]))
    return {"error": error, "yielded": len(got), "complete": sorted(got) == sorted(sent), "wrong": wrong}


async def _receive_and_fail(adapter: Any, version: int, seed: int) -> dict[str, Any]:
    """As a server adapter whose load raises at the third tensor: the generator is left open (an
    `async for` does not close it), then verl's worker ends the sync (`finalize`)."""
    taken = 0
    try:
        async for _name, _tensor in adapter.receive_weights(global_steps=version):
            taken += 1
            if taken == 3:
                raise RuntimeError("load_weights failed")
    except RuntimeError as exc:
        error = str(exc)
    stale_at_once = adapter.stale
    adapter.finalize()
    return {"error": error, "yielded": taken, "stale_at_once": stale_at_once}


@contextmanager
def _patched(engine: Any, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    engine.__dict__[name] = make(getattr(engine, name))
    try:
        yield
    finally:
        del engine.__dict__[name]
        engine._layout = None  # a plan edited on its way out must not be reused by the next sync


def _corrupting(start: Any, engine: Any) -> Any:
    """Flip a byte of bucket CORRUPT_BUCKET after its checksum was written: on the wire for gloo,
    in the shared bucket for shm."""
    def flipped(k: int, nbytes: int) -> Any:
        if k == CORRUPT_BUCKET:
            engine.slots[k % 2].data[5] ^= 0xFF
        return start(k, nbytes)
    return flipped


def _undeliverable(send_layout: Any) -> Any:
    """Publish a plan whose first tensor has a dtype that cannot travel (our sender never makes one)."""
    def edited(metas: Any) -> Any:
        layout = send_layout(metas)
        layout.raw = layout.raw.replace(b'"float32"', b'"quint8"', 1)
        return layout
    return edited


def _scenarios(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any]:
    """Every sync of the module, in order, on both sides; each outcome keyed `backend/what`."""
    out: dict[str, Any] = {}
    for backend in BACKENDS:
        adapter = _new(_config(backend), **({} if rank else {"is_master": True}))
        out[f"{backend}/type"] = [type(adapter).__module__, type(adapter).__name__]
        out[f"{backend}/v5"] = _sync(rank, adapter, 5, seed=0)
        out[f"{backend}/v6"] = _sync(rank, adapter, 6, seed=1, asynchronous=True)
        corrupt = _patched(adapter.engine, "_start_send", lambda start: _corrupting(start, adapter.engine))
        packs = _patched(adapter.engine, "sends_regions", lambda _: False)  # the flip must be in a packed slot
        with corrupt if rank == 0 else nullcontext(), packs if rank == 0 else nullcontext():
            out[f"{backend}/corrupt"] = _sync(rank, adapter, 7, seed=2)
        out[f"{backend}/after_corrupt"] = _sync(rank, adapter, 8, seed=2)
        with _patched(adapter.engine, "_send_layout", _undeliverable) if rank == 0 else nullcontext():
            out[f"{backend}/dtype"] = _sync(rank, adapter, 9, seed=3)
        unverified = _new(_config(backend, verify=False), is_master=True) if rank == 0 else adapter
        out[f"{backend}/unverified"] = _sync(rank, unverified, 10, seed=4)
        if unverified is not adapter:
            unverified.close()
        out[f"{backend}/after_refusals"] = _sync(rank, adapter, 11, seed=5)
        out[f"{backend}/load_raised"] = _sync(rank, adapter, 12, seed=6, receive=_receive_and_fail)
        out[f"{backend}/after_load_raised"] = _sync(rank, adapter, 13, seed=6)
        adapter.close()
    return out


@pytest.fixture(scope="module")
def synced(verl: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    actor, rollout = run_ranks(_scenarios, tmp_path_factory.mktemp("verl_ranks"), world_size=2,
                               timeout_s=RANKS_TIMEOUT_S)
    return {"actor": actor, "rollout": rollout}


# -- in this process --------------------------------------------------------------------------


def test_importing_the_module_registers_both_adapters_in_verls_registry(verl: Any) -> None:
    import lifecycle.integrations.verl as adapters

    for backend in BACKENDS:
        found = verl.CheckpointEngineRegistry.get(backend)
        assert found is adapters.ADAPTERS[backend] and issubclass(found, verl.CheckpointEngine)


def test_unknown_engine_kwargs_are_refused_naming_the_key(verl: Any) -> None:
    prefix = r"checkpoint_engine\.engine_kwargs\.trainer_lifecycle_gloo\."
    with pytest.raises(ConfigError, match=prefix + r"bucket_mb: unknown key .*known: apply, host, port, profile"):
        _new(_config("trainer_lifecycle_gloo", bucket_mb=64))
    with pytest.raises(ConfigError, match=prefix + "shm_dir: unknown key"):
        _new(_config("trainer_lifecycle_gloo", shm_dir="/dev/shm"))
    with pytest.raises(ConfigError, match=prefix + "bucket_bytes: .*update_weights_bucket_megabytes"):
        _new(_config("trainer_lifecycle_gloo", bucket_bytes=1 << 20))
    with pytest.raises(ConfigError, match=prefix + "timeout_s: must be in"):
        _new(_config("trainer_lifecycle_gloo", timeout_s=-1))
    with pytest.raises(ConfigError, match=prefix + "apply: must be 'atomic'"):
        _new(_config("trainer_lifecycle_gloo", apply="streamed"))
    with pytest.raises(ConfigError, match=prefix + "verify: must be true or false, got 'no'"):
        _new(_config("trainer_lifecycle_gloo", verify="no"))


def test_verls_options_map_onto_the_engines_options(verl: Any) -> None:
    adapter = _new(_config("trainer_lifecycle_shm", verify=False, rollout_dtype=torch.bfloat16, shm_dir="/tmp"))
    engine = adapter.engine
    assert (engine.name, engine.bucket_bytes, engine.verify) == ("shm", 1 << 20, False)
    assert engine.timeout_s == SYNC_TIMEOUT_S
    assert engine.rollout_dtype == torch.bfloat16 and str(engine.shm_dir) == "/tmp" and engine.apply == "atomic"


def test_actor_rank_0_sends_other_actor_ranks_stand_by_and_rollout_workers_receive(verl: Any) -> None:
    from lifecycle.integrations.verl import BYSTANDER

    config = _config("trainer_lifecycle_gloo", port=29999)
    actors = [_new(config, is_master=rank == 0) for rank in range(3)]
    rollouts = [_new(config) for _ in range(2)]
    metadata = [worker.prepare() for worker in actors + rollouts]
    actor_kwargs, rollout_kwargs = type(actors[0]).build_topology(3, 2, metadata)
    assert actor_kwargs == {"rank": [0, BYSTANDER, BYSTANDER], "host": ["127.0.0.1"] * 3, "port": [29999] * 3,
                            "receivers": [2] * 3}
    assert rollout_kwargs == {"rank": [1, 2], "host": ["127.0.0.1"] * 2, "port": [29999] * 2, "receivers": [2] * 2}
    with pytest.raises(EngineError, match="rollout rank 1 was built with is_master=True; only actor rank 0"):
        type(actors[0]).build_topology(3, 2, metadata[:4] + [metadata[0]])
    with pytest.raises(EngineError, match="actor rank 0 was built with is_master=False"):
        type(actors[0]).build_topology(3, 2, metadata[1:] + [metadata[1]])
    with pytest.raises(EngineError, match="rollout rank 0 runs checkpoint engine 'nccl'; every actor"):
        type(actors[0]).build_topology(3, 2, metadata[:3] + [{"backend": "nccl"}, metadata[4]])


def test_a_bystander_actor_rank_walks_the_weights_and_sends_nothing(verl: Any) -> None:
    from lifecycle.integrations.verl import BYSTANDER

    bystander = _new(_config("trainer_lifecycle_gloo"))
    bystander.init_process_group(rank=BYSTANDER, host="127.0.0.1", port=29999, receivers=1)
    walked: list[str] = []

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in _weights(0)[:3]:
            walked.append(name)
            yield name, tensor

    assert asyncio.run(bystander.send_weights(weights(), global_steps=3)) == {}
    assert walked == [name for name, _ in _weights(0)[:3]]
    with pytest.raises(EngineError, match="receive_weights runs on rollout workers"):
        asyncio.run(anext(bystander.receive_weights(global_steps=3)))
    bystander.finalize()
    with pytest.raises(EngineError, match="send_weights before init_process_group"):
        asyncio.run(bystander.send_weights(iter(()), global_steps=4))


def test_a_sync_whose_peer_never_comes_fails_within_timeout_s_on_either_side(verl: Any) -> None:
    config = _config("trainer_lifecycle_gloo", timeout_s=1.0)
    sender, receiver = _new(config, is_master=True), _new(config)
    actor_kwargs, rollout_kwargs = type(sender).build_topology(1, 1, [sender.prepare(), receiver.prepare()])
    try:
        for adapter, kwargs in ((sender, actor_kwargs), (receiver, rollout_kwargs)):
            mine = {key: value[0] for key, value in kwargs.items()}
            with pytest.raises(TransportError, match="gloo engine: .*timeout_s=1"):
                within(5.0, lambda adapter=adapter, mine=mine: adapter.init_process_group(**mine))
    finally:
        sender.close()
        receiver.close()


def test_without_verl_the_module_imports_and_an_adapter_names_the_missing_module() -> None:
    code = ("import sys\n"
            "class NoVerl:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.partition('.')[0] == 'verl':\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, NoVerl())\n"
            "import lifecycle.integrations.verl as v\n"
            "assert set(v.ADAPTERS) == {'trainer_lifecycle_gloo', 'trainer_lifecycle_shm'}\n"
            "from lifecycle.errors import ConfigError\n"
            "try:\n    v.LifecycleGlooCheckpointEngine(bucket_size=1 << 20)\n"
            "except ConfigError as exc:\n    print('refused:', exc)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused: checkpoint_engine.backend: trainer_lifecycle_gloo is a verl checkpoint "
                                  "engine and needs the package 'verl': importing verl.checkpoint_engine failed: "
                                  "No module named 'verl'"), done.stdout


def _metadata(backend: str, **master: Any) -> list[dict[str, Any]]:
    """What `prepare()` returns on actor rank 0 and on one rollout worker, on one host."""
    return [{"backend": backend, "is_master": True, "hostname": "node-a", "host": "127.0.0.1", "port": 29500,
             **master}, {"backend": backend, "is_master": False, "hostname": "node-a"}]


@pytest.mark.parametrize(("metadata", "message"), [
    (None, "got metadata from None, expected a list from 1 actor + 1 rollout workers"),
    ([["not", "a", "dict"], {}], "actor rank 0 runs metadata"),
    (_metadata(BACKENDS[0], host=None), "actor rank 0 reported rendezvous host None; expected a host name"),
    (_metadata(BACKENDS[0], host=""), "actor rank 0 reported rendezvous host ''"),
    (_metadata(BACKENDS[0], port="x"), "actor rank 0 reported rendezvous port 'x'; expected a TCP port in 1..65535"),
    (_metadata(BACKENDS[0], port=0), "actor rank 0 reported rendezvous port 0"),
    (_metadata(BACKENDS[0], port=True), "actor rank 0 reported rendezvous port True"),
    (_metadata(BACKENDS[0], is_master="yes"), "actor rank 0 was built with is_master='yes'; only actor rank 0"),
])
def test_build_topology_refuses_tampered_metadata_naming_the_actor_rank(metadata: Any, message: str) -> None:
    from lifecycle.integrations.verl import ADAPTERS

    with pytest.raises(EngineError, match=re.escape(f"{BACKENDS[0]}: {message}")):
        ADAPTERS[BACKENDS[0]].build_topology(1, 1, metadata)


def test_only_true_makes_a_master_and_numpy_integers_are_taken_for_sizes_and_ports(verl: Any) -> None:
    from lifecycle.integrations.verl import ADAPTERS

    adapter = ADAPTERS[BACKENDS[0]]
    rollout_says_no = [_metadata(BACKENDS[0])[0], {**_metadata(BACKENDS[0])[1], "is_master": "no"}]
    actor_kwargs, _ = adapter.build_topology(np.int64(1), np.int64(1), rollout_says_no)
    assert actor_kwargs == {"rank": [0], "host": ["127.0.0.1"], "port": [29500], "receivers": [1]}
    _, rollout_kwargs = adapter.build_topology(1, 1, _metadata(BACKENDS[0], port=np.int32(29501)))
    assert rollout_kwargs["port"] == [29501] and type(rollout_kwargs["port"][0]) is int
    assert _new(_config(BACKENDS[0]), is_master="yes").is_master is False
    assert _new(_config(BACKENDS[0], port=np.int64(29502)), is_master=True).prepare()["port"] == 29502


def test_init_process_group_refuses_arguments_build_topology_never_returns(verl: Any) -> None:
    adapter = _new(_config(BACKENDS[0]))
    for bad in ({"port": "x"}, {"host": None}, {"rank": True}, {"receivers": 1.0}):
        with pytest.raises(EngineError, match="init_process_group takes what build_topology returned"):
            adapter.init_process_group(**{"rank": 1, "host": "127.0.0.1", "port": 29500, "receivers": 1, **bad})
    assert adapter.rank is None


def test_shm_refuses_a_rollout_worker_on_another_host_naming_it(verl: Any) -> None:
    from lifecycle.integrations.verl import ADAPTERS

    prepared = _new(_config(BACKENDS[1]), is_master=True).prepare()
    assert prepared["hostname"] == socket.gethostname()
    elsewhere = [*_metadata(BACKENDS[1]), {"backend": BACKENDS[1], "is_master": False, "hostname": "node-b"}]
    with pytest.raises(EngineError, match="trainer_lifecycle_shm: rollout rank 1 runs on host 'node-b' and actor "
                                          "rank 0 on 'node-a': shared memory needs .* use trainer_lifecycle_gloo"):
        ADAPTERS[BACKENDS[1]].build_topology(1, 2, elsewhere)
    gloo = [{**meta, "backend": BACKENDS[0]} for meta in elsewhere]
    assert ADAPTERS[BACKENDS[0]].build_topology(1, 2, gloo)[1]["rank"] == [1, 2]


@pytest.mark.parametrize(("items", "message"), [
    ([torch.ones(2)], "weights item 0: expected a (name, tensor) pair, got tensor("),
    ([("a", torch.ones(1)), ("x", np.ones(2))], "weights item 1 ('x'): expected a torch.Tensor, got ndarray"),
    ([(3, torch.ones(2))], "weights item 0 (3): the name must be a str, got int"),
    ([("a", torch.ones(1)), ("b", torch.ones(1)), ("m", torch.empty(2, device="meta"))],
     "weights item 2 ('m'): a tensor on the meta device holds no data to send"),
])
def test_bad_generator_items_are_refused_naming_the_index_and_the_name(items: list[Any], message: str) -> None:
    from lifecycle.integrations.verl_checks import collect

    for weights in (iter(items), _aiter(items)):
        with pytest.raises(EngineError, match=re.escape(message)):
            asyncio.run(collect(weights, keep=True))


@pytest.mark.parametrize(("weights", "message"), [
    (None, "weights: expected an iterable of (name, tensor) pairs, got None (NoneType)"),
    (12345, "weights: expected an iterable of (name, tensor) pairs, got 12345 (int)"),
    ("w", "weights: expected an iterable of (name, tensor) pairs, got 'w' (str)"),
    ({"w": torch.ones(2)}, "weights: expected an iterable of (name, tensor) pairs, got a dict: pass its .items()"),
])
def test_weights_that_are_no_iterable_of_pairs_are_refused_naming_the_type(weights: Any, message: str) -> None:
    from lifecycle.integrations.verl_checks import collect

    for keep in (True, False):  # the sender, and a bystander rank that only walks them
        with pytest.raises(EngineError, match=re.escape(message)):
            asyncio.run(collect(weights, keep=keep))


def test_a_numpy_bucket_size_from_verls_config_is_taken_as_the_int_it_is(verl: Any) -> None:
    from lifecycle.integrations.verl import ADAPTERS

    adapter = ADAPTERS[BACKENDS[0]](np.int64(1 << 20), host="127.0.0.1")
    assert adapter.engine.options.bucket_bytes == 1 << 20 and type(adapter.engine.options.bucket_bytes) is int
    adapter.close()


def test_host_tensors_are_kept_as_yielded_and_the_version_takes_numpy_integers() -> None:
    """No copy of a CPU tensor (the documented contract: it must not change until the send
    returns); global_steps may be a numpy integer, never a bool."""
    from lifecycle.integrations.verl_checks import collect, weights_version

    tensor = torch.ones(3)
    [(name, kept)] = asyncio.run(collect(iter([("w", tensor)]), keep=True))
    assert name == "w" and kept is tensor
    assert asyncio.run(collect(iter([("odd", "item")]), keep=False)) == []  # a bystander only walks
    assert weights_version(np.int64(7)) == 7 and type(weights_version(np.int64(7))) is int
    for bad in (True, -1, 2.0, "5"):
        with pytest.raises(EngineError, match="global_steps must be a non-negative integer"):
            weights_version(bad)


async def _aiter(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


# -- across processes -------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_verl_drives_a_sync_and_the_rollout_gets_bit_identical_tensors_and_the_version(
        synced: dict[str, dict[str, Any]], backend: str) -> None:
    actor, rollout = synced["actor"], synced["rollout"]
    assert actor[f"{backend}/type"][0] == "lifecycle.integrations.verl"
    for version in (5, 6):
        sent, received = actor[f"{backend}/v{version}"], rollout[f"{backend}/v{version}"]
        assert sent["error"] is None and received["error"] is None, (sent, received)
        assert received["complete"] and received["wrong"] == [] and received["yielded"] == len(_weights(0))
        assert (received["version"], received["stale"]) == (version, False)
        metrics = sent["metrics"]
        assert metrics["trainer_lifecycle/version"] == version and metrics["trainer_lifecycle/receivers"] == 1
        assert metrics["trainer_lifecycle/bytes"] == sum(t.nbytes for _, t in _weights(0))
        assert metrics["trainer_lifecycle/buckets"] == 3 and sent["version"] == version


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_corrupted_bucket_yields_nothing_leaves_the_rollout_stale_on_its_version_and_the_next_sync_repairs(
        synced: dict[str, dict[str, Any]], backend: str) -> None:
    sent, received = synced["actor"][f"{backend}/corrupt"], synced["rollout"][f"{backend}/corrupt"]
    engine = backend.removeprefix("trainer_lifecycle_")
    assert received["error"].startswith(f"{engine} engine: bucket {CORRUPT_BUCKET} of 3 failed its checksum")
    assert "nothing from it was applied; it holds big" in received["error"]
    assert (received["yielded"], received["stale"], received["version"]) == (0, True, 6)
    assert sent["error"].startswith(f"{engine} engine: 1 of 1 receiver(s) rejected weights v7: rank 1: ")
    assert f"bucket {CORRUPT_BUCKET} of 3 failed its checksum" in sent["error"] and sent["version"] == 6
    repaired = synced["rollout"][f"{backend}/after_corrupt"]
    assert repaired["error"] is None and repaired["wrong"] == []
    assert (repaired["version"], repaired["stale"]) == (8, False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_receiver_refuses_a_plan_its_own_checks_reject_whatever_the_sender_says(
        synced: dict[str, dict[str, Any]], backend: str) -> None:
    engine = backend.removeprefix("trainer_lifecycle_")
    reasons = {"dtype": (9, "has dtype torch.quint8, which cannot travel"),
               "unverified": (10, "it sends no checksums (the sender's engine.verify is false) and this receiver "
                                  "verifies every bucket")}
    for case, (version, reason) in reasons.items():
        sent, received = synced["actor"][f"{backend}/{case}"], synced["rollout"][f"{backend}/{case}"]
        assert received["error"].startswith(f"{engine} engine: rank 1 refuses the plan of weights v{version}: ")
        assert reason in received["error"], received["error"]
        assert (received["yielded"], received["stale"], received["version"]) == (0, True, 8)
        assert sent["error"].startswith(f"{engine} engine: 1 of 1 receiver(s) refused the plan of weights v{version}")
    after = synced["rollout"][f"{backend}/after_refusals"]
    assert after["error"] is None and after["wrong"] == [] and (after["version"], after["stale"]) == (11, False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_server_adapter_whose_load_raises_leaves_the_rollout_stale_at_once_and_its_sender_hears_it(
        synced: dict[str, dict[str, Any]], backend: str) -> None:
    sent, received = synced["actor"][f"{backend}/load_raised"], synced["rollout"][f"{backend}/load_raised"]
    assert received["error"] == "load_weights failed" and received["yielded"] == 3
    assert received["stale_at_once"] is True, "three tensors of v12 are in the model: not v11 whole"
    assert (received["stale"], received["version"]) == (True, 11)
    assert "stopped taking tensors before the last one" in sent["error"] and sent["version"] == 11
    repaired = synced["rollout"][f"{backend}/after_load_raised"]
    assert repaired["error"] is None and (repaired["version"], repaired["stale"]) == (13, False)
