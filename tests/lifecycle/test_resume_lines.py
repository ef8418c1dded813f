"""Resume and save at the edges: lines of training a resume went back past, refused resumes,
state a resume leaves unread, user objects raising on save, and the model-config hash."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs
import torch
from torch import nn

from lifecycle.checkpointer import DiskCheckpointer, earlier_config_hash, model_config_hash
from lifecycle.errors import CheckpointError
from lifecycle.jsontree import NotSerializable, encode
from lifecycle.types import Parts, Progress
from tests.lifecycle.test_checkpointer import Loader, config

ROLES = ["actor", "critic"]


def parts(seed: int = 0, width: int = 8) -> Parts:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.Linear(width, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.randn(3, width)).sum().backward()
    opt.step()
    sched.step()
    return Parts(model=model, optimizer=opt, lr_scheduler=sched, dataloader=Loader())


def role(root: Path, name: str) -> DiskCheckpointer:
    return DiskCheckpointer(config(root, checkpoint={"roles": ROLES}), role=name)


def weights(p: Parts) -> list[torch.Tensor]:
    return [t.detach().clone() for t in p.model.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r for r in logs if r["event"] == name]


def test_a_roles_folder_past_the_resumed_step_is_set_aside_so_it_never_pairs_with_the_other_roles_new_line(
    tmp_path: Path,
) -> None:
    for name in ROLES:
        role(tmp_path, name).save(10, parts(), Progress(step=10))
    role(tmp_path, "actor").save(30, parts(seed=30), Progress(step=30))  # line A; the job dies before the critic's
    with capture_logs() as logs:
        assert role(tmp_path, "actor").resume(parts()).step == 10
    assert role(tmp_path, "critic").resume(parts()).step == 10
    moved = events(logs, "checkpoint.role_steps_superseded")
    assert [(r["role"], r["resumed_step"]) for r in moved] == [("actor", 10)]
    aside = Path(moved[0]["paths"][0])
    assert aside.name.startswith("global_step_30.superseded-") and (aside / "actor" / "manifest.json").is_file()
    role(tmp_path, "critic").save(30, parts(seed=31), Progress(step=30))  # line B's critic; the actor's never comes
    restarted = parts(seed=5)
    assert role(tmp_path, "actor").resume(restarted).step == 10  # not line A's actor paired with line B's critic
    assert same(weights(restarted), weights(parts()))
    store = role(tmp_path, "actor").store
    assert store.quarantined() == [] and len(store.superseded()) == 1  # actor's; the critic's own resume moves its


def test_a_roles_resume_never_moves_another_roles_folder_of_a_step_past_the_resumed_one(tmp_path: Path) -> None:
    for name in ROLES:
        role(tmp_path, name).save(10, parts(), Progress(step=10))
    role(tmp_path, "critic").save(30, parts(), Progress(step=30))
    assert role(tmp_path, "actor").resume(parts()).step == 10
    assert (tmp_path / "global_step_30" / "critic" / "manifest.json").is_file()


def test_a_fresh_start_after_a_crash_at_the_first_save_sets_that_step_aside_and_saves_and_resumes_again(
    tmp_path: Path,
) -> None:
    role(tmp_path, "actor").save(1, parts(seed=1), Progress(step=1))  # the critic never saved step 1
    actor, critic = role(tmp_path, "actor"), role(tmp_path, "critic")
    assert actor.resume(parts()) is None and critic.resume(parts()) is None
    assert not (tmp_path / "global_step_1").exists() and actor.store.quarantined() == []
    fresh = parts(seed=2)
    actor.save(1, fresh, Progress(step=1))
    critic.save(1, parts(), Progress(step=1))
    resumed = parts(seed=3)
    assert role(tmp_path, "actor").resume(resumed).step == 1 and same(weights(resumed), weights(fresh))


def test_a_resume_refused_after_extra_was_read_leaves_the_dataloader_position_and_rngs_as_they_were(
    tmp_path: Path,
) -> None:
    saved = parts()
    saved.dataloader.position = 7
    DiskCheckpointer(config(tmp_path), role="actor").save(5, saved, Progress(step=5))
    other = parts(width=4)  # weights that do not fit: refused once extra is read
    random.seed(11)
    state = random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state()
    with pytest.raises(CheckpointError):
        DiskCheckpointer(config(tmp_path, resume={"strict": False}), role="actor").resume(other)
    assert other.dataloader.position == 0
    after = random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state()
    assert after[:2] == state[:2] and torch.equal(after[2], state[2])


def test_a_dataloader_refusing_its_saved_state_stops_the_resume_before_any_weight_is_loaded(tmp_path: Path) -> None:
    """The data position is restored first, as the one part that may refuse its state (another
    dataset, another batch size); the RNGs wait for the resume to be agreed."""
    DiskCheckpointer(config(tmp_path), role="actor").save(1, parts(seed=0), Progress(step=1))

    class Picky(Loader):
        def load_state_dict(self, state: dict[str, Any]) -> None:
            raise ValueError("the dataset changed: another batch size")

    other = parts(seed=1)
    other.dataloader = Picky()
    before = weights(other)
    resumer = DiskCheckpointer(config(tmp_path), role="actor")
    with pytest.raises(CheckpointError, match="refused its state: ValueError: the dataset changed"):
        resumer.resume(other)
    assert same(before, weights(other))


@pytest.mark.parametrize(("absent", "event"), [
    ("lr_scheduler", "checkpoint.resume.content_not_loaded"),
    ("optimizer", "checkpoint.resume.content_not_loaded"),
    ("dataloader", "checkpoint.extra.dataloader_not_restored"),
])
@pytest.mark.parametrize("fmt", ["hf", "torch_dcp"])
def test_saved_state_no_object_is_given_to_take_is_warned_naming_the_content_and_the_step(
    tmp_path: Path, absent: str, event: str, fmt: str,
) -> None:
    cfg = config(tmp_path, checkpoint={"save": {"format": fmt}})
    DiskCheckpointer(cfg, role="actor").save(3, parts(), Progress(step=3))
    given = parts()
    setattr(given, absent, None)
    if absent == "optimizer":
        given.lr_scheduler = None
    with capture_logs() as logs:
        assert DiskCheckpointer(cfg, role="actor").resume(given).step == 3
    found = [(r["content"], r["step"]) for r in events(logs, event)]
    assert (absent, 3) in found


def test_a_resume_leaving_out_extra_warns_naming_the_progress_fields_it_starts_afresh(tmp_path: Path) -> None:
    DiskCheckpointer(config(tmp_path), role="actor").save(5, parts(), Progress(step=5, epoch=2, consumed_samples=64))
    cfg = config(tmp_path, checkpoint={"load": {"contents": ["model", "optimizer"]}})
    with capture_logs() as logs:
        assert DiskCheckpointer(cfg, role="actor").resume(parts()) == Progress(step=5)
    [record] = events(logs, "checkpoint.resume.progress_not_restored")
    assert record["step"] == 5 and {"epoch", "consumed_samples", "weights_version", "user"} <= set(record["reset"])


class RaisingLoader(Loader):
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("sampler not ready")


class RaisingScheduler(torch.optim.lr_scheduler.StepLR):
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("scheduler state unavailable")


@pytest.mark.parametrize("fmt", ["hf", "torch_dcp"])
@pytest.mark.parametrize("raising", ["dataloader", "lr_scheduler"])
def test_a_user_objects_state_dict_raising_on_save_is_a_checkpoint_error_naming_the_step_and_content(
    tmp_path: Path, fmt: str, raising: str,
) -> None:
    p = parts()
    if raising == "dataloader":
        p.dataloader, content = RaisingLoader(), "extra"
    else:
        p.lr_scheduler, content = RaisingScheduler(p.optimizer, step_size=1), "optimizer"
    ckpt = DiskCheckpointer(config(tmp_path, checkpoint={"save": {"format": fmt}}), role="actor")
    with pytest.raises(CheckpointError, match=rf"step 4 \(role actor\) cannot write '{content}': RuntimeError") as exc:
        ckpt.save(4, p, Progress(step=4))
    assert isinstance(exc.value.__cause__, RuntimeError)


def test_a_numpy_array_in_a_state_dict_is_refused_as_not_serializable_naming_its_key() -> None:
    with pytest.raises(NotSerializable, match="value at sampler.perm of type ndarray") as exc:
        encode({"sampler": {"perm": np.arange(8), "pos": np.int64(3)}}, where="extra.json")
    assert exc.value.key == "sampler.perm"
    assert encode({"pos": np.int64(3), "p": np.float32(0.5)}, where="extra.json") == {"pos": 3, "p": 0.5}


class Configured(nn.Linear):
    """A model with an HF-like `config`, whose runtime flags vary between runs of one architecture."""

    def __init__(self, **flags: Any) -> None:
        super().__init__(8, 2)
        self.config = type("Config", (), {"to_dict": lambda _: {"hidden_size": 8, **flags}})()


@pytest.mark.parametrize("flag", ["use_cache", "output_attentions", "output_hidden_states", "return_dict"])
def test_runtime_only_config_flags_leave_the_model_config_hash_as_it_is(flag: str) -> None:
    assert model_config_hash(Parts(model=Configured(**{flag: True}))) == model_config_hash(
        Parts(model=Configured(**{flag: False})))
    assert model_config_hash(Parts(model=Configured(hidden_size=16))) != model_config_hash(Parts(model=Configured()))


def test_a_step_saved_with_the_earlier_hash_of_runtime_flags_still_resumes_strictly(tmp_path: Path) -> None:
    model = Configured(use_cache=True)
    saved = Parts(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    old = DiskCheckpointer(config(tmp_path), role="actor", model_config_hash=earlier_config_hash)
    old.save(2, saved, Progress(step=2))
    assert earlier_config_hash(saved) != model_config_hash(saved)
    again = Configured(use_cache=True)
    resumed = DiskCheckpointer(config(tmp_path), role="actor").resume(
        Parts(model=again, optimizer=torch.optim.SGD(again.parameters(), lr=0.1)))
    assert resumed is not None and resumed.step == 2


def test_a_step_every_role_committed_is_never_set_aside_even_below_a_lagging_ranks_agreed_step(tmp_path: Path) -> None:
    from lifecycle.aside import abandon_line
    from lifecycle.store import CheckpointStore

    for step in (1, 2):
        for name in ROLES:
            role(tmp_path, name).save(step, parts(), Progress(step=step))
    assert abandon_line(CheckpointStore(tmp_path), "actor", 1, ROLES) == []
    assert CheckpointStore(tmp_path).newest_complete(ROLES) == 2
