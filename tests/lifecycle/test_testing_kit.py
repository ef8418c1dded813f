"""The testing kit users get: in-memory stand-ins that fail on demand, and path capture."""

from __future__ import annotations

import pytest
import torch

from lifecycle import Lifecycle, State
from lifecycle.testing import (
    InjectedFailure,
    MemoryCheckpointer,
    MemoryEngine,
    MemoryRollout,
    capture_transitions,
)

S = State


def _lc(**kwargs) -> Lifecycle:  # type: ignore[no-untyped-def]
    return Lifecycle(role="actor", model=torch.nn.Linear(2, 2), **kwargs)


def test_assert_path_passes_on_the_path_taken_and_explains_a_different_one() -> None:
    lc = _lc(checkpointer=MemoryCheckpointer(fail_at={"save"}))
    with capture_transitions(lc) as cap:
        lc.init_load()
        with pytest.raises(InjectedFailure):
            lc.save(1)
    cap.assert_path([S.CREATED, S.LOADING, S.READY, S.SAVING, S.FAILED])
    with pytest.raises(AssertionError, match="expected CREATED -> READY\n  actual   CREATED -> LOADING"):
        cap.assert_path([S.CREATED, S.READY])
    assert cap.triggers == ["init_load", "save"]


def test_capture_without_a_lifecycle_sees_every_lifecycle_and_detaches_after() -> None:
    a, b = _lc(checkpointer=MemoryCheckpointer()), _lc(checkpointer=MemoryCheckpointer())
    with capture_transitions() as cap:
        a.init_load()
        b.close()
    a.close()
    assert cap.triggers == ["init_load", "close"]


def test_memory_checkpointer_failing_at_commit_keeps_the_previous_checkpoint() -> None:
    model = torch.nn.Linear(2, 2)
    ckpt = MemoryCheckpointer()
    lc = Lifecycle(role="actor", model=model, checkpointer=ckpt)
    lc.init_load()
    lc.save(1)
    saved = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    ckpt.fail_next("commit")
    with pytest.raises(InjectedFailure):
        lc.save(2)
    assert lc.resume() == 1
    assert torch.equal(model.weight, saved)
    assert [c for c in ckpt.calls if c[0] in {"save", "commit"}] == [
        ("save", 1), ("commit", 1), ("save", 2), ("commit", 2)
    ]


@pytest.mark.parametrize("phase", ["transfer", "apply"])
def test_memory_engine_failure_marks_the_rollout_stale_and_resumes_it(phase: str) -> None:
    engine = MemoryEngine(fail_at={phase})
    lc = _lc(checkpointer=MemoryCheckpointer(), engine=engine)
    rollout = MemoryRollout()
    lc.init_load()
    with pytest.raises(InjectedFailure):
        lc.sync_weights(rollout)
    assert rollout.stale and not rollout.paused and rollout.weights_version == 0
    with pytest.raises(RuntimeError, match="stale"):
        rollout.serve()
    assert lc.state is S.FAILED


def test_memory_engine_delivers_weights_and_the_version_on_both_sides() -> None:
    lc = _lc(checkpointer=MemoryCheckpointer(), engine=MemoryEngine())
    rollout = MemoryRollout()
    lc.init_load()
    assert lc.sync_weights(rollout) == 1 == rollout.weights_version == lc.progress.weights_version
    assert torch.equal(rollout.serve()["weight"], lc.parts.model.weight)
    assert rollout.calls == ["pause", "load_weights", "resume"]


def test_memory_checkpointer_restores_the_data_position_so_a_resume_trains_on_the_next_batch() -> None:
    """It kept the model, optimizer and scheduler only: a test of resume in a user's suite
    trained on the first batch again, where a disk checkpoint restores the next one."""
    from lifecycle.data import ResumableBatchSampler

    from torch.utils.data import DataLoader

    sampler = ResumableBatchSampler(16, 2, seed=1)
    lc = Lifecycle(model=torch.nn.Linear(2, 2), checkpointer=MemoryCheckpointer(), dataloader=sampler)
    lc.init_load()
    stream = sampler.batches()
    for step in (1, 2, 3):
        with lc.train_step(step):
            next(stream)
    lc.save(3)
    expected = next(stream)
    fresh = ResumableBatchSampler(16, 2, seed=1)
    loader = DataLoader(list(range(16)), batch_sampler=fresh)  # through a DataLoader, as on disk
    again = Lifecycle(model=torch.nn.Linear(2, 2), checkpointer=lc.checkpointer, dataloader=loader)
    assert again.resume() == 3 and next(iter(loader)).tolist() == expected


def test_memory_checkpointer_fail_at_a_bare_string_is_refused_not_split_into_letters() -> None:
    from lifecycle.errors import ConfigError

    with pytest.raises(ConfigError, match="write fail_at={'save'}"):
        MemoryCheckpointer(fail_at="save")


@pytest.mark.parametrize("make", [
    lambda: MemoryCheckpointer(fail_at={"comit"}),
    lambda: MemoryCheckpointer().fail_next("Save"),
    lambda: MemoryEngine(fail_at={"transfer", "load_weights"}),
    lambda: MemoryEngine().fail_next(None),  # type: ignore[arg-type]
], ids=["typo", "case", "engine_other_phase", "not_a_string"])
def test_a_failure_point_the_stand_in_does_not_have_is_refused_listing_the_ones_it_has(make) -> None:  # type: ignore[no-untyped-def]
    """A misspelt point was accepted and never fired: the test meant to see it failed passed."""
    from lifecycle.errors import ConfigError

    with pytest.raises(ConfigError, match="has no phase .*; its phases are (load_initial|pause), "):
        make()


@pytest.mark.parametrize("user", [{"seen": {1, 2}}, {"t": torch.tensor(1.5)}], ids=["set", "tensor"])
def test_memory_checkpointer_refuses_progress_user_a_disk_checkpoint_refuses(user: dict) -> None:  # type: ignore[type-arg]
    from lifecycle.errors import CheckpointError

    lc = _lc(checkpointer=MemoryCheckpointer())
    lc.init_load()
    lc.progress.user.update(user)
    with pytest.raises(CheckpointError, match="Progress.user is not JSON-serialisable at (seen|t)"):
        lc.save(1)
    assert lc.state is S.FAILED and not lc.checkpointer.saved  # type: ignore[attr-defined]


def test_memory_checkpointer_gives_progress_user_back_as_a_disk_resume_would() -> None:
    import numpy as np

    ckpt = MemoryCheckpointer()
    lc = _lc(checkpointer=ckpt)
    lc.init_load()
    lc.progress.user.update({"pair": (1, 2), "n": np.int64(3), "x": float("inf")})
    lc.save(1)
    again = _lc(checkpointer=ckpt)
    assert again.resume() == 1
    user = again.progress.user
    assert user == {"pair": (1, 2), "n": 3, "x": float("inf")} and type(user["n"]) is int
