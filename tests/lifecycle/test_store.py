"""CheckpointStore: layout, commit atomicity, validation, tracker and retention."""

from __future__ import annotations

import json
import os
import shutil
import threading
from datetime import datetime
from pathlib import Path

import pytest

from lifecycle.boundary import OutOfResources
from lifecycle.errors import CheckpointError, ConfigError
import xxhash

from lifecycle.checksum import ALGORITHM, PIECE_BYTES, PLAIN, file_digest
from lifecycle import retention
from lifecycle.store import TRACKER, CheckpointStore
from lifecycle.writer_lock import WriterLock

MANIFEST_KEYS = {"format_version", "step", "role", "created_at", "contents", "parallel",
                 "model_config_hash", "versions", "files", "meta"}


def commit(store: CheckpointStore, step: int, role: str = "actor", *, roles: list[str] | None = None,
           files: dict[str, bytes] | None = None) -> Path:
    staging = store.staging(step, role)
    for rel, data in (files or {"model/weights.bin": b"w" * 100, "extra/extra.json": b"{}"}).items():
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).write_bytes(data)
    return store.commit(step, role, contents={"model": "hf", "extra": "extra"}, parallel={"world_size": 1},
                        model_config_hash="abc", extra_meta={"note": 1}, roles=roles)


def manifest_of(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def rewrite_manifest(folder: Path, **changes: object) -> None:
    data = manifest_of(folder)
    data.update(changes)
    (folder / "manifest.json").write_text(json.dumps(data))


def tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def test_commit_layout_is_exact(tmp_path: Path) -> None:
    final = commit(CheckpointStore(tmp_path), 5)
    assert final == tmp_path / "global_step_5" / "actor"
    assert tree(tmp_path) == [
        "global_step_5", "global_step_5/actor", "global_step_5/actor/extra",
        "global_step_5/actor/extra/extra.json", "global_step_5/actor/manifest.json",
        "global_step_5/actor/model", "global_step_5/actor/model/weights.bin", TRACKER,
    ]
    assert (tmp_path / TRACKER).read_text() == "5\n"


def test_manifest_records_files_contents_and_versions(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    staging = store.staging(3, "actor")
    (staging / "model").mkdir()
    (staging / "model" / "a.bin").write_bytes(b"abc" * 1000)
    final = store.commit(3, "actor", contents={"model": "hf", "hf_model": "hf"}, folders={"hf_model": "model"},
                         parallel={"world_size": 1, "tp": 1}, model_config_hash="h1", extra_meta={"k": "v"})
    data = manifest_of(final)
    assert set(data) == MANIFEST_KEYS
    assert data["step"] == 3 and data["role"] == "actor" and data["format_version"] == 2
    assert data["contents"] == {"model": {"backend": "hf", "folder": "model"},
                                "hf_model": {"backend": "hf", "folder": "model"}}
    one_piece = xxhash.xxh3_64_intdigest(b"abc" * 1000).to_bytes(8, "little")
    assert data["files"] == [{"path": "model/a.bin", "size": 3000, ALGORITHM: xxhash.xxh3_64(one_piece).hexdigest()}]
    assert data["parallel"] == {"world_size": 1, "tp": 1}
    assert data["model_config_hash"] == "h1" and data["meta"] == {"k": "v"}
    assert {"torch", "safetensors", "trainer_lifecycle", "python"} <= set(data["versions"])
    assert datetime.fromisoformat(data["created_at"]).utcoffset().total_seconds() == 0


def test_digest_of_a_file_larger_than_a_chunk_matches_one_pass_and_the_tree_of_its_pieces(tmp_path: Path) -> None:
    data = os.urandom(1024) * (65 * 1024 + 3)  # crosses the 64 MiB chunk boundary
    (tmp_path / "big").write_bytes(data)
    assert file_digest(tmp_path / "big", algorithm=PLAIN) == xxhash.xxh3_64(data).hexdigest()
    pieces = b"".join(xxhash.xxh3_64_intdigest(data[i:i + PIECE_BYTES]).to_bytes(8, "little")
                      for i in range(0, len(data), PIECE_BYTES))
    assert file_digest(tmp_path / "big") == xxhash.xxh3_64(pieces).hexdigest()


def test_staging_left_by_crash_is_cleared_and_never_complete(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    staging = store.staging(7, "actor")
    (staging / "junk.bin").write_bytes(b"partial")
    assert staging.parent == tmp_path / "global_step_7"
    assert not store.is_complete(7, ["actor"]) and store.newest_complete(["actor"]) is None
    again = store.staging(7, "actor")
    assert again == staging and list(again.iterdir()) == []


def test_step_without_manifest_is_not_complete(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    commit(store, 1)
    commit(store, 2)
    (tmp_path / "global_step_2" / "actor" / "manifest.json").unlink()
    assert not store.is_complete(2, ["actor"])
    assert store.newest_complete(["actor"]) == 1


def test_newest_complete_ignores_tracker(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    commit(store, 1)
    store.write_tracker(99)
    assert store.newest_complete(["actor"]) == 1
    (tmp_path / TRACKER).write_text("garbage")
    assert store.newest_complete(["actor"]) == 1


def test_tracker_not_a_number_names_the_file(tmp_path: Path) -> None:
    (tmp_path / TRACKER).write_text("twelve\n")
    with pytest.raises(CheckpointError, match=TRACKER):
        CheckpointStore(tmp_path).read_tracker()


def test_tracker_returns_a_step_that_does_not_exist(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    assert store.read_tracker() is None
    store.write_tracker(42)
    assert store.read_tracker() == 42 and store.steps() == []


def test_tracker_waits_until_every_role_committed(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    roles = ["actor", "critic"]
    commit(store, 1, "actor", roles=roles)
    assert store.read_tracker() is None and not store.is_complete(1, roles)
    commit(store, 1, "critic", roles=roles)
    assert store.read_tracker() == 1 and store.is_complete(1, roles)


def test_status_gives_reasons_per_role(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    commit(store, 1, "actor")
    status = store.status(1, ["actor", "critic"])
    assert status["actor"] == []
    assert "role folder missing" in status["critic"][0]


def test_recommitting_a_step_replaces_the_old_folder(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    commit(store, 1, files={"model/old.bin": b"old"})
    commit(store, 1, files={"model/new.bin": b"new"})
    assert tree(tmp_path / "global_step_1") == [
        "actor", "actor/manifest.json", "actor/model", "actor/model/new.bin"]
    assert store.validate(1, "actor", deep=True) == []


def exchange_works(tmp_path: Path) -> bool:
    (a := tmp_path / "exchange-a").mkdir()
    (b := tmp_path / "exchange-b").mkdir()
    try:
        return retention.exchange(a, b)
    finally:
        a.rmdir()
        b.rmdir()


def test_a_re_commit_exchanges_the_folders_so_no_moment_lacks_a_committed_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the old folder was renamed away first, and a crash before the second rename left
    step 1 with no committed folder at all."""
    if not exchange_works(tmp_path):
        pytest.skip("this filesystem cannot exchange two folders (RENAME_EXCHANGE)")
    store = CheckpointStore(tmp_path)
    commit(store, 1, files={"model/old.bin": b"old"})
    renamed: list[str] = []
    real_rename = os.rename
    monkeypatch.setattr(os, "rename", lambda src, dst: (renamed.append(Path(dst).name), real_rename(src, dst))[1])
    monkeypatch.setattr(CheckpointStore, "_after_rename", lambda *args: None)  # a crash right after the commit
    commit(store, 1, files={"model/new.bin": b"new"})
    assert not [name for name in renamed if name.startswith(".replaced-")]
    assert store.validate(1, "actor", deep=True) == [] and (store.role_dir(1, "actor") / "model/new.bin").exists()
    assert (store.step_dir(1) / ".staging-actor/model/old.bin").exists(), "the replaced copy, left by the crash"
    monkeypatch.undo()
    commit(store, 1, files={"model/newer.bin": b"newer"})
    assert sorted(p.name for p in store.step_dir(1).iterdir()) == ["actor"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".trash-", ".replaced-"))]


def crash_between_renames(store: CheckpointStore, step: int, role: str = "actor") -> Path:
    """What a crash leaves between the two renames of a re-commit without RENAME_EXCHANGE."""
    aside = store.root / f".replaced-{step}-{role}-0123abcd"
    store.role_dir(step, role).rename(aside)
    return aside


def test_a_reader_short_of_file_descriptors_when_listing_replaced_copies_refuses_rather_than_skip_a_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: `replaced_copies` read a failed listing as "none", so a step whose only committed
    copy of a role is aside read as uncommitted, and resume went back a step, when the listing
    failed for want of file descriptors (EMFILE) and the next one did not."""
    store = CheckpointStore(tmp_path)
    commit(store, 1)
    commit(store, 2)
    crash_between_renames(store, 2)
    real, calls = CheckpointStore.entries, []

    def short_once(self: CheckpointStore) -> list[os.DirEntry[str]]:
        calls.append(1)
        if len(calls) == 1:
            raise OutOfResources(f"{self.root}: cannot list the checkpoint root: too many open files")
        return real(self)

    monkeypatch.setattr(CheckpointStore, "entries", short_once)
    with pytest.raises(OutOfResources, match="too many open files"):
        store.newest_committed(["actor"])
    assert store.newest_committed(["actor"]) == 2


def test_the_next_save_puts_back_a_committed_copy_a_crashed_re_commit_left_aside(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    commit(store, 1)
    commit(store, 2, files={"model/two.bin": b"two"})
    aside = crash_between_renames(store, 2)
    assert store.newest_committed(["actor"]) == 2, "a reader counts the copy aside as committed"
    lock = store.writer_lock("actor")
    store.staging(3, "actor", lock)
    lock.release()
    assert not aside.exists() and store.validate(2, "actor", deep=True) == []
    assert (store.role_dir(2, "actor") / "model/two.bin").read_bytes() == b"two"


def test_a_resume_puts_back_its_roles_copy_unless_its_writer_is_at_work_and_never_takes_another_roles_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the actor's resume took the critic's writer lock to put the critic's copy back,
    and a critic save starting at that moment was refused as a second writer's."""
    store = CheckpointStore(tmp_path)
    for role in ("actor", "critic"):
        commit(store, 2, role)
    mine, theirs = crash_between_renames(store, 2, "actor"), crash_between_renames(store, 2, "critic")
    writer = store.writer_lock("actor")
    writer.acquire()
    store.tidy("actor")
    assert mine.exists(), "a writer holds the lock: its own commit is in flight"
    writer.release()
    taken: list[str] = []
    real_acquire = WriterLock.acquire
    monkeypatch.setattr(WriterLock, "acquire", lambda lock: (taken.append(lock.role), real_acquire(lock))[1])
    store.tidy("actor")
    assert taken == ["actor"] and not mine.exists() and store.validate(2, "actor", deep=True) == []
    assert theirs.exists(), "the critic's own resume or save puts its copy back"
    store.tidy("critic")
    assert not theirs.exists() and store.validate(2, "critic", deep=True) == []


def test_a_resume_removes_its_roles_staging_folders_a_crash_left_in_any_step(tmp_path: Path) -> None:
    """A crash right after a re-commit's exchange leaves the replaced copy, manifest and all, in
    `.staging-<role>`. Before: it stayed until that step was saved again or pruned (with keep_last
    unset, for ever)."""
    store = CheckpointStore(tmp_path)
    for step in (1, 2):
        commit(store, step)
    shutil.copytree(store.role_dir(1, "actor"), store.step_dir(1) / ".staging-actor")  # the exchange's old copy
    (store.step_dir(2) / ".staging-actor").mkdir()  # a save killed mid-write
    (store.step_dir(2) / ".staging-critic").mkdir()  # another role's: its own resume decides
    writer = store.writer_lock("actor")
    writer.acquire()
    store.tidy("actor")
    assert (store.step_dir(1) / ".staging-actor").exists(), "a writer holds the lock: a save may be in flight"
    writer.release()
    store.tidy("actor")
    assert [sorted(p.name for p in store.step_dir(step).iterdir()) for step in (1, 2)] == [
        ["actor"], [".staging-critic", "actor"]]
    assert all(store.validate(step, "actor", deep=True) == [] for step in (1, 2))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".trash-")]


def test_a_rollback_takes_a_steps_replaced_copies_with_it_so_a_new_step_of_that_number_never_gets_them(
    tmp_path: Path,
) -> None:
    """Before: the critic's `.replaced-5-*` copy stayed in the root after a rollback to step 3 set
    step 5 aside; the critic's next save put that old copy into the new line's step 5, next to
    the actor's new folder, and resume read the two lines mixed as one complete step."""
    store = CheckpointStore(tmp_path)
    roles = ["actor", "critic"]
    for step in (3, 5):
        for role in roles:
            commit(store, step, role, roles=roles, files={"model/w.bin": f"{role}-old-{step}".encode()})
    crash_between_renames(store, 5, "critic")
    [aside] = store.supersede(3)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".replaced-")]
    assert (aside / "critic" / "model/w.bin").read_bytes() == b"critic-old-5", "set aside whole"
    commit(store, 5, "actor", roles=roles, files={"model/w.bin": b"actor-new-5"})
    lock = store.writer_lock("critic")
    store.staging(5, "critic", lock, roles)
    lock.release()
    assert not store.role_dir(5, "critic").exists() and not store.is_complete(5, roles)
    assert store.newest_committed(roles) == 3


def test_the_sweep_removes_an_orphaned_replaced_copy_whose_step_is_gone(tmp_path: Path) -> None:
    """Before: a copy whose step folder was gone counted as that step's only committed copy, so
    nothing removed it, and a later step of that number took it back as its own."""
    store = CheckpointStore(tmp_path)
    commit(store, 1)
    commit(store, 2)
    orphan = crash_between_renames(store, 1)
    shutil.rmtree(store.step_dir(1))  # pruned, or removed by hand
    store.apply_retention(None, ["actor"], protect=set(), role="actor")
    assert not orphan.exists() and store.steps() == [2]


def test_the_sweep_removes_replaced_copies_but_never_the_only_committed_one(tmp_path: Path) -> None:
    """Before: `.replaced-*` folders were never removed, though the log said the next save would."""
    store = CheckpointStore(tmp_path)
    commit(store, 1)
    commit(store, 2)
    only = crash_between_renames(store, 2)
    leftover = tmp_path / ".replaced-1-actor-89abcdef"
    shutil.copytree(store.role_dir(1, "actor"), leftover)
    store.apply_retention(None, ["actor"], protect=set(), role="actor")
    assert not leftover.exists() and only.exists()
    assert store.validate(1, "actor", deep=True) == []


def test_steps_lists_numeric_step_folders_only(tmp_path: Path) -> None:
    for name in ("global_step_10", "global_step_2", "global_step_abc", "global_step_1x", ".staging"):
        (tmp_path / name).mkdir()
    (tmp_path / "global_step_3").write_text("a file")
    assert CheckpointStore(tmp_path).steps() == [2, 10]
    assert CheckpointStore(tmp_path / "missing").steps() == []


def test_cheap_validation_checks_sizes_deep_checks_checksums(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    final = commit(store, 1)
    weights = final / "model" / "weights.bin"
    weights.write_bytes(b"x" * 100)  # same size, other bytes
    assert store.validate(1, "actor", deep=False) == []
    problems = store.validate(1, "actor", deep=True)
    assert len(problems) == 1 and str(weights) in problems[0] and "checksum" in problems[0]
    weights.write_bytes(b"x" * 99)
    assert "size 99 != manifest 100" in store.validate(1, "actor", deep=False)[0]


def test_a_manifest_naming_the_plain_xxh3_checksum_is_checked_with_it(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    final = commit(store, 1)
    files = manifest_of(final)["files"]
    rewrite_manifest(final, files=[{"path": f["path"], "size": f["size"],
                                    PLAIN: xxhash.xxh3_64((final / f["path"]).read_bytes()).hexdigest()}
                                   for f in files])
    assert store.validate(1, "actor", deep=True) == []
    (final / "model" / "weights.bin").write_bytes(b"x" * 100)
    problems = store.validate(1, "actor", deep=True)
    assert len(problems) == 1 and "weights.bin: checksum" in problems[0]


def test_missing_listed_file_is_a_problem(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    final = commit(store, 1)
    (final / "extra" / "extra.json").unlink()
    problems = store.validate(1, "actor", deep=False)
    assert any("extra.json" in p and "missing" in p for p in problems)


def test_unlisted_file_is_a_deep_problem(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    final = commit(store, 1)
    (final / "extra" / "planted.pkl").write_bytes(b"x")
    assert store.validate(1, "actor", deep=False) == []
    assert any("planted.pkl" in p and "not listed" in p for p in store.validate(1, "actor", deep=True))


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", "{}"])
def test_bad_manifest_is_reported_with_its_path(tmp_path: Path, content: str) -> None:
    store = CheckpointStore(tmp_path)
    final = commit(store, 1)
    (final / "manifest.json").write_text(content)
    problems = store.validate(1, "actor", deep=False)
    assert len(problems) == 1 and str(final / "manifest.json") in problems[0]
    with pytest.raises(CheckpointError, match="manifest"):
        store.read_manifest(1, "actor")


def test_manifest_missing_keys_are_named(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    final = commit(store, 1)
    data = manifest_of(final)
    del data["files"]
    (final / "manifest.json").write_text(json.dumps(data))
    assert "missing key 'files'" in store.validate(1, "actor", deep=False)[0]


@pytest.mark.parametrize("bad", ["../../outside.bin", "/etc/hostname", "model/../../x", "link/target.bin"])
def test_manifest_paths_never_escape_the_folder(tmp_path: Path, bad: str) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    final = commit(store, 1)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "target.bin").write_bytes(b"x")
    (tmp_path / "outside.bin").write_bytes(b"x")
    if bad.startswith("link/"):
        (final / "link").symlink_to(outside)
    data = manifest_of(final)
    data["files"].append({"path": bad, "size": 1, "xxh3_64": "0000000000000000"})
    (final / "manifest.json").write_text(json.dumps(data))
    problems = store.validate(1, "actor", deep=True)
    if bad.startswith("link/"):  # the string is fine; the folder holds a symlink, refused wherever it leads
        assert any(f"{final / 'link'}: a symlink" in p for p in problems), problems
    else:
        assert any(repr(bad) in p and "refused" in p for p in problems), problems


def test_content_folder_escaping_is_a_problem(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    final = commit(store, 1)
    rewrite_manifest(final, contents={"model": {"backend": "hf", "folder": "../critic"}})
    assert any("escapes" in p for p in store.validate(1, "actor", deep=False))


def test_manifest_for_another_step_is_a_problem(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    final = commit(store, 1)
    rewrite_manifest(final, step=2)
    assert "step 2 but the folder is for step 1" in store.validate(1, "actor", deep=False)[0]


def test_verify_reports_progress_up_to_total(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    commit(store, 1)
    calls: list[tuple[int, int]] = []
    assert store.verify(1, "actor", lambda done, total: calls.append((done, total))) == []
    assert calls[-1] == (102, 102) and len(calls) == 2


def make_steps(store: CheckpointStore, complete: list[int], incomplete: list[int]) -> None:
    for step in complete:
        commit(store, step)
    for step in incomplete:
        store.staging(step, "actor")


def test_retention_keeps_newest_complete_steps(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    make_steps(store, [1, 2, 3, 4, 5], [])
    assert store.apply_retention(2, ["actor"], protect=set(), role="actor") == [1, 2, 3]
    assert store.steps() == [4, 5]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_retention_never_deletes_a_protected_step(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    make_steps(store, [1, 2, 3, 4], [])
    assert store.apply_retention(1, ["actor"], protect={2}, role="actor") == [1, 3]
    assert store.steps() == [2, 4]


def test_retention_keeps_incomplete_newer_steps_and_drops_older_ones(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    make_steps(store, [2, 3, 5], [1, 4, 6])
    assert store.apply_retention(2, ["actor"], protect=set(), role="actor") == [1, 2]
    assert store.steps() == [3, 4, 5, 6]


def test_retention_counts_only_steps_complete_for_every_role(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    roles = ["actor", "critic"]
    for step in (1, 2, 3):
        commit(store, step, "actor", roles=roles)
    commit(store, 1, "critic", roles=roles)
    assert store.apply_retention(1, roles, protect=set(), role="actor") == []
    commit(store, 2, "critic", roles=roles)
    assert store.apply_retention(1, roles, protect=set(), role="actor") == [1]
    assert sorted(p.name for p in store.step_dir(1).iterdir()) == ["critic"]


def test_retention_of_a_role_listing_every_role_never_removes_another_roles_folders(tmp_path: Path) -> None:
    """Both roles list `checkpoint.roles: [actor, critic]`; the actor keeps 1, the critic keeps all:
    the actor's retention removed the critic's checkpoints too."""
    store = CheckpointStore(tmp_path)
    roles = ["actor", "critic"]
    for step in (1, 2, 3, 4):
        commit(store, step, "critic", roles=roles)
        commit(store, step, "actor", roles=roles)
        store.apply_retention(1, roles, protect={step}, role="actor")
    assert store.steps() == [1, 2, 3, 4]
    assert [sorted(p.name for p in store.step_dir(step).iterdir()) for step in (1, 2, 3)] == [["critic"]] * 3
    assert all(store.validate(step, "critic", deep=True) == [] for step in (1, 2, 3, 4))
    assert store.is_complete(4, roles)
    assert store.apply_retention(1, roles, protect=set(), role="critic") == [1, 2, 3]
    assert store.steps() == [4]


def test_retention_of_two_roles_keeping_one_each_holds_one_more_folder_of_the_first_saver_until_its_next_save(
    tmp_path: Path,
) -> None:
    """Each role prunes its own part, never the other's: the critic, saving first, still holds
    step 3 once the actor pruned its part of it (keep_last + 1 of its folders), and prunes it at
    its next save. A step the other role pruned already is no longer complete, and must not be
    counted as kept, else the second role's folders pile up forever."""
    store = CheckpointStore(tmp_path)
    roles = ["actor", "critic"]
    for step in (1, 2, 3, 4):
        for role in ("critic", "actor"):
            commit(store, step, role, roles=roles)
            store.apply_retention(1, roles, protect={step}, role=role)
    assert store.steps() == [3, 4] and sorted(p.name for p in store.step_dir(3).iterdir()) == ["critic"]
    assert store.apply_retention(1, roles, protect=set(), role="critic") == [3]
    assert store.steps() == [4] and store.is_complete(4, roles)


def test_retention_tolerates_a_folder_vanishing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CheckpointStore(tmp_path)
    make_steps(store, [2, 3], [])
    real_steps = store.steps
    monkeypatch.setattr(store, "steps", lambda: [1, *real_steps()])
    assert store.apply_retention(1, ["actor"], protect=set(), role="actor") == [2]


def test_retention_prunes_only_its_roles_folders_while_another_role_still_holds_the_step(tmp_path: Path) -> None:
    """The actor's keep_last 1 must not take the critic's only checkpoints (verl: max_actor_ckpt_to_keep=1,
    max_critic_ckpt_to_keep=None); the step folder, the trainer's data.pt with it, goes with the last role."""
    store = CheckpointStore(tmp_path)
    for step in (1, 2, 3):
        commit(store, step, "actor")
        commit(store, step, "critic")
        (store.step_dir(step) / "data.pt").write_bytes(b"trainer")
    assert store.apply_retention(1, ["actor"], protect=set(), role="actor") == [1, 2]
    assert store.steps() == [1, 2, 3]
    for step in (1, 2):
        assert sorted(p.name for p in store.step_dir(step).iterdir()) == ["critic", "data.pt"]
        assert store.validate(step, "critic", deep=True) == []
    assert store.apply_retention(1, ["actor"], protect=set(), role="actor") == [], "nothing of the actor's is left to prune"
    assert store.apply_retention(1, ["critic"], protect=set(), role="critic") == [1, 2]
    assert store.steps() == [3] and not [p for p in tmp_path.iterdir() if p.name.startswith(".trash-")]


def test_retention_keeps_a_step_holding_another_roles_uncommitted_folder(tmp_path: Path) -> None:
    """A folder without a manifest may be another checkpoint manager's (verl's own) or a save in
    progress: only this role's part of the step is pruned."""
    store = CheckpointStore(tmp_path)
    for step in (1, 2, 3):
        commit(store, step, "actor")
    (store.step_dir(1) / "critic").mkdir()
    (store.step_dir(1) / "critic" / "model_world_size_1_rank_0.pt").write_bytes(b"verl's own")
    (store.step_dir(2) / ".staging-critic").mkdir()
    (store.step_dir(2) / ".staging-actor").mkdir()  # this role's crashed save: pruned with its folder
    assert store.apply_retention(1, ["actor"], protect=set(), role="actor") == [1, 2]
    assert sorted(p.name for p in store.step_dir(1).iterdir()) == ["critic"]
    assert sorted(p.name for p in store.step_dir(2).iterdir()) == [".staging-critic"]


def test_retention_off_and_on_other_ranks(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    make_steps(store, [1, 2, 3], [])
    assert store.apply_retention(None, ["actor"], protect=set(), role="actor") == []
    other = CheckpointStore(tmp_path, rank=1, world_size=2, barrier=lambda: None)
    assert other.apply_retention(1, ["actor"], protect=set(), role="actor") == []
    assert store.steps() == [1, 2, 3]


def test_all_ranks_write_one_folder_and_rank0_commits(tmp_path: Path) -> None:
    barrier = threading.Barrier(2, timeout=10)
    results: dict[int, Path] = {}

    def worker(rank: int) -> None:
        store = CheckpointStore(tmp_path, rank=rank, world_size=2, barrier=barrier.wait)
        staging = store.staging(1, "actor")
        (staging / f"shard_{rank}.bin").write_bytes(bytes([rank]) * 10)
        results[rank] = store.commit(1, "actor", contents={"model": "torch_dcp"})

    threads = [threading.Thread(target=worker, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert results[0] == results[1] == tmp_path / "global_step_1" / "actor"
    assert [f["path"] for f in manifest_of(results[0])["files"]] == ["shard_0.bin", "shard_1.bin"]


def test_other_rank_raises_when_rank0_did_not_commit(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, rank=1, world_size=2, barrier=lambda: None)
    store.staging(1, "actor")
    with pytest.raises(CheckpointError, match="rank 0 did not commit"):
        store.commit(1, "actor", contents={})


def test_several_ranks_without_barrier_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="barrier"):
        CheckpointStore(tmp_path, rank=0, world_size=2)


@pytest.mark.parametrize("role", ["../x", "", ".hidden", "a/b"])
def test_role_names_cannot_point_elsewhere(tmp_path: Path, role: str) -> None:
    with pytest.raises(ConfigError, match="role"):
        CheckpointStore(tmp_path).staging(1, role)


def test_commit_without_staging_names_the_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="staging"):
        CheckpointStore(tmp_path).commit(1, "actor", contents={})


def test_commit_with_tracker_false_leaves_the_tracker_to_the_trainer(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    staging = store.staging(1, "actor")
    (staging / "w.bin").write_bytes(b"w")
    store.commit(1, "actor", contents={"model": "hf"}, tracker=False)
    assert store.read_tracker() is None and store.newest_complete(["actor"]) == 1


def files_by_step(root: Path) -> dict[tuple[str, str], bytes]:
    """Every file under a step folder, set aside or not, keyed by (step, path in the step)."""
    return {(p.relative_to(root).parts[0].split(".")[0], "/".join(p.relative_to(root).parts[1:])): p.read_bytes()
            for p in root.glob("global_step_*/**/*") if p.is_file()}


def test_supersede_sets_every_newer_step_aside_and_deletes_nothing(tmp_path: Path) -> None:
    """Another role's save in progress (its writer lock held) and a folder another checkpoint
    manager wrote (no manifest) are renamed aside whole, like committed steps; a tracker naming
    a step set aside points back at the step resumed."""
    store = CheckpointStore(tmp_path)
    for step in (1, 2, 3):
        commit(store, step)
    lock = store.writer_lock("critic")
    lock.acquire()
    try:
        staging = store.step_dir(4) / ".staging-critic"
        staging.mkdir(parents=True)
        (staging / "shard0").write_text("half written")
        (store.step_dir(5) / "critic").mkdir(parents=True)
        (store.step_dir(5) / "critic" / "model.pt").write_text("verl's own")
        store.write_tracker(5)
        before = files_by_step(tmp_path)
        moved = store.supersede(1)
        assert [p.name.split(".")[0] for p in moved] == ["global_step_2", "global_step_3", "global_step_4",
                                                         "global_step_5"]
        assert files_by_step(tmp_path) == before and store.steps() == [1] and lock.held
        assert store.superseded() == sorted(p.name for p in moved)
        assert store.read_tracker() == 1
    finally:
        lock.release()
