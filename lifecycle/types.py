"""Plain data passed between the lifecycle and its pluggable checkpointers and engines."""

from __future__ import annotations

import numbers
import sys

from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Iterable, Iterator, Protocol, runtime_checkable

from lifecycle.errors import EngineError, shorten

MAX_VERSION = 10**19 - 1
"""The largest weights version: a sync carries it as at most 19 decimal digits."""


def is_count(value: Any, low: int = 0) -> bool:
    """An integer (numpy's too; not a bool) of at least `low`: a rank, a size, a number of steps."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= low


def plain_digits(text: str, most: int = 18) -> int | None:
    """The number `text` writes in at most `most` ASCII digits; None for anything else (a sign,
    spaces, '2_0' or other scripts' digits, all of which `int` would take)."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= most else None


def is_version(value: Any) -> bool:
    """A weights version: an integer (not a bool; numpy's count) in 0..`MAX_VERSION`."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and 0 <= value <= MAX_VERSION


class Content(str, Enum):
    """One part of a checkpoint step folder. Named here, once, for the config (which parts to
    write and read), the content table (how) and the formats (which parts each can hold)."""

    MODEL = "model"
    HF_MODEL = "hf_model"
    OPTIMIZER = "optimizer"
    EXTRA = "extra"


FORMAT_CONTENTS: frozenset[str] = frozenset({Content.MODEL.value, Content.HF_MODEL.value, Content.OPTIMIZER.value})
"""The contents a format writes; `extra` (progress, RNG, data position) is the lifecycle's own."""


@dataclass(kw_only=True, slots=True)
class Parts:
    """What a worker hands the lifecycle: the objects whose state a checkpoint holds."""

    model: Any = None
    optimizer: Any = None
    lr_scheduler: Any = None
    dataloader: Any = None


@dataclass(kw_only=True, slots=True)
class Progress:
    """Training position; saved in `extra/` and restored on resume so no step runs twice."""

    step: int = 0
    epoch: int = 0
    consumed_samples: int = 0
    weights_version: int = 0
    user: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable values of the caller's own, kept with the checkpoint."""


@dataclass(kw_only=True, slots=True)
class SaveInfo:
    """What one save wrote; also the figures of the save's transition record."""

    step: int
    path: Path
    contents: list[str]
    backend: str
    bytes: int = 0
    files: int = 0
    seconds: float = 0.0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def figures(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "path": str(self.path),
            "bytes": self.bytes,
            "files": self.files,
            "gbps": round(self.gbps, 3),
        }


@dataclass(slots=True)
class Written:
    """What a save wrote, handed as a value from the writers to the commit."""

    contents: dict[str, str] = field(default_factory=dict)
    """Content -> the backend that wrote it, in the order written."""
    folders: dict[str, str] = field(default_factory=dict)
    """Content -> its folder, where that is not the content's own name."""
    digests: dict[str, str] = field(default_factory=dict)
    """Path relative to the role folder -> the digest its writer returned (`checksum.ALGORITHM`)."""

    def __or__(self, other: Written) -> Written:
        return Written({**self.contents, **other.contents}, {**self.folders, **other.folders},
                       {**self.digests, **other.digests})


@runtime_checkable
class Checkpointer(Protocol):
    """Does the work of init-load, save and resume; the lifecycle only brackets it."""

    def load_initial(self, parts: Parts) -> dict[str, Any]:
        """First load of weights; returns figures for the transition record."""

    def save(self, step: int, parts: Parts, progress: Progress) -> SaveInfo:
        """Write and commit a checkpoint of `step`."""

    def resume(self, parts: Parts) -> Progress | None:
        """Restore from the newest complete checkpoint, or return None when there is none."""


@runtime_checkable
class WeightSyncer(Protocol):
    """Pushes a model's weights to a rollout target; the weight-sync phase's work.

    `backends.engines.WeightSync` is the one built from `engine.*` config; its target is a
    `backends.engines.Rendezvous` (rollouts in other processes) or rollout objects (`naive`).
    """

    def sync(self, named_tensors: Iterator[tuple[str, Any]], target: Any, version: int) -> dict[str, Any]:
        """Deliver every tensor to `target` as weights `version`; returns figures for the log."""


@runtime_checkable
class RolloutTarget(Protocol):
    """The rollout side of a weight sync: paused while weights land, never serving stale ones."""

    weights_version: int
    stale: bool
    """True after a sync failed part-way: weights may be half old, half new; refuse to serve them."""

    def pause(self) -> None: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Copy each tensor into the model as it comes: a tensor may be reused once the next is read."""

    def resume(self) -> None: ...

    def mark_stale(self) -> None: ...


@runtime_checkable
class ReceivingRollout(Protocol):
    """A rollout that runs its own machine (`lifecycle.rollout.RolloutWeights`): it brackets each
    update itself, as one `receive_weights` phase, and takes the version only on the edge into
    SERVING, so nothing outside it sets `weights_version` or `stale`. `updating` takes this path
    for a `RolloutWeights` only (checked by type)."""

    @property
    def weights_version(self) -> int: ...

    @property
    def stale(self) -> bool: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None: ...

    def mark_stale(self) -> None: ...

    def receiving(self) -> AbstractContextManager[Callable[[int], None]]:
        """The update's phase; yields `landed(version)` as `updating` does."""


def lacks(rollout: object) -> list[str]:
    """The methods a sync needs of `rollout` that it does not have: `load_weights`, and `pause`
    and `resume` unless it runs the bracket itself (a `lifecycle.rollout.RolloutWeights`)."""
    machine = sys.modules.get("lifecycle.rollout")
    own = machine is not None and isinstance(rollout, machine.RolloutWeights)
    needed = ("load_weights",) if own else ("load_weights", "pause", "resume")
    return [name for name in needed if not callable(getattr(rollout, name, None))]


def rollouts_problem(engine: str, target: object) -> str | None:
    """Why an in-process engine cannot sync to `target` (a rollout or a list of them), before any
    rollout is paused: none given, or one without a method a sync calls (`lacks`); None if it can."""
    rollouts = target if isinstance(target, (list, tuple)) else [target]
    if not rollouts:
        return f"{engine} engine: no rollout to sync (sync_weights got an empty {type(target).__name__})"
    for i, rollout in enumerate(rollouts):
        if missing := lacks(rollout):
            return (f"{engine} engine: rollout {i} ({shorten(rollout, 40)}) has no {' / '.join(missing)}, "
                    "which a sync calls (pause, load the weights, resume)")
    return None


@contextmanager
def updating(rollout: RolloutTarget | ReceivingRollout) -> Iterator[Callable[[int], None]]:
    """The bracket around every weight update of a rollout: paused while weights land.

    Yields `landed(version)`, which the block calls once the last tensor is in: the rollout
    takes that version and serves again. If the block raises, the rollout may hold some new
    tensors and some old ones, so it is marked stale. It is resumed either way. A rollout with
    its own machine (`lifecycle.rollout.RolloutWeights`) runs the whole bracket itself.

    Which path is decided by type, not by the attributes an object answers: a stand-in that
    answers any attribute (a `MagicMock`) is a `RolloutTarget` and gets pause, resume and the version.
    """
    machine = sys.modules.get("lifecycle.rollout")  # no instance can exist before it is imported
    if machine is not None and isinstance(rollout, machine.RolloutWeights):
        with rollout.receiving() as landed_in_phase:
            yield landed_in_phase
        return
    target: RolloutTarget = rollout  # type: ignore[assignment]  # not a machine: the protocol above

    def landed(version: int) -> None:
        target.weights_version = version
        target.stale = False

    target.pause()
    try:
        yield landed
    except BaseException as failed:
        try:
            target.mark_stale()
        except Exception as exc:  # its own bookkeeping failing must not hide why the update failed
            raise EngineError(f"a weight update failed ({type(failed).__name__}: {failed}) and the rollout's "
                                    f"mark_stale raised {type(exc).__name__}: {exc}; it may serve half-updated "
                                    "weights") from failed
        raise
    finally:
        target.resume()
