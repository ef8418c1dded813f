"""Resuming at an epoch boundary continues with the next epoch, never with zero steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lifecycle import CheckpointError, Lifecycle
from lifecycle.data import ResumableBatchSampler


def _lifecycle(root: Path, sampler: ResumableBatchSampler) -> Lifecycle:
    torch.manual_seed(0)
    return Lifecycle({"checkpoint": {"root": str(root)}}, role="actor",
                     model=torch.nn.Linear(2, 2), dataloader=sampler)


def _reference(num_batches: int) -> list[list[int]]:
    sampler = ResumableBatchSampler(12, 4, seed=3)
    stream = sampler.batches()
    return [next(stream) for _ in range(num_batches)]


@pytest.mark.parametrize("save_after", [3, 6, 2, 4])
def test_resume_continues_with_the_batch_an_uninterrupted_run_would_train_on(tmp_path: Path, save_after: int) -> None:
    sampler = ResumableBatchSampler(12, 4, seed=3)
    lc = _lifecycle(tmp_path, sampler)
    lc.init_load()
    stream = sampler.batches()
    seen = []
    for step in range(1, save_after + 1):
        with lc.train_step(step):
            seen.append(next(stream))
    lc.progress.epoch = sampler.epoch
    lc.save()

    fresh = ResumableBatchSampler(12, 4, seed=3)
    resumed = _lifecycle(tmp_path, fresh)
    assert resumed.resume() == save_after
    more = fresh.batches()
    seen += [next(more) for _ in range(3)]
    assert seen == _reference(save_after + 3)


def test_a_state_saved_at_the_end_of_an_epoch_loads_as_the_start_of_the_next() -> None:
    sampler = ResumableBatchSampler(8, 4, shuffle=False)
    assert list(sampler) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    state = sampler.state_dict()
    assert (state["epoch"], state["position"]) == (0, 2)
    fresh = ResumableBatchSampler(8, 4, shuffle=False)
    fresh.load_state_dict(state)
    assert (fresh.epoch, fresh.position) == (1, 0)
    assert len(list(fresh)) == 2


def test_each_epoch_is_reshuffled_and_every_sample_seen_once() -> None:
    sampler = ResumableBatchSampler(12, 4, seed=1)
    first, second = list(sampler), list(sampler)
    assert first != second
    assert sorted(i for b in first for i in b) == list(range(12)) == sorted(i for b in second for i in b)


def test_a_state_for_another_batch_size_is_refused() -> None:
    state = ResumableBatchSampler(12, 4).state_dict()
    with pytest.raises(CheckpointError, match="batch_size=4 but this sampler has 3"):
        ResumableBatchSampler(12, 3).load_state_dict(state)
