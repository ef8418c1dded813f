"""The nccl engine over real GPUs: one per rank (NCCL refuses two ranks on one device)."""

from __future__ import annotations

import pytest
import torch

from lifecycle.errors import EngineError
from lifecycle.testing import MemoryRollout
from tests.backends.engines.kit import mixed_tensors, new_engine, sync_threads

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices, one per rank"),
]


def _on(device: int) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor.to(f"cuda:{device}")) for name, tensor in mixed_tensors()]


def test_nccl_delivers_every_tensor_from_gpu_buckets_and_keeps_them_on_the_device() -> None:
    rollout = MemoryRollout()
    sender, receiver = new_engine("nccl", device=0), new_engine("nccl", device=1)
    run = sync_threads(sender, [receiver], _on(0), [rollout], version=2)
    assert run.error is None and run.errors == [None] and run.versions == [2]
    for name, tensor in mixed_tensors():
        got = rollout.serve()[name]
        assert got.device == torch.device("cuda", 1) and torch.equal(got.cpu(), tensor), name
    assert sender.slots == [] and receiver.slots == []  # type: ignore[attr-defined]


def test_nccl_refuses_a_corrupted_bucket_with_the_on_device_checksum() -> None:
    from backends.engines.nccl import NcclEngine

    class Corrupting(NcclEngine):
        sends_regions = False  # it flips a byte of the packed slot, so it packs every bucket

        def _start_send(self, k: int, nbytes: int) -> object:
            if k == 1:
                self.slots[k % 2].data[5] ^= 0xFF
            return super()._start_send(k, nbytes)

    rollout = MemoryRollout()
    run = sync_threads(Corrupting(device=0, bucket_bytes=4096, timeout_s=30), [new_engine("nccl", device=1)],
                       _on(0), [rollout])
    assert isinstance(run.error, EngineError) and "failed its checksum" in str(run.error)
    assert rollout.stale
