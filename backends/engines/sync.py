"""Both ends of a weight sync: `WeightSync` for the trainer's `lc.sync_weights(target)`, and
`receive_into` for the rollout worker that receives.

The trainer's target is a `Rendezvous` for engines that cross processes (every rollout
process runs `receive_into` against the same one), or the rollout object(s) themselves for the
in-process `naive` engine. The rollout is paused while weights land, and marked stale when a
sync fails part-way: it may hold some new tensors and some old ones, and must not serve them
as either version. The next sync sends every tensor again, so it repairs that.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, NoReturn

import torch

from backends.engines.base import MAX_VERSION, CheckpointEngine, Rendezvous, SyncStats, is_version
from backends.engines.flat import Named
from backends.engines.options import EngineSource, is_path, shown
from backends.engines.registry import CheckpointEngineRegistry
from backends.engines.sources import sendable
from lifecycle.errors import EngineError, shorten
from lifecycle.types import RolloutTarget, rollouts_problem, updating



class WeightSync:
    """The `WeightSyncer` a `Lifecycle` drives: one engine session per sync, finalized in `finally`."""

    def __init__(self, engine: CheckpointEngine, *, profile_dir: str | os.PathLike[str] | None = None) -> None:
        self.engine = engine
        self.profile_dir = profile_dir

    @classmethod
    def from_config(cls, config: EngineSource, model: Any = None) -> WeightSync:
        """The engine `config.backend` names; `auto` picks by the device `model`'s weights are on."""
        name = CheckpointEngineRegistry.resolve(config.backend, device_type(model))
        engine = CheckpointEngineRegistry.get(name).from_config(config)
        return cls(engine, profile_dir=config.profile_dir if config.profile else None)

    def check_target(self, target: Any) -> None:
        """`EngineError` for a target this engine cannot sync to: called by `Lifecycle.sync_weights`
        before its machine moves, so a wrong target is the caller's error, not a failed trainer."""
        problem = self._target_problem(target)
        if problem is not None:
            raise EngineError(problem)

    def _target_problem(self, target: Any) -> str | None:
        name = self.engine.name
        if not self.engine.capabilities.in_process:
            if isinstance(target, Rendezvous):
                return None
            return (f"{name} engine sends to other processes: sync_weights needs a Rendezvous(host, port, "
                    f"receivers) as its target, got {type(target).__name__}")
        if isinstance(target, Rendezvous):
            return (f"{name} engine runs in one process: sync_weights needs the rollout object(s) as its target, "
                    "not a Rendezvous")
        return rollouts_problem(name, target)

    def sync(self, named_tensors: Iterable[tuple[str, Any]], target: Any, version: int) -> dict[str, Any]:
        self.check_target(target)
        start = time.perf_counter()
        with profiled(self.profile_dir, f"weight_sync_{self.engine.name}_v{version}_send"):
            if self.engine.capabilities.in_process:
                stats = self._sync_local(named_tensors, target, version)
            else:
                stats = self._sync_remote(named_tensors, target, version)
        stats.seconds = time.perf_counter() - start
        return stats.figures()

    def _sync_remote(self, named_tensors: Iterable[tuple[str, Any]], target: Any, version: int) -> SyncStats:
        with self.engine.session(target, rank=0):
            return self.engine.send_weights(named_tensors, version)

    def _sync_local(self, named_tensors: Iterable[tuple[str, Any]], target: Any, version: int) -> SyncStats:
        """Each rollout in turn; the rollouts are handed the trainer's own tensors (no copy), so
        one whose `load_weights` wrote into them fails the sync before the next one receives."""
        rollouts: Sequence[Any] = target if isinstance(target, (list, tuple)) else [target]
        pairs = sendable(self.engine.name, named_tensors)  # refused as the engine would: read once, kept
        counters = _versions(pairs)
        with self.engine.session(None, rank=0):
            stats = self.engine.send_weights(pairs, version)
            for i, rollout in enumerate(rollouts):
                receive_into(self.engine, rollout, version=version)
                _check_untouched(self.engine.name, counters, i, rollout)
        stats.receivers = len(rollouts)
        return stats

    def close(self) -> None:
        """Called by `Lifecycle.close()`: the engine gives back its buckets and rendezvous."""
        self.engine.close()


def _versions(pairs: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor, int]]:
    """Each tensor with its version counter, which every in-place write to it (or to a view of it,
    `detach()` included) raises; tensors that keep none (inference mode) are left out."""
    counters: list[tuple[str, torch.Tensor, int]] = []
    for name, tensor in pairs:
        try:
            counters.append((name, tensor, tensor._version))
        except RuntimeError:  # an inference tensor tracks no version
            continue
    return counters


def _check_untouched(engine: str, counters: list[tuple[str, torch.Tensor, int]], index: int, rollout: Any) -> None:
    """`EngineError` naming the first trainer tensor the rollout's `load_weights` wrote into."""
    changed = next((name for name, tensor, seen in counters if tensor._version != seen), None)
    if changed is not None:
        raise EngineError(f"{engine} engine: rollout {index} ({shown(rollout)}) wrote into the trainer's own "
                          f"weight {changed[:200]!r} in its load_weights (it is handed the trainer's tensors: copy "
                          "them, never change them in place); the trainer's weights are no longer the ones it trained")


def receive_into(
    engine: CheckpointEngine,
    rollout: RolloutTarget,
    rendezvous: Rendezvous | None = None,
    *,
    rank: int = 1,
    version: int | None = None,
    expected: Collection[str] | None = None,
    into: Named | None = None,
    profile_dir: str | os.PathLike[str] | None = None,
) -> int:
    """The rollout side of one sync: pause, receive and verify, load, take the version, resume.

    Returns the version received. On any failure the rollout is marked stale and the error
    propagates; it is resumed either way. `version=None` accepts what the sender sends.
    `expected`: the names of the weights the rollout must get; a sync that leaves any out is
    refused before anything is applied, and the sender is told (the engine's
    `receive_weights` must take `expected`, as every engine of this package does).
    `into`: the rollout's own tensors, flattened (`flatten_parameters`, in the trainer's
    `named_parameters()` order and wire dtype): a streamed gloo / nccl / hccl receive lands
    every bucket straight in their storage (`inplace`), and `load_weights` is handed views of
    that storage, already holding the values. A failed sync then leaves the weights partly
    overwritten (the rollout is stale). Tensors of `into` the plan does not send keep their
    values; pass `expected` to require them. An engine whose `receive_weights` does not take
    the `expected` or `into` it is given joins the sync only to refuse it (`engine.refuse`: a
    bucket engine answers the plan, so the sender fails before a byte moves), and raises
    `EngineError`; the rollout is untouched. So is it for a call that could not run at all: no
    Rendezvous for an engine that needs one, an engine whose session is under way, or a
    `profile_dir` that cannot be a folder (the sender is told, where it can be reached).
    """
    if not isinstance(engine, CheckpointEngine):
        raise EngineError(f"receive_into takes an engine (CheckpointEngineRegistry.new(name, ...)), got {shown(engine)}")
    if rendezvous is not None and not isinstance(rendezvous, Rendezvous):
        raise EngineError(f"{engine.name} engine: receive_into takes a Rendezvous(host, port, receivers) or None, "
                          f"got {shown(rendezvous)}")
    if not engine.capabilities.in_process and (type(rank) is not int or rank < 1):
        raise EngineError(f"{engine.name} engine: a receiver's rank is an int from 1 (rank 0 sends), got {shown(rank)}")
    if rendezvous is not None and not engine.capabilities.in_process and rank > rendezvous.receivers:
        raise EngineError(f"{engine.name} engine: rank {rank} is not a receiver of a Rendezvous of "
                          f"{rendezvous.receivers} (ranks 1..{rendezvous.receivers}); the rollout is untouched")
    expected, problem = _names(expected)
    problem = problem or _receive_problem(engine, rollout, version, expected, into, profile_dir)
    if problem is not None:
        _refuse(engine, rendezvous, rank, problem)
    if (unusable := _unusable(engine, rendezvous)) is not None:
        raise EngineError(f"{engine.name} engine: {unusable}; the rollout is untouched")
    version = None if version is None else int(version)
    with ExitStack() as bracket:
        try:
            landed = bracket.enter_context(updating(rollout))
        except Exception as exc:  # noqa: BLE001 - the rollout's own error, passed on as the reason the sender hears
            _refuse(engine, rendezvous, rank, f"the rollout could not be paused for the sync: {type(exc).__name__}: {exc}")
        with profiled(profile_dir, f"weight_sync_{engine.name}_receive_rank{rank}"):
            if engine.capabilities.in_process:
                received = _load(engine, rollout, version, expected, into)
            else:
                with engine.session(rendezvous, rank):
                    received = _load(engine, rollout, version, expected, into)
        landed(received)
    return received


def _unusable(engine: CheckpointEngine, rendezvous: Rendezvous | None) -> str | None:
    """Why this engine can open no session for the receive (so no sender can be told), or None:
    found before the rollout is paused, which would leave it stale for a call that never ran."""
    if engine.capabilities.in_process:  # it receives inside its sender's session (`WeightSync._sync_local`)
        return None
    if engine.busy():
        return ("a sync is under way on this engine already; one engine carries one sync at a time "
                "(give each concurrent sync an engine of its own)")
    if rendezvous is None:
        return "needs a Rendezvous(host, port, receivers) to meet its peers"
    return None


def _receive_problem(engine: CheckpointEngine, rollout: Any, version: Any, expected: list[str] | None,
                     into: Named | None, profile_dir: str | os.PathLike[str] | None) -> str | None:
    """Why this receive cannot be done as asked (the sender is told: `_refuse`), or None."""
    if version is not None and not is_version(version):
        return f"version= must be None or an int in 0..{MAX_VERSION}, got {shown(version)}"
    if not callable(getattr(rollout, "load_weights", None)):
        return f"the rollout ({shown(rollout)}) has no load_weights to take the weights with"
    if expected is not None and not _takes(type(engine), "expected"):
        return ("its receive_weights takes no `expected`, so it cannot refuse a sync that leaves weights out; "
                "call receive_into without expected=")
    if into is not None and not _takes(type(engine), "into"):
        return ("its receive_weights takes no `into`, so it cannot land a sync in the rollout's own storage; "
                "call receive_into without into=")
    try:
        trace_folder(profile_dir)
    except EngineError as exc:
        return str(exc)
    return None


def _names(expected: Any) -> tuple[list[str] | None, str | None]:
    """`expected=` as a list (a generator read once), or why it is not a collection of names."""
    if expected is None:
        return None, None
    if isinstance(expected, (str, bytes)) or not isinstance(expected, Iterable):
        return None, f"expected= takes a collection of weight names, got {shown(expected)}"
    names = list(expected)
    odd = next((name for name in names if not isinstance(name, str)), None)
    if odd is not None:
        return None, f"expected= takes weight names (str), and holds {shown(odd)}"
    return names, None


def _refuse(engine: CheckpointEngine, rendezvous: Rendezvous | None, rank: int, why: str) -> NoReturn:
    """Raise `EngineError(why)` for a receive this engine cannot do as asked, after joining the
    sync only to fail it (`CheckpointEngine.refuse`), so its sender fails now with the reason
    instead of waiting out its timeout; the rollout is not touched. An in-process engine has no
    sender waiting, and raises at once."""
    message = f"{engine.name} engine: {why}"
    if engine.capabilities.in_process:
        raise EngineError(message)
    try:
        with engine.session(rendezvous, rank):
            engine.refuse(message)
    except Exception as exc:  # noqa: BLE001 - the refusal is the error to raise; this only says the sender may not know
        raise EngineError(f"{message} (refusing the sync failed too, so the sender may not know: "
                          f"{type(exc).__name__}: {exc})") from exc
    raise EngineError(message)


def _load(engine: CheckpointEngine, rollout: RolloutTarget, version: int | None,
          expected: Collection[str] | None, into: Named | None) -> int:
    options = {key: value for key, value in (("expected", expected), ("into", into)) if value is not None}
    incoming = engine.receive_weights(version, **options).hold()
    try:
        rollout.load_weights(incoming)
    except BaseException as exc:
        incoming.abort(f"the rollout's load_weights raised {type(exc).__name__}: {exc}")
        raise
    if incoming.stop_reason is not None:  # it read on, then aborted: the sender hears a refusal, so no version
        raise EngineError(f"{engine.name} engine: the rollout's load_weights aborted the sync: {incoming.stop_reason}")
    if not incoming.complete:
        incoming.abort(f"the rollout's load_weights returned after {incoming.tensors} tensors")
        raise EngineError(f"{engine.name} engine: the rollout's load_weights returned after {incoming.tensors} "
                          "tensors, before the last one; it holds a partial update")
    return incoming.version


@functools.cache
def _takes(engine_class: type[CheckpointEngine], option: str) -> bool:
    """Whether the class's `receive_weights` takes `option` (the base class declares `expected`,
    an engine written before it may not; every `BucketEngine` takes `into`, and refuses it in its
    answer to the plan where it cannot land in place). Looked up once per class, not on every receive."""
    return option in inspect.signature(engine_class.receive_weights).parameters


@contextmanager
def profiled(folder: str | os.PathLike[str] | None, label: str) -> Iterator[None]:
    """Record a torch.profiler trace of the block into `folder` (Chrome trace JSON); None: off."""
    out = trace_folder(folder)
    if out is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    profiler = profile(activities=activities)
    try:
        with profiler:
            yield
    finally:
        profiler.export_chrome_trace(str(out / f"{label}_pid{os.getpid()}.json"))


def trace_folder(folder: str | os.PathLike[str] | None) -> Path | None:
    """`profile_dir` as a folder, created if need be; None: off. `EngineError` naming it when it
    cannot be one (checked by `receive_into` before the rollout is paused)."""
    if folder is None:
        return None
    if not is_path(folder):
        raise EngineError(f"profile_dir must name a folder, got {shorten(folder, 60)}")
    out = Path(folder)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EngineError(f"profile_dir {out}: cannot create the folder for profiler traces: {exc}") from exc
    return out


def device_type(model: Any) -> str:
    """The device type of a module's first parameter; cpu for anything else."""
    parameters = getattr(model, "parameters", None)
    first = next(iter(parameters()), None) if callable(parameters) else None
    return "cpu" if first is None else first.device.type
