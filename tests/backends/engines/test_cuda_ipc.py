"""The cuda_ipc engine: a trainer and a rollout in two processes on one GPU.

The GPU tests (the `gpu` marker) run each side in a spawned process: CUDA IPC handles open
only in another process. What a receiver accepts from a sender's published handles is
checked without a GPU: it is plain JSON, parsed and checked before anything is opened.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from backends.engines import CheckpointEngineRegistry, Rendezvous, receive_into
from backends.engines.plan import PlanRefused
from lifecycle.errors import EngineError
from lifecycle.testing import MemoryCheckpointer, MemoryRollout
from tests.backends.dist_util import free_port, run_ranks
from tests.backends.engines.kit import (
    AdoptingRollout, ModelRollout, die_at_release, digest, greedy, mixed_tensors, read_case, tiny_qwen2,
)

TIMEOUT_S = 30.0
HANDLE = "01" + "63" + "ab" * 64
"""As torch's allocator writes a plain segment's handle: a version byte, type 'c', 64 bytes."""


def _published(**change: Any) -> dict[str, Any]:
    slot = {"handle": HANDLE, "size": 64 + 4096, "offset": 0, "ref": b"/torch_12_34_0".hex(), "ref_offset": 0,
            "event": "cd" * 64, "event_sync": True}
    return {"gpu": "GPU-0", "slots": [{**slot, **change}, {**slot, **change, "offset": 8192}]}


def test_auto_never_picks_cuda_ipc() -> None:
    assert CheckpointEngineRegistry.resolve("auto", "cuda") == "nccl"
    assert "cuda_ipc" in CheckpointEngineRegistry.names()


def test_cuda_ipc_declares_flip_into_sets_the_rollout_owns() -> None:
    """The trainer's memory is not safe to serve from (see the engine's docstring): a flip
    receiver creates the sets, the sender writes into them."""
    from backends.engines.cuda_ipc import CudaIpcEngine

    assert CudaIpcEngine.capabilities.flips and CudaIpcEngine.rollout_owns_sets


def test_well_formed_handles_parse() -> None:
    from backends.engines.cuda_ipc import _parse

    assert _parse(json.dumps(_published()).encode())["gpu"] == "GPU-0"


@pytest.mark.parametrize("raw, reason", [
    (b"\x80\x04\x95cos\nsystem\n.", "not a GPU and 2 CUDA IPC handles"),
    (b"[" * 100_000 + b"]" * 100_000, "not a GPU and 2 CUDA IPC handles"),
    (json.dumps({"gpu": "GPU-0", "slots": []}).encode(), "not a GPU and 2 CUDA IPC handles"),
    (json.dumps(_published(handle="ab" * 66)).encode(), "bucket 0: its handle is not a plain CUDA IPC memory handle"),
    (json.dumps(_published(handle="0165" + "ab" * 64)).encode(), "bucket 0: its handle is not a plain CUDA IPC"),
    (json.dumps(_published(handle=HANDLE[:-2])).encode(), "bucket 0: its handle is not a plain CUDA IPC"),
    (json.dumps(_published(handle="zz" * 66)).encode(), "bucket 0: its handle is not a plain CUDA IPC memory handle"),
    (json.dumps(_published(handle=" " + HANDLE[1:])).encode(), "bucket 0: its handle is not a plain CUDA IPC"),
    (json.dumps(_published(ref_offset=10_000)).encode(), r"reference counter's slot 10000 is outside 0..9999"),
    (json.dumps(_published(event="")).encode(), "event handle is not 64 bytes of hex"),
    (json.dumps(_published(ref=b"/etc/passwd".hex())).encode(), "reference counter is not one of torch's"),
    (json.dumps(_published(ref=b"/torch_1_2_3/../../x".hex())).encode(), "reference counter is not one of torch's"),
    (json.dumps(_published(size=100)).encode(), "its size 100 is no bucket's size"),
    (json.dumps(_published(size=True)).encode(), "its size is True, not int"),
    (json.dumps(_published(offset=-1)).encode(), "its offset is out of range"),
    (json.dumps(_published(event="ab")).encode(), "event handle is not 64 bytes"),
    (json.dumps(_published(extra=1)).encode(), "has not exactly the fields"),
    (json.dumps({**_published(), "slots": [_published()["slots"][0]] * 2}).encode(), "two buckets that overlap"),
    (json.dumps({**_published(), "slots": [_published()["slots"][0], {**_published()["slots"][0],
                 "handle": HANDLE.upper(), "offset": 4096}]}).encode(), "two buckets that overlap"),
], ids=["pickle", "deep", "no-slots", "long-handle", "expandable-segment", "short-handle", "not-hex", "space",
        "counter-slot", "empty-event", "ref-path", "ref-escape", "tiny", "bool-size", "negative-offset",
        "short-event", "extra-field", "same-bucket-twice", "overlap-spelt-otherwise"])
def test_a_receiver_refuses_published_handles_it_cannot_trust_before_opening_anything(raw: bytes, reason: str) -> None:
    from backends.engines.cuda_ipc import _parse

    with pytest.raises(PlanRefused, match=reason.replace("(", r"\(")):
        _parse(raw)


def test_a_receiver_on_another_gpu_refuses_before_opening_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    from backends.engines import cuda_ipc

    monkeypatch.setattr(cuda_ipc, "_uuid", lambda device: "GPU-1")
    monkeypatch.setattr(cuda_ipc, "_open_slot", lambda *a: pytest.fail("opened a handle of another GPU"))
    engine = cuda_ipc.CudaIpcEngine(bucket_bytes=4096)
    engine.device = torch.device("cuda", 0)
    with pytest.raises(PlanRefused, match="the sender's buckets are on GPU GPU-0, this receiver's device cuda:0 is "
                                          "GPU GPU-1; cuda_ipc needs one GPU shared by trainer and rollout"):
        engine._open(json.dumps(_published()).encode())


def test_a_device_that_is_not_cuda_is_refused_when_the_sync_starts() -> None:
    from backends.engines.cuda_ipc import CudaIpcEngine

    with pytest.raises(EngineError, match="device 'cpu' is not a CUDA device"):
        CudaIpcEngine(device="cpu").prepare()


# -- two processes on one GPU -------------------------------------------------------------------


def _case(tmp_path: Path, **case: Any) -> None:
    (tmp_path / "case.json").write_text(json.dumps(case), encoding="utf-8")


def _cuda_step(model: torch.nn.Module, seed: int) -> None:
    from tests.backends.megatron_util import TINY_QWEN2

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TINY_QWEN2["vocab_size"], (4, 16), generator=gen).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    model.eval()


def _generation_rank(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any]:
    from lifecycle import Lifecycle

    case = read_case(tmp_path / "case.json")
    model = tiny_qwen2(seed=rank).cuda()
    out: dict[str, Any] = {}
    if rank == 0:
        lc = Lifecycle({"engine": {"backend": "cuda_ipc", **case["options"]}}, model=model,
                       checkpointer=MemoryCheckpointer())
        lc.init_load()
        for step, port in enumerate(case["ports"], start=1):
            with lc.train_step(step):
                _cuda_step(model, seed=step)
            version = lc.sync_weights(Rendezvous("127.0.0.1", port))
            out[str(step)] = {"version": version, "tokens": greedy_cuda(model), "state": _state(model)}
        lc.close()
        return out
    flip = case["options"]["apply"] == "flip"
    rollout = AdoptingRollout(model) if flip else ModelRollout(model)
    engine = CheckpointEngineRegistry.new("cuda_ipc", **case["options"])
    for step, port in enumerate(case["ports"], start=1):
        version = receive_into(engine, rollout, Rendezvous("127.0.0.1", port), rank=1)
        rollout.serve()
        out[str(step)] = {"version": version, "tokens": greedy_cuda(model), "state": _state(model)}
        if flip:
            out[f"in the trainer's set {step}"] = _in_sets(model, engine)
    engine.close()
    return out


def _in_sets(model: torch.nn.Module, engine: Any) -> bool:
    """Every parameter of `model` a view into one of the weight sets `engine` opened (flip)."""
    sets = [(memory.data_ptr(), memory.data_ptr() + memory.numel()) for memory in engine._flip.memory]
    return len(sets) == 2 and all(
        any(start <= param.data_ptr() and param.data_ptr() + param.numel() * param.element_size() <= end
            for start, end in sets) for param in model.parameters())


def greedy_cuda(model: torch.nn.Module) -> list[int]:
    return greedy(_OnDevice(model))


class _OnDevice(torch.nn.Module):
    """`kit.greedy` feeds CPU token ids; this moves them to the model's GPU."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def generate(self, tokens: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.model.generate(tokens.cuda(), **kwargs).cpu()


def _state(model: torch.nn.Module) -> str:
    return digest((name, tensor.cpu()) for name, tensor in model.state_dict().items())


@pytest.mark.gpu
@pytest.mark.transformers
@pytest.mark.parametrize("apply", ["atomic", "streamed", "flip"])
def test_a_rollout_on_the_trainers_gpu_generates_as_the_trainer_after_each_sync(apply: str, tmp_path: Path) -> None:
    _case(tmp_path, ports=[free_port(), free_port()],
          options={"bucket_bytes": 256 * 1024, "timeout_s": TIMEOUT_S, "apply": apply})
    trainer, rollout = run_ranks(_generation_rank, tmp_path, world_size=2, timeout_s=180)
    assert trainer["1"]["state"] != trainer["2"]["state"]
    if apply == "flip":  # the rollout's weights are views into the sets the trainer wrote, no copy of its own
        assert rollout.pop("in the trainer's set 1") and rollout.pop("in the trainer's set 2")
    assert rollout == trainer
    assert [trainer[s]["version"] for s in ("1", "2")] == [1, 2]


def _mixed_rank(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any]:
    from backends.engines import WeightSync
    from backends.engines.cuda_ipc import CudaIpcEngine

    class Corrupting(CudaIpcEngine):
        def _start_send(self, k: int, nbytes: int) -> Any:
            if k == 1:
                self.slots[k % 2].data[5] ^= 0xFF
            return super()._start_send(k, nbytes)

    case = read_case(tmp_path / "case.json")
    named = [(name, tensor.cuda()) for name, tensor in mixed_tensors()]
    rdv = [Rendezvous("127.0.0.1", port) for port in case["ports"]]
    if rank == 0:
        out: dict[str, Any] = {}
        try:
            WeightSync(Corrupting(**case["options"])).sync(iter(named), rdv[0], 3)
        except EngineError as exc:
            out["corrupted"] = str(exc)
        sender = CudaIpcEngine(**case["options"])
        out["figures"] = WeightSync(sender).sync(iter(named), rdv[1], 4)
        sender.close()
        return out
    rollout = MemoryRollout()
    old = [(name, tensor.cuda()) for name, tensor in mixed_tensors(seed=7)]
    rollout.load_weights(old)
    rollout.weights_version = 2
    engine = CheckpointEngineRegistry.new("cuda_ipc", **case["options"])
    try:
        receive_into(engine, rollout, rdv[0], rank=1)
        first = None
    except EngineError as exc:
        first = str(exc)
    kept = rollout.weights_version == 2 and rollout.stale and all(
        torch.equal(rollout.weights[name], tensor) for name, tensor in old)
    version = receive_into(engine, rollout, rdv[1], rank=1)
    got = rollout.serve()
    same = all(got[name].device.type == "cuda" and torch.equal(got[name].cpu(), tensor)
               for name, tensor in mixed_tensors())
    engine.close()
    return {"first": first, "kept": kept, "version": version, "same": same}


@pytest.mark.gpu
def test_a_corrupted_bucket_applies_nothing_and_the_next_sync_delivers_every_dtype_bit_for_bit(tmp_path: Path) -> None:
    _case(tmp_path, ports=[free_port(), free_port()], options={"bucket_bytes": 4096, "timeout_s": TIMEOUT_S})
    sender, receiver = run_ranks(_mixed_rank, tmp_path, world_size=2, timeout_s=180)
    assert "failed its checksum" in sender["corrupted"] and "failed its checksum" in receiver["first"]
    assert receiver["kept"] and receiver["version"] == 4 and receiver["same"]
    assert sender["figures"]["backend"] == "cuda_ipc" and sender["figures"]["version"] == 4


def _flip_rank(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any] | None:
    """The trainer: syncs 1, 2 (its last bucket corrupted after its checksum) and 3, then
    closes its engine, fills new GPU memory of the sets' sizes and SIGKILLs itself. The rollout
    adopts each set and generates, before and after all that;
    its engine is closed after sync 1, so sync 2 lands in new sets of its own."""
    from backends.engines import WeightSync
    from backends.engines.cuda_ipc import CudaIpcEngine

    case = read_case(tmp_path / "case.json")
    rdv = [Rendezvous("127.0.0.1", port) for port in case["ports"]]
    options = {"bucket_bytes": 64 * 1024, "timeout_s": TIMEOUT_S, "apply": "flip"}
    model = tiny_qwen2(seed=rank).cuda()
    if rank == 0:
        class Corrupting(CudaIpcEngine):
            corrupt = False

            def _start_send(self, k: int, nbytes: int) -> Any:
                if self.corrupt and k == len(self.slots) - 1:  # flip: a slot per bucket
                    self.slots[k].data[5] ^= 0xFF
                return super()._start_send(k, nbytes)

        engine = Corrupting(**options)
        sync, seen = WeightSync(engine), {}
        sync.sync(iter(list(model.named_parameters())), rdv[0], 1)
        _cuda_step(model, seed=2)
        engine.corrupt = True
        try:
            sync.sync(iter(list(model.named_parameters())), rdv[1], 2)
            seen["error"] = None
        except EngineError as exc:
            seen["error"] = str(exc)
        engine.corrupt = False
        _cuda_step(model, seed=3)
        sync.sync(iter(list(model.named_parameters())), rdv[2], 3)
        seen.update(tokens=greedy_cuda(model), state=_state(model), buckets=len(engine.slots), pid=os.getpid())
        sizes = [memory.numel() for memory in engine._flip.memory]
        engine.close()  # lets go of the rollout's sets it opened
        filler = [torch.full((n,), 0xFF, dtype=torch.uint8, device="cuda") for n in sizes * 2]  # what would
        torch.cuda.synchronize()  # take their blocks, were they the trainer's to hand out
        seen["filled"] = sum(int(f.numel()) for f in filler)
        (tmp_path / "trainer.part").write_text(json.dumps(seen), encoding="utf-8")
        (tmp_path / "trainer.part").rename(tmp_path / "trainer.json")
        os.kill(os.getpid(), signal.SIGKILL)
    rollout = AdoptingRollout(model)
    engine = CheckpointEngineRegistry.new("cuda_ipc", **options)
    out: dict[str, Any] = {"version 1": receive_into(engine, rollout, rdv[0], rank=1)}
    tokens, state = greedy_cuda(model), _state(model)
    where = {name: param.data_ptr() for name, param in model.named_parameters()}
    out["in the set"] = _in_sets(model, engine)
    engine.close()  # drops its sets (the rollout keeps the one it serves): sync 2 gets two new ones
    try:
        receive_into(engine, rollout, rdv[1], rank=1)
        out["error"] = None
    except EngineError as exc:
        out["error"] = str(exc)
    out["kept"] = (rollout.stale and rollout.weights_version == 1 and _state(model) == state
                   and greedy_cuda(model) == tokens
                   and {name: param.data_ptr() for name, param in model.named_parameters()} == where)
    out["version 3"] = receive_into(engine, rollout, rdv[2], rank=1)
    out["tokens"], out["state"] = greedy_cuda(model), _state(model)
    engine.close()
    deadline = time.monotonic() + 60
    while not (tmp_path / "trainer.json").is_file() or _alive(read_case(tmp_path / "trainer.json")["pid"]):
        assert time.monotonic() < deadline, "the trainer did not end"
        time.sleep(0.1)
    torch.cuda.synchronize()
    out["after the trainer's death"] = {"tokens": greedy_cuda(model), "state": _state(model)}
    return out


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.gpu
@pytest.mark.transformers
def test_a_flip_rollout_keeps_its_set_through_a_corrupted_sync_and_generates_on_after_the_trainer_dies(
        tmp_path: Path) -> None:
    """A corrupted last bucket leaves the rollout on its old set (same addresses, bit-identical,
    generating as before), also after its engine was closed and opened the sets again. Once the
    trainer closed its engine, took new GPU memory and was SIGKILLed, the set it wrote last,
    which the rollout serves, is unchanged: the sets are the rollout's own memory."""
    _case(tmp_path, ports=[free_port() for _ in range(3)])
    trainer, rollout = run_ranks(_flip_rank, tmp_path, world_size=2, timeout_s=240, killed_ok=True)
    assert trainer is None  # it killed itself
    seen = read_case(tmp_path / "trainer.json")
    assert seen["buckets"] > 1 and "failed its checksum" in seen["error"] and "failed its checksum" in rollout["error"]
    assert rollout["version 1"] == 1 and rollout["in the set"] and rollout["kept"] and rollout["version 3"] == 3
    assert (rollout["tokens"], rollout["state"]) == (seen["tokens"], seen["state"])
    assert rollout["after the trainer's death"] == {"tokens": seen["tokens"], "state": seen["state"]}


def _killed_rank(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any] | None:
    from backends.engines import WeightSync

    case = read_case(tmp_path / "case.json")
    rdv = Rendezvous("127.0.0.1", case["port"])
    named = [(f"w{i}", torch.full((4096,), float(i), device="cuda")) for i in range(64)]
    if rank == 0:
        start = time.monotonic()
        try:
            WeightSync(CheckpointEngineRegistry.new("cuda_ipc", **case["sender"])).sync(iter(named), rdv, 1)
            error = None
        except EngineError as exc:
            error = str(exc)
        return {"error": error, "seconds": time.monotonic() - start}
    engine = die_at_release(CheckpointEngineRegistry.new("cuda_ipc", **case["receiver"]), 2)
    receive_into(engine, MemoryRollout(), rdv, rank=1)
    return None


@pytest.mark.gpu
def test_a_killed_receiver_fails_the_sender_within_its_timeout(tmp_path: Path) -> None:
    timeout = 3.0
    _case(tmp_path, port=free_port(), sender={"bucket_bytes": 16 * 1024, "timeout_s": timeout},
          receiver={"bucket_bytes": 16 * 1024, "timeout_s": TIMEOUT_S})
    sender, killed = run_ranks(_killed_rank, tmp_path, world_size=2, timeout_s=120, killed_ok=True)
    assert killed is None
    assert sender["error"] and sender["error"].startswith("cuda_ipc engine: ")
    assert sender["seconds"] < timeout + 5


def _two_receivers_rank(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any]:
    from backends.engines import WeightSync

    case = read_case(tmp_path / "case.json")
    named = [(name, tensor.cuda()) for name, tensor in mixed_tensors()]
    results = []
    engine = CheckpointEngineRegistry.new("cuda_ipc", bucket_bytes=4096, timeout_s=TIMEOUT_S)
    for version, (port, bucket) in enumerate(zip(case["ports"], (4096, 8192)), start=1):
        rdv = Rendezvous("127.0.0.1", port, receivers=2)
        if rank == 0:
            if bucket != engine.bucket_bytes:  # a new bucket size: new slots, new handles to open
                engine.close()
                engine = CheckpointEngineRegistry.new("cuda_ipc", bucket_bytes=bucket, timeout_s=TIMEOUT_S)
            results.append(WeightSync(engine).sync(iter(named), rdv, version)["version"])
        else:
            rollout = MemoryRollout()
            receive_into(engine, rollout, rdv, rank=rank)
            got = rollout.serve()
            results.append(all(torch.equal(got[name].cpu(), tensor) for name, tensor in mixed_tensors()))
    engine.close()
    return {"results": results}


@pytest.mark.gpu
def test_two_receivers_on_one_gpu_get_every_sync_and_reopen_new_buckets(tmp_path: Path) -> None:
    _case(tmp_path, ports=[free_port(), free_port()])
    sender, *receivers = run_ranks(_two_receivers_rank, tmp_path, world_size=3, timeout_s=180)
    assert sender == {"results": [1, 2]}
    assert receivers == [{"results": [True, True]}] * 2
