"""The verl drop-in and the hf / torch_dcp formats against a config or a model they used to take
silently: an LR schedule `extra` does not hold here, adapter keys of `lifecycle_config` that were
overwritten without a word, a tracker nobody writes, a configured root reached through a symlink,
verl's negative `max_ckpt_to_keep`, a buffer that is a slice of a parameter, a meta-device model
loaded into.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs
from torch import nn

from lifecycle import CheckpointError, ConfigError, LifecycleConfig
from lifecycle.integrations.verl_checkpoint import LifecycleCheckpointManager
from lifecycle.store import TRACKER, CheckpointStore
from tests.integrations.test_verl_checkpoint import build, local_path, manager, train_step

# -- G2: verl keeps the lr scheduler in `extra`; this library keeps it with the optimizer ------


def test_save_contents_with_extra_but_without_optimizer_and_an_lr_scheduler_is_refused_naming_save_contents() -> None:
    with pytest.raises(ConfigError, match=r"^checkpoint_config\.save_contents: .*lr_scheduler.*optimizer"):
        manager(checkpoint_config={"save_contents": ["model", "extra"]})


def test_load_contents_with_extra_but_without_optimizer_and_an_lr_scheduler_is_refused_naming_load_contents(
    tmp_path: Path,
) -> None:
    saver, _ = manager()
    saver.save_checkpoint(local_path(tmp_path, 1), None, 1)
    with pytest.raises(ConfigError, match=r"^checkpoint_config\.load_contents: .*lr_scheduler.*optimizer"):
        manager(checkpoint_config={"load_contents": ["model", "extra"]})


def test_save_contents_with_extra_but_without_optimizer_gives_a_config_level_remedy_not_lr_scheduler_none() -> None:
    """verl's workers always pass their lr_scheduler: the remedy must be one a verl config can give."""
    with pytest.raises(ConfigError) as caught:
        manager(checkpoint_config={"save_contents": ["model", "extra"]})
    assert "add 'optimizer' to checkpoint_config.save_contents" in str(caught.value)
    assert "lr_scheduler=None" not in str(caught.value)


def test_load_contents_of_model_and_extra_says_the_schedule_travels_with_the_optimizer_and_how_to_keep_it(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError) as caught:
        manager(checkpoint_config={"save_contents": ["model", "optimizer", "extra"],
                                   "load_contents": ["model", "extra"]})
    said = str(caught.value)
    assert said.startswith("checkpoint_config.load_contents: ")
    assert "travels with the optimizer" in said and "add 'optimizer' to checkpoint_config.load_contents" in said
    assert "lr_scheduler=None" not in said


def test_load_contents_of_model_alone_starts_the_schedule_afresh_as_the_refusal_offers(tmp_path: Path) -> None:
    saver, _ = manager()
    train_step(saver.model, saver.optimizer, saver.lr_scheduler)
    saver.save_checkpoint(local_path(tmp_path, 1), None, 1)
    fresh, _ = manager(5, checkpoint_config={"load_contents": ["model"]})
    fresh.load_checkpoint(local_path(tmp_path, 1))
    assert fresh.lr_scheduler.last_epoch == 0 and saver.lr_scheduler.last_epoch == 1


def test_extra_without_optimizer_and_without_an_lr_scheduler_still_saves_and_loads(tmp_path: Path) -> None:
    contents = {"save_contents": ["model", "extra"]}
    model, _, _ = build(0)
    LifecycleCheckpointManager(model, checkpoint_config=contents).save_checkpoint(local_path(tmp_path, 1), None, 1)
    other, _, _ = build(1)
    LifecycleCheckpointManager(other, checkpoint_config=contents).load_checkpoint(local_path(tmp_path, 1))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))


# -- G3, G4: keys of lifecycle_config the adapter decides ----------------------------------------


def test_an_explicit_checkpoint_tracker_true_is_honoured_by_a_critic_without_async_save_beside_an_async_actor(
    tmp_path: Path,
) -> None:
    """verl's trainer writes no tracker when the actor saves asynchronously; the critic, which
    does not, must still write it once both roles committed, as its config asks."""
    config = {"checkpoint": {"roles": ["actor", "critic"], "tracker": True}}
    actor, _ = manager(0, checkpoint_config={"async_save": True}, lifecycle_config=config)
    critic, _ = manager(1, checkpoint_config={"async_save": False}, lifecycle_config=config)
    for step in (1, 2):
        actor.save_checkpoint(local_path(tmp_path, step), None, step)
        actor.wait()
        critic.save_checkpoint(local_path(tmp_path, step, "critic"), None, step)
    actor.close()
    critic.close()
    assert CheckpointStore(tmp_path).read_tracker() == 2


def test_without_checkpoint_tracker_a_manager_without_async_save_still_leaves_the_tracker_to_verls_trainer(
    tmp_path: Path,
) -> None:
    for config in (None, LifecycleConfig.from_dict({"checkpoint": {"save": {"format": "torch_dcp"}}})):
        ckpt, _ = manager(lifecycle_config=config)
        ckpt.save_checkpoint(local_path(tmp_path, 1), None, 1)
        ckpt.close()
        assert not (tmp_path / TRACKER).exists()


def test_checkpoint_tracker_false_under_async_save_is_refused_naming_checkpoint_tracker() -> None:
    with pytest.raises(ConfigError, match=r"^checkpoint\.tracker: .*async_save"):
        manager(checkpoint_config={"async_save": True}, lifecycle_config={"checkpoint": {"tracker": False}})


@pytest.mark.parametrize(("section", "key", "value", "verls"), [
    ("save", "async", True, "async_save"),
    ("save", "contents", ["model"], "save_contents"),
    ("load", "contents", ["model"], "load_contents"),
])
def test_save_async_and_contents_in_lifecycle_config_are_refused_naming_the_key_and_verls(
    section: str, key: str, value: Any, verls: str,
) -> None:
    with pytest.raises(ConfigError, match=rf"^checkpoint\.{section}\.{key}: .*checkpoint_config\.{verls}"):
        manager(lifecycle_config={"checkpoint": {section: {key: value}}})


def test_a_checkpoint_tracker_that_is_not_a_bool_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"^checkpoint\.tracker: .*bool"):
        manager(lifecycle_config={"checkpoint": {"tracker": "yes"}})


# -- G8: a configured root reached through a symlink is that root ----------------------------


def test_a_save_through_a_symlinked_spelling_of_the_configured_root_is_taken(tmp_path: Path) -> None:
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real)
    ckpt, _ = manager(lifecycle_config={"checkpoint": {"root": str(real)}})
    ckpt.save_checkpoint(local_path(link, 1), None, 1)
    assert CheckpointStore(real).validate(1, "actor", deep=True) == []


# -- G10: verl's negative max_ckpt_to_keep keeps every step ----------------------------------


def test_a_negative_max_ckpt_to_keep_keeps_every_step_as_verl_does_with_one_warning_naming_the_value(
    tmp_path: Path,
) -> None:
    ckpt, model = manager()
    with capture_logs() as logs:
        for step in (1, 2, 3):
            ckpt.save_checkpoint(local_path(tmp_path, step), None, step, max_ckpt_to_keep=-1)
    assert CheckpointStore(tmp_path).steps() == [1, 2, 3]
    warned = [log for log in logs if log["log_level"] == "warning" and log.get("max_ckpt_to_keep") == -1]
    assert len(warned) == 1


# -- G6: hf, a buffer that is a slice of a parameter -----------------------------------------


class SliceBuffer(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(4, 4)
        self.register_buffer("row", self.lin.weight.data[1])


def test_hf_save_of_a_buffer_that_is_a_slice_of_a_parameter_is_refused_naming_both_before_any_file(
    tmp_path: Path,
) -> None:
    from backends.hf import HFBackend

    with pytest.raises(CheckpointError, match=r"'lin\.weight' and 'row'"):
        HFBackend().save_model(SliceBuffer(0), tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_hf_save_of_tied_weights_that_are_one_tensor_still_saves_and_loads(tmp_path: Path) -> None:
    from backends.hf import HFBackend

    def tied(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        model[1].weight = model[0].weight
        return model

    saved, loaded = tied(0), tied(1)
    HFBackend().save_model(saved, tmp_path / "model")
    HFBackend().load_model(loaded, tmp_path / "model")
    assert torch.equal(saved[0].weight, loaded[0].weight) and loaded[1].weight is loaded[0].weight


# -- G7: loading into a meta-device model ----------------------------------------------------


@pytest.mark.parametrize("fmt", ["hf", "torch_dcp"])
def test_loading_into_a_meta_model_is_refused_naming_the_tensor_and_to_empty_before_loading(
    tmp_path: Path, fmt: str,
) -> None:
    config = {"checkpoint": {"save": {"format": fmt}}}
    model, _, _ = build(0)
    LifecycleCheckpointManager(model, checkpoint_config={"save_contents": ["model"]},
                               lifecycle_config=config).save_checkpoint(local_path(tmp_path, 1), None, 1)
    with torch.device("meta"):
        empty = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.25), nn.Linear(16, 1))
    loader = LifecycleCheckpointManager(empty, checkpoint_config={"save_contents": ["model"]}, lifecycle_config=config)
    with pytest.raises(CheckpointError, match=r"'0\.weight' is a meta tensor.*to_empty\(\).*before loading") as caught:
        loader.load_checkpoint(local_path(tmp_path, 1))
    assert "before saving" not in str(caught.value) and "process group" not in str(caught.value)


def test_a_trained_step_still_resumes_under_verls_default_contents(tmp_path: Path) -> None:
    """The refusals above leave verl's default contents (model, optimizer, extra) as they were."""
    ckpt, _ = manager()
    model, optimizer, scheduler = ckpt.model, ckpt.optimizer, ckpt.lr_scheduler
    train_step(model, optimizer, scheduler)
    ckpt.save_checkpoint(local_path(tmp_path, 1), None, 1)
    resumed, _ = manager(5)
    resumed.load_checkpoint(local_path(tmp_path, 1))
    assert resumed.lr_scheduler.last_epoch == scheduler.last_epoch == 1
