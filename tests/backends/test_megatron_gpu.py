"""The Megatron backends on CUDA (NCCL; Transformer Engine's layer spec when it is installed).

Skipped without a GPU (the `gpu` marker); on a GPU machine they run on one rank per device,
up to two, with no CPU patch applied.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.backends.dist_util import run_ranks
from tests.backends.megatron_util import hf_tensors, make_hf_checkpoint, same_tensors

pytestmark = [pytest.mark.gpu, pytest.mark.transformers]


def _ranks() -> int:
    return max(1, min(2, torch.cuda.device_count()))


def _round_trip_on_gpu(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    from backends.dist_ckpt import DistCkptBackend
    from backends.mbridge import MBridgeBackend
    from backends.megatron import build_model, transformer_engine_available
    from megatron.core import parallel_state

    model = build_model(tmp / "hf", tp=world_size)
    devices = {p.device.type for p in model.parameters()}
    MBridgeBackend().load_model(model, tmp / "hf")
    MBridgeBackend().save_model(model, tmp / "hf_out")
    DistCkptBackend().save_model(model, tmp / "dist")
    parallel_state.destroy_model_parallel()
    fresh = build_model(tmp / "hf", tp=1)
    DistCkptBackend().load_model(fresh, tmp / "dist")
    exported = {k: v.cpu() for k, v in fresh.state_dict().items()}
    return {"devices": sorted(devices), "te": transformer_engine_available(),
            "differ": same_tensors(hf_tensors(tmp / "hf"), exported)}


def test_mbridge_and_dist_ckpt_round_trip_on_cuda_with_the_gpu_layer_spec(tmp_path: Path) -> None:
    make_hf_checkpoint(tmp_path / "hf")
    for result in run_ranks(_round_trip_on_gpu, tmp_path, world_size=_ranks(), timeout_s=300, backend="nccl"):
        assert result["devices"] == ["cuda"]
        assert result["differ"] == []
    assert same_tensors(hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "hf_out")) == []


def _lifecycle_on_gpu(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    from backends.megatron import build_model
    from lifecycle import Lifecycle

    model = build_model(tmp / "hf", tp=world_size)
    optimizer = torch.optim.Adam(list(model.parameters()), lr=1e-3)
    cfg = {"checkpoint": {"root": str(tmp / "ckpt"), "save": {"format": "dist_ckpt"},
                          "pre_load": {"format": "mbridge", "path": str(tmp / "hf")}}}
    lc = Lifecycle(cfg, role="actor", model=model, optimizer=optimizer)
    lc.init_load()
    with lc.train_step(1):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
    lc.save(1)
    saved = [p.detach().clone() for p in model.parameters()]
    moments = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
            optimizer.state[p]["exp_avg"].zero_()
    step = Lifecycle(cfg, role="actor", model=model, optimizer=optimizer).resume()
    same = all(torch.equal(a, p) for a, p in zip(saved, model.parameters()))
    same_moments = all(torch.equal(m, optimizer.state[p]["exp_avg"]) for m, p in zip(moments, model.parameters()))
    return {"step": step, "weights": same, "optimizer": same_moments}


def test_lifecycle_saves_and_resumes_a_megatron_model_on_cuda(tmp_path: Path) -> None:
    make_hf_checkpoint(tmp_path / "hf")
    results = run_ranks(_lifecycle_on_gpu, tmp_path, world_size=_ranks(), timeout_s=300, backend="nccl")
    assert results == [{"step": 1, "weights": True, "optimizer": True}] * _ranks()
