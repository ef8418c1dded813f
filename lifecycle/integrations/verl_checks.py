"""What crosses into the verl integrations from verl, checked.

verl hands the engine adapters (`lifecycle.integrations.verl`) values our engines never made:
the metadata every worker's `prepare()` returned (it crossed processes through Ray, and a
worker built from another config or version may send anything), the generator of named tensors
the actor's model produces, and `global_steps`. Each is checked here, so that a bad one is an
`EngineError` naming the worker or the item, not a `KeyError` from the middle of a sync or a
wait for a timeout. The adapters' `engine_kwargs` are mapped onto our engine's options here,
and the folders they name checked, so a bad one is a `ConfigError` naming its key when the
adapter is built, not a failure of every sync. Integers from verl's configs may be numpy's;
both integrations take them.

The checkpoint manager (`lifecycle.integrations.verl_config`) takes verl's `checkpoint_config`
and an OmegaConf `lifecycle_config`: `plain` resolves those whole, so a missing value (`???`),
an interpolation that does not resolve or a container that holds itself is a `ConfigError`
naming the key, not an omegaconf error, a `RecursionError` or a silent default.
"""

from __future__ import annotations

import operator
import os
import sys
from collections.abc import AsyncIterable, AsyncIterator, Collection, Iterable, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn

import torch

from lifecycle.config_file import YAML_DEPTH_LIMIT as CONFIG_DEPTH_LIMIT
from lifecycle.config_rules import join
from lifecycle.errors import ConfigError, EngineError, shorten

Weights = Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]]
KEY = "checkpoint_engine"
"""Where verl's config holds the engine adapters' settings (under actor_rollout_ref.rollout. in the PPO trainer)."""
ADAPTER_KWARGS = ("host", "port")
"""The engine_kwargs an adapter takes for itself: where actor rank 0 hosts the rendezvous."""


def integer(value: object) -> int | None:
    """`value` as an int when it is an integer (numpy's too: configs may hand them), never a
    bool; else None."""
    if isinstance(value, bool):
        return None
    try:
        return int(operator.index(value))  # type: ignore[arg-type]
    except TypeError:
        return None


def plain(value: Any, where: str = "") -> Any:
    """Mappings and sequences (OmegaConf's `DictConfig` and `ListConfig` too, resolved) as dicts
    and lists; `where` is the dotted key of `value`, which a `ConfigError` names. A container
    that holds itself (a recursive YAML anchor) or one nested deeper than a config file may be
    is refused, naming where, rather than recursing until Python gives up."""
    return _plain(value, where, ())


def _plain(value: Any, where: str, path: tuple[int, ...]) -> Any:
    """`plain`; `path` holds the ids of the containers that enclose `value`."""
    if _omegaconf_container(value):
        value = _resolved(value, where)
    is_mapping = isinstance(value, Mapping)
    if not is_mapping and not (isinstance(value, Sequence) and not isinstance(value, (str, bytes))):
        return value
    if id(value) in path:
        raise ConfigError(where, "refers to itself (a recursive YAML anchor, or a container that holds itself)")
    if len(path) >= CONFIG_DEPTH_LIMIT:
        raise ConfigError(where, f"nested deeper than {CONFIG_DEPTH_LIMIT} levels")
    inside = (*path, id(value))
    if is_mapping:
        return {key: _plain(item, join(where, key), inside) for key, item in value.items()}
    return [_plain(item, f"{where}[{i}]", inside) for i, item in enumerate(value)]


def _omegaconf_container(value: object) -> bool:
    """Whether `value` is OmegaConf's; no value can be before omegaconf is imported, so this never imports it."""
    omegaconf = sys.modules.get("omegaconf")
    return omegaconf is not None and isinstance(value, omegaconf.Container)


def _resolved(config: Any, where: str) -> Any:
    """An OmegaConf container as plain data, every interpolation resolved. Read key by key, a
    missing value (`???`) would be None, a default taken silently; resolved whole, it raises."""
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    try:
        return OmegaConf.to_container(config, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as error:
        full_key = str(getattr(error, "full_key", None) or "")
        node = str(config._get_full_key(None) or "")  # a sub-node (verl passes actor.checkpoint): keys from its root
        if node and full_key.startswith(node):
            full_key = full_key[len(node):].lstrip(".")
        key = join(where, full_key) if full_key else where
        if isinstance(error, MissingMandatoryValue):
            raise ConfigError(key, "missing ('???' in the OmegaConf config); give it a value") from None
        problem = (str(error).splitlines() or [type(error).__name__])[0]
        raise ConfigError(key, f"cannot resolve its interpolation: {problem}") from None


def engine_key(adapter: str, name: str) -> str:
    """The dotted key of an adapter's engine_kwargs entry `name`, as a `ConfigError` names it."""
    return f"{KEY}.engine_kwargs.{adapter}.{name}"


def engine_options(adapter: str, options_class: type[Any], bucket_size: object, kwargs: Mapping[str, Any],
                   extra_kwargs: Collection[str]) -> Any:
    """Our engine's options (`options_class`) from verl's bucket size and the adapter's
    engine_kwargs; a key that is no option, none of `extra_kwargs` (the engine's own) and none of
    `ADAPTER_KWARGS` is refused, naming it and the keys there are, as is an `apply` but atomic."""
    names = {f.name for f in fields(options_class)} - {"bucket_bytes"}
    known = ", ".join(sorted(names | set(extra_kwargs) | set(ADAPTER_KWARGS)))
    for key in kwargs:
        if key == "bucket_bytes":
            raise ConfigError(engine_key(adapter, key),
                              f"the bucket size comes from {KEY}.update_weights_bucket_megabytes")
        if key not in names and key not in extra_kwargs:
            raise ConfigError(engine_key(adapter, str(key)),
                              f"unknown key for checkpoint engine {adapter}; known: {known}")
    values = {key: value for key, value in kwargs.items() if key in names}
    if isinstance(values.get("rollout_dtype"), torch.dtype):
        values["rollout_dtype"] = str(values["rollout_dtype"]).removeprefix("torch.")
    size = integer(bucket_size)  # a numpy integer from verl's config reads as the int it is
    options = options_class(bucket_bytes=bucket_size if size is None else size, **values)
    if found := options.problem():
        key = f"{KEY}.update_weights_bucket_megabytes" if found[0] == "bucket_bytes" else engine_key(adapter, found[0])
        raise ConfigError(key, found[1])
    if options.apply != "atomic":
        raise ConfigError(engine_key(adapter, "apply"), f"must be 'atomic' for a verl rollout, got {options.apply!r}: "
                                                        "verl's server adapter loads tensors as they are yielded, so "
                                                        "only an atomic receive keeps a bad bucket from leaving it "
                                                        "half-updated")
    return options


def check_folder(key: str, folder: str | os.PathLike[str], *, create: bool) -> None:
    """A folder an engine_kwargs key names, checked when the adapter is built, since every sync
    would fail on it: created first when `create` (profile traces), else it must exist (shm_dir)."""
    try:
        if create:
            Path(folder).mkdir(parents=True, exist_ok=True)
        elif not Path(folder).is_dir():
            problem = "is no folder" if os.path.lexists(folder) else "does not exist"
            raise ConfigError(key, f"{os.fspath(folder)} {problem}; name an existing folder")
    except OSError as exc:
        raise ConfigError(key, f"cannot create the folder {os.fspath(folder)}: {type(exc).__name__}: "
                               f"{exc.strerror or exc}") from exc


def weights_version(global_steps: object) -> int:
    """verl's `global_steps`, which becomes the weights version."""
    version = integer(global_steps)
    if version is None or version < 0:
        raise EngineError(f"global_steps must be a non-negative integer (it becomes the weights version), "
                          f"got {shorten(global_steps)}")
    return version


def check_worker(engine: str, who: str, meta: object, *, master: bool) -> None:
    """One worker's `prepare()` metadata: the same engine, and `is_master` True on actor rank 0
    alone (only `True` itself counts: a truthy string from a config is no master)."""
    backend = meta.get("backend") if isinstance(meta, dict) else None
    if backend != engine:
        found = f"checkpoint engine {shorten(backend)}" if isinstance(meta, dict) else f"metadata {shorten(meta)}"
        raise EngineError(f"{engine}: {who} runs {found}; every actor and rollout worker must select {engine}")
    flag = meta.get("is_master")  # type: ignore[union-attr]
    if (flag is True) != master:
        raise EngineError(f"{engine}: {who} was built with is_master={shorten(flag)}; only actor rank 0 hosts the "
                          "rendezvous (verl passes is_master=True there, and only True counts)")


def rendezvous(engine: str, meta: dict[str, Any]) -> tuple[str, int]:
    """Where actor rank 0 hosts the rendezvous, as its `prepare()` reported it."""
    host, port = meta.get("host"), integer(meta.get("port"))
    if not (isinstance(host, str) and host):
        raise EngineError(f"{engine}: actor rank 0 reported rendezvous host {shorten(meta.get('host'))}; expected a "
                          "host name or address")
    if port is None or not 0 < port < 65536:
        raise EngineError(f"{engine}: actor rank 0 reported rendezvous port {shorten(meta.get('port'))}; expected a "
                          "TCP port in 1..65535")
    return host, port


def check_one_host(engine: str, master: dict[str, Any], rollouts: list[dict[str, Any]]) -> None:
    """Shared memory reaches one host: every rollout worker must run on actor rank 0's."""
    host = master.get("hostname")
    for i, meta in enumerate(rollouts):
        if not isinstance(host, str) or meta.get("hostname") != host:
            raise EngineError(f"{engine}: rollout rank {i} runs on host {shorten(meta.get('hostname'))} and actor "
                              f"rank 0 on {shorten(host)}: shared memory needs actor rank 0 and every rollout "
                              "worker on one host; use trainer_lifecycle_gloo across hosts")


async def collect(weights: Weights, *, keep: bool) -> list[tuple[str, torch.Tensor]]:
    """Walk verl's (possibly async) generator on the event loop's thread, where the actor's
    collectives and current device live; kept items are checked and their tensors come to host
    memory as they arrive, so the device never holds more than the one being produced. A tensor
    already in host memory is kept as it is, not copied: it must not change until the send
    ends (see `lifecycle.integrations.verl`).

    Producing each item is collective over the actor ranks (an FSDP gather), and every other
    rank walks the generator whole: so a refused item, or a copy to the host that fails, ends
    the keeping but not the walk, and the first problem is raised once the generator is done.
    Kept, an empty generator (an exhausted one, say) is refused: a sync of no tensors would
    announce a new version the rollout never received."""
    pairs: list[tuple[str, torch.Tensor]] = []
    problem: EngineError | None = None
    async for index, item in _items(weights):
        if keep and problem is None:
            try:
                pairs.append(on_host(index, item))
            except EngineError as exc:
                problem = exc
                pairs.clear()  # host memory back while the rest is walked
    if problem is not None:
        raise problem
    if keep and not pairs:
        raise EngineError("weights: the generator yielded no (name, tensor) pairs (already consumed, or empty); a "
                          "sync of nothing would announce a version the rollout never got; nothing was sent")
    return pairs


async def refuse_after_walk(weights: Weights, problem: EngineError) -> NoReturn:
    """Raise `problem`, found before the walk, once every item of `weights` was produced: the
    other actor ranks walk it whole, and their collectives need this rank's (see `collect`)."""
    await collect(weights, keep=False)
    raise problem


async def _items(weights: Weights) -> AsyncIterator[tuple[int, object]]:
    """The items of a sync or async iterable, numbered; anything else refused before the walk."""
    if isinstance(weights, AsyncIterable):
        index = 0
        async for item in weights:
            yield index, item
            index += 1
        return
    if isinstance(weights, Mapping):
        raise EngineError(f"weights: expected an iterable of (name, tensor) pairs, got a {type(weights).__name__}: "
                          "pass its .items()")
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Iterable):
        raise EngineError(f"weights: expected an iterable of (name, tensor) pairs, got {shorten(weights)} "
                          f"({type(weights).__name__})")
    for pair in enumerate(weights):
        yield pair


def on_host(index: int, item: object) -> tuple[str, torch.Tensor]:
    """Item `index` of the generator: a (str, torch.Tensor) pair with data, its tensor on the host."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise EngineError(f"weights item {index}: expected a (name, tensor) pair, got {shorten(item)}")
    name, tensor = item
    if not isinstance(name, str):
        raise EngineError(f"weights item {index} ({shorten(name)}): the name must be a str, got "
                          f"{type(name).__name__}")
    if not isinstance(tensor, torch.Tensor):
        raise EngineError(f"weights item {index} ({shorten(name)}): expected a torch.Tensor, got "
                          f"{type(tensor).__name__}")
    if tensor.device.type == "meta":
        raise EngineError(f"weights item {index} ({shorten(name)}): a tensor on the meta device holds no data to "
                          "send (materialize the model's weights first)")
    if tensor.device.type == "cpu":
        return name, tensor
    try:
        return name, tensor.detach().to("cpu")
    except Exception as exc:  # a device error or an out-of-memory, from whichever device
        raise EngineError(f"weights item {index} ({shorten(name)}): copying the tensor from {tensor.device} to host "
                          f"memory failed: {type(exc).__name__}: {exc}") from exc


def rollout_holds(version: int | None, yielded: int) -> str:
    """What a rollout holds after a failed receive, for the stale record."""
    if yielded:
        return f"may hold part of the new version ({yielded} tensor(s) yielded before the failure)"
    if version is None:
        return "holds no version from this engine yet (nothing was yielded)"
    return f"still holds v{version} whole (nothing was yielded)"


__all__ = ["ADAPTER_KWARGS", "KEY", "Weights", "check_folder", "check_one_host", "check_worker", "collect",
           "engine_key", "engine_options", "integer", "on_host", "plain", "refuse_after_walk", "rendezvous",
           "rollout_holds", "weights_version"]
