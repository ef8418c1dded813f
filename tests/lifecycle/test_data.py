"""Resuming at an epoch boundary continues with the next epoch, never with zero steps."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lifecycle import CheckpointError, Lifecycle, State
from lifecycle.data import ResumableBatchSampler
from tests.lifecycle.test_bad_input import resign


def _lifecycle(root: Path, sampler: ResumableBatchSampler, **resume: Any) -> Lifecycle:
    torch.manual_seed(0)
    return Lifecycle({"checkpoint": {"root": str(root)}, "resume": resume}, role="actor",
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


# States that do not fit: refused naming the field, nothing assigned --------------------------

BAD_STATES = {
    "not-a-mapping": ([1, 2], "sampler state must be a mapping"),
    "missing-epoch": ({"epoch": None}, "field 'epoch' must be an integer, found None"),
    "epoch-a-list": ({"epoch": [1]}, "field 'epoch' must be an integer, found [1]"),
    "epoch-a-bool": ({"epoch": True}, "field 'epoch' must be an integer, found True"),
    "epoch-negative": ({"epoch": -1}, "field 'epoch' must be within 0.."),
    "position-negative": ({"position": -3}, "field 'position' must be within 0..3"),
    "position-past-the-epoch": ({"position": 4}, "field 'position' must be within 0..3"),
    "position-a-float": ({"position": 1.0}, "field 'position' must be an integer, found 1.0"),
    "seed-a-string": ({"seed": "x"}, "field 'seed' must be an integer, found 'x'"),
    "seed-too-large": ({"seed": 10**30}, "field 'seed' must be within"),
    "seed-too-small": ({"seed": -(2**63) - 1}, "field 'seed' must be within"),
    "seed-beyond-int64": ({"seed": 2**63}, "field 'seed' must be within"),
    "epoch-too-large": ({"epoch": 2**62 + 1}, "field 'epoch' must be within 0.."),
    "batch-size-a-string": ({"batch_size": "4"}, "field 'batch_size' must be an integer, found '4'"),
}


@pytest.mark.parametrize("change,message", BAD_STATES.values(), ids=BAD_STATES.keys())
def test_a_state_with_a_missing_or_out_of_range_field_is_refused_and_nothing_changes(
    change: object, message: str
) -> None:
    sampler = ResumableBatchSampler(12, 4, seed=3)
    next(iter(sampler))
    if isinstance(change, dict):
        state: object = {k: v for k, v in {**sampler.state_dict(), **change}.items() if v is not None}
    else:
        state = change
    fresh = ResumableBatchSampler(12, 4, seed=5)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        fresh.load_state_dict(state)  # type: ignore[arg-type]
    assert (fresh.epoch, fresh.position, fresh.seed) == (0, 0, 5)


def test_the_widest_seeds_torch_accepts_load_and_iterate() -> None:
    for seed, epoch in ((2**63 - 1, 2**62), (-(2**63), 3)):
        sampler = ResumableBatchSampler(8, 4, seed=0)
        sampler.load_state_dict({"epoch": epoch, "position": 0, "seed": seed, "num_samples": 8, "batch_size": 4})
        assert len(list(sampler)) == 2


@pytest.mark.parametrize("change", [{"epoch": [1]}, {"position": -3}, {"seed": 10**30}, {"epoch": None}],
                         ids=["epoch-a-list", "position-negative", "seed-too-large", "missing-epoch"])
def test_resume_refuses_a_sampler_state_that_does_not_fit_and_the_previous_step_resumes(
    tmp_path: Path, change: dict[str, object]
) -> None:
    root = tmp_path / "ckpt"
    sampler = ResumableBatchSampler(12, 4, seed=3)
    lc = _lifecycle(root, sampler)
    lc.init_load()
    stream = sampler.batches()
    for step in (1, 2):
        with lc.train_step(step):
            next(stream)
        lc.save(step)
    lc.close()
    saved_at_1 = {"epoch": 0, "position": 1}
    folder = root / "global_step_2" / "actor"
    path = folder / "extra" / "rank_0" / "extra.json"
    doc = json.loads(path.read_text())
    doc["dataloader"] = {k: v for k, v in {**doc["dataloader"], **change}.items() if v is not None}
    path.write_text(json.dumps(doc))
    resign(folder)
    fresh = ResumableBatchSampler(12, 4, seed=3)
    refused_lc = _lifecycle(root, fresh, on_damaged="refuse")
    with pytest.raises(CheckpointError, match=rf"(?s){path}: dataloader ResumableBatchSampler refused its state: "
                                              rf"sampler state field '{next(iter(change))}'"):
        refused_lc.resume()
    assert refused_lc.state is State.FAILED
    shutil.rmtree(root / "global_step_2")
    again = ResumableBatchSampler(12, 4, seed=3)
    assert _lifecycle(root, again, on_damaged="refuse").resume() == 1
    assert {"epoch": again.epoch, "position": again.position} == saved_at_1


def test_a_running_iterator_follows_a_state_loaded_under_it_to_the_batch_an_uninterrupted_run_trains_on() -> None:
    """A resume in the same process (after a failed step) loads the sampler while its endless
    iterator runs: the iterator kept the order of the epoch it had reached, so training went
    on with a batch of another epoch's order."""
    sampler = ResumableBatchSampler(8, 2, seed=5)
    stream = sampler.batches()
    taken = [next(stream) for _ in range(3)]
    saved = sampler.state_dict()
    for _ in range(4):  # into the next epoch, whose order differs
        next(stream)
    sampler.load_state_dict(saved)
    reference = ResumableBatchSampler(8, 2, seed=5).batches()
    assert [next(stream) for _ in range(4)] == [next(reference) for _ in range(7)][3:] and len(taken) == 3


def test_a_state_of_the_other_shuffle_is_refused_and_one_saved_without_it_loads() -> None:
    shuffled = ResumableBatchSampler(8, 2).state_dict()
    with pytest.raises(CheckpointError, match="shuffle=True but this sampler has shuffle=False"):
        ResumableBatchSampler(8, 2, shuffle=False).load_state_dict(shuffled)
    older = {k: v for k, v in shuffled.items() if k != "shuffle"}
    ResumableBatchSampler(8, 2).load_state_dict(older)


@pytest.mark.parametrize(("args", "kwargs", "says"), [
    (("10", 2), {}, r"num_samples: must be an integer in 1\.\.4611686018427387904, got '10'"),
    ((10, 2.5), {}, r"batch_size: must be an integer in 1\.\.10, got 2\.5"),
    ((10, True), {}, r"batch_size: must be an integer"),
    ((10, 20), {}, r"batch_size: must be an integer in 1\.\.10, got 20"),
    ((10**30, 1), {}, r"num_samples: must be an integer"),
    ((10, 2), {"seed": "x"}, r"seed: must be an integer"),
    ((10, 2), {"shuffle": "yes"}, r"shuffle: must be true or false"),
], ids=["string", "float", "bool", "batch-over-samples", "huge", "string-seed", "string-shuffle"])
def test_a_sampler_built_from_odd_values_is_a_config_error_naming_the_argument(
    args: tuple[Any, ...], kwargs: dict[str, Any], says: str,
) -> None:
    from lifecycle import ConfigError

    with pytest.raises(ConfigError, match=says):
        ResumableBatchSampler(*args, **kwargs)


def test_a_torch_dataloader_over_the_sampler_saves_its_position_and_one_without_says_it_saves_none(tmp_path: Path) -> None:
    """Passed as `dataloader=`, a DataLoader (no state_dict of its own) saved no position and
    said nothing: the resumed run replayed epoch 0. Its batch sampler's position is used."""
    from structlog.testing import capture_logs
    from torch.utils.data import DataLoader

    data = list(range(40))
    sampler = ResumableBatchSampler(40, 4, seed=2)
    loader = DataLoader(data, batch_sampler=sampler)
    lc = _lifecycle(tmp_path, loader)  # type: ignore[arg-type]
    lc.init_load()
    batches = iter(loader)
    for step in (1, 2, 3):
        with lc.train_step(step):
            next(batches)
    lc.save(3)
    expected = next(batches).tolist()
    again_loader = DataLoader(data, batch_sampler=ResumableBatchSampler(40, 4, seed=2))
    assert _lifecycle(tmp_path, again_loader).resume() == 3  # type: ignore[arg-type]
    assert next(iter(again_loader)).tolist() == expected
    plain = _lifecycle(tmp_path / "plain", DataLoader(data, batch_size=4))  # type: ignore[arg-type]
    plain.init_load()
    with capture_logs() as logs:
        plain.save(1)
        plain.save(2)  # said once per loader, not at every save
    assert [r["dataloader"] for r in logs if r["event"] == "checkpoint.extra.dataloader_position_unsaved"] \
        == ["DataLoader"]
