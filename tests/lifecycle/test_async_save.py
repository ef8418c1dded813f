"""Async save: the trainer waits for the host copy only; write and commit happen in the background.

The background write is held at a gate where a test needs to act while it is in flight,
so nothing here depends on timing.
"""

from __future__ import annotations

import dataclasses

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from structlog.testing import capture_logs
from torch import nn

from backends.base import backend_class
from lifecycle import CheckpointError, ConfigError, Lifecycle, State
from lifecycle.async_save import HostCopier, PendingSave
from lifecycle.checkpointer import DiskCheckpointer
from lifecycle.config import LifecycleConfig
from lifecycle.data import ResumableBatchSampler
from lifecycle.manifest import MANIFEST
from lifecycle.store import CheckpointStore
from lifecycle.types import Parts, Progress
from tests.backends.dist_util import run_ranks
from tests.backends.megatron_util import TINY_QWEN2
from tests.lifecycle.test_crash import fill, lifecycle_at, wrong_weights

REPO = Path(__file__).resolve().parents[2]
ROLE = "actor"


def tiny_qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**TINY_QWEN2, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config)


def _storage_bytes(lc: Lifecycle) -> int:
    """Bytes of the model's and optimizer's distinct tensor storages: what the host copy holds."""
    optimizer = lc.parts.optimizer
    tensors = [*lc.parts.model.state_dict().values(),
               *(t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor))]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def trainer(root: Path, fmt: str = "hf") -> Lifecycle:
    model = tiny_qwen2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    config = {"checkpoint": {"root": str(root), "save": {"format": fmt, "async": True}}}
    return Lifecycle(config, role=ROLE, model=model, optimizer=optimizer, lr_scheduler=scheduler,
                     dataloader=ResumableBatchSampler(64, 4, seed=1))


def train(lc: Lifecycle, step: int) -> None:
    with lc.train_step(step):
        batch = torch.tensor(next(iter(lc.parts.dataloader)))[None, :] + torch.randint(0, 200, (1, 4))
        loss = lc.parts.model(batch, labels=batch).loss
        loss.backward()
        lc.parts.optimizer.step()
        lc.parts.optimizer.zero_grad()
        lc.parts.lr_scheduler.step()


def state_of(lc: Lifecycle) -> dict[str, Any]:
    return {"model": {k: v.clone() for k, v in lc.parts.model.state_dict().items()},
            "exp_avg": [s["exp_avg"].clone() for s in lc.parts.optimizer.state.values()],
            "lr": lc.parts.optimizer.param_groups[0]["lr"], "data": lc.parts.dataloader.state_dict()}


class Gate:
    """Holds every background model write of a format until opened."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fmt: str = "hf", fail: BaseException | None = None) -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()
        cls = backend_class(fmt)
        real = cls.save_model

        def held(backend: Any, model: Any, folder: Path) -> None:
            self.entered.set()
            if not self.opened.wait(30):
                raise TimeoutError("the test never opened the gate")
            if fail is not None:
                raise fail
            real(backend, model, folder)

        monkeypatch.setattr(cls, "save_model", held)

    def open(self) -> None:
        self.opened.set()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate(monkeypatch)
    yield g
    g.open()


@pytest.mark.parametrize("fmt", ["hf", "torch_dcp"])
def test_save_returns_before_the_write_and_commits_the_state_of_its_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    gate = Gate(monkeypatch, fmt)
    lc = trainer(tmp_path, fmt)
    lc.init_load()
    train(lc, 1)
    saved = state_of(lc)
    info = lc.save(1)
    draw_after_save = torch.rand(4)
    assert isinstance(info, PendingSave) and lc.state is State.READY
    assert gate.entered.wait(10) and not info.committed.done()
    assert not (tmp_path / "global_step_1" / ROLE / MANIFEST).exists()
    assert info.bytes == _storage_bytes(lc)
    train(lc, 2)
    train(lc, 3)
    gate.open()
    committed = info.wait(30)
    assert committed.path == info.path and (committed.path / MANIFEST).is_file()
    assert CheckpointStore(tmp_path).read_tracker() == 1
    lc.close()

    again = trainer(tmp_path, fmt)
    assert again.resume() == 1
    resumed = state_of(again)
    assert all(torch.equal(saved["model"][k], v) for k, v in resumed["model"].items())
    assert all(torch.equal(a, b) for a, b in zip(saved["exp_avg"], resumed["exp_avg"]))
    assert (resumed["lr"], resumed["data"]) == (saved["lr"], saved["data"])
    assert torch.equal(torch.rand(4), draw_after_save), "RNG state is the one at save time"


def test_next_save_waits_for_the_previous_commit(tmp_path: Path, gate: Gate) -> None:
    lc, model = lifecycle_at(tmp_path, save={"async": True})
    lc.init_load()
    fill(model, 1)
    first = lc.save(1)
    fill(model, 2)
    second: list[Any] = []
    saver = threading.Thread(target=lambda: second.append(lc.save(2)))
    saver.start()
    saver.join(0.3)
    assert saver.is_alive() and lc.state is State.SAVING, "the second save is waiting for the first commit"
    assert not (tmp_path / "global_step_2").exists()
    gate.open()
    saver.join(30)
    assert first.committed.done() and second[0].wait(30).step == 2
    assert CheckpointStore(tmp_path).newest_complete([ROLE]) == 2
    lc.close()


def test_background_failure_is_raised_by_the_next_save_and_never_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lc, model = lifecycle_at(tmp_path, save={"async": True})
    lc.init_load()
    fill(model, 1)
    lc.save(1).wait(30)
    Gate(monkeypatch, fail=OSError(28, "No space left on device")).open()
    fill(model, 2)
    with capture_logs() as logs:
        pending = lc.save(2)
        with pytest.raises(CheckpointError, match=r"step 2.*No space left on device \(ENOSPC\)"):
            pending.wait(30)
    failed = [r for r in logs if r["event"] == "checkpoint.async_save"]
    assert failed and failed[0]["ok"] is False and failed[0]["step"] == 2 and "No space" in failed[0]["error"]
    assert lc.state is State.READY
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="async save of step 2 .role actor. failed before its commit"):
        lc.save(3)
    assert lc.state is State.FAILED
    store = CheckpointStore(tmp_path)
    assert not (tmp_path / "global_step_2" / ROLE / MANIFEST).exists()
    assert store.newest_complete([ROLE]) == 1 and store.read_tracker() == 1
    assert lc.resume() == 1 and wrong_weights(model, 1) == []
    fill(model, 2)
    lc.save(2).wait(30)
    assert store.newest_complete([ROLE]) == 2
    lc.close()


def test_close_waits_for_the_commit_and_raises_a_background_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gate: Gate
) -> None:
    lc, model = lifecycle_at(tmp_path / "ok", save={"async": True})
    lc.init_load()
    lc.save(1)
    threading.Timer(0.2, gate.open).start()
    lc.close()
    assert lc.state is State.CLOSED and CheckpointStore(tmp_path / "ok").newest_complete([ROLE]) == 1

    failing, _ = lifecycle_at(tmp_path / "bad", save={"async": True})
    Gate(monkeypatch, fail=OSError(5, "Input/output error")).open()
    failing.init_load()
    failing.save(1)
    with pytest.raises(CheckpointError, match="step 1"):
        failing.close()
    assert failing.state is State.CLOSED and failing.history[-1].ok is False
    assert CheckpointStore(tmp_path / "bad").newest_complete([ROLE]) is None


def test_resume_after_a_failed_step_waits_for_the_pending_commit(tmp_path: Path, gate: Gate) -> None:
    lc, model = lifecycle_at(tmp_path, save={"async": True})
    lc.init_load()
    fill(model, 1)
    lc.save(1)
    with pytest.raises(RuntimeError), lc.train_step(2):
        fill(model, 7)
        raise RuntimeError("loss is nan")
    threading.Timer(0.2, gate.open).start()
    assert lc.resume() == 1 and wrong_weights(model, 1) == []
    lc.close()


def test_async_refuses_at_construction_formats_that_cannot_write_in_the_background(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def build(fmt: str, world_size: int) -> Lifecycle:
        config = {"checkpoint": {"root": "unused", "save": {"format": fmt, "async": True}}}
        return Lifecycle(config, role=ROLE, model=nn.Linear(2, 2), rank=0, world_size=world_size)

    with pytest.raises(ConfigError, match="checkpoint.save.async: format 'torch_dcp' saves with collectives"):
        build("torch_dcp", 2)
    build("torch_dcp", 1)
    hf = backend_class("hf")
    monkeypatch.setattr(hf, "capabilities", dataclasses.replace(hf.capabilities, supports_async=False))
    with pytest.raises(ConfigError, match="format 'hf' cannot write in the background"):
        build("hf", 1)
    config = LifecycleConfig.from_dict({"checkpoint": {"root": "unused", "save": {"format": "hf", "async": True}}})
    with pytest.raises(ConfigError, match="format 'hf' cannot write in the background"):
        DiskCheckpointer(config, role=ROLE).save(1, Parts(model=nn.Linear(2, 2)), Progress(step=1))


@pytest.mark.transformers
def test_host_copy_reuses_its_buffers_and_keeps_tied_weights_tied() -> None:
    model = tiny_qwen2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    optimizer.step()
    copier = HostCopier()
    first = copier.snapshot(Parts(model=model, optimizer=optimizer))
    state = first.model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    pointers = {k: v.data_ptr() for k, v in state.items()}
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    assert not torch.equal(state["model.norm.weight"], model.model.norm.weight)
    second = copier.snapshot(Parts(model=model, optimizer=optimizer))
    assert {k: v.data_ptr() for k, v in second.model.state_dict().items()} == pointers
    assert torch.equal(second.model.state_dict()["model.norm.weight"], model.model.norm.weight)
    assert second.optimizer.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]
    frozen_momentum = [s["momentum_buffer"] for s in second.optimizer.state_dict()["state"].values()]
    live_momentum = [s["momentum_buffer"] for s in optimizer.state_dict()["state"].values()]
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(frozen_momentum, live_momentum))


def _two_ranks_save(rank: int, world_size: int, tmp_path: Path) -> int | None:
    """Training's all-reduce on the default group runs while the commit's barrier runs on its own."""
    import torch.distributed as dist

    lc, model = lifecycle_at(tmp_path / "ckpt", save={"async": True})
    lc.init_load()
    fill(model, 1)
    pending = lc.save(1)
    total = torch.ones(1)
    dist.all_reduce(total)
    pending.wait(30)
    lc.close()
    return CheckpointStore(tmp_path / "ckpt").newest_complete([ROLE]) if total.item() == world_size else None


def test_two_ranks_commit_in_the_background_beside_training_collectives(tmp_path: Path) -> None:
    assert run_ranks(_two_ranks_save, tmp_path, world_size=2, timeout_s=60) == [1, 1]


CHILD = """\
import sys, time
sys.path.insert(0, {repo!r})
import structlog
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
from backends.hf import HFBackend
from tests.lifecycle.test_crash import fill, lifecycle_at
real = HFBackend.save_model
def slow_after_writing(self, model, folder):
    real(self, model, folder)
    print("written", flush=True)
    time.sleep(120)
lc, model = lifecycle_at(__import__("pathlib").Path(sys.argv[1]), save={{"async": True}})
lc.init_load()
fill(model, 1)
lc.save(1).wait()
HFBackend.save_model = slow_after_writing
fill(model, 2)
lc.save(2)
print("returned", flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="needs SIGKILL")
def test_sigkill_after_the_background_write_before_its_commit_resumes_the_previous_step(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(repo=str(REPO)))
    root = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, str(script), str(root)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    watchdog = threading.Timer(90, proc.kill)
    watchdog.start()
    try:
        assert proc.stdout is not None
        lines = {proc.stdout.readline().strip() for _ in range(2)}
        assert lines == {"written", "returned"}, lines
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
    finally:
        watchdog.cancel()
        proc.kill()
    staging = root / "global_step_2" / f".staging-{ROLE}"
    assert (staging / "model" / "model.safetensors").is_file() and not (staging / MANIFEST).exists()
    store = CheckpointStore(root)
    assert store.newest_complete([ROLE]) == store.newest_committed([ROLE]) == 1 and store.read_tracker() == 1
    lc, model = lifecycle_at(root, save={"async": True})
    assert lc.resume() == 1 and wrong_weights(model, 1) == []
    fill(model, 2)
    lc.save(2).wait(30)
    assert store.newest_complete([ROLE]) == 2 and not staging.exists()
    lc.close()


@pytest.mark.parametrize("fmt", ["hf", "torch_dcp"])
def test_an_async_save_before_the_first_step_with_a_scheduler_resumes_and_leaves_the_live_optimizer_alone(
    tmp_path: Path, fmt: str
) -> None:
    def parts() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)

    config = {"checkpoint": {"root": str(tmp_path), "save": {"format": fmt, "async": True}}}
    model, optimizer, scheduler = parts()
    lc = Lifecycle(config, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    lc.init_load()
    lc.save(0).wait()
    lc.close()
    assert optimizer.state_dict()["state"] == {}  # the save stepped nothing of the live optimizer
    model, optimizer, scheduler = parts()
    resumed = Lifecycle(config, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    assert resumed.resume() == 0
    resumed.close()


def _cuda_trainer(root: Path, seed: int) -> Lifecycle:
    """A CUDA model of 64 MiB (four 2048x2048 float32 layers) and AdamW, saving hf asynchronously."""
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(4))).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"checkpoint": {"root": str(root), "save": {"format": "hf", "async": True}}}
    return Lifecycle(config, role=ROLE, model=model, optimizer=optimizer)


def _queue_a_late_write(model: nn.Module, value: float) -> None:
    """A weight write queued behind about 0.1 s of GPU work: a copy that did not wait for the
    training's stream would read the weights from before it."""
    torch.cuda._sleep(int(2e8))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(value)


@pytest.mark.gpu
def test_async_save_from_cuda_commits_the_weights_at_save_time_though_the_next_step_overwrites_them(
    tmp_path: Path,
) -> None:
    lc = _cuda_trainer(tmp_path, seed=0)
    model, optimizer = lc.parts.model, lc.parts.optimizer
    lc.init_load()
    with lc.train_step(1):
        model(torch.randn(64, 2048, device="cuda")).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        _queue_a_late_write(model, 1.0)
    pending = lc.save(1)
    assert isinstance(pending, PendingSave)
    saved = {k: v.clone() for k, v in model.state_dict().items()}  # queued after the write: the values saved
    moments = [s["exp_avg"].clone() for s in optimizer.state.values()]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0).add_(7.0)  # the next step, queued at once on the training's stream
    pending.wait(60)
    lc.close()

    again = _cuda_trainer(tmp_path, seed=1)
    assert again.resume() == 1
    resumed = again.parts.model.state_dict()
    assert all(v.device.type == "cuda" for v in resumed.values())
    assert [k for k, v in saved.items() if not torch.equal(v, resumed[k])] == []
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, again.parts.optimizer.state.values()))
    again.close()


@pytest.mark.gpu
def test_host_copy_of_a_cuda_model_is_pinned_reused_and_ordered_after_the_step_that_wrote_it() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 8)).cuda()
    copier = HostCopier()
    first = copier.snapshot(Parts(model=model)).model.state_dict()
    pointers = {k: v.data_ptr() for k, v in first.items()}
    assert all(v.device.type == "cpu" and v.is_pinned() for v in first.values())
    _queue_a_late_write(model, 0.5)
    second = copier.snapshot(Parts(model=model)).model.state_dict()
    assert {k: v.data_ptr() for k, v in second.items()} == pointers
    live = {k: v.cpu() for k, v in model.state_dict().items()}
    assert [k for k, v in second.items() if not torch.equal(v, live[k])] == []


_EXITING = """
import os, sys
from pathlib import Path
from tests.lifecycle.test_crash import fill, lifecycle_at
root, how = Path(sys.argv[1]), sys.argv[2]
lc, model = lifecycle_at(root, save={"async": True})
lc.init_load()
fill(model, 1)
lc.save(1).wait(60)
fill(model, 2)
lc.save(2)  # in the background: the script ends before it commits
if how == "fork":  # a data loader's worker, forked while step 2 is written, lives on
    child = os.fork()
    if child == 0:
        import time
        lc.close()  # the child's copy of the save in flight is not its own to wait for
        time.sleep(1.5)
        os._exit(0)
    fill(model, 3)
    lc.save(3).wait(60)  # the lock the child inherited does not refuse the parent's next save
    os.waitpid(child, 0)
elif how == "exit":
    sys.exit(0)
elif how == "raise":
    raise RuntimeError("training crashed right after the save")
"""


def test_scripts_that_end_right_after_an_async_save_commit_it_first(tmp_path: Path) -> None:
    """Four scripts at once (each pays its own torch import): one falls off its end, one calls
    sys.exit, one raises, one forks a child that outlives its parent's next save."""
    hows = ("end", "exit", "raise", "fork")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    runs = {how: subprocess.Popen([sys.executable, "-c", _EXITING, str(tmp_path / how), how], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for how in hows}
    try:
        errors = {how: proc.communicate(timeout=180)[1] for how, proc in runs.items()}
    finally:
        for proc in runs.values():  # a script past its hang guard is reaped, never left behind
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for how, proc in runs.items():
        assert proc.returncode == (1 if how == "raise" else 0), (how, errors[how][-2000:])
        newest = 3 if how == "fork" else 2
        assert CheckpointStore(tmp_path / how).newest_complete([ROLE]) == newest, (how, errors[how][-2000:])
        lc, model = lifecycle_at(tmp_path / how)
        assert lc.resume() == newest and not wrong_weights(model, newest), how


def test_an_interrupted_wait_keeps_the_save_in_flight_and_its_failure_for_the_next_wait() -> None:
    from lifecycle.background import BackgroundSaver

    saver, opened = BackgroundSaver(ROLE), threading.Event()

    def work() -> Any:
        opened.wait(30)
        raise OSError(28, "No space left on device")

    saver.submit(7, work)
    earlier = signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as Python's own, whatever ran before
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        main = threading.main_thread().ident  # a signal to the process may land on another thread
        timer = threading.Timer(0.3, lambda: signal.pthread_kill(main, signal.SIGINT))  # type: ignore[arg-type]
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            saver.wait()  # Ctrl-C while the background write goes on
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, earlier)
    opened.set()
    with pytest.raises(CheckpointError, match=r"async save of step 7 \(role actor\) failed before its commit"):
        saver.wait()
    saver.close()


def test_two_storages_at_one_address_are_each_copied_whole(tmp_path: Path) -> None:
    """A tensor made from a numpy view of a parameter starts at the parameter's address with a
    shorter storage: keyed by address alone, the parameter was laid over the short copy and
    other heap memory was committed as its weights (checksums and all)."""
    from safetensors.torch import load_file

    model, child = nn.Module(), nn.Module()
    child.big = nn.Parameter(torch.arange(64, dtype=torch.float32))
    model.register_buffer("small", torch.from_numpy(child.big.detach().numpy()[:4]))  # met first
    model.child = child
    lc = Lifecycle({"checkpoint": {"root": str(tmp_path), "save": {"async": True}}}, role="actor", model=model)
    lc.init_load()
    lc.save(1).wait()
    lc.close()
    saved = load_file(str(tmp_path / "global_step_1" / "actor" / "model" / "model.safetensors"))
    assert torch.equal(saved["child.big"], child.big.detach()) and torch.equal(saved["small"], torch.arange(4.0))


@pytest.mark.parametrize("asynchronous", [True, False])
def test_a_meta_tensor_is_refused_by_name_not_saved_as_whatever_memory_held(tmp_path: Path, asynchronous: bool) -> None:
    model = nn.Linear(2, 2)
    model.register_buffer("late", torch.empty(4, device="meta"))
    lc = Lifecycle({"checkpoint": {"root": str(tmp_path), "save": {"async": asynchronous}}}, role="actor", model=model)
    lc.init_load()
    with pytest.raises(CheckpointError, match="late.*meta tensor"):
        lc.save(1)
    assert CheckpointStore(tmp_path).newest_complete(["actor"]) is None


def test_a_pending_saves_wait_raises_typed_errors_naming_the_step() -> None:
    from concurrent.futures import Future

    from lifecycle.async_save import AsyncSaver

    failed: Future[Any] = Future()
    failed.set_exception(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"))
    pending = PendingSave(step=4, path=Path("x"), bytes=0, seconds=0.0, contents=["model"], backend="hf",
                          committed=failed)
    with pytest.raises(CheckpointError, match="step 4 failed before its commit.*Connection reset"):
        pending.wait()
    with pytest.raises(CheckpointError, match="step 4 is still in flight after 0.01 s"):
        dataclasses.replace(pending, committed=Future()).wait(0.01)
    with pytest.raises(CheckpointError, match="process group was destroyed"):
        AsyncSaver._check_group(4, collective=True)  # no group here: destroyed under a save begun across ranks
    AsyncSaver._check_group(4, collective=False)


def test_the_commit_group_keeps_the_world_groups_timeout() -> None:
    """A new group takes torch's default (30 minutes for gloo): a peer stalled in its background
    write held the survivor's wait that long, past the timeout the job set."""
    import datetime

    import torch.distributed as dist

    from backends.base import free_port
    from lifecycle.async_save import _world_timeout

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=25))
    try:
        assert _world_timeout(dist) == datetime.timedelta(seconds=25)
    finally:
        dist.destroy_process_group()
