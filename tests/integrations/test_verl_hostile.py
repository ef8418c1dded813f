"""The verl integrations against hostile input: what verl, its config or its generator hand in.

Each test pins one refusal or one guarantee: a refused weights item on actor rank 0 still walks
the whole generator (the other actor ranks' collectives stay matched), an empty generator is
no new version, verl's `max_ckpt_to_keep` alone decides retention, a rendezvous host or a
folder that cannot work is a `ConfigError` naming its key, and a config that refers to itself
or nests too deep is refused, naming where. The syncs run in one process, on threads, with a
`threading.Barrier` standing in for the actor group's collective (an FSDP gather per item).
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lifecycle import ConfigError, LifecycleConfig
from lifecycle.errors import EngineError
from lifecycle.integrations.verl_checks import collect, plain
from tests.guards import within
from tests.integrations.test_verl_checkpoint import local_path, manager

GLOO, SHM = "trainer_lifecycle_gloo", "trainer_lifecycle_shm"
SYNC_TIMEOUT_S = 20.0
"""The adapters' timeout_s: a side that waited it out instead of failing fast shows in `FAST_S`."""
FAST_S = 8.0
"""Hang guard for a sync that fails: well under `SYNC_TIMEOUT_S`."""
ITEMS = 4


@pytest.fixture(scope="module")
def adapters() -> Any:
    pytest.importorskip("verl.checkpoint_engine")
    from lifecycle.integrations.verl import ADAPTERS

    return ADAPTERS


class Unmovable(torch.Tensor):
    """A device tensor whose copy to the host fails, as a CUDA error or an out-of-memory would."""

    @property  # type: ignore[override]
    def device(self) -> torch.device:
        return torch.device("cuda", 0)

    def detach(self) -> Unmovable:  # type: ignore[override]
        return self

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def _generator(bad: int | None, make_bad: Callable[[int], Any], walked: list[int],
               collective: threading.Barrier | None = None) -> Iterator[Any]:
    """`ITEMS` items, item `bad` from `make_bad`; each waits on `collective` first, as an FSDP
    gather waits for every actor rank."""
    for i in range(ITEMS):
        if collective is not None:
            collective.wait()
        walked.append(i)
        yield make_bad(i) if i == bad else (f"w{i}", torch.full((4,), float(i)))


BAD_ITEMS: dict[str, Callable[[int], Any]] = {
    "a name that is no str": lambda i: (i, torch.ones(4)),
    "a copy to the host that fails": lambda i: (f"w{i}", torch.ones(4).as_subclass(Unmovable)),
    "no pair": lambda i: torch.ones(4),
}


# -- 1, 2: actor rank 0 walks the whole generator, then refuses -----------------------------


@pytest.mark.parametrize("kind", sorted(BAD_ITEMS))
def test_collect_walks_every_item_after_a_refused_one_and_then_raises_naming_it(kind: str) -> None:
    walked: list[int] = []
    with pytest.raises(EngineError, match=r"weights item 1\b") as refused:
        asyncio.run(collect(_generator(1, BAD_ITEMS[kind], walked), keep=True))
    assert walked == list(range(ITEMS))
    if kind == "a copy to the host that fails":
        assert "illegal memory access" in str(refused.value) and "host memory" in str(refused.value)


def test_collect_refuses_an_empty_or_exhausted_generator_on_the_sender_and_a_bystander_just_walks_it() -> None:
    exhausted = iter([("w", torch.ones(2))])
    list(exhausted)
    for weights in (iter(()), exhausted):
        with pytest.raises(EngineError, match="weights: the generator yielded no"):
            asyncio.run(collect(weights, keep=True))
    assert asyncio.run(collect(iter(()), keep=False)) == []


def _sync(adapters: Any, weights: Callable[[], Any], global_steps: object = 1,
          collective: threading.Barrier | None = None) -> dict[str, Any]:
    """One sync on threads: actor rank 0 sends `weights()`, one rollout worker receives, and an
    actor bystander walks `weights()` when `collective` stands for the actor group. Returns each
    side's outcome, the receiver's (version, stale) and how long the slowest took."""
    from lifecycle.integrations.verl import BYSTANDER

    cls = adapters[GLOO]
    sender = cls(1 << 20, is_master=True, host="127.0.0.1", timeout_s=SYNC_TIMEOUT_S)
    receiver = cls(1 << 20, host="127.0.0.1", timeout_s=SYNC_TIMEOUT_S)
    bystander = cls(1 << 20, host="127.0.0.1", timeout_s=SYNC_TIMEOUT_S)
    actors, rollouts = cls.build_topology(1, 1, [sender.prepare(), receiver.prepare()])
    out: dict[str, Any] = {}

    async def receive() -> int:
        return len([name async for name, _ in receiver.receive_weights(global_steps=None)])

    def side(name: str, adapter: Any, kwargs: dict[str, Any], work: Callable[[], Any]) -> None:
        try:
            adapter.init_process_group(**kwargs)
            out[name] = ("ok", asyncio.run(work()))
        except Exception as exc:  # noqa: BLE001  (recorded for the test to read)
            out[name] = ("error", exc)

    sides = [("sender", sender, {k: v[0] for k, v in actors.items()},
              lambda: sender.send_weights(weights(), global_steps=global_steps)),
             ("receiver", receiver, {k: v[0] for k, v in rollouts.items()}, receive)]
    if collective is not None:
        sides.append(("bystander", bystander, {"rank": BYSTANDER, "host": "127.0.0.1", "port": 1, "receivers": 1},
                      lambda: bystander.send_weights(weights(), global_steps=global_steps)))
    threads = [threading.Thread(target=side, args=args, daemon=True) for args in sides]
    start = time.monotonic()
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(FAST_S)
        assert not any(thread.is_alive() for thread in threads), f"a side still runs after {FAST_S} s: {out}"
    finally:
        if collective is not None:
            collective.abort()
        for adapter in (sender, receiver, bystander):
            adapter.close()
    out.update(seconds=time.monotonic() - start, rollout=(receiver.version, receiver.stale))
    return out


@pytest.mark.parametrize("kind", ["a name that is no str", "a copy to the host that fails"])
def test_a_refused_item_on_actor_rank_0_leaves_no_bystander_waiting_in_the_actor_groups_collective(
    adapters: Any, kind: str,
) -> None:
    collective = threading.Barrier(2, timeout=FAST_S / 2)  # actor rank 0 and one bystander
    walked: list[int] = []
    out = _sync(adapters, lambda: _generator(1, BAD_ITEMS[kind], walked, collective), collective=collective)
    assert out["bystander"] == ("ok", {})  # it walked every item: its collectives all matched
    assert walked == sorted(list(range(ITEMS)) * 2)
    assert out["sender"][0] == "error" and isinstance(out["sender"][1], EngineError)
    assert re.search(r"weights item 1\b", str(out["sender"][1]))
    assert out["receiver"][0] == "error" and out["rollout"] == (None, True)


def test_a_refused_global_steps_on_actor_rank_0_still_walks_the_weights_with_the_bystander(adapters: Any) -> None:
    collective = threading.Barrier(2, timeout=FAST_S / 2)
    walked: list[int] = []
    out = _sync(adapters, lambda: _generator(None, BAD_ITEMS["no pair"], walked, collective), global_steps=True,
                collective=collective)
    assert out["bystander"] == ("ok", {})
    assert walked == sorted(list(range(ITEMS)) * 2)
    assert out["sender"][0] == "error" and "global_steps must be a non-negative integer" in str(out["sender"][1])
    assert out["receiver"][0] == "error"


def test_send_weights_before_init_process_group_walks_the_weights_then_refuses(adapters: Any) -> None:
    adapter = adapters[GLOO](1 << 20, is_master=True, host="127.0.0.1")
    walked: list[int] = []
    try:
        with pytest.raises(EngineError, match="send_weights before init_process_group"):
            asyncio.run(adapter.send_weights(_generator(None, BAD_ITEMS["no pair"], walked), global_steps=1))
    finally:
        adapter.close()
    assert walked == list(range(ITEMS))


def test_an_exhausted_generator_is_no_new_version_the_sender_refuses_and_the_rollout_claims_nothing(
    adapters: Any,
) -> None:
    exhausted = iter([("w", torch.ones(4))])
    list(exhausted)
    out = _sync(adapters, lambda: exhausted)
    assert out["sender"][0] == "error" and "the generator yielded no" in str(out["sender"][1])
    assert out["receiver"][0] == "error" and out["rollout"] == (None, True)
    assert out["seconds"] < FAST_S


# -- 3: verl's max_ckpt_to_keep alone decides retention ---------------------------------------


@pytest.mark.parametrize("source", ["dict", "yaml", "LifecycleConfig"])
def test_checkpoint_keep_last_in_lifecycle_config_is_refused_naming_verls_max_ckpt_to_keep(
    tmp_path: Path, source: str,
) -> None:
    yaml = tmp_path / "lifecycle.yaml"
    yaml.write_text("checkpoint:\n  keep_last: 1\n")
    config = {"dict": {"checkpoint": {"keep_last": 1}}, "yaml": str(yaml),
              "LifecycleConfig": LifecycleConfig.from_dict({"checkpoint": {"keep_last": 1}})}[source]
    with pytest.raises(ConfigError, match=r"checkpoint\.keep_last: .*max_ckpt_to_keep"):
        manager(lifecycle_config=config)


# -- 4, 5, 7: hosts and folders that cannot work are refused naming the key -------------------


def _ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6(), reason="needs IPv6 on loopback")
def test_free_port_probes_the_hosts_own_address_family() -> None:
    from backends.base import free_port

    port = free_port("::1")
    with socket.socket(socket.AF_INET6) as listener:
        listener.bind(("::1", port))

    for host, family, bound in (("[::1]", socket.AF_INET6, "::1"), ("", socket.AF_INET, "")):
        port = free_port(host)  # an IPv6 address in brackets, and "" (every IPv4 address), as before
        with socket.socket(family) as listener:
            listener.bind((bound, port))


@pytest.mark.parametrize("host", ["no-such-host.invalid", "192.0.2.1"])
def test_prepare_on_actor_rank_0_refuses_a_host_it_cannot_bind_naming_the_key(adapters: Any, host: str) -> None:
    adapter = adapters[GLOO](1 << 20, is_master=True, host=host)
    try:
        with pytest.raises(ConfigError, match=rf"engine_kwargs\.{GLOO}\.host: .*{re.escape(host)}"):
            adapter.prepare()
    finally:
        adapter.close()


@pytest.mark.skipif(not _ipv6(), reason="needs IPv6 on loopback")
def test_prepare_on_actor_rank_0_takes_an_ipv6_host(adapters: Any) -> None:
    adapter = adapters[GLOO](1 << 20, is_master=True, host="::1")
    try:
        metadata = adapter.prepare()
    finally:
        adapter.close()
    assert metadata["host"] == "::1" and 0 < metadata["port"] < 65536


def test_a_profile_dir_that_is_a_file_is_refused_when_the_adapter_is_built(adapters: Any, tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ConfigError, match=rf"engine_kwargs\.{GLOO}\.profile_dir: .*{re.escape(str(afile))}"):
        adapters[GLOO](1 << 20, host="127.0.0.1", profile=True, profile_dir=str(afile))


def test_profiled_wraps_a_folder_it_cannot_create_as_an_engine_error_naming_it(tmp_path: Path) -> None:
    from backends.engines.sync import profiled

    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(EngineError, match=rf"profile_dir {re.escape(str(afile))}: cannot create the folder"):
        with profiled(afile, "label"):
            pass


@pytest.mark.parametrize("shm_dir", ["missing", "afile"])
def test_an_shm_dir_that_is_no_folder_is_refused_when_the_adapter_is_built(
    adapters: Any, tmp_path: Path, shm_dir: str,
) -> None:
    (tmp_path / "afile").write_text("")
    folder = tmp_path / shm_dir
    for master in (True, False):
        with pytest.raises(ConfigError, match=rf"engine_kwargs\.{SHM}\.shm_dir: .*{re.escape(str(folder))}"):
            adapters[SHM](1 << 20, is_master=master, shm_dir=str(folder))


# -- 6: configs that refer to themselves or nest too deep --------------------------------------


def _nested(depth: int) -> list[Any]:
    outer = inner = []
    for _ in range(depth):
        inner.append([])
        inner = inner[0]
    return outer


def test_plain_refuses_a_config_that_refers_to_itself_naming_where() -> None:
    loop: dict[str, Any] = {}
    loop["checkpoint"] = {"save": loop}
    with pytest.raises(ConfigError, match=r"^checkpoint\.save: refers to itself"):
        plain(loop)
    contents: list[Any] = ["model"]
    contents.append(contents)
    with pytest.raises(ConfigError, match=r"^checkpoint_config\.save_contents\[1\]: refers to itself"):
        plain({"save_contents": contents}, "checkpoint_config")
    shared = ["actor"]
    assert plain({"a": shared, "b": shared}) == {"a": ["actor"], "b": ["actor"]}  # shared, not a cycle


def test_plain_refuses_a_config_nested_too_deep_without_a_recursion_error() -> None:
    with pytest.raises(ConfigError, match=r"^checkpoint\.roles\[0\].*: nested deeper than \d+ levels"):
        within(5.0, lambda: plain({"checkpoint": {"roles": _nested(2000)}}))
    assert plain({"checkpoint": {"roles": _nested(20)}}) == {"checkpoint": {"roles": _nested(20)}}


def test_a_yaml_lifecycle_config_with_a_recursive_anchor_is_refused_naming_the_key(tmp_path: Path) -> None:
    yaml = tmp_path / "cycle.yaml"
    yaml.write_text("checkpoint:\n  roles: &a [actor, *a]\n")
    with pytest.raises(ConfigError, match=r"checkpoint\.roles\[1\]: refers to itself"):
        manager(lifecycle_config=str(yaml))


# -- 8: verl's contents, checked under verl's names --------------------------------------------


@pytest.mark.parametrize(("checkpoint_config", "key", "problem"), [
    ({"save_contents": ["model", "model"]}, "save_contents", "duplicate 'model'"),
    ({"load_contents": ["model", "extra", "extra"]}, "load_contents", "duplicate 'extra'"),
    ({"save_contents": [], "load_contents": []}, "save_contents", "lists nothing to save"),
])
def test_contents_verl_cannot_use_are_refused_under_verls_key(checkpoint_config: dict[str, Any], key: str,
                                                              problem: str) -> None:
    with pytest.raises(ConfigError, match=rf"^checkpoint_config\.{key}: .*{re.escape(problem)}"):
        manager(checkpoint_config=checkpoint_config)


def test_an_hf_only_export_saves_the_hf_model_and_its_load_reads_nothing_as_in_verl(tmp_path: Path) -> None:
    checkpoints, model = manager(checkpoint_config={"save_contents": ["hf_model"], "load_contents": ["hf_model"]})
    try:
        checkpoints.save_checkpoint(local_path(tmp_path, 1), global_step=1)
        assert (tmp_path / "global_step_1" / "actor" / "hf_model").is_dir()
        before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)
        changed = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        checkpoints.load_checkpoint(local_path(tmp_path, 1))
        assert all(torch.equal(changed[name], tensor) for name, tensor in model.state_dict().items())
        assert not all(torch.equal(before[name], changed[name]) for name in before)
    finally:
        checkpoints.close()
