"""dist_ckpt and build_model against layouts and optimizers the first version got wrong.

Per-rank optimizer hyper-parameters (PP stages with their own lr), a frozen layer of a stacked
parameter, the dtype written beside the weights, CUDA-only building blocks on CPU, and TP / PP
sizes the architecture cannot be split by.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from lifecycle.errors import CheckpointError, ConfigError
from tests.backends.dist_util import run_ranks
from tests.backends.megatron_util import TINY_QWEN2, make_hf_checkpoint

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")
pytestmark = pytest.mark.transformers


def _stage_optimizer(model: Any, rank: int, split: bool) -> torch.optim.Optimizer:
    """Each PP stage its own lr and weight decay; with `split`, rank 0's embedding in a group of its own."""
    params = list(model.parameters())
    lr, wd = (0.001, 0.1) if rank == 0 else (0.01, 0.0)
    groups = [{"params": params[:1]}, {"params": params[1:]}] if split and rank == 0 else [{"params": params}]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=wd)


def _stepped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    optimizer.step()
    return optimizer


def _pp2_groups(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    from backends.dist_ckpt import DistCkptBackend
    from backends.megatron import build_model

    model = build_model(tmp / "hf", pp=2)
    DistCkptBackend().save_optimizer(_stepped(_stage_optimizer(model, rank, False)), None, tmp / "same", model=model)
    DistCkptBackend().save_optimizer(_stepped(_stage_optimizer(model, rank, True)), None, tmp / "split", model=model)
    resumed = _stage_optimizer(model, rank, False)
    for group in resumed.param_groups:
        group.update(lr=0.5, weight_decay=0.5)
    DistCkptBackend().load_optimizer(resumed, None, tmp / "same", model=model)
    try:
        DistCkptBackend().load_optimizer(_stage_optimizer(model, rank, False), None, tmp / "split", model=model)
        refused = ""
    except CheckpointError as exc:
        refused = str(exc)
    old = tmp / "same" / "optimizer.json"
    if rank == 0:  # as written before each rank's groups were kept: rank 0's only
        old.write_text(json.dumps({k: v for k, v in json.loads(old.read_text()).items() if k != "ranks"}))
    torch.distributed.barrier()
    legacy = _stage_optimizer(model, rank, False)
    with capture_logs() as logs:
        DistCkptBackend().load_optimizer(legacy, None, tmp / "same", model=model)
    return {"lr": resumed.param_groups[0]["lr"], "wd": resumed.param_groups[0]["weight_decay"], "refused": refused,
            "legacy_lr": legacy.param_groups[0]["lr"], "warned": [e["event"] for e in logs]}


def test_at_pp2_each_stage_resumes_its_own_lr_and_a_group_count_that_fits_one_rank_only_is_refused_on_every_rank(
    tmp_path: Path,
) -> None:
    """Before: optimizer.json kept rank 0's groups; rank 1 resumed with rank 0's lr and weight
    decay, and with another group count one rank refused alone while the other waited in a
    collective until the process group's timeout (a raw RuntimeError). A file written before
    (no `ranks`) still loads as it did."""
    make_hf_checkpoint(tmp_path / "hf")
    results = run_ranks(_pp2_groups, tmp_path, timeout_s=150)
    assert [(r["lr"], r["wd"]) for r in results] == [(0.001, 0.1), (0.01, 0.0)]
    assert "param_groups must list 1 group(s)" in results[0]["refused"]
    assert "other rank(s) refused the checkpoint" in results[1]["refused"]
    assert json.loads((tmp_path / "split" / "optimizer.json").read_text())["ranks"]["layout"] == {
        "world": 2, "tp": 1, "pp": 2}
    assert [r["legacy_lr"] for r in results] == [0.001, 0.001]  # an older file loads as before, with a warning
    assert all("dist_ckpt.param_groups_of_rank0" in r["warned"] for r in results)


def _frozen_layer(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    from backends.dist_ckpt import DistCkptBackend
    from backends.megatron import build_model

    def trainable() -> tuple[Any, torch.optim.Optimizer, torch.nn.Parameter]:
        model = build_model(tmp / "hf")
        frozen = dict(model.chunks[0].named_parameters())["decoder.layers.0.self_attention.linear_proj.weight"]
        frozen.requires_grad_(False)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01), frozen

    model, optimizer, _ = trainable()
    DistCkptBackend().save_optimizer(_stepped(optimizer), None, tmp / "frozen", model=model)
    again, resumed, frozen = trainable()
    DistCkptBackend().load_optimizer(resumed, None, tmp / "frozen", model=again)
    same = all(torch.equal(optimizer.state[p]["exp_avg"], resumed.state[q]["exp_avg"])
               for p, q in zip(model.parameters(), again.parameters()) if p.requires_grad)
    whole = torch.optim.AdamW(list(again.parameters()), lr=0.01)  # unfrozen at resume: no state of its own
    DistCkptBackend().load_optimizer(whole, None, tmp / "frozen", model=again)
    doc = json.loads((tmp / "frozen" / "optimizer.json").read_text())
    return {"same": same, "frozen_state": bool(whole.state.get(frozen)), "stand_ins": doc["optimizer"]["stand_ins"],
            "ranks": doc["ranks"], "held": len(whole.state)}


def test_an_optimizer_without_one_layers_frozen_weight_saves_and_resumes_its_moments_and_gives_the_frozen_none(
    tmp_path: Path,
) -> None:
    """Before: Megatron refused the save ("Invalid access pattern"): the stacked layers' tensor
    had state for layer 1 only. Layer 0 now gets a zero stand-in, named in optimizer.json."""
    make_hf_checkpoint(tmp_path / "hf")
    [result] = run_ranks(_frozen_layer, tmp_path, world_size=1, timeout_s=150)
    assert result["same"] and not result["frozen_state"] and result["ranks"] is None
    assert result["stand_ins"] == ["decoder.layers.self_attention.linear_proj.weight[0]"]


def _bf16_from_fp32_config(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    from backends.dist_ckpt import DistCkptBackend
    from backends.hf_config import config_dtype
    from backends.megatron import build_model
    from backends.megatron_files import write_hf_export

    model = build_model(tmp / "hf", dtype=torch.bfloat16)
    DistCkptBackend().save_model(model, tmp / "dist")
    write_hf_export(model, tmp / "export")
    return {"dist": json.loads((tmp / "dist" / "config.json").read_text()).get("dtype"),
            "export": json.loads((tmp / "export" / "config.json").read_text()).get("dtype"),
            "after": str(config_dtype(model.bridge.hf_config))}


def test_the_config_json_beside_a_bf16_model_built_from_a_float32_config_says_bfloat16(tmp_path: Path) -> None:
    """Before: it said float32 over bfloat16 tensors, and convert refused the library's own checkpoint."""
    make_hf_checkpoint(tmp_path / "hf")
    [result] = run_ranks(_bf16_from_fp32_config, tmp_path, world_size=1, timeout_s=150)
    assert result == {"dist": "bfloat16", "export": "bfloat16", "after": "torch.float32"}


def _tied_pp2(rank: int, world_size: int, tmp: Path) -> bool:
    from backends.megatron import build_model

    model = build_model(tmp / "hf", pp=2)
    return all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU patches apply only without CUDA")
def test_tied_embeddings_at_pp2_build_on_cpu(tmp_path: Path) -> None:
    """Before: Megatron's `weight.data.cuda()` for the last stage's copy raised a raw AssertionError."""
    import transformers

    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY_QWEN2, tie_word_embeddings=True)).save_pretrained(
        str(tmp_path / "hf"))
    assert run_ranks(_tied_pp2, tmp_path, timeout_s=150) == [True, True]


def _moe(rank: int, world_size: int, tmp: Path) -> str:
    import transformers

    from backends.megatron import build_model

    config = transformers.MixtralConfig(**TINY_QWEN2, num_local_experts=4, num_experts_per_tok=2)
    try:
        build_model(config)
    except ConfigError as exc:
        return str(exc)
    return "built"


@pytest.mark.skipif(torch.cuda.is_available(), reason="MoE layers build with CUDA")
def test_a_moe_model_on_cpu_is_a_config_error_naming_cuda(tmp_path: Path) -> None:
    """Before: a raw RuntimeError from torch.cuda.Stream in Megatron's MoELayer."""
    [message] = run_ranks(_moe, tmp_path, world_size=1, timeout_s=150)
    assert message.startswith("hf_config") and "CUDA" in message, message


@pytest.mark.parametrize(("change", "tp", "pp", "key", "needle"), [
    ({}, 3, 1, "parallel.tp", "num_attention_heads=4"),
    ({"num_attention_heads": 8}, 4, 1, "parallel.tp", "num_key_value_heads=2"),
    ({}, 1, 3, "parallel.pp", "num_hidden_layers=2"),
    ({"vocab_size": 255}, 2, 1, "parallel.tp", "vocab_size=255"),
    ({"intermediate_size": 127}, 2, 1, "parallel.tp", "intermediate_size=127"),
], ids=["heads", "query-groups", "layers", "vocab", "ffn"])
def test_a_layout_the_architecture_cannot_be_split_by_is_a_config_error_naming_the_size_before_any_rank_starts(
    change: dict[str, int], tp: int, pp: int, key: str, needle: str,
) -> None:
    """Before: raw ValueError / AssertionError from Megatron on every rank; no process group here."""
    import transformers

    from backends.megatron import build_model, check_layout

    config = transformers.Qwen2Config(**{**TINY_QWEN2, **change})
    with pytest.raises(ConfigError) as caught:
        build_model(config, tp=tp, pp=pp)
    assert caught.value.key == key and needle in str(caught.value)
    check_layout(config, tp=1, pp=1)
    check_layout(transformers.Qwen2Config(**TINY_QWEN2), tp=2, pp=2)
