"""`resume.on_damaged`: an unattended restart gets past a damaged newest step, and never past a
model that does not fit, nor into a silent fresh start.

Damage is real here: bytes flipped, files cut short, removed, or made unreadable for a process
without root's powers. Every test checks that the step resumed holds exactly its weights and
that nothing was deleted: a damaged step is renamed aside.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from lifecycle import CheckpointError, State, resumer
from lifecycle.report import inspect_root, verify_root
from lifecycle.store import CheckpointStore
from lifecycle.writer_lock import WriterLock
from tests.lifecycle.hostile import ROLE, Net, has_weights_of, lifecycle_at, run_unprivileged, saved_run

WEIGHTS = "model/model.safetensors"


def role_folder(root: Path, step: int, role: str = ROLE) -> Path:
    return root / f"global_step_{step}" / role


def set_aside(root: Path, step: int) -> list[Path]:
    return sorted(root.glob(f"global_step_{step}.damaged-*"))


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x55
    path.write_bytes(bytes(data))


def damage(root: Path, how: str, step: int = 2) -> Path:
    path = role_folder(root, step) / WEIGHTS
    if how == "flipped":
        flip_byte(path)
    elif how == "short":
        path.write_bytes(path.read_bytes()[:-7])
    elif how == "missing":
        path.unlink()
    elif how == "optimizer-flipped":
        path = role_folder(root, step) / "optimizer" / "optimizer.safetensors"
        flip_byte(path)
    return path


@pytest.mark.parametrize(("how", "verify"), [
    ("flipped", True), ("short", True), ("missing", True), ("optimizer-flipped", True),
    ("short", False), ("missing", False),  # with load.verify false a flipped byte is not looked for
])
def test_a_damaged_newest_step_is_set_aside_and_the_previous_one_resumes_exactly(
    tmp_path: Path, how: str, verify: bool
) -> None:
    saved_run(tmp_path)
    path = damage(tmp_path, how)
    lc = lifecycle_at(tmp_path, verify=verify)
    with capture_logs() as logs:
        assert lc.resume() == 1
    assert lc.state is State.READY and has_weights_of(lc.parts.model, 1) and lc.progress.step == 1
    [aside] = set_aside(tmp_path, 2)
    assert not (tmp_path / "global_step_2").exists()
    assert (aside / ROLE / "manifest.json").is_file()  # renamed, nothing deleted
    [record] = [r for r in logs if r["event"] == "checkpoint.step_quarantined"]
    assert record["log_level"] == "error" and record["step"] == 2 and record["path"] == str(aside)
    assert any(str(path) in problem for problem in record["files"]), record["files"]


def test_an_unreadable_file_is_damage_too(tmp_path: Path) -> None:
    saved_run(tmp_path)
    (role_folder(tmp_path, 2) / WEIGHTS).chmod(0)
    code = ("import sys; from pathlib import Path; from tests.lifecycle.hostile import *; "
            "lc = lifecycle_at(Path(sys.argv[1])); step = lc.resume(); "
            "print('RESUMED', step, has_weights_of(lc.parts.model, step))")
    result = run_unprivileged(code, str(tmp_path))
    assert "RESUMED 1 True" in result.stdout, result.stderr
    assert "Permission denied" in result.stdout + result.stderr  # the quarantine record names why
    assert len(set_aside(tmp_path, 2)) == 1


def test_a_model_that_does_not_fit_is_refused_and_nothing_is_set_aside(tmp_path: Path) -> None:
    saved_run(tmp_path)
    lc = lifecycle_at(tmp_path)
    lc.parts.model = Net(width=7)
    lc.parts.optimizer = torch.optim.AdamW(lc.parts.model.parameters())
    with pytest.raises(CheckpointError, match="model-config hash"):
        lc.resume()
    assert lc.state is State.FAILED and set_aside(tmp_path, 2) == [] and role_folder(tmp_path, 2).is_dir()


def test_a_step_intact_on_disk_but_unloadable_is_a_refusal_not_damage(tmp_path: Path) -> None:
    """extra.json rewritten with a value numpy refuses, and the manifest re-signed: the bytes are
    what the manifest says, so this is not damage; resume stops, renames nothing."""
    saved_run(tmp_path)
    folder = role_folder(tmp_path, 2)
    extra = folder / "extra" / "rank_0" / "extra.json"
    doc = json.loads(extra.read_text())
    doc["rng"]["numpy"]["pos"] = 10_000
    extra.write_text(json.dumps(doc))
    from tests.lifecycle.test_bad_input import resign

    resign(folder)
    lc = lifecycle_at(tmp_path)
    with pytest.raises(CheckpointError, match="rng.numpy.pos"):
        lc.resume()
    assert set_aside(tmp_path, 2) == [] and folder.is_dir()


def test_with_no_undamaged_step_left_resume_refuses_instead_of_starting_fresh(tmp_path: Path) -> None:
    saved_run(tmp_path)
    damage(tmp_path, "flipped", step=1)
    damage(tmp_path, "flipped", step=2)
    lc = lifecycle_at(tmp_path)
    with pytest.raises(CheckpointError, match="(?s)no undamaged checkpoint is left.*step 2.*step 1") as caught:
        lc.resume()
    assert str(role_folder(tmp_path, 2) / WEIGHTS) in str(caught.value)
    assert lc.state is State.FAILED and len(set_aside(tmp_path, 1)) == len(set_aside(tmp_path, 2)) == 1
    again = lifecycle_at(tmp_path)  # the restart after: still no fresh start over them
    with pytest.raises(CheckpointError, match="(?s)no undamaged checkpoint.*damaged-"):
        again.resume()


@pytest.mark.parametrize("resume", [{"on_damaged": "refuse"}, {"mode": "path"}], ids=["refuse", "path"])
def test_refuse_and_mode_path_stop_at_damage_and_rename_nothing(tmp_path: Path, resume: dict[str, str]) -> None:
    saved_run(tmp_path)
    path = damage(tmp_path, "flipped")
    if resume.get("mode") == "path":
        resume = {**resume, "path": str(tmp_path / "global_step_2")}
    lc = lifecycle_at(tmp_path, **resume)
    with pytest.raises(CheckpointError, match="cannot resume from step 2") as caught:
        lc.resume()
    assert str(path) in str(caught.value) and "checksum" in str(caught.value)
    assert set_aside(tmp_path, 2) == [] and role_folder(tmp_path, 2).is_dir()


def test_roles_agree_through_the_disk_on_the_step_to_resume(tmp_path: Path) -> None:
    """Only the actor's part of step 2 is damaged; the critic, resuming first, sees it too."""
    roles = ("actor", "critic")
    saved_run(tmp_path, roles=roles)
    damage(tmp_path, "flipped")
    critic = lifecycle_at(tmp_path, role="critic", roles=list(roles))
    assert critic.resume() == 1 and has_weights_of(critic.parts.model, 1)
    assert len(set_aside(tmp_path, 2)) == 1
    actor = lifecycle_at(tmp_path, role="actor", roles=list(roles))
    assert actor.resume() == 1 and has_weights_of(actor.parts.model, 1)


def test_the_actor_finding_its_own_damage_sets_aside_the_step_the_critic_then_skips(tmp_path: Path) -> None:
    roles = ("actor", "critic")
    saved_run(tmp_path, roles=roles)
    damage(tmp_path, "short")
    actor = lifecycle_at(tmp_path, role="actor", roles=list(roles))
    assert actor.resume() == 1
    critic = lifecycle_at(tmp_path, role="critic", roles=list(roles))
    assert critic.resume() == 1 and has_weights_of(critic.parts.model, 1)


def test_saving_after_a_fallback_reuses_the_step_number_and_retention_never_touches_the_damaged(
    tmp_path: Path,
) -> None:
    saved_run(tmp_path)
    damage(tmp_path, "flipped")
    lc = lifecycle_at(tmp_path, keep_last=1)
    assert lc.resume() == 1
    for step in (2, 3, 4):
        lc.save(step)
    assert sorted(p.name for p in tmp_path.glob("global_step_*") if ".damaged-" not in p.name) == ["global_step_4"]
    assert len(set_aside(tmp_path, 2)) == 1


def test_inspect_and_verify_list_the_steps_set_aside_and_verify_fails_while_any_remain(tmp_path: Path) -> None:
    import io

    saved_run(tmp_path)
    damage(tmp_path, "flipped")
    assert lifecycle_at(tmp_path).resume() == 1
    [aside] = set_aside(tmp_path, 2)
    out = io.StringIO()
    assert inspect_root(tmp_path, None, out) == 1
    assert "set aside as damaged (1" in out.getvalue() and aside.name in out.getvalue()
    out = io.StringIO()
    assert verify_root(tmp_path, None, None, out, io.StringIO()) == 1
    assert "1 of 1 role folders verified" in out.getvalue() and aside.name in out.getvalue()
    import shutil

    shutil.rmtree(aside)
    assert verify_root(tmp_path, None, None, io.StringIO(), io.StringIO()) == 0


def test_after_a_fallback_the_tracker_names_the_step_resumed(tmp_path: Path) -> None:
    """Before: the tracker still named the step set aside, and verl, which reads the tracker,
    would start fresh."""
    saved_run(tmp_path)
    damage(tmp_path, "flipped")
    assert lifecycle_at(tmp_path).resume() == 1
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def test_a_damaged_step_gone_before_it_is_set_aside_is_not_said_to_be_set_aside_by_rank_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved_run(tmp_path, steps=(1,))
    damage(tmp_path, "flipped", step=1)
    real_quarantine = CheckpointStore.quarantine

    def another_role_first(self: CheckpointStore, step: int, *args: Any) -> Path | None:
        self.step_dir(step).rename(tmp_path / f"global_step_{step}.damaged-by-another-role")
        return real_quarantine(self, step, *args)

    monkeypatch.setattr(CheckpointStore, "quarantine", another_role_first)
    with pytest.raises(CheckpointError, match="no undamaged checkpoint") as refused:
        lifecycle_at(tmp_path).resume()
    assert "rank 0" not in str(refused.value) and "gone before it could be set aside" in str(refused.value)


def into_the_gap(monkeypatch: pytest.MonkeyPatch, root: Path, step: int, role: str, *, back_after: int) -> Path:
    """The checks of `role`'s folder of `step` meet it renamed aside by a re-commit without
    RENAME_EXCHANGE (the first of its two renames), and back after `back_after` checks."""
    folder, aside = role_folder(root, step, role), root / f".replaced-{step}-{role}-0123abcd"
    checks = []
    real_validate = CheckpointStore.validate

    def validate(self: CheckpointStore, at: int, name: str, *, deep: bool) -> list[str]:
        if (at, name) == (step, role):
            checks.append(at)
            if len(checks) == 1:
                folder.rename(aside)
            elif len(checks) > back_after and aside.exists():
                aside.rename(folder)
        return real_validate(self, at, name, deep=deep)

    monkeypatch.setattr(CheckpointStore, "validate", validate)
    return aside


def test_a_role_folder_missing_while_its_re_commit_is_in_flight_is_checked_again_not_set_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The actor re-commits step 2 while the critic resumes. Before: the critic took the gap for
    damage, set the good step aside for both roles and resumed step 1."""
    roles = ("actor", "critic")
    saved_run(tmp_path, roles=roles)
    into_the_gap(monkeypatch, tmp_path, 2, "actor", back_after=1)
    critic = lifecycle_at(tmp_path, role="critic", roles=list(roles))
    assert critic.resume() == 2 and has_weights_of(critic.parts.model, 2)
    assert not set_aside(tmp_path, 2)


def test_another_roles_copy_left_aside_waits_for_that_roles_own_resume_and_its_lock_is_never_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The actor's re-commit of step 2 died between its two renames. Before: the critic's resume
    took the actor's writer lock to put the actor's copy back, and an actor save starting at that
    moment was refused as a second writer's. Now the critic waits for it, stops rather than set
    the step aside, and the actor's own resume puts it back."""
    roles = ("actor", "critic")
    saved_run(tmp_path, roles=roles)
    aside = role_folder(tmp_path, 2, "actor").rename(tmp_path / ".replaced-2-actor-0123abcd")
    monkeypatch.setattr(resumer, "FLUX_WAIT_S", 0.01)
    taken: list[str] = []
    real_acquire = WriterLock.acquire
    monkeypatch.setattr(WriterLock, "acquire", lambda lock: (taken.append(lock.role), real_acquire(lock))[1])
    with pytest.raises(CheckpointError, match="changed while resume checked it"):
        lifecycle_at(tmp_path, role="critic", roles=list(roles)).resume()
    assert "actor" not in taken and aside.exists() and not set_aside(tmp_path, 2)
    monkeypatch.undo()
    assert lifecycle_at(tmp_path, role="actor", roles=list(roles)).resume() == 2 and not aside.exists()
    critic = lifecycle_at(tmp_path, role="critic", roles=list(roles))
    assert critic.resume() == 2 and has_weights_of(critic.parts.model, 2)
    assert not set_aside(tmp_path, 2)


def test_damaged_steps_set_aside_leave_a_step_in_flux_its_own_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: every damaged step set aside used up one of the checks meant for a step changing
    while checked, so after FLUX_CHECKS - 1 of them a step merely mid-commit stopped resume at
    once, with no wait."""
    roles = ("actor", "critic")
    saved_run(tmp_path, steps=(1, 2, 3), roles=roles)
    damage(tmp_path, "flipped", step=3)
    into_the_gap(monkeypatch, tmp_path, 2, "actor", back_after=1)
    monkeypatch.setattr(resumer, "FLUX_CHECKS", 2)
    monkeypatch.setattr(resumer, "FLUX_WAIT_S", 0.01)
    critic = lifecycle_at(tmp_path, role="critic", roles=list(roles))
    assert critic.resume() == 2 and has_weights_of(critic.parts.model, 2)
    assert set_aside(tmp_path, 3) and not set_aside(tmp_path, 2)
