"""The save path under hostile conditions: an extra state a resume could never read,
`flock` and `close` failing the way network filesystems fail them, a rank failing alone before
the step agreement, an async save of state that cannot be copied, a save refused for its step
number, step numbers that are no step numbers, retention beside the trainer's tracker and
another checkpoint manager's folders, and a model-config hash that must not follow
PYTHONHASHSEED."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs
from torch import nn

import lifecycle.extra as extra
import lifecycle.writer_lock as writer_lock
from lifecycle import CheckpointError, Lifecycle, State
from lifecycle.boundary import TRACKER
from lifecycle.checkpointer import model_config_hash
from lifecycle.jsontree import NotSerializable
from lifecycle.manifest import MANIFEST
from lifecycle.store import CheckpointStore
from lifecycle.types import Parts
from lifecycle.writer_lock import WriterLock
from tests.backends.dist_util import run_ranks
from tests.lifecycle.hostile import ROLE, Net, fill, has_weights_of, lifecycle_at

REPO = Path(__file__).resolve().parents[2]


class _Loader:
    """A dataloader whose position is whatever `state` holds."""

    def __init__(self, size: int) -> None:
        self.state: dict[str, Any] = {"order": "x" * size}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def _with_loader(root: Path, loader: _Loader, keep_last: int | None = 1) -> Lifecycle:
    model = Net()
    return Lifecycle({"checkpoint": {"root": str(root), "keep_last": keep_last}}, role=ROLE, model=model,
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataloader=loader)


def _no_locks(fd: int, op: int) -> None:
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))


# E1 -------------------------------------------------------------------------------------------

def test_save_refuses_extra_state_over_the_json_limit_before_its_commit_and_keeps_the_resumable_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(extra, "JSON_LIMIT", 200_000)
    loader = _Loader(150_000)  # a legitimate state near the limit still saves
    lc = _with_loader(tmp_path, loader)
    lc.init_load()
    fill(lc.parts.model, 1)
    lc.save(1)
    loader.state = {"order": "x" * 250_000}
    fill(lc.parts.model, 2)
    with pytest.raises(CheckpointError, match=r"extra\.json: extra state is \d+ bytes encoded, over the 200000 "
                                              r"a resume reads \(dataloader state \d+ bytes"):
        lc.save(2)
    store = CheckpointStore(tmp_path)
    assert store.newest_complete([ROLE]) == 1 and not (tmp_path / "global_step_2" / ROLE).exists()
    again = _with_loader(tmp_path, _Loader(0))
    assert again.resume() == 1 and has_weights_of(again.parts.model, 1)


# E2 -------------------------------------------------------------------------------------------

def test_writer_lock_turns_flock_enolck_into_a_checkpoint_error_naming_the_lock_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_lock.fcntl, "flock", _no_locks)
    lock = WriterLock(tmp_path, ROLE)
    with pytest.raises(CheckpointError, match=r"\.lock-actor: cannot lock the writer lock of role 'actor': .*ENOLCK"):
        lock.acquire()
    assert not lock.held


def test_resume_skips_tidying_when_flock_fails_enolck_and_resumes_the_committed_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lc = lifecycle_at(tmp_path)
    lc.init_load()
    fill(lc.parts.model, 1)
    lc.save(1)
    lc.close()
    (tmp_path / "global_step_2" / ".staging-actor").mkdir(parents=True)  # a crashed save's leftover
    monkeypatch.setattr(writer_lock.fcntl, "flock", _no_locks)
    again = lifecycle_at(tmp_path)
    with capture_logs() as logs:
        assert again.resume() == 1 and has_weights_of(again.parts.model, 1)
    skipped = [r for r in logs if r["event"] == "checkpoint.tidy_skipped"]
    assert len(skipped) == 1 and skipped[0]["path"] == str(tmp_path / ".lock-actor") and skipped[0]["errno"] == "ENOLCK"
    assert skipped[0]["log_level"] == "warning"
    with pytest.raises(CheckpointError, match=r"\.lock-actor: cannot lock .*ENOLCK"):
        again.save(3)


def test_resume_of_a_role_ahead_when_flock_fails_enolck_in_abandon_line_resumes_the_common_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    roles = ["actor", "critic"]
    for role in roles:
        lc = lifecycle_at(tmp_path, role=role, roles=roles)
        lc.init_load()
        fill(lc.parts.model, 1)
        lc.save(1)
        lc.close()
    ahead = lifecycle_at(tmp_path, role="actor", roles=roles)
    ahead.init_load()
    fill(ahead.parts.model, 2)
    ahead.save(2)
    ahead.close()
    monkeypatch.setattr(writer_lock.fcntl, "flock", _no_locks)
    again = lifecycle_at(tmp_path, role="actor", roles=roles)
    with capture_logs() as logs:
        assert again.resume() == 1 and again.state is State.READY
    kept = [r for r in logs if r["event"] == "checkpoint.abandoned_line_not_moved"]
    assert len(kept) == 1 and kept[0]["path"] == str(tmp_path / ".lock-actor") and kept[0]["errno"] == "ENOLCK"
    assert kept[0]["held"] is False


# E3 -------------------------------------------------------------------------------------------

def _save_step_1_on_both_ranks(root: Path) -> None:
    import torch.distributed as dist

    lc = lifecycle_at(root)
    lc.init_load()
    fill(lc.parts.model, 1)
    lc.save(1)
    lc.close()
    dist.barrier()


def _rank1_out_of_descriptors_when_listing(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any]:
    import lifecycle.store as store_module

    root = tmp_path / "ckpt"
    _save_step_1_on_both_ranks(root)
    if rank == 1:
        real = os.scandir

        def scandir(path: Any = ".") -> Any:
            if Path(path) == root:
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), str(path))
            return real(path)

        store_module.os.scandir = scandir  # type: ignore[assignment]
    started, error = time.monotonic(), None
    try:
        lifecycle_at(root).resume()
    except CheckpointError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "seconds": time.monotonic() - started}


def test_a_rank_out_of_descriptors_before_the_step_agreement_stops_every_rank_with_a_checkpoint_error(
    tmp_path: Path,
) -> None:
    ranks = run_ranks(_rank1_out_of_descriptors_when_listing, tmp_path, world_size=2, timeout_s=480)  # group: 240 s
    assert ranks[1]["error"].startswith("OutOfResources") and "EMFILE" in ranks[1]["error"]
    assert ranks[0]["error"] is not None and "another rank cannot list the committed steps" in ranks[0]["error"]
    assert all(r["seconds"] < 60 for r in ranks), "no rank waited for the process group's timeout (240 s)"


def _rank0_flock_enolck_in_tidy(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any]:
    import fcntl

    import torch.distributed as dist

    root = tmp_path / "ckpt"
    _save_step_1_on_both_ranks(root)
    if rank == 0:
        (root / "global_step_2" / ".staging-actor").mkdir(parents=True)
        fcntl.flock = _no_locks  # type: ignore[assignment]
    dist.barrier()
    lc = lifecycle_at(root)
    return {"step": lc.resume(), "exact": has_weights_of(lc.parts.model, 1)}


def test_two_ranks_resume_the_committed_step_when_rank0_flock_fails_enolck_while_tidying(tmp_path: Path) -> None:
    ranks = run_ranks(_rank0_flock_enolck_in_tidy, tmp_path, world_size=2, timeout_s=60)
    assert ranks == [{"step": 1, "exact": True}] * 2


# E4 -------------------------------------------------------------------------------------------

class _GuardedState(nn.Module):
    """A module whose extra state holds a lock, which neither JSON nor deepcopy takes."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2, 2))
        self.guard = threading.Lock()

    def get_extra_state(self) -> Any:
        return {"guard": self.guard}

    def set_extra_state(self, state: Any) -> None:
        pass


def test_async_save_refuses_uncopyable_extra_state_as_not_serializable_naming_the_key(tmp_path: Path) -> None:
    model = _GuardedState()
    lc = Lifecycle({"checkpoint": {"root": str(tmp_path), "save": {"async": True}}}, role=ROLE, model=model,
                   optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    lc.init_load()
    with pytest.raises(NotSerializable, match=r"value at model\._extra_state\.guard of type lock") as caught:
        lc.save(1)
    assert caught.value.key == "model._extra_state.guard"


def test_async_save_refuses_a_param_group_holding_an_uncopyable_object_as_not_serializable(tmp_path: Path) -> None:
    model = Net()
    optimizer = torch.optim.SGD([{"params": model.parameters(), "guard": threading.Lock()}], lr=0.1)
    lc = Lifecycle({"checkpoint": {"root": str(tmp_path), "save": {"async": True}}}, role=ROLE, model=model,
                   optimizer=optimizer)
    lc.init_load()
    with pytest.raises(NotSerializable, match=r"value at optimizer\.group0\.guard of type lock"):
        lc.save(1)
    assert CheckpointStore(tmp_path).newest_complete([ROLE]) is None


# E5 -------------------------------------------------------------------------------------------

class _CloseFails:
    """`os` whose `close` closes, then reports a deferred write error, as NFS may."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def close(fd: int) -> None:
        os.close(fd)
        raise OSError(errno.EIO, os.strerror(errno.EIO))


def test_committed_save_is_reported_saved_when_closing_the_writer_lock_fails_with_eio(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lc = lifecycle_at(tmp_path)
    lc.init_load()
    fill(lc.parts.model, 1)
    monkeypatch.setattr(writer_lock, "os", _CloseFails())
    with capture_logs() as logs:
        info = lc.save(1)
    assert info.step == 1 and lc.state is State.READY
    warned = [r for r in logs if r["event"] == "checkpoint.writer_lock_close_failed"]
    assert warned and warned[0]["path"].endswith(".lock-actor") and "Input/output error" in warned[0]["error"]
    monkeypatch.undo()
    fill(lc.parts.model, 2)
    lc.save(2)  # the lock was dropped with its descriptor
    assert CheckpointStore(tmp_path).newest_complete([ROLE]) == 2


# H1 -------------------------------------------------------------------------------------------

def test_save_of_a_step_behind_a_committed_one_is_refused_before_the_lifecycle_moves_and_keeps_it_ready(
    tmp_path: Path,
) -> None:
    lc = lifecycle_at(tmp_path)
    lc.init_load()
    fill(lc.parts.model, 3)
    lc.save(3)
    fill(lc.parts.model, 5)  # steps 4 and 5, trained in memory
    with pytest.raises(CheckpointError, match="cannot save step 2 .role actor.: step 3 is committed"):
        lc.save(2)
    assert lc.state is State.READY
    lc.save(5)
    again = lifecycle_at(tmp_path)
    assert again.resume() == 5 and has_weights_of(again.parts.model, 5)


def _rank0_sees_step_3_committed(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any]:
    import torch.distributed as dist

    root = tmp_path / "ckpt"
    lc = lifecycle_at(root)
    lc.init_load()
    lc.save(3)
    dist.barrier()
    try:
        lc.save(2)
        error = None
    except CheckpointError as exc:
        error = str(exc)
    return {"error": error, "state": lc.state.name}


def test_two_ranks_both_refuse_a_save_behind_a_committed_step_and_stay_ready(tmp_path: Path) -> None:
    ranks = run_ranks(_rank0_sees_step_3_committed, tmp_path, world_size=2, timeout_s=60)
    assert "step 3 is committed" in ranks[0]["error"] and "refused by rank 0" in ranks[1]["error"]
    assert [r["state"] for r in ranks] == ["READY", "READY"]


# H15 ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("step", [1.5, True, -3, "7", 2**70])
def test_store_refuses_a_step_that_is_no_step_number_before_creating_any_folder(tmp_path: Path, step: Any) -> None:
    store = CheckpointStore(tmp_path)
    with pytest.raises(CheckpointError, match="step must be an integer"):
        store.staging(step, ROLE)
    with pytest.raises(CheckpointError, match="step must be an integer"):
        store.commit(step, ROLE, contents={"x": "raw"})
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_store_still_takes_numpy_integer_steps(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    staging = store.staging(np.int64(7), ROLE)  # type: ignore[arg-type]
    (staging / "model").mkdir()
    (staging / "model" / "weights.bin").write_bytes(b"w" * 100)
    store.commit(np.int64(7), ROLE, contents={"model": "hf"})  # type: ignore[arg-type]
    assert json.loads((tmp_path / "global_step_7" / ROLE / MANIFEST).read_text())["step"] == 7
    assert store.steps() == [7] and store.newest_complete([ROLE]) == 7


# G1 -------------------------------------------------------------------------------------------

def test_retention_keeps_the_step_a_trainer_written_tracker_names_after_a_crash_between_two_roles(
    tmp_path: Path,
) -> None:
    def role_at(role: str) -> Lifecycle:
        model = Net()
        return Lifecycle({"checkpoint": {"root": str(tmp_path), "keep_last": 1, "tracker": False}}, role=role,
                         model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    actor, critic = role_at("actor"), role_at("critic")
    actor.init_load()
    critic.init_load()
    for step in (1, 2):
        actor.save(step)
        critic.save(step)
        (tmp_path / TRACKER).write_text(f"{step}\n")  # the trainer's, once every role saved
    actor.save(3)  # the critic's save of step 3 never comes: a crash
    store = CheckpointStore(tmp_path)
    assert store.newest_complete(["actor", "critic"]) == 2


# G5 -------------------------------------------------------------------------------------------

def test_retention_keeps_another_managers_role_folder_without_a_manifest_and_says_so_once(tmp_path: Path) -> None:
    native = tmp_path / "global_step_4" / ROLE
    native.mkdir(parents=True)
    (native / "model_world_size_1_rank_0.pt").write_bytes(b"verl's own")
    lc = lifecycle_at(tmp_path, keep_last=1)
    lc.init_load()
    with capture_logs() as logs:
        for step in (5, 6):
            fill(lc.parts.model, step)
            lc.save(step)
    assert (native / "model_world_size_1_rank_0.pt").read_bytes() == b"verl's own"
    assert CheckpointStore(tmp_path).steps() == [4, 6], "our own step 5 is still pruned"
    kept = [r for r in logs if r["event"] == "checkpoint.retention_kept"]
    assert len(kept) == 1 and kept[0]["path"] == str(native) and kept[0]["step"] == 4


def test_retention_still_removes_a_step_holding_only_a_crashed_saves_staging_folder(tmp_path: Path) -> None:
    lc = lifecycle_at(tmp_path)
    lc.init_load()
    for step in (1, 3):
        lc.save(step)
    leftover = tmp_path / "global_step_2" / ".staging-actor"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"half written")
    (tmp_path / "global_step_2" / "data.pt").write_bytes(b"trainer")
    store = CheckpointStore(tmp_path)
    assert store.apply_retention(1, [ROLE], protect=set(), role=ROLE) == [1, 2]
    assert store.steps() == [3] and (tmp_path / "global_step_3" / ROLE / MANIFEST).is_file()


# G9 -------------------------------------------------------------------------------------------

class _Described(nn.Module):
    """A model whose fingerprint is the given config."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = config

    def fingerprint(self) -> dict[str, Any]:
        return self.config


_HASH_IN_CHILD = """
import sys
from torch import nn
from lifecycle.checkpointer import model_config_hash
from lifecycle.types import Parts
class M(nn.Module):
    def fingerprint(self):
        return {"frozen_modules": {"embed_tokens", "lm_head", "norm", "q_proj", "k_proj", "v_proj", "o_proj"},
                "pairs": frozenset({("a", 1), ("b", 2), ("c", 3)}), "width": 16}
print(model_config_hash(Parts(model=M())))
"""


def test_model_config_hash_of_a_config_holding_sets_is_the_same_under_any_pythonhashseed() -> None:
    hashes = set()
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        done = subprocess.run([sys.executable, "-c", _HASH_IN_CHILD], capture_output=True, text=True, env=env,
                              cwd=REPO, timeout=120, check=True)
        hashes.add(done.stdout.strip().splitlines()[-1])
    assert len(hashes) == 1


def test_model_config_hash_of_a_config_without_sets_is_the_hash_earlier_releases_wrote() -> None:
    config = {"hidden_size": 16, "torch_dtype": torch.bfloat16, "layers": [1, 2], "rope": {"theta": 1e4},
              "name": None}
    old = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:16]
    assert model_config_hash(Parts(model=_Described(config))) == old


# Review, second pass ---------------------------------------------------------------------------

class _IntegerSets(Net):
    """A model whose config holds a set of integers, whose `str` the previous release hashed."""

    def fingerprint(self) -> dict[str, Any]:
        return {"skip_layers": {9, 10}, "width": 16}


def _with_integer_sets(root: Path) -> Lifecycle:
    model = _IntegerSets()
    return Lifecycle({"checkpoint": {"root": str(root)}, "resume": {"strict": True}}, role=ROLE, model=model,
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_step_whose_config_hash_the_previous_release_wrote_for_an_integer_set_still_resumes_strictly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lifecycle.checkpointer as checkpointer

    config = _IntegerSets().fingerprint()
    previous = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:16]
    assert model_config_hash(Parts(model=_IntegerSets())) != previous, "the sorted text differs: {10, 9}"
    monkeypatch.setattr(checkpointer, "_text", str)  # the previous release's formula
    saver = _with_integer_sets(tmp_path)
    saver.init_load()
    fill(saver.parts.model, 1)
    saver.save(1)
    saver.close()
    monkeypatch.undo()
    assert json.loads((tmp_path / "global_step_1" / ROLE / MANIFEST).read_text())["model_config_hash"] == previous
    again = _with_integer_sets(tmp_path)
    assert again.resume() == 1 and has_weights_of(again.parts.model, 1)


def test_async_save_of_a_step_behind_the_one_still_saving_in_the_background_is_refused_at_once_and_stays_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = Net()
    lc = Lifecycle({"checkpoint": {"root": str(tmp_path), "save": {"async": True}}}, role=ROLE, model=model,
                   optimizer=torch.optim.AdamW(model.parameters(), lr=0.01))  # as `lifecycle_at` resumes it
    lc.init_load()
    saver = lc.checkpointer._saver  # type: ignore[attr-defined]
    release, commit = threading.Event(), saver.commit

    def held_commit(*args: Any, **kwargs: Any) -> Any:
        release.wait(120)  # a refusal that waited for this commit would wait here, then fail the lifecycle
        return commit(*args, **kwargs)

    monkeypatch.setattr(saver, "commit", held_commit)
    fill(model, 10)
    lc.save(10)
    try:
        with pytest.raises(CheckpointError, match=r"cannot save step 5 \(role actor\): step 10 is being saved in "
                                                  r"the background"):
            lc.save(5)
        assert lc.state is State.READY and lc.checkpointer._async.background.in_flight() == 10  # type: ignore[attr-defined]
    finally:
        release.set()
    fill(model, 11)
    lc.save(11)
    lc.close()
    again = lifecycle_at(tmp_path)
    assert again.resume() == 11 and has_weights_of(again.parts.model, 11)


def test_async_save_behind_a_role_step_in_flight_that_other_roles_have_not_committed_is_not_refused_early(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = Net()
    lc = Lifecycle({"checkpoint": {"root": str(tmp_path), "roles": ["actor", "critic"], "save": {"async": True}}},
                   role=ROLE, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    lc.init_load()
    fill(model, 10)
    lc.save(10)
    lc.checkpointer.check_save(5)  # the critic has no step 10: once committed, step 10 is not every role's
    lc.close()


def _rank0_check_raises_a_foreign_error(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any]:
    lc = lifecycle_at(tmp_path / "ckpt")
    lc.init_load()
    if rank == 0:
        def broken(*args: Any) -> None:
            raise RuntimeError("a bug in the check")

        CheckpointStore.check_not_behind = broken  # type: ignore[assignment, method-assign]
    started = time.monotonic()
    try:
        lc.save(2)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "state": lc.state.name, "seconds": time.monotonic() - started}


def test_a_foreign_error_in_rank0s_save_check_stops_every_rank_at_once_typed_and_keeps_them_ready(
    tmp_path: Path,
) -> None:
    ranks = run_ranks(_rank0_check_raises_a_foreign_error, tmp_path, world_size=2, timeout_s=480)  # group: 240 s
    assert ranks[0]["error"].startswith("CheckpointError") and "RuntimeError: a bug in the check" in ranks[0]["error"]
    assert ranks[1]["error"].startswith("CheckpointError") and "refused by rank 0" in ranks[1]["error"]
    assert [r["state"] for r in ranks] == ["READY", "READY"]
    assert all(r["seconds"] < 60 for r in ranks), "no rank waited for the process group's timeout (240 s)"


def test_a_foreign_error_in_the_save_check_is_a_checkpoint_error_naming_the_step_and_keeps_the_lifecycle_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("a bug in the check")

    lc = lifecycle_at(tmp_path)
    lc.init_load()
    monkeypatch.setattr(CheckpointStore, "check_not_behind", broken)
    with pytest.raises(CheckpointError, match=r"save of step 2 \(role actor\): cannot check the root: RuntimeError"):
        lc.save(2)
    assert lc.state is State.READY


def test_writer_lock_held_by_another_writer_is_a_lock_held_error_and_tidy_skips_it_without_a_warning(
    tmp_path: Path,
) -> None:
    (tmp_path / "global_step_2" / ".staging-actor").mkdir(parents=True)
    holder = WriterLock(tmp_path, ROLE)
    holder.acquire()
    try:
        with pytest.raises(writer_lock.LockHeld, match=r"role 'actor' is being saved into this root by host"):
            WriterLock(tmp_path, ROLE).acquire()
        with capture_logs() as logs:
            CheckpointStore(tmp_path).tidy(ROLE)
    finally:
        holder.release()
    assert not [r for r in logs if r["event"] == "checkpoint.tidy_skipped"]
    assert (tmp_path / "global_step_2" / ".staging-actor").is_dir(), "left to the writer holding the lock"


def _manifest_unreadable(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    real = os.lstat

    def lstat(p: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(p) == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(p))
        return real(p, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", lstat)


def test_retention_keeps_a_step_whose_manifest_cannot_be_read_and_logs_the_real_error_not_another_managers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lc = lifecycle_at(tmp_path)
    lc.init_load()
    for step in (1, 2):
        lc.save(step)
    _manifest_unreadable(monkeypatch, tmp_path / "global_step_1" / ROLE / MANIFEST)
    with capture_logs() as logs:
        CheckpointStore(tmp_path).apply_retention(1, [ROLE], protect=set(), role=ROLE)
    monkeypatch.undo()
    assert (tmp_path / "global_step_1" / ROLE / MANIFEST).is_file()
    assert not [r for r in logs if r["event"] == "checkpoint.retention_kept"]
    failed = [r for r in logs if r["event"] == "checkpoint.retention_failed"]
    assert failed and failed[0]["path"] == str(tmp_path / "global_step_1" / ROLE)
    assert "Permission denied" in failed[0]["error"] and "EACCES" in failed[0]["error"]


def test_retention_names_another_managers_folder_once_per_store_and_remembers_a_bounded_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lifecycle.retention as retention

    monkeypatch.setattr(retention, "_KEPT_LIMIT", 2)
    for step in (1, 2, 3):
        native = tmp_path / f"global_step_{step}" / ROLE
        native.mkdir(parents=True)
        (native / "model_world_size_1_rank_0.pt").write_bytes(b"verl's own")
    lc = lifecycle_at(tmp_path)
    lc.init_load()
    lc.save(4)

    def named(store: CheckpointStore) -> list[int]:
        with capture_logs() as logs:
            store.apply_retention(1, [ROLE], protect=set(), role=ROLE)
            store.apply_retention(1, [ROLE], protect=set(), role=ROLE)
        assert len(store.kept) <= 2
        return [r["step"] for r in logs if r["event"] == "checkpoint.retention_kept"]

    first = CheckpointStore(tmp_path)
    assert sorted(set(named(first))) == [1, 2, 3]
    assert named(CheckpointStore(tmp_path))[:3] == [1, 2, 3], "another store (another job) is told too"
    assert CheckpointStore(tmp_path).steps() == [1, 2, 3, 4]


def test_async_save_of_uncopyable_state_says_it_cannot_be_copied_for_the_background_write_not_pickle(
    tmp_path: Path,
) -> None:
    model = _GuardedState()
    lc = Lifecycle({"checkpoint": {"root": str(tmp_path), "save": {"async": True}}}, role=ROLE, model=model,
                   optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    lc.init_load()
    with pytest.raises(NotSerializable, match=r"model\._extra_state\.guard of type lock cannot be copied to host "
                                              r"memory for the background write") as caught:
        lc.save(1)
    assert "pickle" not in str(caught.value)
