"""Async save of a wrapped optimizer, a full disk at the manifest, and the background saver's submit.

A wrapped optimizer (accelerate's `AcceleratedOptimizer`, torch's `PostLocalSGDOptimizer`) keeps
`param_groups` and `state` as properties that forward to the optimizer it wraps: the host copy
must never set them, or the live optimizer would step the copy's parameters.
"""

from __future__ import annotations

import errno
import pickle
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lifecycle import CheckpointError, Lifecycle
from lifecycle.background import BackgroundSaver
from lifecycle.manifest import MANIFEST
from lifecycle.types import SaveInfo
from tests.disk import small_tmpfs


class Forwarding(torch.optim.Optimizer):
    """As accelerate's `AcceleratedOptimizer`: properties with setters that forward to `optimizer`."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> Any:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> Any:  # type: ignore[override]
        return self.optimizer.defaults

    def state_dict(self) -> Any:  # type: ignore[override]
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:  # type: ignore[override]
        self.optimizer.load_state_dict(state_dict)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)


class ReadOnly(Forwarding):
    """As torch's `PostLocalSGDOptimizer`: the forwarding properties have no setter."""

    param_groups = property(lambda self: self.optimizer.param_groups)  # type: ignore[assignment]
    state = property(lambda self: self.optimizer.state)  # type: ignore[assignment]


def _wrapped(root: Path, wrapper: type[Forwarding], *, asynchronous: bool, fmt: str = "hf"
             ) -> tuple[Lifecycle, nn.Module, torch.optim.Optimizer, Forwarding]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    optimizer = wrapper(inner)
    config = {"checkpoint": {"root": str(root), "save": {"format": fmt, "async": asynchronous}}}
    lc = Lifecycle(config, model=model, optimizer=optimizer)
    lc.init_load()
    return lc, model, inner, optimizer


def _step(lc: Lifecycle, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    with lc.train_step(step):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def _save(lc: Lifecycle, step: int) -> None:
    saved = lc.save(step)
    wait = getattr(saved, "wait", None)
    if wait is not None:
        wait(30)


@pytest.mark.parametrize("wrapper", [Forwarding, ReadOnly])
def test_an_async_save_of_a_wrapped_optimizer_leaves_the_live_optimizer_stepping_the_model(
    tmp_path: Path, wrapper: type[Forwarding]
) -> None:
    lc, model, inner, optimizer = _wrapped(tmp_path, wrapper, asynchronous=True)
    _step(lc, model, optimizer, 1)
    _save(lc, 1)
    params = list(model.parameters())
    assert all(p is q for p, q in zip(inner.param_groups[0]["params"], params, strict=True))
    assert all(any(k is p for p in params) for k in inner.state) and len(inner.state) == len(params)
    before = [p.detach().clone() for p in params]
    _step(lc, model, optimizer, 2)
    assert all(not torch.equal(b, p) for b, p in zip(before, params))
    lc.close()


def _optimizer_files(root: Path) -> dict[str, Any]:
    """Each file's bytes; of DCP's `.metadata`, what it describes (it also holds a random save id)."""
    folder = root / "global_step_1" / "actor" / "optimizer"
    files: dict[str, Any] = {f.name: f.read_bytes() for f in sorted(folder.iterdir())}
    if ".metadata" in files:
        files[".metadata"] = pickle.loads(files[".metadata"]).state_dict_metadata
    return files


@pytest.mark.parametrize("wrapper", [Forwarding, ReadOnly])
@pytest.mark.parametrize("fmt", ["hf", "torch_dcp"])
def test_an_async_save_of_a_wrapped_optimizer_writes_what_a_sync_save_of_it_writes(
    tmp_path: Path, wrapper: type[Forwarding], fmt: str
) -> None:
    written = {}
    for asynchronous in (False, True):
        root = tmp_path / ("async" if asynchronous else "sync")
        lc, model, _, optimizer = _wrapped(root, wrapper, asynchronous=asynchronous, fmt=fmt)
        _step(lc, model, optimizer, 1)
        _save(lc, 1)
        lc.close()
        written[asynchronous] = _optimizer_files(root)
    assert written[True] == written[False]
    assert any(len(data) > 1000 for data in written[True].values())  # the state's tensors, not an empty one


@pytest.mark.parametrize("fmt", ["hf", "torch_dcp"])
def test_an_async_save_of_a_never_stepped_wrapped_optimizer_steps_nothing_of_the_live_one(
    tmp_path: Path, fmt: str
) -> None:
    lc, model, inner, _ = _wrapped(tmp_path, Forwarding, asynchronous=True, fmt=fmt)
    before = [p.detach().clone() for p in model.parameters()]
    lc.save(1)
    try:
        lc.close()
    except CheckpointError as exc:  # a format that steps the copy to create its state: refused by name
        assert "Forwarding that has no state yet" in str(exc)
    assert inner.state_dict()["state"] == {}
    assert all(p is q for p, q in zip(inner.param_groups[0]["params"], model.parameters(), strict=True))
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.parametrize("fmt", ["hf", "torch_dcp"])
def test_an_async_save_of_a_wrapped_optimizer_resumes_into_a_fresh_wrapper_with_the_saved_state(
    tmp_path: Path, fmt: str
) -> None:
    lc, model, inner, optimizer = _wrapped(tmp_path, Forwarding, asynchronous=True, fmt=fmt)
    _step(lc, model, optimizer, 1)
    _save(lc, 1)
    lc.close()
    saved = [s["exp_avg"].clone() for s in inner.state.values()]
    torch.manual_seed(1)
    fresh_model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fresh = torch.optim.AdamW(fresh_model.parameters(), lr=0.1)
    config = {"checkpoint": {"root": str(tmp_path), "save": {"format": fmt, "async": True}}}
    resumed = Lifecycle(config, model=fresh_model, optimizer=Forwarding(fresh))
    assert resumed.resume() == 1
    resumed.close()
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(saved, fresh.state.values(), strict=True))


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, unmounted afterwards; skipped where mounting is not permitted."""
    with small_tmpfs(tmp_path / "disk", "2m") as disk:
        yield disk


def _fill(disk: Path) -> None:
    with open(disk / "filler", "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def test_a_full_disk_while_the_commit_writes_the_manifest_names_the_manifest(
    small_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lifecycle.store as store

    def then_fill(*args: Any, **kwargs: Any) -> Any:
        manifest = real(*args, **kwargs)
        _fill(small_disk)
        return manifest

    real = store.build_manifest
    monkeypatch.setattr(store, "build_manifest", then_fill)
    model = nn.Linear(4, 4)
    lc = Lifecycle({"checkpoint": {"root": str(small_disk / "root")}}, model=model,
                   optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    lc.init_load()
    try:
        with pytest.raises(CheckpointError) as caught:
            lc.save(1)
    finally:
        (small_disk / "filler").unlink(missing_ok=True)
        lc.close()
    assert "No space left on device" in str(caught.value)
    assert f"{MANIFEST}" in str(caught.value) and str(small_disk / "root") in str(caught.value)


def _interrupted_after_queueing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C landing right after the pool took the save, before the saver recorded it."""
    import lifecycle.background as background

    real = background.submitted

    def then_interrupted(*args: Any) -> Any:
        real(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(background, "submitted", then_interrupted)


def test_a_ctrl_c_right_after_the_save_is_queued_leaves_it_in_flight_for_the_next_wait(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _interrupted_after_queueing(monkeypatch)
    saver, opened, runs = BackgroundSaver("actor"), threading.Event(), []
    info = SaveInfo(step=7, path=tmp_path, contents=["model"], backend="hf")

    def work() -> SaveInfo:
        opened.wait(30)
        runs.append(7)
        return info

    with pytest.raises(KeyboardInterrupt):
        saver.submit(7, work)
    threading.Timer(0.2, opened.set).start()
    assert saver.wait() is info and runs == [7]
    saver.close()


def test_a_ctrl_c_right_after_an_async_save_is_queued_keeps_the_writer_lock_until_its_commit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from lifecycle.saver import SaveJob

    releases: list[tuple[str, bool]] = []
    real_release = SaveJob.release
    manifest = tmp_path / "global_step_1" / "actor" / MANIFEST

    def recorded(job: SaveJob) -> None:
        releases.append((threading.current_thread().name, manifest.exists()))
        real_release(job)

    monkeypatch.setattr(SaveJob, "release", recorded)
    _interrupted_after_queueing(monkeypatch)
    model = nn.Linear(4, 4)
    lc = Lifecycle({"checkpoint": {"root": str(tmp_path), "save": {"async": True}}}, model=model,
                   optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    lc.init_load()
    with pytest.raises(KeyboardInterrupt):
        lc.save(1)
    lc.close()
    assert manifest.exists()
    assert releases and all(thread.startswith("async-save-") and committed for thread, committed in releases)
