"""Crashes inside a save: real SIGKILLs of a saving process, and a backend raising mid-write.

Whatever moment a save dies at, resume must land on the newest step whose manifest was
published, with exactly that step's weights, and never on a staging folder or a step
without a manifest. The children are fresh interpreters (no fork of pytest): they import
this module for the model and the save loop, so parent and child agree on the weights.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
from structlog.testing import capture_logs
import torch
from torch import nn

from backends.hf import HFBackend
from lifecycle import DELETE, CheckpointError, Lifecycle, State
from lifecycle.manifest import MANIFEST, check_folder
from lifecycle.store import TRACKER, CheckpointStore
from tests.children import Child

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs SIGKILL")

REPO = Path(__file__).resolve().parents[2]
ROLE = "actor"
KEEP_LAST = 3
SHAPES = [(64 * (1 + i % 4), 256) for i in range(20)]
"""20 float32 tensors, 3.2 MiB in all: one save (write, fsync, checksum) takes tens of ms."""
TRIALS = 12
PREFETCH = 4
"""Children importing torch while an earlier one saves: startup, not saving, is the slow part."""
CHILD_TIMEOUT_S = 90.0

CHILD = """\
import os, sys
sys.path.insert(0, {repo!r})
import structlog
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
from tests.lifecycle.test_crash import run_child
run_child(sys.argv[1], int(sys.argv[2]), os.environ.get("KILL_AT", ""))
"""


class Blob(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for i, shape in enumerate(SHAPES):
            self.register_parameter(f"w{i:02d}", nn.Parameter(torch.zeros(shape)))


def value(step: int, index: int) -> float:
    """Exact in float32: a weight that is off by one step or one tensor shows."""
    return float(step * 100 + index)


def fill(model: nn.Module, step: int) -> None:
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(value(step, i))


def wrong_weights(model: nn.Module, step: int) -> list[str]:
    return [name for i, (name, p) in enumerate(model.named_parameters())
            if not torch.equal(p, torch.full_like(p, value(step, i)))]


def lifecycle_at(root: Path, **checkpoint: Any) -> tuple[Lifecycle, nn.Module]:
    model = Blob()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"checkpoint": {"root": str(root), "keep_last": KEEP_LAST, **checkpoint}}
    return Lifecycle(cfg, role=ROLE, model=model, optimizer=optimizer), model


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _install_kill(kill_at: str) -> None:
    """Die at one exact point of the commit: `point:step`."""
    import lifecycle.store as store_mod

    point, _, step_text = kill_at.partition(":")
    at_step = int(step_text or 0)
    if point == "after_manifest":
        write_json = store_mod.write_json_atomic

        def after_manifest(path: Path, data: Any) -> None:
            write_json(path, data)
            if data.get("step") == at_step:
                _die()

        store_mod.write_json_atomic = after_manifest  # type: ignore[assignment]
    elif point == "before_tracker":
        write_tracker = CheckpointStore.write_tracker

        def before_tracker(self: CheckpointStore, step: int) -> None:
            if step == at_step:
                _die()
            write_tracker(self, step)

        CheckpointStore.write_tracker = before_tracker  # type: ignore[method-assign]
    elif point == "mid_retention":
        import lifecycle.retention as retention_mod

        rmtree = retention_mod.rmtree

        def mid_retention(path: Path) -> None:
            if path.name.startswith(".trash-"):
                _die()
            rmtree(path)

        retention_mod.rmtree = mid_retention  # type: ignore[assignment]
    else:
        raise ValueError(f"unknown kill point {kill_at!r}")


def run_child(root: str, steps: int, kill_at: str = "") -> None:
    """The child's whole life: wait for the go, then save every step, saying so after each commit."""
    torch.set_num_threads(1)  # intra-op threads make fill_ take longer than the save itself here
    if kill_at:
        _install_kill(kill_at)
    lc, model = lifecycle_at(Path(root))
    lc.init_load()
    if sys.stdin.readline() != "go\n":
        return  # the parent is gone: nothing to prove any more
    for step in range(1, steps + 1):
        fill(model, step)
        lc.save(step)
        print(f"committed {step}", flush=True)
    print("done", flush=True)


def start_child(tmp_path: Path, root: Path, steps: int, kill_at: str = "") -> Child:
    script = tmp_path / "child.py"
    if not script.exists():
        script.write_text(CHILD.format(repo=str(REPO)))
    return Child.spawn([str(script), str(root), str(steps)], root.with_name(root.name + ".stderr"), CHILD_TIMEOUT_S,
                       cwd=REPO, env={"KILL_AT": kill_at})


@dataclass
class Disk:
    """What a kill left behind, judged with the library's own deep check."""

    published: list[int]
    incomplete: list[int]
    staging: list[Path]
    trash: list[Path]
    tracker: int | None

    @property
    def debris(self) -> bool:
        return bool(self.staging or self.incomplete)

    def kind(self) -> str:
        if any((s / MANIFEST).exists() for s in self.staging):
            return "commit (manifest written, not renamed)"
        if self.staging:
            return "write (staging folder)"
        if self.trash:
            return "retention (trash folder)"
        if self.published and self.tracker != self.published[-1]:
            return "tracker (behind the newest commit)"
        return "between saves (no debris)"


def inspect_disk(root: Path) -> Disk:
    store = CheckpointStore(root)
    published, incomplete = [], []
    for step in store.steps():
        folder = store.role_dir(step, ROLE)
        if (folder / MANIFEST).exists():
            problems = check_folder(folder, deep=True, expect_step=step, expect_role=ROLE)
            assert problems == [], f"step {step} was published half-written: {problems}"
            published.append(step)
        else:
            incomplete.append(step)
    return Disk(published, incomplete, sorted(root.glob("global_step_*/.staging-*")),
                sorted(root.glob(".trash-*")), store.read_tracker())


def assert_resumes_newest_published(root: Path, disk: Disk, committed: list[int]) -> int:
    """Resume lands on the newest published step, with its exact weights, and can save on."""
    assert disk.published, f"nothing published although the child reported {committed}"
    newest = disk.published[-1]
    assert newest in (committed[-1], committed[-1] + 1), (newest, committed)
    assert len(disk.published) <= KEEP_LAST + 1, disk.published
    lc, model = lifecycle_at(root)
    assert lc.resume() == newest
    assert lc.state is State.READY and lc.progress.step == newest
    assert all(step > newest for step in disk.incomplete), (newest, disk.incomplete)
    assert wrong_weights(model, newest) == []
    fill(model, newest + 1)
    lc.save(newest + 1)
    assert CheckpointStore(root).validate(newest + 1, ROLE, deep=True) == []
    assert not (root / f"global_step_{newest + 1}" / f".staging-{ROLE}").exists()
    assert not list(root.glob(".trash-*")), "retention leaves no half-deleted step behind"
    lc.close()
    return newest


@pytest.mark.slow
def test_sigkill_at_random_moments_of_saving_resumes_the_newest_published_step(tmp_path: Path) -> None:
    rng = random.Random(20240611)
    kinds: list[str] = []
    debris = 0
    started = time.perf_counter()
    roots = [tmp_path / f"run{trial}" for trial in range(TRIALS)]
    waiting = deque(start_child(tmp_path, root, steps=500) for root in roots[:PREFETCH])
    try:
        for trial, root in enumerate(roots):
            child = waiting.popleft()
            child.go()
            if trial + PREFETCH < TRIALS:
                waiting.append(start_child(tmp_path, roots[trial + PREFETCH], steps=500))
            child.read_commits(1 + trial % 5)
            time.sleep(rng.uniform(0.0, 0.12))
            child.proc.send_signal(signal.SIGKILL)
            assert child.finish() == -signal.SIGKILL
            disk = inspect_disk(root)
            kinds.append(disk.kind())
            debris += disk.debris
            assert_resumes_newest_published(root, disk, child.committed)
    finally:
        for idle in waiting:
            idle.proc.kill()
            idle.finish()
    summary = f"{debris}/{TRIALS} kills left a staging folder or an incomplete step; {sorted(kinds)}"
    print(f"\n{summary}; {time.perf_counter() - started:.1f} s")
    assert debris >= 3, f"too few kills landed mid-save to prove that resume skips partial steps: {summary}"


COMMIT_POINTS = {
    "after_manifest:3": (2, 2, "commit (manifest written, not renamed)"),
    "before_tracker:3": (3, 2, "tracker (behind the newest commit)"),
    "mid_retention:4": (4, 4, "retention (trash folder)"),
}
"""Kill point -> (step resume must land on, step the tracker names, debris left)."""


@pytest.mark.slow
def test_sigkill_at_each_commit_point_resumes_the_newest_published_step(tmp_path: Path) -> None:
    children = {point: start_child(tmp_path, tmp_path / point.replace(":", "-"), steps=50, kill_at=point)
                for point in COMMIT_POINTS}
    for child in children.values():
        child.go()
    for point, child in children.items():
        assert child.finish() == -signal.SIGKILL, point
        root = tmp_path / point.replace(":", "-")
        expected, tracker, kind = COMMIT_POINTS[point]
        disk = inspect_disk(root)
        assert disk.kind() == kind, (point, disk)
        assert (disk.published[-1], disk.tracker) == (expected, tracker), point
        assert assert_resumes_newest_published(root, disk, child.committed) == expected


RECOMMIT_CHILD = """\
import os, shutil, signal, sys
from pathlib import Path
sys.path.insert(0, {repo!r})
import lifecycle.store as store_mod
root, step = Path(sys.argv[1]), int(sys.argv[2])
store_mod.exchange = lambda a, b: False  # a filesystem without RENAME_EXCHANGE: the commit renames twice
rename = os.rename

def rename_then_die(src, dst):
    rename(src, dst)
    if Path(dst).name.startswith(store_mod.REPLACED):
        os.kill(os.getpid(), signal.SIGKILL)  # between the two renames

os.rename = rename_then_die
store = store_mod.CheckpointStore(root)
manifest = store.read_manifest(step, {role!r})
staging = store.staging(step, {role!r}, store.writer_lock({role!r}))
shutil.copytree(store.role_dir(step, {role!r}), staging, dirs_exist_ok=True)
(staging / "manifest.json").unlink()
store.commit(step, {role!r}, contents={{k: v["backend"] for k, v in manifest["contents"].items()}},
             folders={{k: v["folder"] for k, v in manifest["contents"].items()}}, parallel=manifest["parallel"])
"""


def test_sigkill_between_the_renames_of_a_re_commit_resumes_the_step_it_replaced(tmp_path: Path) -> None:
    """Without RENAME_EXCHANGE a re-commit renames the committed folder aside, then the new one
    in. Before: a SIGKILL between the two left the only copy of step 2 in `.replaced-*`, which
    resume never read: it went back to step 1 (or started fresh, with keep_last 1)."""
    lc, model = lifecycle_at(tmp_path)
    lc.init_load()
    for step in (1, 2):
        fill(model, step)
        lc.save(step)
    lc.close()
    script = tmp_path / "recommit.py"
    script.write_text(RECOMMIT_CHILD.format(repo=str(REPO), role=ROLE))
    child = Child.spawn([str(script), str(tmp_path), "2"], tmp_path / "recommit.stderr", CHILD_TIMEOUT_S, cwd=REPO,
                        stdin=None)
    assert child.finish() == -signal.SIGKILL, (tmp_path / "recommit.stderr").read_text()
    assert not (tmp_path / "global_step_2" / ROLE).exists() and list(tmp_path.glob(".replaced-2-actor-*"))
    lc, model = lifecycle_at(tmp_path)
    with capture_logs() as logs:
        assert lc.resume() == 2
    assert wrong_weights(model, 2) == []
    assert [r["step"] for r in logs if r["event"] == "checkpoint.replaced_restored"] == [2]
    assert not list(tmp_path.glob(".replaced-*"))
    fill(model, 3)
    lc.save(3)
    assert CheckpointStore(tmp_path).validate(3, ROLE, deep=True) == []


def test_the_copy_a_crash_right_after_a_re_commits_exchange_leaves_is_removed_by_the_next_resume(
    tmp_path: Path,
) -> None:
    """The exchange puts the replaced folder, manifest and all, at `.staging-<role>`, and a kill
    before its removal leaves it there. Before: it stayed until that step was saved again or
    pruned, and inspect did not mention it."""
    lc, model = saved_step_one(tmp_path)
    lc.close()
    leftover = tmp_path / "global_step_1" / f".staging-{ROLE}"
    shutil.copytree(tmp_path / "global_step_1" / ROLE, leftover)  # what the kill leaves
    lc, model = lifecycle_at(tmp_path)
    assert lc.resume() == 1 and wrong_weights(model, 1) == []
    assert not leftover.exists() and sorted(p.name for p in (tmp_path / "global_step_1").iterdir()) == [ROLE]


def saved_step_one(root: Path) -> tuple[Lifecycle, nn.Module]:
    """A READY lifecycle whose step 1 (weights filled with 1s) is committed."""
    lc, model = lifecycle_at(root)
    lc.init_load()
    fill(model, 1)
    lc.save(1)
    return lc, model


class MegatronConfigLike:
    """Stands in for a TransformerConfig whose callables must be removed while it is written."""

    def __init__(self) -> None:
        self.init_method: Callable[[], None] = lambda: None
        self.num_layers = 2


def test_backend_raising_mid_write_fails_the_save_and_undoes_its_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lc, model = saved_step_one(tmp_path)
    megatron_config = MegatronConfigLike()
    init_method = megatron_config.init_method
    exit_hooks: list[str] = []

    def save_model_then_disk_full(self: HFBackend, module: nn.Module, folder: Path) -> None:
        lc.temporarily(megatron_config, init_method=DELETE, num_layers=0)
        lc.on_exit(lambda: exit_hooks.append("ran"))
        assert not hasattr(megatron_config, "init_method")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(HFBackend, "save_model", save_model_then_disk_full)
    fill(model, 2)
    with pytest.raises(CheckpointError, match=r"step 2 .*'model'.*No space left on device \(ENOSPC\)"):
        lc.save(2)
    assert lc.state is State.FAILED
    assert megatron_config.init_method is init_method and megatron_config.num_layers == 2
    assert exit_hooks == ["ran"]
    record = lc.history[-1]
    assert (record.trigger, record.ok) == ("save", False) and "No space left" in str(record.error)

    store = CheckpointStore(tmp_path)
    assert store.validate(1, ROLE, deep=True) == [] and store.read_tracker() == 1
    assert not (tmp_path / "global_step_2" / f".staging-{ROLE}").exists()  # its space given back
    assert not store.is_complete(2, [ROLE])
    assert store.newest_complete([ROLE]) == store.newest_committed([ROLE]) == 1

    monkeypatch.undo()
    assert lc.resume() == 1
    assert lc.state is State.READY and wrong_weights(model, 1) == []
    fill(model, 2)
    lc.save(2)
    assert store.validate(2, ROLE, deep=True) == [] and store.read_tracker() == 2
    assert not (tmp_path / "global_step_2" / f".staging-{ROLE}").exists()


def test_failing_tracker_write_after_commit_is_logged_and_the_save_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lc, model = saved_step_one(tmp_path)

    def tracker_write_fails(self: CheckpointStore, step: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(CheckpointStore, "write_tracker", tracker_write_fails)
    fill(model, 2)
    with capture_logs() as logs:
        assert lc.save(2).step == 2
    assert lc.state is State.READY
    failed = [r for r in logs if r["event"] == "checkpoint.tracker_failed"]
    assert failed and failed[0]["step"] == 2 and "Input/output error" in failed[0]["error"]
    assert failed[0]["path"] == str(tmp_path / TRACKER)
    assert (tmp_path / TRACKER).read_text() == "1\n"
    assert CheckpointStore(tmp_path).validate(2, ROLE, deep=True) == []

    monkeypatch.undo()
    again, fresh = lifecycle_at(tmp_path)
    assert again.resume() == 2 and wrong_weights(fresh, 2) == []
    fill(model, 3)
    lc.save(3)
    assert CheckpointStore(tmp_path).read_tracker() == 3  # the next save retries the tracker
