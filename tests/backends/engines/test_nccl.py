"""The nccl engine on real GPUs.

NCCL refuses two ranks on one device, so the engine itself runs only with two GPUs. Its device
code (buckets, header table and word sums in GPU memory, regions of a flattened model, flip's
weight sets, landing in a flattened rollout) also runs on one GPU over a gloo group, which
broadcasts CUDA tensors: everything but the NCCL transport.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from backends.engines.nccl import NcclEngine
from lifecycle.errors import EngineError
from lifecycle.testing import MemoryRollout
from tests.backends.engines.kit import mixed_tensors, new_engine, sync_threads, tiny_qwen2

pytestmark = [pytest.mark.gpu]
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices, one per rank")


def _on(device: int, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor.to(f"cuda:{device}")) for name, tensor in mixed_tensors(seed)]


class OverGloo(NcclEngine):
    """The nccl engine with a gloo group in place of NCCL's: both ranks may share one GPU."""

    def _make_group(self, store: Any, topology: Any, timeout: Any) -> Any:
        from backends.engines.gloo import GlooEngine

        return GlooEngine._make_group(self, store, topology, timeout)  # type: ignore[arg-type]


class Corrupting(NcclEngine):
    sends_regions = False  # it flips a byte of the packed slot, so it packs every bucket

    def _start_send(self, k: int, nbytes: int) -> object:
        if k == 1:
            self.slots[k % len(self.slots)].data[5] ^= 0xFF
        return super()._start_send(k, nbytes)


class CorruptingOverGloo(Corrupting, OverGloo):
    pass


@TWO_GPUS
def test_nccl_delivers_every_tensor_from_gpu_buckets_and_keeps_them_on_the_device() -> None:
    rollout = MemoryRollout()
    sender, receiver = new_engine("nccl", device=0), new_engine("nccl", device=1)
    run = sync_threads(sender, [receiver], _on(0), [rollout], version=2)
    assert run.error is None and run.errors == [None] and run.versions == [2]
    for name, tensor in mixed_tensors():
        got = rollout.serve()[name]
        assert got.device == torch.device("cuda", 1) and torch.equal(got.cpu(), tensor), name
    assert sender.slots == [] and receiver.slots == []  # type: ignore[attr-defined]


@TWO_GPUS
def test_nccl_refuses_a_corrupted_bucket_with_the_on_device_checksum() -> None:
    rollout = MemoryRollout()
    run = sync_threads(Corrupting(device=0, bucket_bytes=4096, timeout_s=30), [new_engine("nccl", device=1)],
                       _on(0), [rollout])
    assert isinstance(run.error, EngineError) and "failed its checksum" in str(run.error)
    assert rollout.stale


@pytest.mark.parametrize("apply", ["atomic", "streamed", "flip"])
def test_the_nccl_device_code_delivers_every_dtype_bit_for_bit_on_one_gpu(apply: str) -> None:
    sender = OverGloo(device=0, bucket_bytes=4096, timeout_s=30, apply=apply)
    receiver = OverGloo(device=0, bucket_bytes=4096, timeout_s=30, apply=apply)
    rollout = MemoryRollout()
    try:
        for version in (1, 2):  # the second sync reuses the plan (flip: into the other set)
            run = sync_threads(sender, [receiver], _on(0, seed=version), [rollout], version=version)
            assert run.error is None and run.errors == [None] and run.versions == [version]
            got = rollout.serve()
            for name, tensor in mixed_tensors(seed=version):
                assert got[name].device.type == "cuda" and torch.equal(got[name].cpu(), tensor), (version, name)
    finally:
        sender.close()
        receiver.close()


def _flat_qwen2(seed: int) -> torch.nn.Module:
    from backends.engines import flatten_parameters

    model = tiny_qwen2(seed).cuda()
    flatten_parameters(model)
    return model


@pytest.mark.transformers
@pytest.mark.parametrize("how", ["streamed", "flip", "into"])
def test_a_flattened_model_on_the_gpu_is_sent_from_its_storage_and_lands_bit_for_bit(
        how: str, packed: list[int]) -> None:
    """Buckets are regions of the sender's flat storage on the GPU (nothing packed); `into`: the
    receiver lands each one in its own flattened model's storage, where its weights stay."""
    apply = "streamed" if how == "into" else how
    sender = OverGloo(device=0, bucket_bytes=1 << 14, timeout_s=30, apply=apply)
    receiver = OverGloo(device=0, bucket_bytes=1 << 14, timeout_s=30, apply=apply)
    trainer, rollout_model, rollout = _flat_qwen2(0), _flat_qwen2(1), MemoryRollout()
    where = [param.data_ptr() for param in rollout_model.parameters()]
    try:
        run = sync_threads(sender, [receiver], list(trainer.named_parameters()), [rollout],
                           into=[rollout_model] if how == "into" else None)
        assert run.error is None and run.errors == [None] and run.versions == [1]
        assert run.figures["buckets"] > 4 and packed == []  # type: ignore[index]
        got = dict(rollout_model.named_parameters()) if how == "into" else rollout.serve()
        for name, param in trainer.named_parameters():
            assert got[name].device.type == "cuda" and torch.equal(got[name].detach(), param.detach()), name
        if how == "into":
            assert [param.data_ptr() for param in rollout_model.parameters()] == where
    finally:
        sender.close()
        receiver.close()


def test_the_nccl_device_code_refuses_a_corrupted_bucket_with_the_on_device_checksum_on_one_gpu() -> None:
    rollout = MemoryRollout()
    receiver = OverGloo(device=0, bucket_bytes=4096, timeout_s=30)
    run = sync_threads(CorruptingOverGloo(device=0, bucket_bytes=4096, timeout_s=30), [receiver], _on(0), [rollout])
    receiver.close()
    assert isinstance(run.error, EngineError) and "failed its checksum" in str(run.error)
    assert isinstance(run.errors[0], EngineError) and rollout.stale
