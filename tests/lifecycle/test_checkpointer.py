"""DiskCheckpointer: save layout, resume selection and verification, retention, first load."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs
import torch
from torch import nn

from backends.hf import HFBackend
from lifecycle import Lifecycle, LifecycleConfig
from lifecycle.checkpointer import DiskCheckpointer, model_config_hash
from lifecycle.checksum import PLAIN, file_digest
from lifecycle.errors import CheckpointError, ConfigError
from lifecycle.store import TRACKER
from lifecycle.types import Parts, Progress


class Loader:
    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def config(root: Path | None, **sections: Any) -> LifecycleConfig:
    checkpoint = {"root": None if root is None else str(root), **sections.pop("checkpoint", {})}
    return LifecycleConfig.from_dict({"checkpoint": checkpoint, **sections})


def parts(seed: int = 0, width: int = 8) -> Parts:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.Linear(width, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.randn(3, width)).sum().backward()
    opt.step()
    sched.step()
    return Parts(model=model, optimizer=opt, lr_scheduler=sched, dataloader=Loader())


def save_steps(ckpt: DiskCheckpointer, p: Parts, steps: list[int]) -> None:
    for step in steps:
        ckpt.save(step, p, Progress(step=step))


def tree(root: Path) -> list[str]:
    return sorted(q.relative_to(root).as_posix() for q in root.rglob("*") if q.is_file())


def test_save_layout_and_figures(tmp_path: Path) -> None:
    ckpt = DiskCheckpointer(config(tmp_path), role="actor")
    info = ckpt.save(3, parts(), Progress(step=3))
    assert tree(tmp_path) == [
        ".lock-actor", "global_step_3/actor/extra/rank_0/extra.json", "global_step_3/actor/extra/rank_0/rng.safetensors",
        "global_step_3/actor/manifest.json", "global_step_3/actor/model/model.safetensors",
        "global_step_3/actor/optimizer/optimizer.json", "global_step_3/actor/optimizer/optimizer.safetensors",
        TRACKER,
    ]
    assert (info.step, info.path, info.backend) == (3, tmp_path / "global_step_3" / "actor", "hf")
    assert info.contents == ["model", "optimizer", "extra"]
    assert info.files == 5 and info.bytes > 0 and info.seconds > 0


def test_hf_model_shares_the_model_folder_for_format_hf(tmp_path: Path) -> None:
    cfg = config(tmp_path, checkpoint={"save": {"contents": ["model", "hf_model"]}})
    info = DiskCheckpointer(cfg, role="actor").save(1, parts(), Progress(step=1))
    manifest = json.loads((info.path / "manifest.json").read_text())
    assert manifest["contents"] == {"model": {"backend": "hf", "folder": "model"},
                                    "hf_model": {"backend": "hf", "folder": "model"}}
    assert sorted(q.name for q in info.path.iterdir()) == ["manifest.json", "model"]


def test_hf_model_alone_gets_its_own_folder(tmp_path: Path) -> None:
    cfg = config(tmp_path, checkpoint={"save": {"contents": ["hf_model"]}})
    info = DiskCheckpointer(cfg, role="actor").save(1, parts(), Progress(step=1))
    assert (info.path / "hf_model" / "model.safetensors").is_file()


def test_resume_restores_model_optimizer_progress_rng_and_dataloader(tmp_path: Path) -> None:
    ckpt = DiskCheckpointer(config(tmp_path), role="actor")
    saved = parts(seed=1)
    saved.dataloader.position = 41
    random.seed(3)
    ckpt.save(7, saved, Progress(step=7, epoch=1, consumed_samples=70, user={"k": [1]}))
    expected_draw = random.random()
    fresh = parts(seed=2)
    progress = DiskCheckpointer(config(tmp_path), role="actor").resume(fresh)
    assert progress == Progress(step=7, epoch=1, consumed_samples=70, user={"k": [1]})
    assert random.random() == expected_draw and fresh.dataloader.position == 41
    for a, b in zip(saved.model.parameters(), fresh.model.parameters()):
        assert torch.equal(a, b)
    assert fresh.lr_scheduler.state_dict() == saved.lr_scheduler.state_dict()
    assert torch.equal(fresh.optimizer.state_dict()["state"][0]["exp_avg"],
                       saved.optimizer.state_dict()["state"][0]["exp_avg"])


def test_resume_with_nothing_on_disk_returns_none(tmp_path: Path) -> None:
    assert DiskCheckpointer(config(tmp_path), role="actor").resume(parts()) is None
    assert DiskCheckpointer(config(None), role="actor").resume(parts()) is None
    cfg = config(tmp_path, resume={"mode": "disable"})
    assert DiskCheckpointer(cfg, role="actor").resume(parts()) is None


def test_saving_without_root_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="checkpoint.root"):
        DiskCheckpointer(config(None), role="actor").save(1, parts(), Progress())


def test_resume_picks_newest_complete_step_whatever_the_tracker_says(tmp_path: Path) -> None:
    ckpt = DiskCheckpointer(config(tmp_path), role="actor")
    save_steps(ckpt, parts(), [1, 2])
    (tmp_path / "global_step_2" / "actor" / "manifest.json").unlink()
    (tmp_path / "global_step_3" / ".staging-actor").mkdir(parents=True)
    (tmp_path / TRACKER).write_text("3\n")
    assert ckpt.resume(parts()).step == 1


def test_resume_needs_every_configured_role(tmp_path: Path) -> None:
    cfg = config(tmp_path, checkpoint={"roles": ["actor", "critic"]})
    actor, critic = DiskCheckpointer(cfg, role="actor"), DiskCheckpointer(cfg, role="critic")
    save_steps(actor, parts(), [1, 2])
    save_steps(critic, parts(), [1])
    assert actor.resume(parts()).step == 1
    assert (tmp_path / TRACKER).read_text() == "1\n"


REFUSE = {"on_damaged": "refuse"}


def test_resume_refuses_a_corrupt_step_and_then_a_load_of_the_possibly_overwritten_model(tmp_path: Path) -> None:
    ckpt = DiskCheckpointer(config(tmp_path, resume=REFUSE), role="actor")
    save_steps(ckpt, parts(), [1])
    weights = tmp_path / "global_step_1" / "actor" / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    target = parts(seed=5)
    with pytest.raises(CheckpointError, match="(?s)cannot resume from step 1.*model.safetensors: checksum"):
        ckpt.resume(target)
    with pytest.raises(CheckpointError, match="partly overwritten"):
        ckpt.load_initial(target)


def test_a_manifest_naming_the_plain_xxh3_checksum_still_resumes_and_still_catches_a_flipped_byte(
    tmp_path: Path,
) -> None:
    ckpt = DiskCheckpointer(config(tmp_path, resume=REFUSE), role="actor")
    saved = parts()
    save_steps(ckpt, saved, [1])
    folder = tmp_path / "global_step_1" / "actor"
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"] = [{"path": f["path"], "size": f["size"], PLAIN: file_digest(folder / f["path"], algorithm=PLAIN)}
                         for f in manifest["files"]]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    target = parts(seed=5)
    assert ckpt.resume(target).step == 1
    assert all(torch.equal(a, b) for a, b in zip(saved.model.state_dict().values(), target.model.state_dict().values()))
    weights = folder / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="(?s)cannot resume from step 1.*model.safetensors: checksum"):
        ckpt.resume(parts(seed=5))


@pytest.mark.parametrize("on_damaged", ["refuse", "fallback"])
def test_planted_pickle_in_extra_is_refused_and_never_executed(tmp_path: Path, on_damaged: str) -> None:
    ckpt = DiskCheckpointer(config(tmp_path, resume={"on_damaged": on_damaged}), role="actor")
    save_steps(ckpt, parts(), [1])
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple[Any, ...]:
            return (open, (str(marker), "w"))

    extra = tmp_path / "global_step_1" / "actor" / "extra"
    (extra / "rank_0" / "rng.pt").write_bytes(pickle.dumps(Exploit()))
    (extra / "state.pkl").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(CheckpointError, match="rng.pt"):
        ckpt.resume(parts())
    assert not marker.exists()
    assert len(list(tmp_path.glob("global_step_1.damaged-*"))) == (on_damaged == "fallback")


@pytest.mark.parametrize("which", ["step", "role"])
def test_resume_from_a_path(tmp_path: Path, which: str) -> None:
    ckpt = DiskCheckpointer(config(tmp_path / "run1"), role="actor")
    save_steps(ckpt, parts(seed=4), [1, 2])
    step_dir = tmp_path / "run1" / "global_step_1"
    path = step_dir if which == "step" else step_dir / "actor"
    cfg = config(tmp_path / "run2", resume={"mode": "path", "path": str(path)})
    resumer = DiskCheckpointer(cfg, role="actor")
    assert resumer.resume(parts()).step == 1


def test_resume_from_a_missing_path_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "global_step_9"
    cfg = config(tmp_path, resume={"mode": "path", "path": str(missing)})
    with pytest.raises(CheckpointError, match=str(missing)):
        DiskCheckpointer(cfg, role="actor").resume(parts())


def test_resume_from_an_uncommitted_path_is_an_error(tmp_path: Path) -> None:
    ckpt = DiskCheckpointer(config(tmp_path), role="actor")
    save_steps(ckpt, parts(), [1])
    (tmp_path / "global_step_1" / "actor" / "manifest.json").unlink()
    cfg = config(tmp_path, resume={"mode": "path", "path": str(tmp_path / "global_step_1")})
    with pytest.raises(CheckpointError, match="manifest missing"):
        DiskCheckpointer(cfg, role="actor").resume(parts())


def test_strict_resume_refuses_another_model_config(tmp_path: Path) -> None:
    hashes = iter(["aaaa", "bbbb"])
    ckpt = DiskCheckpointer(config(tmp_path), role="actor", model_config_hash=lambda p: next(hashes))
    save_steps(ckpt, parts(), [1])
    with pytest.raises(CheckpointError, match="aaaa.*bbbb"):
        ckpt.resume(parts())


def test_strict_resume_with_the_default_hash_refuses_another_architecture(tmp_path: Path) -> None:
    ckpt = DiskCheckpointer(config(tmp_path), role="actor")
    save_steps(ckpt, parts(width=8), [1])
    with pytest.raises(CheckpointError, match="model-config hash [0-9a-f]{16} differs .* [0-9a-f]{16}"):
        ckpt.resume(parts(width=4))


def test_lenient_resume_ignores_the_model_config_hash(tmp_path: Path) -> None:
    hashes = iter(["aaaa", "bbbb"])
    cfg = config(tmp_path, resume={"strict": False})
    ckpt = DiskCheckpointer(cfg, role="actor", model_config_hash=lambda p: next(hashes))
    save_steps(ckpt, parts(), [1])
    assert ckpt.resume(parts()).step == 1


def test_checkpoint_without_extra_resumes_at_its_step(tmp_path: Path) -> None:
    cfg = config(tmp_path, checkpoint={"save": {"contents": ["model", "optimizer"]}})
    ckpt = DiskCheckpointer(cfg, role="actor")
    save_steps(ckpt, parts(), [5])
    assert ckpt.resume(parts()) == Progress(step=5)


def test_requested_content_missing_from_checkpoint_is_an_error(tmp_path: Path) -> None:
    cfg = config(tmp_path, checkpoint={"save": {"contents": ["model", "extra"]}})
    save_steps(DiskCheckpointer(cfg, role="actor"), parts(), [5])
    with pytest.raises(CheckpointError, match="no 'optimizer' content"):
        DiskCheckpointer(config(tmp_path), role="actor").resume(parts())


def steps_on_disk(root: Path) -> list[int]:
    """Step folders resume can read (set-aside ones are named global_step_N.<why>-<time>)."""
    return sorted(int(q.name.removeprefix("global_step_")) for q in root.glob("global_step_*") if "." not in q.name)


def test_retention_forgets_the_step_resumed_from_once_keep_last_newer_steps_are_committed(tmp_path: Path) -> None:
    """The PPO example's shape: resumed at 20 with keep_last 2, the root ends with the newest two only."""
    cfg = config(tmp_path, checkpoint={"keep_last": 2})
    save_steps(DiskCheckpointer(cfg, role="actor"), parts(), [10, 20])
    ckpt = DiskCheckpointer(cfg, role="actor")
    assert ckpt.resume(parts()).step == 20
    save_steps(ckpt, parts(), [25, 30, 35])
    assert steps_on_disk(tmp_path) == [30, 35]


def test_checkpoint_tracker_false_leaves_the_tracker_to_the_trainer_and_retention_still_runs(tmp_path: Path) -> None:
    """verl's trainer writes the tracker itself once every role has saved; with tracker false a
    commit never writes it, and resume, which reads manifests only, is unaffected."""
    cfg = config(tmp_path, checkpoint={"tracker": False, "keep_last": 1})
    save_steps(DiskCheckpointer(cfg, role="actor"), parts(), [1, 2])
    assert not (tmp_path / TRACKER).exists() and steps_on_disk(tmp_path) == [2]
    assert DiskCheckpointer(cfg, role="actor").resume(parts()).step == 2


def test_a_rollback_sets_the_steps_past_it_aside_so_a_crash_restart_resumes_the_rollback(tmp_path: Path) -> None:
    """Resumed by path from step 10 while step 20 exists: 20 belongs to an abandoned line. It is
    renamed aside (never deleted), retention counts only the new line, and an automatic resume
    after a crash picks the new line's newest step, not 20."""
    save_steps(DiskCheckpointer(config(tmp_path), role="actor"), parts(), [10, 20])
    rollback = config(tmp_path, checkpoint={"keep_last": 2},
                      resume={"mode": "path", "path": str(tmp_path / "global_step_10")})
    ckpt = DiskCheckpointer(rollback, role="actor")
    with capture_logs() as logs:
        assert ckpt.resume(parts()).step == 10
    [aside] = tmp_path.glob("global_step_20.superseded-*")
    assert (aside / "actor" / "manifest.json").is_file()
    assert [r["paths"] for r in logs if r["event"] == "checkpoint.steps_superseded"] == [[str(aside)]]
    save_steps(ckpt, parts(), [11, 12, 13, 14])
    assert steps_on_disk(tmp_path) == [13, 14]
    crashed = DiskCheckpointer(config(tmp_path, checkpoint={"keep_last": 2}), role="actor")
    assert crashed.resume(parts()).step == 14


@pytest.mark.parametrize("spelling", ["relative-root", "dotdot", "symlinked-parent"])
def test_a_rollback_is_one_whatever_the_spelling_of_its_root_and_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spelling: str,
) -> None:
    """`checkpoint.root: ckpt` with an absolute resume.path, a path through `..`, or one through
    a symlinked parent name the root's own step: the newer step is set aside all the same, so
    a crash-restart resumes the rollback's line, and its saves pass."""
    root = tmp_path / "ckpt"
    save_steps(DiskCheckpointer(config(root), role="actor"), parts(), [1, 2])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "link").symlink_to(root)
    given, path = {"relative-root": ("ckpt", root / "global_step_1"),
                   "dotdot": (str(root), root / "global_step_2" / ".." / "global_step_1"),
                   "symlinked-parent": (str(root), tmp_path / "link" / "global_step_1")}[spelling]
    ckpt = DiskCheckpointer(config(Path(given), resume={"mode": "path", "path": str(path)}), role="actor")
    assert ckpt.resume(parts()).step == 1
    assert steps_on_disk(root) == [1] and len(list(root.glob("global_step_2.superseded-*"))) == 1
    save_steps(ckpt, parts(), [2])
    assert DiskCheckpointer(config(root), role="actor").resume(parts()).step == 2


def test_a_save_below_the_newest_step_every_role_committed_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    """A fresh run in a used root (resume disabled) saving step 5 while step 20 is committed:
    the first crash-restart would resume 20, the old line, and retention would prune the new
    one. Said at the fresh start, refused before anything is staged, naming both steps;
    re-saving step 20 replaces it, and a role ahead of the others alone (20 is not committed
    for the critic) blocks nothing."""
    save_steps(DiskCheckpointer(config(tmp_path), role="actor"), parts(), [10, 20])
    fresh = DiskCheckpointer(config(tmp_path, resume={"mode": "disable"}), role="actor")
    with capture_logs() as logs:
        assert fresh.resume(parts()) is None
    assert [r["step"] for r in logs if r["event"] == "checkpoint.fresh_start_over_newer_steps"] == [20]
    with pytest.raises(CheckpointError, match=r"cannot save step 5 \(role actor\): step 20 is committed .*resume"):
        fresh.save(5, parts(), Progress(step=5))
    assert steps_on_disk(tmp_path) == [10, 20] and not (tmp_path / "global_step_5").exists()
    save_steps(fresh, parts(seed=1), [20])
    assert DiskCheckpointer(config(tmp_path), role="actor").resume(parts()).step == 20
    both = config(tmp_path, checkpoint={"roles": ["actor", "critic"]})
    save_steps(DiskCheckpointer(both, role="critic"), parts(), [10])
    with pytest.raises(CheckpointError, match="step 10 is committed"):
        DiskCheckpointer(both, role="critic").save(7, parts(), Progress(step=7))


def test_extra_from_another_world_size_restores_progress_only(tmp_path: Path) -> None:
    save_steps(DiskCheckpointer(config(tmp_path), role="actor"), parts(), [4])
    ckpt = DiskCheckpointer(config(tmp_path), role="actor", rank=1, world_size=2, barrier=lambda: None)
    random.seed(0)
    state = random.getstate()
    p = parts()
    p.dataloader.position = 99
    assert ckpt.resume(p).step == 4
    assert random.getstate() == state and p.dataloader.position == 99


def test_load_initial_from_an_hf_folder(tmp_path: Path) -> None:
    source = parts(seed=8)
    HFBackend().export_hf(source.model, tmp_path / "init")
    cfg = config(tmp_path, checkpoint={"pre_load": {"path": str(tmp_path / "init")}})
    target = parts(seed=9)
    figures = DiskCheckpointer(cfg, role="actor").load_initial(target)
    assert figures["backend"] == "hf" and figures["files"] == 1 and figures["bytes"] > 0
    assert all(torch.equal(a, b) for a, b in zip(source.model.parameters(), target.model.parameters()))
    assert DiskCheckpointer(config(tmp_path), role="actor").load_initial(target) == {}


class WithExtraState(nn.Sequential):
    def get_extra_state(self) -> dict[str, int]:
        return {"scale": 2}

    def set_extra_state(self, state: Any) -> None:
        self.extra = state


def test_load_initial_of_a_tensor_named_for_the_models_extra_state_is_a_checkpoint_error(tmp_path: Path) -> None:
    """A plain HF folder holding `_extra_state` as a tensor, for a model whose extra state is a
    dict: a raw AttributeError from init_load before; now typed, naming the entry."""
    from safetensors.torch import save_file

    model = WithExtraState(nn.Linear(4, 2))
    weights = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    (tmp_path / "init").mkdir()
    save_file({**weights, "_extra_state": torch.zeros(1)}, str(tmp_path / "init" / "model.safetensors"))
    lc = Lifecycle(config(None, checkpoint={"pre_load": {"path": str(tmp_path / "init")}}), role="actor",
                   model=model)
    with pytest.raises(CheckpointError, match="model entry '_extra_state' is a dict, not a tensor"):
        lc.init_load()


def test_load_initial_from_a_missing_folder_names_it(tmp_path: Path) -> None:
    cfg = config(tmp_path, checkpoint={"pre_load": {"path": str(tmp_path / "absent")}})
    with pytest.raises(CheckpointError, match="absent"):
        DiskCheckpointer(cfg, role="actor").load_initial(parts())


def test_model_config_hash_follows_the_architecture() -> None:
    first, second = model_config_hash(parts(seed=1)), model_config_hash(parts(seed=2))
    assert first == second and len(first) == 16 and int(first, 16) >= 0
    assert model_config_hash(parts(width=4)) != first
    assert model_config_hash(Parts()) is None


class FakeHFConfig:
    """The one thing the hash uses of a transformers config: `to_dict()`."""

    def __init__(self, **values: Any) -> None:
        self.values = values

    def to_dict(self) -> dict[str, Any]:
        return dict(self.values)


class WithConfig(nn.Linear):
    def __init__(self, **values: Any) -> None:
        super().__init__(2, 2)
        self.config = FakeHFConfig(**values)


def test_model_config_hash_uses_the_hf_config_without_volatile_keys() -> None:
    base = model_config_hash(Parts(model=WithConfig(layers=2, transformers_version="4.1")))
    assert base == model_config_hash(Parts(model=WithConfig(layers=2, transformers_version="4.9")))
    assert base != model_config_hash(Parts(model=WithConfig(layers=3, transformers_version="4.1")))


def test_lifecycle_saves_and_resumes_through_the_disk_checkpointer(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    p = parts(seed=1)
    lc = Lifecycle(cfg, role="actor", model=p.model, optimizer=p.optimizer, lr_scheduler=p.lr_scheduler)
    lc.init_load()
    assert lc.save(6).path == tmp_path / "global_step_6" / "actor"
    lc.close()
    q = parts(seed=2)
    again = Lifecycle(cfg, role="actor", model=q.model, optimizer=q.optimizer, lr_scheduler=q.lr_scheduler)
    assert again.resume() == 6
    assert all(torch.equal(a, b) for a, b in zip(p.model.parameters(), q.model.parameters()))


def test_load_initial_from_a_committed_torch_dcp_model_folder_verifies_it_first(tmp_path: Path) -> None:
    saver = DiskCheckpointer(config(tmp_path, checkpoint={"save": {"format": "torch_dcp"}}), role="actor")
    source = parts(seed=3)
    saver.save(1, source, Progress(step=1))
    model_folder = tmp_path / "global_step_1" / "actor" / "model"
    cfg = config(None, checkpoint={"save": {"format": "torch_dcp"}, "pre_load": {"format": "torch_dcp", "path": str(model_folder)}})
    target = parts(seed=9)
    DiskCheckpointer(cfg, role="actor").load_initial(target)
    assert all(torch.equal(a, b) for a, b in zip(source.model.parameters(), target.model.parameters()))
    metadata = model_folder / ".metadata"
    metadata.write_bytes(metadata.read_bytes() + b"planted")
    with pytest.raises(CheckpointError, match="(?s)cannot load initial weights.*metadata"):
        DiskCheckpointer(cfg, role="actor").load_initial(parts(seed=9))


def test_load_initial_from_an_uncommitted_torch_dcp_folder_loads_and_says_it_is_unverified(tmp_path: Path) -> None:
    """Its metadata goes through the allow-list (tests/backends/test_dcp_metadata.py), so no
    pickle can run; nothing vouches for the bytes, and the log says so."""
    from backends.torch_dcp import TorchDCPBackend

    source = parts(seed=3)
    TorchDCPBackend().save_model(source.model, tmp_path / "loose")
    cfg = config(None, checkpoint={"save": {"format": "torch_dcp"}, "pre_load": {"format": "torch_dcp", "path": str(tmp_path / "loose")}})
    target = parts(seed=9)
    with capture_logs() as logs:
        DiskCheckpointer(cfg, role="actor").load_initial(target)
    assert all(torch.equal(a, b) for a, b in zip(source.model.parameters(), target.model.parameters()))
    assert [r["path"] for r in logs if r["event"] == "checkpoint.pre_load.unverified"] == [str(tmp_path / "loose")]


def test_a_resume_by_path_from_another_root_leaves_this_roots_steps_alone(tmp_path: Path) -> None:
    save_steps(DiskCheckpointer(config(tmp_path / "run1"), role="actor"), parts(), [1])
    save_steps(DiskCheckpointer(config(tmp_path / "run2"), role="actor"), parts(), [5, 6])
    elsewhere = config(tmp_path / "run2", resume={"mode": "path", "path": str(tmp_path / "run1" / "global_step_1")})
    with capture_logs() as logs:
        assert DiskCheckpointer(elsewhere, role="actor").resume(parts()).step == 1
    assert steps_on_disk(tmp_path / "run2") == [5, 6]
    [resumed] = [r for r in logs if r["event"] == "checkpoint.resumed"]
    assert resumed["path"] == str(tmp_path / "run1" / "global_step_1" / "actor")


def test_a_model_hash_function_that_raises_is_a_checkpoint_error(tmp_path: Path) -> None:
    save_steps(DiskCheckpointer(config(tmp_path), role="actor"), parts(), [1])

    def broken(p: Parts) -> str:
        raise KeyError("hidden_size")

    with pytest.raises(CheckpointError, match="model-config hash cannot be computed: KeyError"):
        DiskCheckpointer(config(tmp_path), role="actor", model_config_hash=broken).resume(parts())


def test_progress_a_resume_would_refuse_fails_the_save_before_any_content_is_written(tmp_path: Path) -> None:
    ckpt = DiskCheckpointer(config(tmp_path), role="actor")
    with pytest.raises(CheckpointError, match=r"save of step 1 \(role actor\): Progress fields must be integers"):
        ckpt.save(1, parts(), Progress(step=1, consumed_samples=-5))
    assert not tmp_path.exists() or not list(tmp_path.iterdir())
