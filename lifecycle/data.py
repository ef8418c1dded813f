"""A batch sampler whose position survives a resume, epoch boundaries included.

A checkpoint taken right after the last batch of an epoch records the position "end of
epoch e". Restored as is, many loaders then yield an empty epoch e (zero steps) or replay
it. This sampler normalises that state to "start of epoch e + 1" when it is loaded, so a
resumed run always continues with the next batch it would have trained on.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from lifecycle.errors import CheckpointError


class ResumableBatchSampler:
    """Index batches, reshuffled each epoch from `seed`; use as a DataLoader `batch_sampler`."""

    def __init__(self, num_samples: int, batch_size: int, *, shuffle: bool = True, seed: int = 0) -> None:
        if num_samples < batch_size or batch_size < 1:
            raise ValueError(f"need 1 <= batch_size ({batch_size}) <= num_samples ({num_samples})")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0
        """Batches of the current epoch already handed out."""

    def __len__(self) -> int:
        return self.num_samples // self.batch_size

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=gen).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        """The rest of the current epoch; the next iteration starts the next epoch."""
        self._roll_over()
        order = self._order()
        while self.position < len(self):
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
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_samples": self.num_samples, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore, refusing a state made for another data set or batch size."""
        for key in ("num_samples", "batch_size"):
            if state.get(key) != getattr(self, key):
                raise CheckpointError(
                    f"sampler state has {key}={state.get(key)!r} but this sampler has {getattr(self, key)!r}"
                )
        self.epoch, self.position, self.seed = int(state["epoch"]), int(state["position"]), int(state["seed"])
        self._roll_over()
