"""A batch sampler whose position survives a resume, epoch boundaries included.

A checkpoint taken right after the last batch of an epoch records the position "end of
epoch e". Restored as is, many loaders then yield an empty epoch e (zero steps) or replay
it. This sampler normalises that state to "start of epoch e + 1" when it is loaded, so a
resumed run always continues with the next batch it would have trained on.
"""

from __future__ import annotations

import numbers
from typing import Any, Iterator

import torch

from lifecycle.errors import CheckpointError, ConfigError, shorten

_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1
"""Seeds a loaded state may hold: int64. Each epoch seeds `torch.Generator.manual_seed` (which
takes -2**63 .. 2**64 - 1) with `seed + epoch`, so with `_EPOCH_MAX` no epoch overflows it."""
_EPOCH_MAX = 2**62
_FIELDS = ("epoch", "position", "seed", "num_samples", "batch_size")


class ResumableBatchSampler:
    """Index batches, reshuffled each epoch from `seed`; use as a DataLoader `batch_sampler`."""

    def __init__(self, num_samples: int, batch_size: int, *, shuffle: bool = True, seed: int = 0) -> None:
        self.num_samples = _integer("num_samples", num_samples, 1, _EPOCH_MAX)
        self.batch_size = _integer("batch_size", batch_size, 1, self.num_samples)
        self.seed = _integer("seed", seed, _SEED_MIN, _SEED_MAX)
        if isinstance(shuffle, str) or not _is_flag(shuffle):  # True, False, 1, 0, numpy's bools
            raise ConfigError("ResumableBatchSampler.shuffle", f"must be true or false, got {shorten(shuffle)}")
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.position = 0
        """Batches of the current epoch already handed out (to a DataLoader with workers, that
        includes the batches its workers prefetched: see `state_dict`)."""
        self._loads = 0
        """Bumped by `load_state_dict`: an iterator running across a load takes the loaded order."""

    def __len__(self) -> int:
        return self.num_samples // self.batch_size

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=gen).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        """The rest of the current epoch; the next iteration starts the next epoch. A state loaded
        while this iterator runs (a resume in the same process) is followed from its next batch."""
        self._roll_over()
        seen, order = (self.epoch, self._loads), self._order()
        while self.position < len(self):
            if (self.epoch, self._loads) != seen:
                seen, order = (self.epoch, self._loads), self._order()
            start = self.position * self.batch_size
            self.position += 1
            yield order[start:start + self.batch_size]

    def batches(self) -> Iterator[list[int]]:
        """Endless batches across epochs, for step-based training loops."""
        while True:
            yield from self

    def _roll_over(self) -> None:
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0

    def state_dict(self) -> dict[str, Any]:
        """The position exactly when the DataLoader has no workers (`num_workers=0`); with workers,
        it counts the batches they prefetched too, so a resume skips those."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_samples": self.num_samples, "batch_size": self.batch_size, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore, refusing a state made for another data set or batch size, or one whose
        fields are out of range; nothing is assigned unless every field is valid."""
        if not isinstance(state, dict):
            raise CheckpointError(f"sampler state must be a mapping of {list(_FIELDS)}, found {type(state).__name__}")
        for key in _FIELDS:
            value = state.get(key)
            if type(value) is not int:
                raise CheckpointError(f"sampler state field {key!r} must be an integer, found {shorten(value)}")
        if "shuffle" in state and state["shuffle"] is not self.shuffle:  # states saved before it was recorded pass
            raise CheckpointError(f"sampler state has shuffle={shorten(state['shuffle'])} but this sampler has "
                                  f"shuffle={self.shuffle}: the order would differ")
        for key in ("num_samples", "batch_size"):
            if state[key] != getattr(self, key):
                raise CheckpointError(
                    f"sampler state has {key}={state[key]!r} but this sampler has {getattr(self, key)!r}"
                )
        epoch, position, seed = state["epoch"], state["position"], state["seed"]
        if not 0 <= position <= len(self):
            raise CheckpointError(f"sampler state field 'position' must be within 0..{len(self)} "
                                  f"(batches per epoch), found {position}")
        if not 0 <= epoch <= _EPOCH_MAX:
            raise CheckpointError(f"sampler state field 'epoch' must be within 0..{_EPOCH_MAX}, found {shorten(epoch)}")
        if not _SEED_MIN <= seed <= _SEED_MAX:
            raise CheckpointError(f"sampler state field 'seed' must be within {_SEED_MIN}..{_SEED_MAX} "
                                  f"(an int64: seed + epoch seeds torch.Generator), found {shorten(seed)}")
        self.epoch, self.position, self.seed = epoch, position, seed
        self._loads += 1
        self._roll_over()


def _integer(key: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= high:
        raise ConfigError(f"ResumableBatchSampler.{key}", f"must be an integer in {low}..{high}, got {shorten(value)}")
    return int(value)


def _is_flag(value: Any) -> bool:
    try:
        return bool(value in (True, False))
    except (TypeError, ValueError):  # an array's ambiguous truth
        return False
