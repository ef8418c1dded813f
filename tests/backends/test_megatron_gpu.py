"""The Megatron backends on CUDA (NCCL; Transformer Engine's layer spec when it is installed).

The `gpu` tests are skipped without a GPU; on a GPU machine they run on one rank per device,
up to two, with no CPU patch applied. The logits check also runs on the CPU, in float32, so
the forward call it makes is known to work before it meets a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.backends.dist_util import run_ranks
from tests.backends.megatron_util import hf_tensors, make_hf_checkpoint, same_tensors

pytestmark = [pytest.mark.transformers]


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


@pytest.mark.gpu
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


@pytest.mark.gpu
def test_lifecycle_saves_and_resumes_a_megatron_model_on_cuda(tmp_path: Path) -> None:
    make_hf_checkpoint(tmp_path / "hf")
    results = run_ranks(_lifecycle_on_gpu, tmp_path, world_size=_ranks(), timeout_s=300, backend="nccl")
    assert results == [{"step": 1, "weights": True, "optimizer": True}] * _ranks()


TOKENS = (2, 32)
"""Batch and sequence of the logits check; a sequence over 16 is what routes bf16 attention to
Megatron's fused softmax when that kernel is installed."""
TOLERANCE = {"float32": 1e-4, "bfloat16": 8 * 2**-8}
"""Largest |Megatron - transformers| allowed per logit, each model in that dtype. The logits of
the tiny random model stay below 1 in magnitude: float32 differs only by summation order
(about 1e-7 measured on the CPU), bf16 by its rounding of every activation, and 2**-8 is one
bf16 step of a value in [0.5, 1) (one step was measured on the CPU)."""


def _megatron_logits(folder: Path, ids: torch.Tensor, dtype: torch.dtype, device: str) -> torch.Tensor:
    """The HF checkpoint init-loaded through mbridge, then `GPTModel(input_ids, position_ids,
    attention_mask)` with a causal bool mask [b, 1, s, s] (True = masked); logits [b, s, vocab]."""
    from contextlib import nullcontext
    from unittest import mock

    from megatron.core import tensor_parallel

    from backends.mbridge import MBridgeBackend
    from backends.megatron import build_model, cpu_safe

    model = build_model(folder, tp=1, dtype=dtype)
    MBridgeBackend().load_model(model, folder)
    chunk = model.chunks[0].eval()
    batch, seq = ids.shape
    positions = torch.arange(seq, device=device).expand(batch, -1)
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)[None, None].expand(batch, 1, -1, -1)
    # Attention dropout forks Megatron's CUDA RNG tracker even in eval mode; on the CPU no tracker exists.
    tracker = nullcontext() if device == "cuda" else mock.patch.object(
        tensor_parallel, "get_cuda_rng_tracker", return_value=mock.Mock(fork=nullcontext))
    with torch.no_grad(), cpu_safe(), tracker:
        return chunk(ids.to(device), positions, mask).float()


def _hf_logits(folder: Path, ids: torch.Tensor, dtype: torch.dtype, device: str) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    with torch.no_grad():
        return model(ids.to(device)).logits.float()


def _in_dtype(folder: Path, dtype: torch.dtype) -> Path:
    """The HF checkpoint in `folder` with its weights in `dtype`, saved by transformers beside it."""
    import transformers

    if dtype == torch.float32:
        return folder
    out = folder.with_name(f"{folder.name}_{str(dtype).removeprefix('torch.')}")
    transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).save_pretrained(str(out))
    return out


def _logits_against_transformers(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids = torch.randint(0, 256, TOKENS, generator=torch.Generator().manual_seed(0))
    reference = _hf_logits(tmp / "hf", ids, torch.float32, device)
    top2 = reference.topk(2, dim=-1).values
    out: dict[str, Any] = {"device": device}
    for name, tolerance in TOLERANCE.items():
        dtype = getattr(torch, name)
        folder = _in_dtype(tmp / "hf", dtype)  # mbridge refuses to cast float32 weights into a bfloat16 model
        megatron, hf = _megatron_logits(folder, ids, dtype, device), _hf_logits(folder, ids, dtype, device)
        clear = (top2[..., 0] - top2[..., 1]) > 2 * tolerance
        differ = megatron.argmax(-1) != hf.argmax(-1)
        out[name] = {"max_abs_diff": float((megatron - hf).abs().max()), "tolerance": tolerance,
                     "max_abs_logit": float(reference.abs().max()), "clear_positions": int(clear.sum()),
                     "argmax_differs_where_clear": int((differ & clear).sum()),
                     "argmax_agreement": float((~differ).float().mean())}
    return out


def _assert_logits_match(result: dict[str, Any]) -> None:
    for name in TOLERANCE:
        got = result[name]
        assert got["max_abs_diff"] <= got["tolerance"], result
        assert got["argmax_differs_where_clear"] == 0 and got["clear_positions"] > 0, result


@pytest.mark.gpu
def test_megatron_logits_on_cuda_match_transformers_in_float32_and_bf16(tmp_path: Path) -> None:
    """One rank, mbridge init-load of an HF checkpoint, both models on the same GPU, each in float32
    and in bf16: the largest |logit difference| at most 1e-4 in float32 and 8 * 2**-8 = 0.031 in bf16
    (`TOLERANCE`; the logits stay below 1), and the same argmax wherever transformers' float32
    logits have their top two more than twice the tolerance apart."""
    make_hf_checkpoint(tmp_path / "hf")
    [result] = run_ranks(_logits_against_transformers, tmp_path, world_size=1, timeout_s=300, backend="nccl")
    assert result["device"] == "cuda"
    _assert_logits_match(result)


@pytest.mark.slow
def test_megatron_logits_on_cpu_match_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check on the CPU (CUDA hidden from the rank), with the CPU patches."""
    make_hf_checkpoint(tmp_path / "hf")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    [result] = run_ranks(_logits_against_transformers, tmp_path, world_size=1, timeout_s=120)
    assert result["device"] == "cpu"
    _assert_logits_match(result)
