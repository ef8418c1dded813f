"""A checkpoint root treated as hostile input: odd names, odd file types, full disks, missing
permissions, symlinks and housekeeping that fails. Each case ends in a typed error naming what
is wrong, in bounded time, with nothing written outside the root, and the previous step still
resumable with its exact weights; or, after a commit, in a logged warning and a save that
succeeds."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from lifecycle import CheckpointError, Lifecycle, State
from lifecycle.checksum import ALGORITHM, file_digest
from lifecycle.manifest import MANIFEST
from lifecycle.report import MAX_LINES, inspect_root, verify_root
from lifecycle.store import TRACKER, CheckpointStore
from tests.disk import small_tmpfs
from tests.guards import within
from tests.lifecycle.hostile import (
    ROLE,
    Net,
    fill,
    has_weights_of,
    lifecycle_at,
    run_unprivileged,
    saved_run,
)

HANG_GUARD_S = 60


def resumes_exactly(root: Path, step: int) -> None:
    lc = lifecycle_at(root, on_damaged="refuse")
    assert lc.resume() == step and has_weights_of(lc.parts.model, step)


def folder(root: Path, step: int = 2) -> Path:
    return root / f"global_step_{step}" / ROLE


def rewrite_manifest(path: Path, edit: Callable[[dict], None]) -> None:
    data = json.loads((path / MANIFEST).read_text())
    edit(data)
    (path / MANIFEST).write_text(json.dumps(data))


def rehash(manifest: dict, role_folder: Path) -> None:
    """The manifest's sizes and digests made to match the files as they are now."""
    for entry in manifest["files"]:
        entry["size"] = (role_folder / entry["path"]).stat().st_size
        entry[ALGORITHM] = file_digest(role_folder / entry["path"])


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lifecycle", *args], capture_output=True, text=True,
                          timeout=HANG_GUARD_S)


# Manifest paths that cannot be files ------------------------------------------------------------

BAD_PATHS = {  # path: what the refusal says
    "nul": ("model/model\x00.safetensors", "NUL byte"),
    "long-name": ("model/" + "x" * 300, "longer than 255"),
    "through-a-file": ("model/model.safetensors/inner", "listed in the manifest but missing"),
    "lone-surrogate": ("model/\ud800.safetensors", "cannot be encoded"),
    "too-long": ("a/" * 2100 + "x", "longer than 4096"),
}


@pytest.mark.parametrize(("bad", "says"), BAD_PATHS.values(), ids=BAD_PATHS.keys())
def test_manifest_paths_that_cannot_be_files_are_refused_by_resume_verify_and_inspect(
    tmp_path: Path, bad: str, says: str
) -> None:
    saved_run(tmp_path)
    rewrite_manifest(folder(tmp_path), lambda d: d["files"].append({"path": bad, "size": 1, "xxh3_64": "0" * 16}))
    lc = lifecycle_at(tmp_path, on_damaged="refuse")
    with pytest.raises(CheckpointError, match=says) as caught:
        lc.resume()
    assert str(folder(tmp_path)) in str(caught.value) and lc.state is State.FAILED
    out = io.StringIO()
    assert verify_root(tmp_path, None, None, out, io.StringIO()) == 1 and says in out.getvalue()
    assert inspect_root(tmp_path, None, io.StringIO()) == 1
    lc = lifecycle_at(tmp_path)  # fallback: step 2 set aside, step 1 resumes exactly
    assert lc.resume() == 1 and has_weights_of(lc.parts.model, 1)


def test_a_content_folder_with_a_nul_byte_is_refused(tmp_path: Path) -> None:
    saved_run(tmp_path)
    rewrite_manifest(folder(tmp_path), lambda d: d["contents"]["model"].update(folder="mo\x00del"))
    with pytest.raises(CheckpointError, match="NUL"):
        lifecycle_at(tmp_path, on_damaged="refuse").resume()


def test_a_manifest_nested_too_deep_or_with_a_huge_number_is_not_a_manifest(tmp_path: Path) -> None:
    saved_run(tmp_path)
    (folder(tmp_path) / MANIFEST).write_text("[" * 100_000)
    (folder(tmp_path, 1) / MANIFEST).write_text('{"step": ' + "9" * 5000 + "}")
    store = CheckpointStore(tmp_path)
    assert "nested too deeply" in store.validate(2, ROLE, deep=False)[0]
    assert "not valid JSON" in store.validate(1, ROLE, deep=False)[0]
    lc = lifecycle_at(tmp_path)  # both set aside as damaged; then no fresh start over them
    with pytest.raises(CheckpointError, match="(?s)no undamaged checkpoint.*nested too deeply.*not valid JSON"):
        lc.resume()
    assert lc.state is State.FAILED


# Odd file types: nothing blocks --------------------------------------------------------------

def test_a_fifo_in_place_of_the_manifest_is_refused_without_blocking(tmp_path: Path) -> None:
    saved_run(tmp_path)
    (folder(tmp_path) / MANIFEST).unlink()
    os.mkfifo(folder(tmp_path) / MANIFEST)
    with pytest.raises(CheckpointError, match="FIFO"):
        within(HANG_GUARD_S, lambda: CheckpointStore(tmp_path).read_manifest(2, ROLE))
    assert within(HANG_GUARD_S, lambda: inspect_root(tmp_path, None, io.StringIO())) == 1
    result = within(HANG_GUARD_S, lambda: cli("verify", str(tmp_path)))
    assert result.returncode == 1 and "FIFO" in result.stdout  # type: ignore[union-attr]
    lc = lifecycle_at(tmp_path)  # fallback: the step whose manifest is a FIFO is set aside
    assert within(HANG_GUARD_S, lc.resume) == 1 and has_weights_of(lc.parts.model, 1)


@pytest.mark.parametrize("where", ["model/model.safetensors", "model/planted.safetensors", "extra/rank_0/fifo"])
def test_a_fifo_inside_a_step_is_refused_in_cheap_and_deep_checks(tmp_path: Path, where: str) -> None:
    saved_run(tmp_path)
    path = folder(tmp_path) / where
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    store = CheckpointStore(tmp_path)
    for deep in (False, True):
        assert any(str(path) in p and "FIFO" in p for p in store.validate(2, ROLE, deep=deep))
    lc = lifecycle_at(tmp_path, verify=False, on_damaged="refuse")
    with pytest.raises(CheckpointError, match="FIFO"):
        within(HANG_GUARD_S, lc.resume)
    falls_back = lifecycle_at(tmp_path, verify=False)  # fallback: step 2 set aside, step 1 exactly
    assert within(HANG_GUARD_S, falls_back.resume) == 1 and has_weights_of(falls_back.parts.model, 1)


@pytest.mark.parametrize("kind", ["fifo", "folder", "huge-number", "not-ascii", "symlink"])
def test_a_tracker_that_is_not_a_tracker_never_fails_a_save(tmp_path: Path, kind: str) -> None:
    saved_run(tmp_path, steps=(1,))
    tracker = tmp_path / TRACKER
    tracker.unlink()
    if kind == "fifo":
        os.mkfifo(tracker)
    elif kind == "folder":
        tracker.mkdir()
    elif kind == "huge-number":
        tracker.write_text("9" * 10_000)
    elif kind == "not-ascii":
        tracker.write_bytes(b"\xff\xfe1")
    else:
        (tmp_path / "target").write_text("keep me")
        tracker.symlink_to(tmp_path / "target")
    lc = lifecycle_at(tmp_path)
    assert within(HANG_GUARD_S, lc.resume) == 1
    with capture_logs() as logs:
        for step in (2, 3):
            fill(lc.parts.model, step)
            assert within(HANG_GUARD_S, lambda: lc.save(step)).step == step  # type: ignore[union-attr]
    assert lc.state is State.READY
    if kind == "folder":  # cannot be replaced: logged by each save, which succeeds
        failed = [r for r in logs if r["event"] == "checkpoint.tracker_failed"]
        assert len(failed) == 2 and failed[0]["path"] == str(tracker) and failed[0]["step"] == 2
        assert "Is a directory" in failed[0]["error"]
    else:  # read as no step: the save puts a good tracker in its place
        assert CheckpointStore(tmp_path).read_tracker() == 3
    if kind == "symlink":
        assert (tmp_path / "target").read_text() == "keep me"
    assert not list(tmp_path.glob(f".{TRACKER}.tmp-*"))
    resumes_exactly(tmp_path, 3)


# Permissions: a process without root's powers ------------------------------------------------

UNPRIVILEGED = """
import contextlib, io, sys
from pathlib import Path
from lifecycle import CheckpointError
from lifecycle.cli import main
from tests.lifecycle.hostile import lifecycle_at, has_weights_of
root = Path(sys.argv[1])
for job in sys.argv[2:]:  # in the order given, in one process: one import of torch for them all
    print("JOB", job, flush=True)
    if job.startswith("cli-"):  # a command of the CLI: its exit code, then what it wrote to each stream
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([job[4:], str(root)])
        print(f"RC {code}\\nSTDOUT {out.getvalue()}\\nSTDERR {err.getvalue()}", flush=True)
        continue
    lc = lifecycle_at(root, on_damaged=job)  # a resume with this on_damaged mode, in a fresh lifecycle
    try:
        step = lc.resume()
        print("RESUMED", step, has_weights_of(lc.parts.model, step))
    except CheckpointError as exc:
        print("REFUSED", exc)
"""


def unprivileged(root: Path, *jobs: str) -> tuple[list[str], subprocess.CompletedProcess[str]]:
    """What each of `jobs` said, one after the other in one unprivileged process: a resume in an
    `on_damaged` mode ("refuse", "fallback"), or a CLI command run on `root` ("cli-verify")."""
    done = run_unprivileged(UNPRIVILEGED, str(root), *jobs)
    said = [part.partition("\n")[2] for part in done.stdout.split("JOB ")[1:]]
    assert len(said) == len(jobs), done.stdout + done.stderr
    return said, done


@pytest.mark.parametrize("target", ["file", "folder", "manifest", "role"])
def test_unreadable_files_and_folders_are_named_with_the_errno_text(tmp_path: Path, target: str) -> None:
    saved_run(tmp_path)
    path = {"file": folder(tmp_path) / "optimizer" / "optimizer.json",
            "folder": folder(tmp_path) / "model",
            "manifest": folder(tmp_path) / MANIFEST,
            "role": folder(tmp_path)}[target]
    path.chmod(0)
    try:
        # a role folder it cannot search is a damaged row of `inspect`, not the end of its table
        jobs = ["cli-inspect"] * (target == "role") + ["refuse", "fallback", "cli-verify"]
        said, done = unprivileged(tmp_path, *jobs)
        assert "Traceback" not in done.stderr, done.stderr
        if target == "role":
            table = said.pop(0)
            assert table.startswith("RC 1") and "resume stops: " in table and "Permission denied" in table, table
        refused, falls_back, listing = said
        assert "REFUSED" in refused and str(path) in refused
        assert "Permission denied" in refused
        if target == "role":  # which steps it holds cannot be told: no fallback sets healthy steps aside
            assert "REFUSED" in falls_back and "Permission denied" in falls_back, done.stdout + done.stderr
        else:
            assert "RESUMED 1 True" in falls_back, done.stdout + done.stderr
        assert listing.startswith(("RC 1", "RC 2")), listing
    finally:
        subprocess.run(["chmod", "-R", "u+rwX", str(tmp_path)], check=True)  # the step may be set aside


def test_an_unreadable_root_is_a_checkpoint_error_naming_it(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    saved_run(root)
    root.chmod(0)
    try:
        (said, listing), done = unprivileged(root, "fallback", "cli-inspect")
        assert "REFUSED" in said and str(root) in said and "Permission denied" in said
        assert listing.startswith("RC 2") and "Permission denied" in listing.partition("STDERR ")[2], listing
        assert "Traceback" not in done.stderr, done.stderr
    finally:
        root.chmod(0o755)


# A full disk --------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, unmounted after the test."""
    with small_tmpfs(tmp_path / "small", "1m") as mount:
        yield mount


@pytest.mark.parametrize("fmt", ["hf", "torch_dcp"])
def test_a_full_disk_fails_the_save_naming_the_step_and_gives_its_space_back(small_disk: Path, fmt: str) -> None:
    """torch's DCP writer says only `unexpected pos 704 vs 598`: the cause is named for it."""
    root = small_disk / "ckpt"
    lc = lifecycle_at(root, save_format=fmt)
    lc.init_load()
    fill(lc.parts.model, 1)
    lc.save(1)
    ballast = small_disk / "ballast"
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    ballast.write_bytes(b"\0" * max(0, free - 4096))
    fill(lc.parts.model, 2)
    with pytest.raises(CheckpointError, match=r"step[_ ]2\b.*No space left on device"):
        lc.save(2)
    assert lc.state is State.FAILED
    assert not (root / "global_step_2" / f".staging-{ROLE}").exists()
    ballast.unlink()
    if fmt == "hf":
        resumes_exactly(root, 1)
    else:
        assert lifecycle_at(root, save_format=fmt, on_damaged="refuse").resume() == 1


# Step folder names and junk --------------------------------------------------------------------

def test_a_zero_padded_step_folder_is_reported_and_never_crashes_the_cli(tmp_path: Path) -> None:
    saved_run(tmp_path)
    (tmp_path / "global_step_2").rename(tmp_path / "global_step_0002")
    for command in ("inspect", "verify"):
        result = cli(command, str(tmp_path))
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert "global_step_0002: not a canonical step folder name" in result.stdout
    lc = lifecycle_at(tmp_path)
    assert lc.resume() == 1 and has_weights_of(lc.parts.model, 1)


def test_hundreds_of_junk_entries_give_bounded_output_and_the_rest_is_still_checked(tmp_path: Path) -> None:
    saved_run(tmp_path)
    for i in range(500):
        (tmp_path / f"global_step_{i:05d}").mkdir()
        (tmp_path / f"junk-{i}").mkdir()
        (tmp_path / "global_step_1" / f"not a role {i}").mkdir()
    (tmp_path / "global_step_\udcff").mkdir()  # a name that is not UTF-8
    for command in ("inspect", "verify"):
        result = cli(command, str(tmp_path))
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        lines = result.stdout.splitlines()
        assert len(lines) < 6 * MAX_LINES + 40, f"{len(lines)} lines"
        assert "... and" in result.stdout
    assert "2 of 2 role folders verified" in cli("verify", str(tmp_path)).stdout


# Symlinks ------------------------------------------------------------------------------------

def test_a_step_folder_symlinked_outside_the_root_is_never_written_through(tmp_path: Path) -> None:
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    saved_run(root, steps=(1,))
    outside.mkdir()
    (root / "global_step_2").symlink_to(outside)
    lc = lifecycle_at(root)
    assert lc.resume() == 1
    with pytest.raises(CheckpointError, match="global_step_2: a step folder is a symlink"):
        lc.save(2)
    assert list(outside.iterdir()) == []
    resumes_exactly(root, 1)


def test_a_role_folder_symlinked_elsewhere_is_not_followed_on_resume(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    saved_run(root)
    folder(root).rename(elsewhere)
    folder(root).symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="a role folder is a symlink"):
        lifecycle_at(root, on_damaged="refuse").resume()
    lc = lifecycle_at(root)
    assert lc.resume() == 1 and has_weights_of(lc.parts.model, 1)
    assert (elsewhere / MANIFEST).is_file()  # set aside as a link; what it pointed at is untouched


@pytest.mark.parametrize("named", ["step", "role"])
def test_resume_path_through_a_symlinked_step_folder_is_refused_and_loads_nothing(tmp_path: Path,
                                                                                 named: str) -> None:
    root, other = tmp_path / "ckpt", tmp_path / "other"
    saved_run(root, steps=(1,))
    saved_run(other, steps=(3,))
    (root / "global_step_3").symlink_to(other / "global_step_3")
    path = root / "global_step_3" / (ROLE if named == "role" else "")
    lc = lifecycle_at(root, mode="path", path=str(path))
    with pytest.raises(CheckpointError, match="global_step_3: .*is a symlink"):
        lc.resume()
    assert not has_weights_of(lc.parts.model, 3)


def test_a_step_whose_progress_names_another_step_is_refused_before_anything_loads(tmp_path: Path) -> None:
    saved_run(tmp_path)
    extra = folder(tmp_path) / "extra" / "rank_0" / "extra.json"
    data = json.loads(extra.read_text())
    data["progress"]["step"] = 7
    extra.write_text(json.dumps(data))
    rewrite_manifest(folder(tmp_path), lambda m: rehash(m, folder(tmp_path)))  # the forger's own digests
    lc = lifecycle_at(tmp_path, on_damaged="refuse")
    with pytest.raises(CheckpointError, match="its progress says step 7, but it is in the folder of step 2"):
        lc.resume()
    assert not has_weights_of(lc.parts.model, 2), "refused before the weights were loaded"


@pytest.mark.parametrize("plant", ["fifo", "symlink"])
def test_a_planted_lock_or_staging_entry_is_handled_without_blocking(tmp_path: Path, plant: str) -> None:
    saved_run(tmp_path, steps=(1,))
    lock = tmp_path / f".lock-{ROLE}"
    lock.unlink()
    if plant == "fifo":
        os.mkfifo(lock)
    else:
        lock.symlink_to(tmp_path / "elsewhere")
    lc = lifecycle_at(tmp_path)
    assert lc.resume() == 1
    with pytest.raises(CheckpointError, match=str(lock)):
        within(HANG_GUARD_S, lambda: lc.save(2))
    assert not (tmp_path / "elsewhere").exists()
    resumes_exactly(tmp_path, 1)


# Housekeeping after a commit -----------------------------------------------------------------

RETENTION = """
import sys
from pathlib import Path
from structlog.testing import capture_logs
from tests.lifecycle.hostile import lifecycle_at, fill
lc = lifecycle_at(Path(sys.argv[1]), keep_last=1)
assert lc.resume() == int(sys.argv[2])
with capture_logs() as logs:
    for step in map(int, sys.argv[3].split(",")):
        fill(lc.parts.model, step)
        lc.save(step)
print("STATE", lc.state.name)
print("FAILED", sum(r["event"] == "checkpoint.retention_failed" for r in logs))
"""


def test_retention_that_cannot_delete_is_logged_and_retried_never_failing_a_save(tmp_path: Path) -> None:
    saved_run(tmp_path, steps=(1, 2))
    stuck = tmp_path / "global_step_1" / ROLE / "model"
    stuck.chmod(0o555)  # its file cannot be unlinked without root's powers
    try:
        first = run_unprivileged(RETENTION, str(tmp_path), "2", "3,4")
        assert "STATE READY" in first.stdout, first.stdout + first.stderr
        failed = int(first.stdout.split("FAILED ")[1].split()[0])
        assert failed >= 1  # the step went out of sight; removing what it holds failed, logged
        assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_4"]
        assert list(tmp_path.glob(".trash-*"))  # the leftover waits for a later save
    finally:
        for leftover in tmp_path.glob(".trash-*/**/model"):
            leftover.chmod(0o755)
        stuck.chmod(0o755) if stuck.exists() else None
    again = run_unprivileged(RETENTION, str(tmp_path), "4", "5")
    assert "STATE READY" in again.stdout and "FAILED 0" in again.stdout, again.stdout + again.stderr
    assert not list(tmp_path.glob(".trash-*"))
    resumes_exactly(tmp_path, 5)


# Writes never go through something planted ----------------------------------------------------

def test_a_symlink_planted_at_the_trackers_temporary_name_is_never_written_through(tmp_path: Path) -> None:
    root, precious = tmp_path / "ckpt", tmp_path / "precious"
    root.mkdir()
    precious.write_text("PRECIOUS\n")
    for pid in range(os.getpid() - 50, os.getpid() + 50):  # the names a pid-based temporary file would take
        (root / f".{TRACKER}.tmp-{pid}").symlink_to(precious)
    lc = lifecycle_at(root)
    lc.init_load()
    lc.save(1)
    assert precious.read_text() == "PRECIOUS\n"
    assert not (root / TRACKER).is_symlink() and CheckpointStore(root).read_tracker() == 1


def test_a_lock_file_hard_linked_to_another_file_is_refused_untouched(tmp_path: Path) -> None:
    root, precious = tmp_path / "ckpt", tmp_path / "precious"
    saved_run(root, steps=(1,))
    precious.write_text("PRECIOUS\n")
    (root / f".lock-{ROLE}").unlink()
    os.link(precious, root / f".lock-{ROLE}")
    lc = lifecycle_at(root)
    assert lc.resume() == 1
    with pytest.raises(CheckpointError, match="names .a hard link"):
        lc.save(2)
    assert precious.read_text() == "PRECIOUS\n"


@pytest.mark.parametrize("step", [1.5, True, "3", -1, 10**18, None])
def test_a_step_that_cannot_name_a_folder_is_refused_before_the_machine_moves(tmp_path: Path, step: object) -> None:
    saved_run(tmp_path, steps=(1,))
    lc = lifecycle_at(tmp_path)
    assert lc.resume() == 1
    lc.progress.step = step  # type: ignore[assignment]  # what save() falls back to without an argument
    with pytest.raises(CheckpointError, match="step must be an integer"):
        lc.save(step) if step is not None else lc.save()
    assert lc.state is State.READY
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("global_step")) == ["global_step_1"]
    resumes_exactly(tmp_path, 1)


def test_numpy_and_torch_integer_steps_are_saved_as_plain_numbers(tmp_path: Path) -> None:
    import numpy as np
    import torch

    lc = lifecycle_at(tmp_path)
    lc.init_load()
    lc.save(np.int64(2))  # type: ignore[arg-type]
    lc.save(torch.tensor(3))  # type: ignore[arg-type]
    assert CheckpointStore(tmp_path).steps() == [2, 3] and CheckpointStore(tmp_path).read_manifest(3, ROLE)["step"] == 3


# Loading what the manifest vouches for, into what the worker runs --------------------------------

def test_a_pre_load_folder_holding_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    saved_run(tmp_path / "run", steps=(1,))
    init = tmp_path / "init"
    init.mkdir()
    for f in (folder(tmp_path / "run", 1) / "model").iterdir():
        (init / f.name).write_bytes(f.read_bytes())
    os.mkfifo(init / "extra.safetensors")
    lc = Lifecycle({"checkpoint": {"pre_load": {"path": str(init)}}}, role=ROLE, model=Net())
    with pytest.raises(CheckpointError, match="extra.safetensors: a FIFO"):
        within(HANG_GUARD_S, lc.init_load)


def test_a_dataloader_raising_its_own_error_on_resume_is_a_checkpoint_error(tmp_path: Path) -> None:
    class Loader:
        def state_dict(self) -> dict:
            return {"position": 3}

        def load_state_dict(self, state: dict) -> None:
            raise KeyError("epoch")

    lc = lifecycle_at(tmp_path)
    lc.parts.dataloader = Loader()
    lc.init_load()
    lc.save(1)
    again = lifecycle_at(tmp_path, on_damaged="refuse")
    again.parts.dataloader = Loader()
    with pytest.raises(CheckpointError, match="KeyError: 'epoch'"):
        again.resume()
    assert again.state is State.FAILED


def test_a_manifest_naming_a_format_of_another_model_family_is_refused_before_importing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lifecycle.load_format as load_format

    saved_run(tmp_path)
    rewrite_manifest(folder(tmp_path), lambda d: d["contents"]["model"].update(backend="dist_ckpt"))
    asked: list[str] = []
    backend_class = load_format.backend_class
    monkeypatch.setattr(load_format, "backend_class", lambda name: asked.append(name) or backend_class(name))
    with pytest.raises(CheckpointError, match="saved with format 'dist_ckpt' .Megatron."):
        lifecycle_at(tmp_path, on_damaged="refuse").resume()
    assert "dist_ckpt" not in asked


def test_a_manifest_stating_an_impossible_size_is_not_a_manifest_and_inspect_says_so(tmp_path: Path) -> None:
    saved_run(tmp_path)
    rewrite_manifest(folder(tmp_path), lambda d: d["files"][0].update(size=10**400))
    result = cli("inspect", str(tmp_path))
    assert result.returncode == 1 and "Traceback" not in result.stderr and "0 to 2**62" in result.stdout
    lc = lifecycle_at(tmp_path)
    assert lc.resume() == 1 and has_weights_of(lc.parts.model, 1)


def test_a_config_error_raised_inside_a_guarded_call_keeps_its_key() -> None:
    from lifecycle.boundary import os_errors
    from lifecycle.errors import ConfigError

    with pytest.raises(ConfigError, match="parallel: bad"), os_errors("cannot write"):
        raise ConfigError("parallel", "bad")


def test_a_module_path_a_manifest_names_as_its_format_is_never_imported(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest is the checkpoint's own word (no checksum covers it): a format named
    `planted:Backend` there would import, and so run, any module on the path. It is refused
    unimported."""
    saved_run(tmp_path)
    plugins = tmp_path.parent / f"{tmp_path.name}-path"
    plugins.mkdir()
    marker = plugins / "ran"
    (plugins / "planted_by_manifest.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(plugins))
    rewrite_manifest(folder(tmp_path), lambda d: d["contents"]["model"].update(backend="planted_by_manifest:X"))
    with pytest.raises(CheckpointError, match="module path this worker's config does not name"):
        lifecycle_at(tmp_path, on_damaged="refuse").resume()
    assert not marker.exists() and "planted_by_manifest" not in sys.modules
