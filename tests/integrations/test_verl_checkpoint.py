"""The verl checkpoint manager over a `Lifecycle`: verl's calls in, this library's commit,
verification and retention underneath, and verl's own `find_latest_ckpt_path` still finding
the newest step.

Only the pytest process and the resume child of the SIGKILL test import verl (about 15 s
each): the adapter itself never does. The children are fresh interpreters that import this
module for the model, the training step and the reference states, as `test_crash` does.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from lifecycle import CheckpointError, ConfigError, State
from lifecycle.integrations.verl_checkpoint import LifecycleCheckpointManager, StepPath
from lifecycle.manifest import MANIFEST
from lifecycle.store import TRACKER, CheckpointStore
from tests.children import Child

REPO = Path(__file__).resolve().parents[2]
ROLE = "actor"
VERL = "verl.utils.checkpoint.checkpoint_manager"
TRAIN_TIMEOUT_S = 180.0
RESUME_TIMEOUT_S = 300.0
"""The resume child imports verl: about 15 s on an idle machine, several times that on a busy one."""

CHILD = """\
import sys
sys.path.insert(0, {repo!r})
import structlog
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
from tests.integrations import test_verl_checkpoint as t
getattr(t, sys.argv[1])(*sys.argv[2:])
"""


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.25), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    return model, optimizer, scheduler


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    """Draws from torch (data, dropout), numpy and Python's RNGs, so each must resume exactly."""
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    scale = 1.0 + random.random() + float(np.random.rand())
    loss = ((model(x) - y) ** 2).mean() * scale
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    """Everything a resume must restore, in types `torch.load(weights_only=True)` reads back."""
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached]},
    }


def differences(got: Any, want: Any, where: str = "") -> list[str]:
    """Where two snapshots differ: tensors bit for bit (dtype included), the rest by `==`."""
    if isinstance(want, torch.Tensor):
        same = isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
        return [] if same else [where]
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{where}: keys {sorted(map(str, got)) if isinstance(got, dict) else got} != "
                    f"{sorted(map(str, want))}"]
        return [d for k in want for d in differences(got[k], want[k], f"{where}.{k}")]
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return [f"{where}: {got!r} != {want!r}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in differences(g, w, f"{where}[{i}]")]
    return [] if got == want else [f"{where}: {got!r} != {want!r}"]


def local_path(root: Path, step: int, role: str = ROLE) -> str:
    return str(root / f"global_step_{step}" / role)


def trainer_writes(root: Path, step: int) -> None:
    """What verl's `RayPPOTrainer._save_checkpoint` does after its workers return: `data.pt`
    beside the role folders, then its own tracker, written in place (not atomically)."""
    torch.save({"dataloader_position": step}, root / f"global_step_{step}" / "data.pt")
    with open(root / TRACKER, "w") as tracker:
        tracker.write(str(step))


# The children of the SIGKILL test.

def train_child(root: str, refs: str, kill_step: str) -> None:
    """Train and save steps 1.. through the adapter, as a verl worker and its trainer would;
    the save of `kill_step` stops mid-write (the model written, the optimizer not) and waits
    to be killed. Each step's state is dumped before its save: the uninterrupted reference."""
    from backends.torch_dcp import TorchDCPBackend

    torch.set_num_threads(1)
    random.seed(0)
    np.random.seed(0)
    model, optimizer, scheduler = build(seed=0)
    manager = LifecycleCheckpointManager(model, optimizer, scheduler,
                                         checkpoint_config={"save_contents": ["model", "optimizer", "extra"]})
    armed = {"step": None}
    save_optimizer = TorchDCPBackend.save_optimizer

    def hang_mid_write(self: TorchDCPBackend, *args: Any, **kwargs: Any) -> Any:
        if armed["step"] is not None:
            print(f"mid-write {armed['step']}", flush=True)
            time.sleep(3600)
        return save_optimizer(self, *args, **kwargs)

    TorchDCPBackend.save_optimizer = hang_mid_write  # type: ignore[method-assign]
    for step in range(1, int(kill_step) + 1):
        train_step(model, optimizer, scheduler)
        torch.save(snapshot(model, optimizer, scheduler), Path(refs) / f"step_{step}.pt")
        armed["step"] = step if step == int(kill_step) else None
        manager.save_checkpoint(local_path(Path(root), step), None, step, max_ckpt_to_keep=2)
        trainer_writes(Path(root), step)
        print(f"saved {step}", flush=True)


def resume_child(root: str, refs: str) -> None:
    """A restarted worker: verl's `find_latest_ckpt_path`, a new adapter, `load_checkpoint`;
    reports how the restored state and one more step differ from the references."""
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    if sys.stdin.readline() != "go\n":
        return  # the test is gone. The child starts early, so its import of verl overlaps the training child
    torch.set_num_threads(1)
    random.seed(99)
    np.random.seed(99)
    model, optimizer, scheduler = build(seed=99)  # other weights and RNG states until the load
    latest = find_latest_ckpt_path(root)
    manager = LifecycleCheckpointManager(model, optimizer, scheduler)
    manager.load_checkpoint(os.path.join(latest, ROLE), None, False)
    loaded = differences(snapshot(model, optimizer, scheduler), torch.load(Path(refs) / "step_2.pt"))
    train_step(model, optimizer, scheduler)
    stepped = differences(snapshot(model, optimizer, scheduler), torch.load(Path(refs) / "step_3.pt"))
    manager.save_checkpoint(local_path(Path(root), 3), None, 3, max_ckpt_to_keep=2)
    trainer_writes(Path(root), 3)
    print(json.dumps({"latest": latest, "loaded": loaded, "stepped": stepped}), flush=True)


def start(tmp_path: Path, timeout_s: float, *args: str, stdin: int | None = subprocess.DEVNULL) -> Child:
    return Child.spawn(["-c", CHILD.format(repo=str(REPO)), *args], tmp_path / f"{args[0]}.stderr", timeout_s,
                       cwd=REPO, stdin=stdin)


def read_until(child: Child, wanted: str) -> list[str]:
    """The child's lines up to and including `wanted` (the watchdog ends a child that hangs)."""
    assert child.proc.stdout is not None
    lines: list[str] = []
    while not lines or lines[-1] != wanted:
        line = child.proc.stdout.readline()
        if not line:
            child.fail(f"child ended (code {child.proc.poll()}) after {lines}, before {wanted!r}")
        lines.append(line.strip())
    return lines


def manager(seed: int = 0, **kwargs: Any) -> tuple[LifecycleCheckpointManager, nn.Module]:
    model, optimizer, scheduler = build(seed)
    return LifecycleCheckpointManager(model, optimizer, scheduler, **kwargs), model


def steps_on_disk(root: Path) -> list[int]:
    return CheckpointStore(root).steps()


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="needs SIGKILL")
def test_sigkill_mid_save_resumes_the_last_committed_step_bit_for_bit_through_verls_own_lookup(
    tmp_path: Path,
) -> None:
    root, refs = tmp_path / "ckpt", tmp_path / "refs"
    refs.mkdir()
    resumed = start(tmp_path, TRAIN_TIMEOUT_S + RESUME_TIMEOUT_S, "resume_child", str(root), str(refs),
                    stdin=subprocess.PIPE)  # imports verl meanwhile; resumes only once told to go
    child = start(tmp_path, TRAIN_TIMEOUT_S, "train_child", str(root), str(refs), "3")
    assert read_until(child, "mid-write 3") == ["saved 1", "saved 2", "mid-write 3"]
    child.proc.send_signal(signal.SIGKILL)
    assert child.finish() == -signal.SIGKILL

    store = CheckpointStore(root)
    assert (root / "global_step_3" / f".staging-{ROLE}" / "model").is_dir()  # killed mid-write
    assert not (root / "global_step_3" / ROLE).exists()
    assert store.read_tracker() == 2 and store.newest_committed([ROLE]) == 2
    assert store.validate(2, ROLE, deep=True) == []

    resumed.go()
    rc = resumed.proc.wait()
    assert resumed.proc.stdout is not None
    if rc != 0:
        resumed.fail(f"resume child exited with {rc}")
    report = json.loads(resumed.proc.stdout.read().strip().splitlines()[-1])
    resumed.end()
    assert report["latest"] == str(root / "global_step_2")
    assert report["loaded"] == [], "model, optimizer, scheduler or RNG state differ from step 2's"
    assert report["stepped"] == [], "one more step differs from the uninterrupted run's step 3"
    assert steps_on_disk(root) == [2, 3] and store.read_tracker() == 3
    assert store.validate(3, ROLE, deep=True) == []
    assert not list(root.glob("global_step_*.*")), "the half-written step 3 left nothing set aside"
    assert (root / "global_step_2" / "data.pt").is_file()


def test_verls_find_latest_ckpt_path_finds_the_adapters_newest_step(tmp_path: Path) -> None:
    verl = pytest.importorskip(VERL)
    from omegaconf import OmegaConf
    from verl.trainer.config import CheckpointConfig

    for config in (CheckpointConfig(save_contents=["model", "optimizer", "extra", "hf_model"]),
                   OmegaConf.create({"save_contents": ["model", "optimizer", "extra"],
                                     "load_contents": "${.save_contents}", "async_save": False})):
        root = tmp_path / type(config).__name__
        ckpt, _ = manager(checkpoint_config=config)
        assert verl.find_latest_ckpt_path(str(root)) is None
        for step in (1, 2):
            ckpt.save_checkpoint(local_path(root, step), None, step, None)
            assert verl.find_latest_ckpt_path(str(root)) == (str(root / f"global_step_{step - 1}") if step > 1 else None)
            trainer_writes(root, step)  # the tracker is verl's trainer's to write (async_save false)
            assert verl.find_latest_ckpt_path(str(root)) == str(root / f"global_step_{step}")
        contents = CheckpointStore(root).read_manifest(2, ROLE)["contents"]
        assert sorted(contents) == sorted(ckpt.checkpoint_save_contents)


def test_max_ckpt_to_keep_counts_the_steps_on_disk_across_adapter_instances(tmp_path: Path) -> None:
    first, _ = manager()
    for step in (1, 2, 3):
        first.save_checkpoint(local_path(tmp_path, step), global_step=step)  # None: keep every step
    assert steps_on_disk(tmp_path) == [1, 2, 3]
    restarted, _ = manager()  # verl's in-memory list would know of no earlier step here
    restarted.save_checkpoint(local_path(tmp_path, 4), global_step=4, max_ckpt_to_keep=2)
    assert steps_on_disk(tmp_path) == [3, 4]
    restarted.save_checkpoint(local_path(tmp_path, 5), global_step=5, max_ckpt_to_keep=0)  # 0: keep all, as verl
    assert steps_on_disk(tmp_path) == [3, 4, 5]
    assert CheckpointStore(tmp_path).read_tracker() is None  # verl's trainer writes it, after every role


def test_data_pt_and_the_trainers_tracker_beside_the_role_folders_change_nothing(tmp_path: Path) -> None:
    ckpt, model = manager()
    for step in (1, 2, 3):
        ckpt.save_checkpoint(local_path(tmp_path, step), None, step, 2)
        trainer_writes(tmp_path, step)
    assert steps_on_disk(tmp_path) == [2, 3]  # retention removed step 1, its data.pt with it
    store = CheckpointStore(tmp_path)
    assert store.validate(3, ROLE, deep=True) == [] and store.read_tracker() == 3
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    again, other = manager(seed=1)
    again.load_checkpoint(local_path(tmp_path, 3))
    assert differences(other.state_dict(), weights) == []
    assert (tmp_path / "global_step_3" / "data.pt").is_file()


def test_loading_an_older_step_of_the_configured_root_sets_the_newer_ones_aside_and_points_the_tracker_at_it(
    tmp_path: Path,
) -> None:
    """A rollback (verl's resume_from_path into the run's own root): verl's next automatic
    resume must not find the abandoned line through a tracker that names a step no longer
    there. Nothing is deleted: a step with no committed role is set aside like the others."""
    ckpt, _ = manager()
    for step in (1, 2, 3):
        ckpt.save_checkpoint(local_path(tmp_path, step), None, step)
        trainer_writes(tmp_path, step)
    (tmp_path / "global_step_4" / ".staging-critic").mkdir(parents=True)  # another role's save, in progress
    (tmp_path / "global_step_4" / ".staging-critic" / "shard").write_text("half written")
    manager(lifecycle_config={"checkpoint": {"root": str(tmp_path)}})[0].load_checkpoint(local_path(tmp_path, 1))
    assert steps_on_disk(tmp_path) == [1]
    aside = sorted(tmp_path.glob("global_step_*.superseded-*"))
    assert [p.name.split(".")[0] for p in aside] == ["global_step_2", "global_step_3", "global_step_4"]
    assert (aside[2] / ".staging-critic" / "shard").read_text() == "half written"
    assert all((p / "data.pt").is_file() for p in aside[:2])
    assert CheckpointStore(tmp_path).read_tracker() == 1


def test_resuming_the_trackers_step_after_a_crash_before_the_tracker_sets_the_newer_steps_aside_at_the_first_save(
    tmp_path: Path,
) -> None:
    """Step 3 was committed but verl's trainer died before writing its tracker (it names 1), so
    verl resumes 1, without checkpoint.root. The store refuses a save below a committed step, so
    the first save into that same root sets the abandoned 2 and 3 aside (never deleted), and an
    automatic resume then takes the new line."""
    ckpt, _ = manager()
    for step in (1, 2, 3):
        ckpt.save_checkpoint(local_path(tmp_path, step), None, step)
    trainer_writes(tmp_path, 1)
    ckpt.close()
    again, _ = manager(seed=1)
    again.load_checkpoint(local_path(tmp_path, 1))
    again.save_checkpoint(local_path(tmp_path, 2), None, 2)
    assert steps_on_disk(tmp_path) == [1, 2]
    aside = sorted(p.name.split(".")[0] for p in tmp_path.glob("global_step_*.superseded-*"))
    assert aside == ["global_step_2", "global_step_3"]
    again.save_checkpoint(local_path(tmp_path, 3), None, 3)
    assert steps_on_disk(tmp_path) == [1, 2, 3] and len(list(tmp_path.glob("*.superseded-*"))) == 2
    fresh, _ = manager(seed=2)
    with pytest.raises(CheckpointError, match="cannot save step 2 .*step 3 is committed"):
        fresh.save_checkpoint(local_path(tmp_path, 2), None, 2)  # no load: nothing says 3 is abandoned


def test_a_load_through_a_symlinked_spelling_of_the_root_still_sets_the_abandoned_steps_aside(tmp_path: Path) -> None:
    """The same crash as above, with the load's path spelled through a link to the root: the
    roots were compared as text, so the first save was refused instead."""
    root = tmp_path / "root"
    ckpt, _ = manager()
    for step in (1, 2, 3):
        ckpt.save_checkpoint(local_path(root, step), None, step)
    trainer_writes(root, 1)
    ckpt.close()
    (tmp_path / "link").symlink_to(root)
    again, _ = manager(seed=1)
    again.load_checkpoint(local_path(tmp_path / "link", 1))
    again.save_checkpoint(local_path(root, 2), None, 2)
    assert steps_on_disk(root) == [1, 2] and len(list(root.glob("global_step_*.superseded-*"))) == 2


def files_under(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_loading_from_another_runs_root_changes_nothing_there(tmp_path: Path) -> None:
    """verl's resume_mode=resume_path with resume_from_path in another experiment: run B loads
    run A's step 1. Without checkpoint.root, or with B's own, nothing of A's moves: not its newer
    steps, not another role's save in progress, not its tracker."""
    run_a, run_b = tmp_path / "runA", tmp_path / "runB"
    ckpt, model = manager()
    for step in (1, 2, 3):
        ckpt.save_checkpoint(local_path(run_a, step), None, step)
        trainer_writes(run_a, step)
    (run_a / "global_step_4" / ".staging-critic").mkdir(parents=True)
    (run_a / "global_step_4" / "data.pt").write_text("x")
    ckpt.close()
    before = files_under(run_a)
    dirs = sorted(p.name for p in run_a.iterdir())
    for config in (None, {"checkpoint": {"root": str(run_b)}}):
        loader, other = manager(seed=1, lifecycle_config=config)
        loader.load_checkpoint(local_path(run_a, 1))
        loader.close()
        assert files_under(run_a) == before and sorted(p.name for p in run_a.iterdir()) == dirs
    assert not run_b.exists()


def test_the_tracker_is_verls_trainers_unless_async_save_and_then_waits_for_every_listed_role(
    tmp_path: Path,
) -> None:
    """A crash after the actor's save of step 2 and before the critic's: the tracker must still
    name step 1, so that verl's find_latest_ckpt_path never names a step the critic lacks.
    Without async_save the managers leave it to verl's trainer (no roles listed needed); with
    it, they write it once the step is complete for checkpoint.roles."""
    for async_save in (False, True):
        root = tmp_path / f"async_{async_save}"
        listed = {"checkpoint": {"roles": ["actor", "critic"]}} if async_save else None
        made = {role: manager(checkpoint_config={"async_save": async_save}, lifecycle_config=listed)[0]
                for role in ("actor", "critic")}
        for role, ckpt in made.items():
            ckpt.save_checkpoint(local_path(root, 1, role), None, 1)
            ckpt.wait()
        if not async_save:
            trainer_writes(root, 1)
        made["actor"].save_checkpoint(local_path(root, 2, "actor"), None, 2)
        made["actor"].wait()
        assert CheckpointStore(root).read_tracker() == 1
        made["critic"].save_checkpoint(local_path(root, 2, "critic"), None, 2)
        made["critic"].wait()
        assert CheckpointStore(root).read_tracker() == (2 if async_save else 1)
        for ckpt in made.values():
            ckpt.close()


def test_the_actors_max_ckpt_to_keep_never_removes_the_critics_checkpoints(tmp_path: Path) -> None:
    """verl: max_actor_ckpt_to_keep=1, max_critic_ckpt_to_keep=None. Retention is per role, as
    verl's own managers' is; a step folder (its data.pt with it) goes with the last role's folder,
    and the step the trainer's tracker names stays whole, so a crash between the two roles' saves
    leaves a step both can resume."""
    actor, critic = manager()[0], manager(seed=1)[0]
    for step in (1, 2):
        actor.save_checkpoint(local_path(tmp_path, step, "actor"), None, step, 1)
        critic.save_checkpoint(local_path(tmp_path, step, "critic"), None, step, None)
        trainer_writes(tmp_path, step)
    actor.save_checkpoint(local_path(tmp_path, 3, "actor"), None, 3, 1)  # the critic's save of 3 then crashes
    store = CheckpointStore(tmp_path)
    assert sorted(p.name for p in store.step_dir(1).iterdir()) == ["critic", "data.pt"]
    assert sorted(p.name for p in store.step_dir(2).iterdir()) == ["actor", "critic", "data.pt"]
    assert all(store.validate(step, role, deep=True) == [] for step, role in [(1, "critic"), (2, "actor"),
                                                                               (2, "critic"), (3, "actor")])
    critic.save_checkpoint(local_path(tmp_path, 3, "critic"), None, 3, 1)
    assert steps_on_disk(tmp_path) == [2, 3]  # 2 is the tracker's until the trainer writes 3
    trainer_writes(tmp_path, 3)
    for role, ckpt in (("actor", actor), ("critic", critic)):
        ckpt.save_checkpoint(local_path(tmp_path, 4, role), None, 4, 1)
    assert steps_on_disk(tmp_path) == [3, 4]


def test_numpy_integers_are_taken_for_global_step_and_max_ckpt_to_keep_and_bools_are_refused(
    tmp_path: Path,
) -> None:
    ckpt, _ = manager()
    for step in (1, 2):
        ckpt.save_checkpoint(local_path(tmp_path, step), None, np.int64(step), np.int64(1))
    assert steps_on_disk(tmp_path) == [2]
    with pytest.raises(ConfigError, match="max_ckpt_to_keep: must be None or an integer >= 0, got True"):
        ckpt.save_checkpoint(local_path(tmp_path, 3), None, 3, True)
    with pytest.raises(CheckpointError, match="step must be an integer from 0"):
        ckpt.save_checkpoint(local_path(tmp_path, 1), None, True, None)


def test_a_bytes_local_path_is_refused_naming_it(tmp_path: Path) -> None:
    path = os.fsencode(local_path(tmp_path, 1))
    with pytest.raises(CheckpointError, match="local_path must be a str path .*got bytes"):
        StepPath.parse(path)
    with pytest.raises(CheckpointError, match="local_path must be a str path"):
        manager()[0].save_checkpoint(path, None, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["global_step_1", "step_1/actor", "global_step_01/actor",
                                 "global_step_1/.staging-actor", "global_step_x/actor", ""])
def test_a_path_that_is_not_root_global_step_n_role_is_refused_naming_it(tmp_path: Path, bad: str) -> None:
    ckpt, _ = manager()
    path = str(tmp_path / bad) if bad else bad
    with pytest.raises(CheckpointError, match="local_path" if not bad else "verl checkpoint path") as saving:
        ckpt.save_checkpoint(path, None, 1)
    with pytest.raises(CheckpointError) as loading:
        ckpt.load_checkpoint(path)
    if bad:
        assert path in str(saving.value) and path in str(loading.value)
    assert not list(tmp_path.rglob("global_step_*/*")), "nothing written"


def test_a_global_step_other_than_the_paths_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    ckpt, _ = manager()
    with pytest.raises(CheckpointError, match=r"global_step_5/actor: the path is for step 5 but global_step is 4"):
        ckpt.save_checkpoint(local_path(tmp_path, 5), None, 4)
    assert not tmp_path.joinpath("global_step_5").exists() and not tmp_path.joinpath("global_step_4").exists()


def test_hdfs_paths_are_refused_by_save_and_load(tmp_path: Path) -> None:
    ckpt, _ = manager()
    for call in (lambda: ckpt.save_checkpoint(local_path(tmp_path, 1), "hdfs://nn/ckpt/global_step_1/actor", 1),
                 lambda: ckpt.load_checkpoint(local_path(tmp_path, 1), "hdfs://nn/ckpt/global_step_1/actor")):
        with pytest.raises(ConfigError, match=r"hdfs_path: hdfs://nn/ckpt/global_step_1/actor: .* not supported"):
            call()
    assert not tmp_path.joinpath("global_step_1").exists()


def test_a_corrupted_or_uncommitted_step_is_refused_naming_the_file_and_the_model_is_untouched(
    tmp_path: Path,
) -> None:
    ckpt, _ = manager()
    ckpt.save_checkpoint(local_path(tmp_path, 1), None, 1)
    [data] = (tmp_path / "global_step_1" / ROLE / "model").glob("*.distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    fresh, model = manager(seed=7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=f"{data}.*checksum"):
        fresh.load_checkpoint(local_path(tmp_path, 1))
    assert differences(model.state_dict(), before) == []
    assert fresh.lifecycle is None  # released; the next call starts a new one
    (tmp_path / "global_step_2" / ".staging-actor").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"global_step_2/actor: resume.path is neither a committed"):
        fresh.load_checkpoint(local_path(tmp_path, 2))


def test_none_local_paths_are_no_ops_and_del_local_after_load_keeps_the_local_checkpoint(tmp_path: Path) -> None:
    ckpt, _ = manager()
    ckpt.save_checkpoint(None, None, 1)
    ckpt.load_checkpoint(None)
    assert ckpt.lifecycle is None
    ckpt.save_checkpoint(local_path(tmp_path, 1), None, 1)
    ckpt.load_checkpoint(local_path(tmp_path, 1), None, del_local_after_load=True)
    assert CheckpointStore(tmp_path).validate(1, ROLE, deep=True) == []
    ckpt.save_checkpoint(local_path(tmp_path, 2), None, 2)  # a save after a load: a new machine, READY
    assert ckpt.lifecycle is not None and ckpt.lifecycle.state is State.READY


def test_a_failed_save_leaves_the_previous_step_and_the_next_save_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from backends.torch_dcp import TorchDCPBackend

    ckpt, _ = manager()
    ckpt.save_checkpoint(local_path(tmp_path, 1), None, 1)

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(TorchDCPBackend, "save_optimizer", disk_full)
    with pytest.raises(CheckpointError, match="No space left on device"):
        ckpt.save_checkpoint(local_path(tmp_path, 2), None, 2)
    store = CheckpointStore(tmp_path)
    assert store.newest_complete([ROLE]) == 1 and not (tmp_path / "global_step_2" / ROLE).exists()
    assert not (tmp_path / "global_step_2" / f".staging-{ROLE}").exists()
    monkeypatch.undo()
    ckpt.save_checkpoint(local_path(tmp_path, 2), None, 2)
    assert store.newest_complete([ROLE]) == 2 and store.validate(2, ROLE, deep=True) == []


def test_async_save_commits_in_the_background_and_the_tracker_follows_the_commit(tmp_path: Path) -> None:
    ckpt, _ = manager(checkpoint_config={"async_save": True})
    for step in (1, 2):
        ckpt.save_checkpoint(local_path(tmp_path, step), None, step, 1)
    ckpt.wait()
    assert steps_on_disk(tmp_path) == [2] and CheckpointStore(tmp_path).read_tracker() == 2
    ckpt.close()
    assert (tmp_path / "global_step_2" / ROLE / MANIFEST).is_file()


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"lifecycle_config": {"checkpoint": {"pre_load": {"path": "/weights"}}}}, "checkpoint.pre_load.path"),
    ({"lifecycle_config": {"resume": {"mode": "disable"}}}, "resume.mode"),
    ({"lifecycle_config": {"checkpoint": {"save": "hf"}}}, "checkpoint.save"),
    ({"lifecycle_config": {"checkpoint": {"save": {"format": "nope"}}}}, "checkpoint.save.format"),
    ({"checkpoint_config": {"save_contents": ["model", "tokenizer"]}}, "checkpoint_config.save_contents"),
    ({"checkpoint_config": {"save_lora_only": True}}, "checkpoint_config.save_lora_only"),
])
def test_config_that_cannot_work_is_refused_at_construction(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        manager(**kwargs)


@pytest.mark.parametrize(("checkpoint_config", "key", "problem"), [
    (5, "checkpoint_config", "expected a mapping"),
    ([{"save_contents": ["model"]}], "checkpoint_config", "expected a mapping"),
    ({"save_contents": 5}, "checkpoint_config.save_contents", "expected a list of names"),
    ({"save_contents": "model"}, "checkpoint_config.save_contents", "expected a list of names"),
    ({"load_contents": ["model", None]}, "checkpoint_config.load_contents", "expected a list of names"),
    ({"async_save": "false"}, "checkpoint_config.async_save", "expected a boolean, got 'false' .*give true or false"),
    ({"async_save": 1}, "checkpoint_config.async_save", "expected a boolean"),
    ({"save_lora_only": "false"}, "checkpoint_config.save_lora_only", "expected a boolean"),
])
def test_a_checkpoint_config_of_the_wrong_shape_or_type_is_refused_naming_the_key(
        checkpoint_config: Any, key: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem) as refused:
        manager(checkpoint_config=checkpoint_config)
    assert refused.value.key == key


@pytest.mark.parametrize(("argument", "data", "key", "problem"), [
    ("checkpoint_config", {"save_contents": "???"}, "checkpoint_config.save_contents", "missing"),
    ("checkpoint_config", {"async_save": "???"}, "checkpoint_config.async_save", "missing"),
    ("checkpoint_config", {"load_contents": ["model", "???"]}, "checkpoint_config.load_contents[1]", "missing"),
    ("checkpoint_config", {"save_contents": "${nope}"}, "checkpoint_config.save_contents", "interpolation"),
    ("lifecycle_config", {"checkpoint": {"keep_last": "???"}}, "checkpoint.keep_last", "missing"),
    ("lifecycle_config", {"checkpoint": {"keep_last": "${trainer.k}"}}, "checkpoint.keep_last", "interpolation"),
    ("lifecycle_config", {"checkpoint": {"keep_last": "${oc.env:LIFECYCLE_TEST_UNSET}"}}, "checkpoint.keep_last",
     "interpolation.*LIFECYCLE_TEST_UNSET"),
])
def test_an_omegaconf_missing_value_or_broken_interpolation_is_refused_naming_the_key(
        argument: str, data: dict[str, Any], key: str, problem: str, monkeypatch: pytest.MonkeyPatch) -> None:
    omegaconf = pytest.importorskip("omegaconf")
    monkeypatch.delenv("LIFECYCLE_TEST_UNSET", raising=False)
    with pytest.raises(ConfigError, match=problem) as refused:
        manager(**{argument: omegaconf.OmegaConf.create(data)})
    assert refused.value.key == key


def test_an_omegaconf_section_inside_a_plain_lifecycle_config_is_resolved_and_refused_naming_its_key() -> None:
    omegaconf = pytest.importorskip("omegaconf")
    with pytest.raises(ConfigError, match="missing") as refused:
        manager(lifecycle_config={"checkpoint": omegaconf.OmegaConf.create({"keep_last": "???"})})
    assert refused.value.key == "checkpoint.keep_last"


def test_async_save_from_an_env_interpolation_is_refused_as_a_string_and_taken_once_decoded_to_a_bool(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    omegaconf = pytest.importorskip("omegaconf")
    monkeypatch.setenv("LIFECYCLE_TEST_ASYNC_SAVE", "false")
    as_string = omegaconf.OmegaConf.create({"async_save": "${oc.env:LIFECYCLE_TEST_ASYNC_SAVE}"})
    with pytest.raises(ConfigError, match="async_save: expected a boolean, got 'false'"):
        manager(checkpoint_config=as_string)
    decoded = omegaconf.OmegaConf.create({"async_save": "${oc.decode:${oc.env:LIFECYCLE_TEST_ASYNC_SAVE}}"})
    ckpt, _ = manager(checkpoint_config=decoded)
    ckpt.save_checkpoint(local_path(tmp_path, 1), None, 1)
    ckpt.close()
    assert not (tmp_path / TRACKER).exists(), "the manager writes the tracker only under async_save"


@dataclass
class VerlStyleCheckpointConfig:
    """A dataclass like verl's `CheckpointConfig`, but not a Mapping (as verl's is)."""

    save_contents: tuple[str, ...] = ("model", "optimizer")
    load_contents: tuple[str, ...] = ("model",)
    async_save: bool = False


def test_a_dataclass_or_an_omegaconf_checkpoint_config_gives_its_resolved_contents() -> None:
    ckpt, _ = manager(checkpoint_config=VerlStyleCheckpointConfig())
    assert (ckpt.checkpoint_save_contents, ckpt.checkpoint_load_contents) == (["model", "optimizer"], ["model"])
    omegaconf = pytest.importorskip("omegaconf")
    config = omegaconf.OmegaConf.create({"names": ["model", "optimizer", "extra"], "save_contents": "${names}"})
    ckpt, _ = manager(checkpoint_config=config)
    assert ckpt.checkpoint_save_contents == ckpt.checkpoint_load_contents == ["model", "optimizer", "extra"]


def test_a_configured_root_other_than_the_paths_and_a_bad_max_ckpt_to_keep_are_refused(tmp_path: Path) -> None:
    ckpt, _ = manager(lifecycle_config={"checkpoint": {"root": str(tmp_path / "elsewhere")}})
    with pytest.raises(ConfigError, match="checkpoint.root: .*elsewhere differs"):
        ckpt.save_checkpoint(local_path(tmp_path, 1), None, 1)
    assert not tmp_path.joinpath("elsewhere").exists()
    with pytest.raises(ConfigError, match="max_ckpt_to_keep"):
        manager()[0].save_checkpoint(local_path(tmp_path, 1), None, 1, max_ckpt_to_keep=1.5)
    assert not tmp_path.joinpath("global_step_1").exists()


@pytest.mark.parametrize("remote", ["hdfs://namenode:8020/user/ckpt/global_step_3/actor",
                                    "s3://bucket/ckpt/global_step_3/actor", "~/ckpt/global_step_3/actor"])
def test_a_url_or_an_unexpanded_home_as_local_path_is_refused_and_nothing_is_written(
        tmp_path: Path, remote: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="not a local path: a URL or an unexpanded '~'"):
        manager()[0].save_checkpoint(remote, None, 3)
    assert list(tmp_path.iterdir()) == []


def test_step_path_reads_root_step_and_role_from_verls_local_path(tmp_path: Path) -> None:
    where = StepPath.parse(str(tmp_path / "run" / "global_step_12" / "critic") + "/")
    assert (where.root, where.step, where.role) == (tmp_path / "run", 12, "critic")
    assert where.folder == tmp_path / "run" / "global_step_12" / "critic"


def test_the_adapter_imports_and_saves_without_verl(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "class NoVerl:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'verl' or name.startswith('verl.'): raise ImportError('verl is not installed')\n"
        "sys.meta_path.insert(0, NoVerl())\n"
        "import torch\n"
        "from lifecycle.integrations.verl_checkpoint import LifecycleCheckpointManager\n"
        "m = torch.nn.Linear(2, 2)\n"
        "LifecycleCheckpointManager(m, torch.optim.SGD(m.parameters(), lr=0.1)).save_checkpoint(sys.argv[1], None, 1)\n"
        "assert not any(k == 'verl' or k.startswith('verl.') for k in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, local_path(tmp_path, 1)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert CheckpointStore(tmp_path).validate(1, ROLE, deep=True) == []


def test_a_missing_value_in_the_sub_node_verl_passes_is_named_from_that_node() -> None:
    """verl hands over `actor_rollout_ref.actor.checkpoint`, a node of its whole config, whose
    errors name keys from the config's root."""
    from omegaconf import OmegaConf

    root = OmegaConf.create({"actor_rollout_ref": {"actor": {"checkpoint": {"save_contents": ["model"],
                                                                            "async_save": "???"}}}})
    with pytest.raises(ConfigError, match="missing") as refused:
        manager(checkpoint_config=root.actor_rollout_ref.actor.checkpoint)
    assert refused.value.key == "checkpoint_config.async_save"
