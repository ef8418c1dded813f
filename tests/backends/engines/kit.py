"""What the engine tests share: a tiny Qwen2, a rollout around it, and a sync run in threads.

Thread runs put the sender in the test's thread and each receiver in a thread of its own, all
in this process: the engines still meet through their real store and process groups on
loopback, in milliseconds instead of a process spawn. Every thread has a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from backends.engines import CheckpointEngine, CheckpointEngineRegistry, Rendezvous, WeightSync, receive_into
from backends.engines.gloo import GlooEngine
from backends.engines.shm import ShmEngine
from lifecycle.testing import MemoryRollout
from tests.backends.dist_util import free_port
from tests.backends.megatron_util import TINY_QWEN2

PROMPT = [[3, 14, 15, 92, 65, 35]]
REPO = Path(__file__).resolve().parents[3]
"""The repository root: where a test's subprocess runs, to import the project and the tests."""
TRANSPORTS = ["gloo", "shm"]
"""The engines that cross processes and run on any host."""


class RolloutSetsShm(ShmEngine):
    """shm whose flip sets the receiver creates and the sender writes into, as cuda_ipc's are
    (`SharedSlotEngine.rollout_owns_sets`): the protocol cuda_ipc flips with, run on a host."""

    rollout_owns_sets = True


CLASSES: dict[str, type[CheckpointEngine]] = {"gloo": GlooEngine, "shm": ShmEngine, "shm-rollout-sets": RolloutSetsShm}
"""Engines by the names tests give them: the registry's, and test-only ones (`new_engine` builds those too)."""
TIMEOUT_S = 30.0
"""The timeout_s of the engines whose failures must not wait it out."""
HANG_GUARD_S = 10.0
"""Each side of such a failure ends within this; one that fell back to waiting out the timeout
would take TIMEOUT_S (a hang guard, not a speed check)."""
DEEP = b"[" * 100_000 + b"]" * 100_000
"""JSON nested far deeper than the interpreter's stack: `json.loads` raises RecursionError."""


def tiny_qwen2(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**TINY_QWEN2)).eval()


def train_step(model: torch.nn.Module, seed: int) -> None:
    """One AdamW step on random tokens: every weight moves."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TINY_QWEN2["vocab_size"], (4, 16), generator=gen)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    model.eval()


def greedy(model: torch.nn.Module) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor(PROMPT), max_new_tokens=8, do_sample=False, pad_token_id=0)
    return [int(t) for t in out[0]]


def digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    state = xxhash.xxh3_64()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        state.update(name.encode())
        state.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())
    return state.hexdigest()


class ModelRollout(MemoryRollout):
    """A rollout serving a transformers model; `load_weights` copies into it by name."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in named_tensors:
                state[name].copy_(tensor)

    def generate(self) -> list[int]:
        """Greedy tokens; refuses, like `serve`, while stale or paused."""
        self.serve()
        return greedy(self.model)


class AdoptingRollout(ModelRollout):
    """A rollout that takes the received tensors as its model's weights (`adopt_weights`), no copy."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        from backends.engines import adopt_weights

        adopt_weights(self.model, named_tensors)


@dataclass
class Run:
    """What one threaded sync did on each side: figures or the error, per side, and how long
    the whole of it took."""

    figures: dict[str, Any] | None = None
    error: BaseException | None = None
    versions: list[int | None] = field(default_factory=list)
    errors: list[BaseException | None] = field(default_factory=list)
    seconds: float = 0.0


def new_engine(name: str, **kwargs: Any) -> CheckpointEngine:
    kwargs.setdefault("bucket_bytes", 4096)
    kwargs.setdefault("timeout_s", 10.0)
    if name not in CheckpointEngineRegistry.names():
        return CLASSES[name](**kwargs)
    return CheckpointEngineRegistry.new(name, **kwargs)


def corrupting(name: str, bucket: int | None = None, **kwargs: Any) -> CheckpointEngine:
    """A `name` sender that flips one byte of bucket `corrupt` (`bucket` at first; None: none)
    after its checksum was started. It flips a byte of the packed slot, so it packs every bucket:
    a bucket sent from its weights' own storage is one the sender hashes as sent
    (test_contiguous corrupts those)."""

    class Corrupting(CLASSES[name]):  # type: ignore[valid-type,misc]
        corrupt: int | None = bucket
        sends_regions = False

        def _start_send(self, k: int, nbytes: int) -> Any:
            if k == self.corrupt:
                self.slots[k % len(self.slots)].data[5] ^= 0xFF
            return super()._start_send(k, nbytes)

    return Corrupting(**{"bucket_bytes": 4096, "timeout_s": 10, **kwargs})


def sync_threads(sender: CheckpointEngine | WeightSync, receivers: list[CheckpointEngine],
                 named: list[tuple[str, torch.Tensor]], rollouts: list[Any] | None = None, *,
                 version: int = 1, port: int | None = None, deadline_s: float = TIMEOUT_S + 5,
                 expected: Collection[str] | None = None, into: list[Any] | None = None) -> Run:
    """One sync: `sender` on this thread, receiver i (rank i + 1) on a thread of its own;
    `expected` goes to every receiver's `receive_into`, `into[i]` to receiver i's."""
    start = time.monotonic()
    rdv = Rendezvous("127.0.0.1", port or free_port(), receivers=len(receivers))
    rollouts = rollouts if rollouts is not None else [MemoryRollout() for _ in receivers]
    run = Run(versions=[None] * len(receivers), errors=[None] * len(receivers))

    def receive(i: int) -> None:
        try:
            run.versions[i] = receive_into(receivers[i], rollouts[i], rdv, rank=i + 1, expected=expected,
                                           into=None if into is None else into[i])
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            run.errors[i] = exc

    threads = [threading.Thread(target=receive, args=(i,), daemon=True) for i in range(len(receivers))]
    for thread in threads:
        thread.start()
    syncer = sender if isinstance(sender, WeightSync) else WeightSync(sender)
    try:
        run.figures = syncer.sync(iter(named), rdv, version)
    except BaseException as exc:  # noqa: BLE001 - handed to the test
        run.error = exc
    for thread in threads:
        thread.join(deadline_s)
    hung = [i + 1 for i, thread in enumerate(threads) if thread.is_alive()]
    if hung:
        raise AssertionError(f"receiver rank(s) {hung} still running after {deadline_s}s")
    run.seconds = time.monotonic() - start
    return run


def mixed_tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Every shape of trouble: dtypes, a 0-d, an empty, a non-contiguous, a big one to chunk."""
    gen = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(300, 16, generator=gen)),
        ("norm.weight", torch.rand(16, generator=gen, dtype=torch.float64)),
        ("half", torch.randn(33, generator=gen).half()),
        ("bf16", torch.randn(7, 5, generator=gen).bfloat16()),
        ("ids", torch.randint(0, 1 << 40, (9,), generator=gen)),
        ("mask", torch.rand(3, 4, generator=gen) > 0.5),
        ("scalar", torch.tensor(2.5)),
        ("empty", torch.empty(0, 3)),
        ("transposed", torch.randn(6, 10, generator=gen).t()),
        ("bytes", torch.randint(0, 255, (77,), generator=gen, dtype=torch.uint8)),
    ]


def old_rollout() -> MemoryRollout:
    """A rollout serving v7 of other weights (`mixed_tensors(seed=7)`)."""
    rollout = MemoryRollout()
    rollout.load_weights(mixed_tensors(seed=7))
    rollout.weights_version = 7
    return rollout


def assert_kept_old_weights(rollout: MemoryRollout) -> None:
    """A failed sync left `old_rollout()` on its old weights and version, marked stale."""
    assert rollout.weights_version == 7 and rollout.stale and not rollout.paused
    old = dict(mixed_tensors(seed=7))
    assert rollout.weights.keys() == old.keys()
    for key, value in old.items():
        assert torch.equal(rollout.weights[key], value), key
    with pytest.raises(RuntimeError, match="stale"):
        rollout.serve()


def read_case(path: str | os.PathLike[str]) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def die_at_release(engine: CheckpointEngine, bucket: int) -> CheckpointEngine:
    """`engine`, made to SIGKILL its own process when it is done with `bucket` (a receiver that dies mid-sync)."""
    release = engine._release  # type: ignore[attr-defined]

    def release_or_die(k: int) -> None:
        if k == bucket:
            os.kill(os.getpid(), signal.SIGKILL)
        release(k)

    engine._release = release_or_die  # type: ignore[attr-defined]
    return engine


def die_mid_receive(case_path: str) -> None:
    """A rollout process (rank 2) that SIGKILLs itself once bucket 3 of a sync has landed.

    It holds no model (one that dies needs none), so it starts without importing transformers.
    """
    case = read_case(case_path)
    engine = die_at_release(new_engine(case["engine"], **case["options"]), 3)
    Path(case["victim_ready"]).touch()
    receive_into(engine, MemoryRollout(), Rendezvous("127.0.0.1", case["port"], receivers=2), rank=2)
