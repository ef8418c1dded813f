"""`python -m lifecycle inspect` and `verify` on real checkpoint folders."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lifecycle import Lifecycle
from lifecycle.report import inspect_root, verify_root
from lifecycle.store import CheckpointStore


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def root(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    for role in ("actor", "critic"):
        lc = Lifecycle({"checkpoint": {"root": str(tmp_path), "roles": ["actor", "critic"]}}, role=role, model=model)
        lc.init_load()
        for step in (1, 2):
            lc.save(step)
    return tmp_path


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lifecycle", *args], capture_output=True, text=True)


def test_inspect_lists_every_step_and_role_with_contents_format_and_size(root: Path) -> None:
    result = _cli("inspect", str(root))
    assert result.returncode == 0, result.stderr
    lines = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [(cols[0], cols[1], cols[2]) for cols in lines] == [
        ("1", "actor", "yes"), ("1", "critic", "yes"), ("2", "actor", "yes"), ("2", "critic", "yes")
    ]
    assert all(cols[3] == "extra,model" and cols[4] == "hf" for cols in lines)
    assert "resume picks step: 2; tracker: 2" in result.stdout


def test_inspect_says_why_a_step_is_incomplete_and_exits_non_zero(root: Path) -> None:
    (root / "global_step_2" / "critic" / "manifest.json").unlink()
    (root / "global_step_2" / "actor" / "model" / "model.safetensors").write_bytes(b"short")
    out = io.StringIO()
    assert inspect_root(root, None, out) == 1
    text = out.getvalue()
    assert "2  actor      NO" in text and "2  critic     NO" in text
    assert "model.safetensors: size 5 != manifest" in text
    assert "manifest.json" in text and "resume picks step: 1" in text
    assert "resume ignores it" in text


def test_verify_passes_on_an_intact_root(root: Path) -> None:
    result = _cli("verify", str(root))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 of 4 role folders verified" in result.stdout


def test_verify_finds_a_flipped_byte_and_names_the_file(root: Path) -> None:
    target = root / "global_step_1" / "critic" / "model" / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    result = _cli("verify", str(root), "--step", "1")
    assert result.returncode == 1
    assert f"{target}: checksum" in result.stdout
    assert "1 of 2 role folders verified" in result.stdout


def test_verify_shows_progress_on_a_terminal(root: Path) -> None:
    err = _Terminal()
    assert verify_root(root, 2, ["actor"], io.StringIO(), err) == 0
    updates = err.getvalue().split("\r")
    assert any("(100.0%)" in u for u in updates)
    assert "global_step_2/actor: ok" in updates[-1] and "GB/s" in updates[-1]


def test_verify_of_a_missing_step_or_root_is_an_error_naming_it(root: Path) -> None:
    result = _cli("verify", str(root), "--step", "9")
    assert result.returncode == 2 and "global_step_9: no such step" in result.stderr
    result = _cli("inspect", str(root / "nowhere"))
    assert result.returncode == 2 and "nowhere: no such checkpoint root" in result.stderr


def test_inspect_reports_a_tracker_that_is_not_a_number(root: Path) -> None:
    (root / "latest_checkpointed_iteration.txt").write_text("two\n")
    out = io.StringIO()
    assert inspect_root(root, None, out) == 1
    assert "tracker: unreadable" in out.getvalue() and "latest_checkpointed_iteration.txt" in out.getvalue()
    assert json.loads((root / "global_step_2" / "actor" / "manifest.json").read_text())["step"] == 2


def test_inspect_exits_non_zero_when_an_older_committed_step_is_damaged(root: Path) -> None:
    (root / "global_step_1" / "actor" / "model" / "model.safetensors").unlink()
    out = io.StringIO()
    assert inspect_root(root, None, out) == 1, "a fallback would need that step"
    assert "1  actor      NO" in out.getvalue() and "resume picks step: 2" in out.getvalue()


def test_inspect_exits_zero_when_an_older_step_holds_one_role_only(root: Path) -> None:
    """A save that never committed every role (a crash between roles) is no damage."""
    import shutil

    shutil.rmtree(root / "global_step_1" / "critic")
    assert inspect_root(root, None, io.StringIO()) == 0


def test_names_and_manifest_strings_reach_the_terminal_escaped(root: Path) -> None:
    clipboard = "\x1b]52;c;cm0gLXJmIH4K\x07\x1b[2J"
    (root / clipboard).write_text("x")
    (root / "global_step_1" / "actor" / "model" / "model.safetensors").unlink()
    manifest = root / "global_step_1" / "actor" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["files"][0]["path"] = "model/x\n       1  actor      yes\x1b[8m"
    manifest.write_text(json.dumps(data))
    for command in ("inspect", "verify"):
        result = _cli(command, str(root))
        assert result.returncode == 1, result.stderr
        for text in (result.stdout, result.stderr):
            assert "\x1b" not in text and "\x07" not in text, command
        assert "\\x1b]52;c;cm0gLXJmIH4K\\x07\\x1b[2J" in result.stdout
        assert not any(line.strip().startswith("1  actor      yes") for line in result.stdout.splitlines())
    missing = _cli("verify", str(root / "no\x1b[2Jsuch"))
    assert missing.returncode == 2 and "\x1b" not in missing.stderr and "no\\x1b[2Jsuch" in missing.stderr


@pytest.mark.parametrize(("contents", "said"), [
    ({"weights\n   2  actor  yes": {"backend": "hf", "folder": "model"}}, "which is none of"),
    ({"model": {"backend": "hf\x1b[8m", "folder": "model"}}, "which no backend is called"),
])
def test_a_manifest_naming_an_unknown_content_or_an_odd_backend_is_refused(root: Path, contents: dict,
                                                                          said: str) -> None:
    manifest = root / "global_step_2" / "actor" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["contents"] = contents
    manifest.write_text(json.dumps(data))
    out = io.StringIO()
    assert inspect_root(root, None, out) == 1
    assert said in out.getvalue()


def test_a_folder_no_save_committed_is_wrong_not_taken_for_a_role(root: Path) -> None:
    (root / "global_step_1" / "tmp").mkdir()
    out = io.StringIO()
    assert inspect_root(root, None, out) == 1
    text = out.getvalue()
    assert "global_step_1/tmp: a folder no save committed" in text and "resume picks step: 2" in text
    assert " tmp " not in text.split("wrong")[0], "no row for it"


def test_a_role_whose_every_manifest_is_gone_is_reported_wrong_not_left_out(root: Path) -> None:
    for step in (1, 2):
        (root / f"global_step_{step}" / "critic" / "manifest.json").unlink()
    out = io.StringIO()
    assert inspect_root(root, None, out) == 1
    assert out.getvalue().count("a role whose every step lost its manifest") == 2
    out = io.StringIO()
    assert inspect_root(root, ["actor", "critic"], out) == 1 and "resume picks step: None" in out.getvalue()


def test_a_root_full_of_empty_steps_and_stray_folders_prints_a_bounded_report(root: Path) -> None:
    from lifecycle.report import MAX_ROWS

    for step in range(10, 10 + MAX_ROWS):
        (root / f"global_step_{step}").mkdir()
    for i in range(300):
        (root / "global_step_2" / f"r{i}").mkdir()
    out = io.StringIO()
    assert inspect_root(root, None, out) == 1, "the newest step is empty"
    lines = out.getvalue().splitlines()
    assert len(lines) < 3 * MAX_ROWS + 60 and f"{2 * MAX_ROWS + 4 - MAX_ROWS} older rows not shown" in out.getvalue()
    out = io.StringIO()
    assert verify_root(root, None, None, out, err=io.StringIO()) == 1
    assert len(out.getvalue().splitlines()) < 3 * MAX_ROWS + 60
    assert f"... and {2 * MAX_ROWS - MAX_ROWS} more role folders failed" in out.getvalue()


def test_a_tracker_naming_a_step_that_is_not_on_disk_is_wrong(root: Path) -> None:
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    out = io.StringIO()
    assert inspect_root(root, None, out) == 1
    assert "tracker: 7 (WRONG: no such step on disk" in out.getvalue()


@pytest.mark.parametrize(("args", "said"), [
    (["inspect", ""], "an empty path names no checkpoint root"),
    (["verify", "ROOT", "--step", "2_0"], "'2_0' is not a step number"),
    (["verify", "ROOT", "--step", "\u0662"], "is not a step number"),
])
def test_cli_arguments_that_name_no_root_or_step_are_refused(root: Path, args: list[str], said: str) -> None:
    result = _cli(*[str(root) if a == "ROOT" else a for a in args])
    assert result.returncode == 2 and said in result.stderr and "Traceback" not in result.stderr


def test_a_root_that_is_a_file_is_named_as_one_and_roles_given_twice_are_checked_once(root: Path) -> None:
    result = _cli("inspect", str(root / "latest_checkpointed_iteration.txt"))
    assert result.returncode == 2 and "a regular file, not a checkpoint root folder" in result.stderr
    result = _cli("verify", str(root), "--roles", "actor", "actor")
    assert result.returncode == 0 and "2 of 2 role folders verified" in result.stdout


def _moves_aside_while_read(monkeypatch: pytest.MonkeyPatch, method: str, step: int, whole_step: bool) -> None:
    """The first check of `step`'s actor folder finds it gone: retention (or a rollback) moved
    it into the trash a moment after the root was listed."""
    real = getattr(CheckpointStore, method)

    def check(self: CheckpointStore, at: int, role: str, *args: Any, **kwargs: Any) -> list[str]:
        target = self.step_dir(at) if whole_step else self.role_dir(at, role)
        if (at, role) == (step, "actor") and target.exists():
            target.rename(self.root / f".trash-{target.name}-0123abcd")
        return real(self, at, role, *args, **kwargs)

    monkeypatch.setattr(CheckpointStore, method, check)


@pytest.mark.parametrize("whole_step", [True, False])
def test_a_step_removed_while_verify_reads_it_is_reported_removed_not_damaged(
    root: Path, monkeypatch: pytest.MonkeyPatch, whole_step: bool
) -> None:
    """Before: verify said 'role folder missing' or 'file missing' and exited 1 while retention ran."""
    _moves_aside_while_read(monkeypatch, "verify", 1, whole_step)
    out = io.StringIO()
    assert verify_root(root, None, None, out, io.StringIO()) == 0, out.getvalue()
    assert "global_step_1/actor: removed while it was read" in out.getvalue()
    assert "missing" not in out.getvalue()


def test_a_step_removed_while_inspect_reads_it_is_reported_removed_not_damaged(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _moves_aside_while_read(monkeypatch, "validate", 2, whole_step=True)
    out = io.StringIO()
    assert inspect_root(root, None, out) == 0, out.getvalue()
    assert "removed while being read (2;" in out.getvalue() and "missing" not in out.getvalue()
    assert "resume picks step: 1" in out.getvalue()


def test_inspect_lists_copies_a_re_commit_left_aside(root: Path) -> None:
    """Before: `.replaced-*` folders were hidden as housekeeping, though nothing removed them."""
    import shutil

    shutil.copytree(root / "global_step_1" / "critic", root / ".replaced-1-critic-0123abcd")
    (root / "global_step_2" / "actor").rename(root / ".replaced-2-actor-89abcdef")
    out = io.StringIO()
    assert inspect_root(root, None, out) == 1
    text = out.getvalue()
    assert "left aside by a re-commit (2)" in text
    assert ".replaced-1-critic-0123abcd: a replaced copy of step 1, role critic; the next save removes it" in text
    assert ".replaced-2-actor-89abcdef: the only committed copy of step 2, role actor" in text
    assert "resume picks step: 2" in text


def test_inspect_lists_a_replaced_copy_whose_step_is_gone_as_orphaned_never_as_an_only_copy(root: Path) -> None:
    """Before: a copy of a step since pruned was called that step's only committed copy, to be put back."""
    import shutil

    shutil.copytree(root / "global_step_1" / "critic", root / ".replaced-7-critic-0123abcd")
    out = io.StringIO()
    assert inspect_root(root, None, out) == 0, out.getvalue()
    assert ".replaced-7-critic-0123abcd: orphaned: a replaced copy of step 7, role critic" in out.getvalue()
    assert "only committed copy" not in out.getvalue()


def test_inspect_lists_staging_folders_with_or_without_a_manifest_as_leftovers_not_wrong(root: Path) -> None:
    """Before: the copy a crash right after a re-commit's exchange left in `.staging-<role>` was not mentioned."""
    import shutil

    shutil.copytree(root / "global_step_1" / "actor", root / "global_step_1" / ".staging-actor")
    (root / "global_step_2" / ".staging-critic").mkdir()
    out = io.StringIO()
    assert inspect_root(root, None, out) == 0, out.getvalue()
    text = out.getvalue()
    assert "staging folders (2; saves in progress, or left by a crash; not damage)" in text
    assert "global_step_1/.staging-actor: holds a manifest" in text
    assert "global_step_2/.staging-critic: a save in progress, or one a crash cut short" in text


def test_verify_passes_with_a_role_missing_from_an_older_step_and_fails_when_the_newest_lacks_one(root: Path) -> None:
    """Each role prunes only its own folders, so between saves the role that saves first holds one
    step more than keep_last, without the other role's folder. Before: verify said 'critic: role
    folder missing' and exited 1."""
    import shutil

    shutil.rmtree(root / "global_step_1" / "critic")
    out = io.StringIO()
    assert verify_root(root, None, None, out, io.StringIO()) == 0, out.getvalue()
    assert "3 of 3 role folders verified" in out.getvalue() and "missing" not in out.getvalue()
    assert "incomplete older steps (1; not wrong)" in out.getvalue()
    assert "global_step_1/critic: not committed (an older step than 2, which resume picks)" in out.getvalue()
    assert inspect_root(root, None, io.StringIO()) == 0
    shutil.rmtree(root / "global_step_2" / "critic")
    out = io.StringIO()
    assert verify_root(root, None, ["actor", "critic"], out, io.StringIO()) == 1
    assert "global_step_2/critic: role folder missing" in out.getvalue()
