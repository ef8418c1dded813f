"""The checkpoint store against a hostile process, not a hostile disk: a reader short of file
descriptors or memory, a tracker write that fails, a log sink that fails, a bad argument to wait,
a save from an `atexit` hook, a working directory that changes under a relative root.

Each case ends right or loudly refused with the library's own error, and nothing is lost: no
healthy step set aside, no step the tracker names pruned, no committed save reported failed.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

from lifecycle import CheckpointError, ConfigError, Lifecycle, State
from lifecycle.background import PendingSave
from lifecycle.boundary import OutOfResources, os_error
from lifecycle.store import CheckpointStore
from lifecycle.types import SaveInfo
from tests.lifecycle.hostile import REPO, ROLE, Net, fill, has_weights_of, lifecycle_at, saved_run


def steps_and_aside(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("global_step_"))


# A reader short of its own resources ---------------------------------------------------------


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.ENOBUFS, errno.EINTR,
                                  errno.ESTALE, errno.ETIMEDOUT])
def test_os_error_tells_a_shortage_of_the_reader_from_a_fault_of_the_file(code: int) -> None:
    error = os_error(OSError(code, os.strerror(code)), "cannot open", "/ckpt/global_step_2/actor/x")
    assert isinstance(error, OutOfResources) and "says nothing about the file" in str(error)
    for fault in (errno.EIO, errno.EACCES, errno.ENOENT):
        assert type(os_error(OSError(fault, os.strerror(fault)), "cannot open", "/x")) is CheckpointError


def _failing_open(monkeypatch: pytest.MonkeyPatch, code: int, inside: str, suffix: str) -> None:
    """`os.open` raises `code` for the files under `inside` whose name ends with `suffix`."""
    real_open = os.open

    def fake_open(path: Any, *args: Any, **kwargs: Any) -> int:
        text = os.fsdecode(path)
        if inside in text and text.endswith(suffix):
            raise OSError(code, os.strerror(code), text)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)


@pytest.mark.parametrize(("code", "suffix"), [
    (errno.EMFILE, "manifest.json"), (errno.EMFILE, ".safetensors"), (errno.ENFILE, ".safetensors"),
    (errno.ESTALE, ".safetensors"), (errno.ETIMEDOUT, "manifest.json"),  # a network filesystem's handle or server
])
def test_a_resume_short_of_its_own_resources_refuses_and_sets_no_healthy_step_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, suffix: str,
) -> None:
    saved_run(tmp_path)
    lc = lifecycle_at(tmp_path, on_damaged="fallback")
    with monkeypatch.context() as patch:
        _failing_open(patch, code, "global_step_", suffix)
        with pytest.raises(CheckpointError, match=f"{errno.errorcode[code]}.*says nothing about the file"):
            lc.resume()
    assert lc.state is State.FAILED
    assert steps_and_aside(tmp_path) == ["global_step_1", "global_step_2"]  # nothing renamed aside
    again = lifecycle_at(tmp_path)
    assert again.resume() == 2 and has_weights_of(again.parts.model, 2)


@pytest.mark.parametrize("failure", [OSError(errno.ENOMEM, "Cannot allocate memory"), MemoryError()])
def test_a_resume_out_of_memory_while_hashing_refuses_and_sets_nothing_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: BaseException,
) -> None:
    saved_run(tmp_path)
    lc = lifecycle_at(tmp_path, on_damaged="fallback")

    def no_memory(*args: Any, **kwargs: Any) -> mmap.mmap:
        raise failure

    with monkeypatch.context() as patch:
        patch.setattr(mmap, "mmap", no_memory)
        with pytest.raises(CheckpointError, match="says nothing about the file"):
            lc.resume()
    assert steps_and_aside(tmp_path) == ["global_step_1", "global_step_2"]


def test_an_io_error_reading_a_file_is_still_damage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved_run(tmp_path)
    lc = lifecycle_at(tmp_path, on_damaged="fallback")
    with monkeypatch.context() as patch:
        _failing_open(patch, errno.EIO, "global_step_2/", ".safetensors")
        assert lc.resume() == 1
    assert has_weights_of(lc.parts.model, 1)
    [aside] = [name for name in steps_and_aside(tmp_path) if name.startswith("global_step_2.damaged-")]
    assert aside


# The tracker and retention -------------------------------------------------------------------


def test_retention_keeps_the_step_a_tracker_that_could_not_be_advanced_still_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    lc = lifecycle_at(tmp_path, keep_last=1)
    lc.init_load()
    fill(lc.parts.model, 1)
    lc.save(1)
    store = CheckpointStore(tmp_path)
    with monkeypatch.context() as patch:
        def disk_full(self: CheckpointStore, step: int) -> None:
            raise CheckpointError(f"{self.tracker_path}: cannot write the tracker: No space left on device (ENOSPC)")

        patch.setattr(CheckpointStore, "write_tracker", disk_full)
        fill(lc.parts.model, 2)
        lc.save(2)  # committed: the tracker is best effort
    assert store.read_tracker() == 1 and store.steps() == [1, 2]  # the step the tracker names is kept
    fill(lc.parts.model, 3)
    lc.save(3)
    assert store.read_tracker() == 3 and store.steps() == [3]  # pruned once the tracker moved on


# A log sink that fails -----------------------------------------------------------------------


class _BrokenSink:
    """A log sink that raises like a closed pipe (the log collector went away)."""

    def msg(self, message: str) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    log = debug = info = warning = error = critical = msg


@pytest.fixture
def broken_sink() -> Any:
    structlog.configure(logger_factory=lambda *args: _BrokenSink(), cache_logger_on_first_use=False)
    try:
        yield
    finally:
        structlog.reset_defaults()


def _lifecycle(root: Path, **checkpoint: Any) -> Lifecycle:
    model = Net()
    return Lifecycle({"checkpoint": {"root": str(root), **checkpoint}}, role=ROLE, model=model,
                     optimizer=torch.optim.AdamW(model.parameters(), lr=0.01))


@pytest.mark.usefixtures("broken_sink")
def test_a_failing_log_sink_never_fails_a_committed_save_sync_or_async(tmp_path: Path) -> None:
    lc = _lifecycle(tmp_path / "sync", keep_last=1)
    lc.init_load()
    for step in (1, 2):  # the second save prunes the first: retention logs too
        fill(lc.parts.model, step)
        assert lc.save(step).step == step
    assert lc.state is State.READY and CheckpointStore(tmp_path / "sync").steps() == [2]
    later = _lifecycle(tmp_path / "async", save={"async": True})
    later.init_load()
    fill(later.parts.model, 3)
    assert later.save(3).wait(60).step == 3
    later.close()
    assert CheckpointStore(tmp_path / "async").is_complete(3, [ROLE], deep=True)


def test_a_failing_log_sink_never_fails_a_resume_that_loaded(tmp_path: Path) -> None:
    saved_run(tmp_path)
    structlog.configure(logger_factory=lambda *args: _BrokenSink(), cache_logger_on_first_use=False)
    try:
        lc = lifecycle_at(tmp_path)
        assert lc.resume() == 2
    finally:
        structlog.reset_defaults()
    assert lc.state is State.READY and has_weights_of(lc.parts.model, 2)


# PendingSave.wait ----------------------------------------------------------------------------


def _pending(future: Future[SaveInfo]) -> PendingSave:
    return PendingSave(step=7, path=Path("/nowhere"), contents=["model"], backend="hf", committed=future)


@pytest.mark.parametrize("timeout", ["5", math.nan, -1, math.inf, True, [1]])
def test_wait_refuses_a_timeout_that_is_no_number_of_seconds_and_says_nothing_failed(timeout: Any) -> None:
    future: Future[SaveInfo] = Future()
    with pytest.raises(ConfigError, match="PendingSave.wait") as refused:
        _pending(future).wait(timeout)
    assert refused.value.key == "timeout"
    done = SaveInfo(step=7, path=Path("/nowhere"), contents=["model"], backend="hf")
    future.set_result(done)
    assert _pending(future).wait(0) is done and _pending(future).wait(10**400) is done


def test_wait_reports_the_writes_own_timeout_as_its_failure_not_as_in_flight() -> None:
    future: Future[SaveInfo] = Future()
    future.set_exception(TimeoutError("gloo: timed out"))
    with pytest.raises(CheckpointError, match="failed before its commit.*TimeoutError: gloo: timed out"):
        _pending(future).wait(1)
    with pytest.raises(CheckpointError, match="still in flight after 0 s"):
        _pending(Future()).wait(0)


# A save from an atexit hook ------------------------------------------------------------------

AT_EXIT = """
import atexit, os, sys
from pathlib import Path
from lifecycle.background import BackgroundSaver
from lifecycle.checksum import ALGORITHM, PIECE_BYTES, file_digest
from lifecycle.manifest import build_manifest
from lifecycle.types import SaveInfo

folder = Path(sys.argv[1])
(folder / "big.bin").write_bytes(os.urandom(PIECE_BYTES + 4096))  # two pieces: hashed on two threads
(folder / "small.bin").write_bytes(b"x" * 100)
before = {name: file_digest(folder / name) for name in ("big.bin", "small.bin")}

def at_exit():
    manifest = build_manifest(folder, step=1, role="actor", contents={}, parallel={}, model_config_hash=None, meta={})
    print("FILES", {f["path"]: f[ALGORITHM] for f in manifest["files"]} == before)
    info = SaveInfo(step=1, path=folder, contents=["model"], backend="hf")
    future = BackgroundSaver("actor").submit(1, lambda: info)
    print("ASYNC", future.done() and future.result() is info)

atexit.register(at_exit)
"""


def test_hashing_and_an_async_save_still_work_from_an_atexit_hook(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", AT_EXIT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "FILES True" in done.stdout and "ASYNC True" in done.stdout, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr


# A relative root -----------------------------------------------------------------------------


def test_a_relative_root_stays_where_it_was_when_the_working_directory_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "run_a").mkdir()
    (tmp_path / "run_b").mkdir()
    monkeypatch.chdir(tmp_path / "run_a")
    lc = lifecycle_at(Path("ckpt"))
    lc.init_load()
    fill(lc.parts.model, 1)
    lc.save(1)
    monkeypatch.chdir(tmp_path / "run_b")  # a callback or a tool changing the working directory
    fill(lc.parts.model, 2)
    assert lc.save(2).path == tmp_path / "run_a" / "ckpt" / "global_step_2" / ROLE
    assert CheckpointStore(tmp_path / "run_a" / "ckpt").steps() == [1, 2]
    assert not (tmp_path / "run_b" / "ckpt").exists()


def test_a_manifest_naming_a_key_twice_is_refused_naming_the_key(tmp_path: Path) -> None:
    """Before: `json` kept the last of two `files` objects, so a manifest could show one list
    to this reader and another to any reader that keeps the first."""
    from lifecycle.manifest import MANIFEST, read_manifest_file

    (tmp_path / MANIFEST).write_text('{"format_version": 2, "files": {}, "files": {"a": 1}}')
    with pytest.raises(CheckpointError, match=r"manifest\.json: an object names the key 'files' twice"):
        read_manifest_file(tmp_path)
