"""What an mbridge load or build used to get wrong without a word: stored tensors the model has
no place for (dropped), float32 tensors loaded into a bfloat16 model (rounded), and HF configs
the bridge builds into another model than transformers does (biases it does not build,
sliding-window attention built as full attention)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lifecycle.errors import CheckpointError, ConfigError
from tests.backends.dist_util import run_ranks
from tests.backends.megatron_util import TINY_QWEN2, make_hf_checkpoint

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")
pytestmark = pytest.mark.transformers


def _load(model: Any, folder: Path) -> str:
    from backends.mbridge import MBridgeBackend

    try:
        MBridgeBackend().load_model(model, folder)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


def _four_layers_under_a_two_layer_config(tmp: Path) -> Path:
    """A 4-layer model's weights with the 2-layer model's config.json beside them."""
    make_hf_checkpoint(tmp / "hf")
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(TINY_QWEN2, "num_hidden_layers", 4)
        make_hf_checkpoint(tmp / "hf4")
    (tmp / "lie").mkdir()
    shutil.copy(tmp / "hf4" / "model.safetensors", tmp / "lie" / "model.safetensors")
    shutil.copy(tmp / "hf" / "config.json", tmp / "lie" / "config.json")
    return tmp / "lie"


def _load_both_at_pp2(rank: int, world_size: int, tmp: Path) -> dict[str, str]:
    from backends.megatron import build_model

    model = build_model(tmp / "hf", pp=2)
    return {"lie": _load(model, tmp / "lie"), "hf": _load(model, tmp / "hf")}


def test_stored_layers_the_model_has_no_place_for_are_refused_on_every_pp_rank_and_the_real_folder_loads(
    tmp_path: Path,
) -> None:
    """Before: layers 2-3 of a 4-layer folder whose config.json says 2 layers were dropped without
    a word. Each PP stage asks for its own layers only, so the refusal must come from what no
    rank asks for: the plain 2-layer folder still loads at PP=2."""
    _four_layers_under_a_two_layer_config(tmp_path)
    for out in run_ranks(_load_both_at_pp2, tmp_path, world_size=2, timeout_s=150):
        assert "holds tensors this model has no place for" in out["lie"], out
        assert "model.layers.2." in out["lie"] and "model.layers.1." not in out["lie"], out
        assert out["hf"] == "loaded"


def _with_dtype(src: Path, dst: Path, *, tensors: torch.dtype | None, config: str) -> Path:
    """`src` copied with its tensors cast to `tensors` (None: as stored) and config.json's dtype set to `config`."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    stored = load_file(str(src / "model.safetensors"))
    save_file({n: t if tensors is None else t.to(tensors) for n, t in stored.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    fields = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**fields, "dtype": config}))
    return dst


def _load_into_bf16(rank: int, world_size: int, tmp: Path) -> dict[str, str]:
    from backends.megatron import build_model

    into_bf16 = build_model(tmp / "hf", dtype=torch.bfloat16)
    from_lying_config = build_model(tmp / "lying")
    honest = build_model(tmp / "bf16")
    return {"float32_into_bf16": _load(into_bf16, tmp / "hf"), "lying": _load(from_lying_config, tmp / "lying"),
            "bf16": _load(honest, tmp / "bf16"), "model_dtype": str(from_lying_config.config.params_dtype)}


def test_float32_tensors_are_refused_by_a_bfloat16_model_naming_the_tensor_and_both_dtypes(tmp_path: Path) -> None:
    """Before: rounded into bf16 without a word (max error 2.3e-4), also when config.json says
    bfloat16 over float32 tensors; dist_ckpt refuses the same. A bf16 folder loads as before."""
    make_hf_checkpoint(tmp_path / "hf")
    _with_dtype(tmp_path / "hf", tmp_path / "lying", tensors=None, config="bfloat16")
    _with_dtype(tmp_path / "hf", tmp_path / "bf16", tensors=torch.bfloat16, config="bfloat16")
    [out] = run_ranks(_load_into_bf16, tmp_path, world_size=1, timeout_s=150)
    says = "has dtype torch.float32, the model expects torch.bfloat16"
    assert says in out["float32_into_bf16"] and "'model.embed_tokens.weight'" in out["float32_into_bf16"], out
    assert says in out["lying"] and out["model_dtype"] == "torch.bfloat16", out
    assert out["bf16"] == "loaded"


def _check(config: Any) -> str | None:
    """The key `check_config` refuses `config` on, or None."""
    from backends.hf_config import check_config

    try:
        check_config(config)
    except ConfigError as exc:
        return exc.key
    return None


def _llama(**fields: Any) -> Any:
    import transformers

    return transformers.LlamaConfig(**{**TINY_QWEN2, **fields})


@pytest.mark.parametrize(("fields", "key"), [
    ({"attention_bias": True}, "hf_config.attention_bias"),
    ({"mlp_bias": True}, "hf_config.mlp_bias"),
    ({}, None),
], ids=["attention-bias", "mlp-bias", "no-bias"])
def test_a_llama_config_with_biases_the_bridge_does_not_build_is_refused_naming_the_key(
    fields: dict[str, Any], key: str | None,
) -> None:
    """Before: mbridge builds q/k/v biases from attention_bias but neither o_proj's nor the MLP's,
    so HF -> dist -> HF lost every o_proj and gate/up/down bias while config.json still said true."""
    assert _check(_llama(**fields)) == key


def test_bias_flags_are_refused_only_where_the_bridge_builds_another_model() -> None:
    """Qwen2's q/k/v biases are its architecture (the bridge builds them); Qwen3 with
    attention_bias would lose all four projections' biases, Qwen2-MoE without qkv_bias gain three."""
    import transformers

    assert _check(transformers.Qwen2Config(**TINY_QWEN2)) is None
    assert _check(transformers.Qwen3Config(**TINY_QWEN2, attention_bias=True)) == "hf_config.attention_bias"
    assert _check(transformers.Qwen3Config(**TINY_QWEN2)) is None
    assert _check(SimpleNamespace(model_type="qwen2_moe", rope_theta=10_000.0, qkv_bias=False)) == "hf_config.qkv_bias"


def test_a_qwen2_config_with_sliding_window_attention_is_refused_and_full_attention_passes() -> None:
    """Before: built with full attention (Megatron's window_size None) without a word."""
    import transformers

    sliding = transformers.Qwen2Config(**TINY_QWEN2, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert _check(sliding) in {"hf_config.layer_types", "hf_config.use_sliding_window"}
    # sliding from layer 2 on, and the model has 2 layers: transformers builds full attention too
    assert _check(transformers.Qwen2Config(**TINY_QWEN2, use_sliding_window=True, sliding_window=8,
                                           max_window_layers=2)) is None
    assert _check(transformers.Qwen2Config(**TINY_QWEN2)) is None


@pytest.mark.parametrize(("fields", "key"), [
    ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8}, "hf_config.layer_types"),
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, "hf_config.use_sliding_window"),
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}, None),
    ({"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 0}, None),
    ({"model_type": "mixtral", "sliding_window": 4096}, "hf_config.sliding_window"),
    ({"model_type": "mixtral", "sliding_window": None}, None),
], ids=["layer-types", "tf4-use-sliding-window", "tf4-window-past-the-last-layer", "tf4-window-off",
        "mixtral-window", "mixtral-no-window"])
def test_sliding_window_attention_is_refused_naming_the_key_the_config_says_it_with(
    fields: dict[str, Any], key: str | None,
) -> None:
    """Configs without `layer_types` (transformers 4 before it, Mixtral) say it with
    use_sliding_window and max_window_layers, or with sliding_window alone."""
    config = SimpleNamespace(**{"model_type": "qwen2", "rope_theta": 10_000.0, "num_hidden_layers": 2, **fields})
    assert _check(config) == key


def _load_widening_and_ignored(rank: int, world_size: int, tmp: Path) -> dict[str, str]:
    from backends.megatron import build_model

    return {"bf16_into_float32": _load(build_model(tmp / "bf16", dtype=torch.float32), tmp / "bf16"),
            "inv_freq": _load(build_model(tmp / "hf"), tmp / "inv_freq")}


def test_a_lossless_widening_and_names_transformers_itself_skips_still_load(tmp_path: Path) -> None:
    """A hub checkpoint in bf16 loads into a float32 model (nothing is rounded), and a stored
    `rotary_emb.inv_freq` buffer of an older checkpoint, which transformers skips too, is no
    tensor the model lacks a place for."""
    from safetensors.torch import load_file, save_file

    make_hf_checkpoint(tmp_path / "hf")
    _with_dtype(tmp_path / "hf", tmp_path / "bf16", tensors=torch.bfloat16, config="bfloat16")
    (tmp_path / "inv_freq").mkdir()
    stored = load_file(str(tmp_path / "hf" / "model.safetensors"))
    stored["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(stored, str(tmp_path / "inv_freq" / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(tmp_path / "hf" / "config.json", tmp_path / "inv_freq" / "config.json")
    [out] = run_ranks(_load_widening_and_ignored, tmp_path, world_size=1, timeout_s=150)
    assert out == {"bf16_into_float32": "loaded", "inv_freq": "loaded"}, out
