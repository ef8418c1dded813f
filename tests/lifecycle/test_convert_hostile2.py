"""The converter against a killed parent, a DST with no name of its own, and a rank's own error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from lifecycle.convert import ConvertJob, check
from lifecycle.errors import ConfigError
from tests.backends.megatron_util import make_hf_checkpoint

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")
pytestmark = pytest.mark.transformers

_REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))}


def _ranks(pid: int) -> list[int]:
    """Pids of the processes `pid` spawned through multiprocessing (not its resource tracker), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            spawned = b"spawn_main" in (entry / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if entry.name.isdigit() and int(fields[1]) == pid and spawned:
            found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for a reaper that may never come."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _until(done: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(0.05)
    return False


_CHILD = """
import sys, time
from lifecycle.procgroup import lead_own_group
lead_own_group(parent=int(sys.argv[1]))
print("still running", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not hasattr(os, "setpgrp"), reason="process groups are POSIX")
def test_a_process_told_a_parent_pid_that_is_not_its_parent_ends_itself_at_once() -> None:
    """Before: the parent was read with getppid() after the spawn's imports; a parent SIGKILLed
    meanwhile was taken for the reaper that adopted the rank, which then converted alone."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    result = subprocess.run([sys.executable, "-c", _CHILD, str(gone.pid)], capture_output=True, text=True,
                            timeout=120, env=_env())
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert "still running" not in result.stdout


_MIDDLE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(__import__("os").getpid())])
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not hasattr(os, "setpgrp"), reason="process groups are POSIX")
def test_a_process_given_its_parents_pid_runs_and_ends_itself_once_that_parent_is_killed() -> None:
    middle = subprocess.Popen([sys.executable, "-c", _MIDDLE, _CHILD], stdout=subprocess.PIPE, text=True,
                              env=_env(), start_new_session=True)
    assert middle.stdout is not None
    child = int(middle.stdout.readline())
    try:
        assert _until(lambda: middle.stdout is not None and "still running" in middle.stdout.readline(), 60)
        assert _running(child)  # given its own parent's pid: it runs on
        middle.kill()
        middle.wait()
        assert _until(lambda: not _running(child), 30), "the orphaned process outlived its parent"
    finally:
        middle.kill()
        if _running(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks in /proc")
def test_a_convert_killed_while_its_ranks_start_leaves_no_rank_converting_alone(tmp_path: Path) -> None:
    """Before: the rank outlived the SIGKILLed parent, ran the whole conversion and left a full
    `.out.partial-PID` folder that nothing renames or cleans."""
    hf = make_hf_checkpoint(tmp_path / "hf")
    parent = subprocess.Popen([sys.executable, "-m", "lifecycle", "convert", str(hf), str(tmp_path / "out"),
                               "--to", "dist_ckpt"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=_env(), start_new_session=True)
    ranks: list[int] = []
    try:
        assert _until(lambda: bool(_ranks(parent.pid)), 120), "no rank started"
        ranks = _ranks(parent.pid)
        parent.kill()  # the rank is still importing: it has not read its parent yet
        parent.wait()
        assert _until(lambda: not any(_running(r) for r in ranks), 180), "a rank outlived its killed parent"
        assert not (tmp_path / "out").exists()
        assert [p for p in tmp_path.glob(".out.partial-*") if any(p.iterdir())] == []
    finally:
        for rank in ranks:
            if _running(rank):
                os.kill(rank, signal.SIGKILL)


@pytest.mark.parametrize("dst", [".", "..", "/"])
def test_a_destination_with_no_name_of_its_own_is_refused_before_anything_is_converted(
    tmp_path: Path, dst: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: `convert SRC .` in an empty folder converted everything, then failed with EINVAL
    on `rmdir('.')` and threw the result away."""
    hf = make_hf_checkpoint(tmp_path / "hf")
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    with pytest.raises(ConfigError, match="names no folder of its own") as info:
        check(ConvertJob(src=hf, dst=Path(dst), to="dist_ckpt"))
    assert info.value.key == "DST" and dst in info.value.message


def test_the_final_error_of_a_failed_convert_carries_the_failing_ranks_own_message(tmp_path: Path) -> None:
    """Before: the last line named the rank and its exit code only ("exit code 2")."""
    hf = make_hf_checkpoint(tmp_path / "hf")
    size = (hf / "model.safetensors").stat().st_size  # as many bytes: the check of the config's sizes passes
    (hf / "model.safetensors").write_bytes(b"not safetensors".ljust(size, b"\0"))
    result = subprocess.run([sys.executable, "-m", "lifecycle", "convert", str(hf), str(tmp_path / "out"),
                             "--to", "dist_ckpt"], capture_output=True, text=True, timeout=240, env=_env())
    assert result.returncode == 2
    final = [line for line in result.stderr.splitlines() if line.startswith("error: convert")]
    assert len(final) == 1, result.stderr
    assert f"convert-rank0: {hf / 'model.safetensors'}" in final[0]
    assert "exit code" not in final[0] and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("tp", "pp", "says"), [(3, 1, "tp=3 does not divide the HF config's num_attention_heads"),
                                                 (1, 3, "pp=3 does not divide the HF config's num_hidden_layers")])
def test_a_layout_the_architecture_cannot_be_split_by_is_refused_before_any_rank_starts(
        tmp_path: Path, tp: int, pp: int, says: str) -> None:
    """Before: every rank started and Megatron refused it on each, as a raw error."""
    src = make_hf_checkpoint(tmp_path / "hf")
    with pytest.raises(ConfigError, match=f"--tp/--pp: {says}"):
        check(ConvertJob(src=src, dst=tmp_path / "out", to="dist_ckpt", tp=tp, pp=pp))
    assert not (tmp_path / "out").exists()
