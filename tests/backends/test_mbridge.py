"""The mbridge format refuses, on every rank and before the bridge's collectives, an HF folder
whose config or tensors are not this model's: a wrong-shaped tensor would stop one TP rank in
mbridge's scatter while its peers wait forever, a moved gate/up split would load unnoticed."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lifecycle.errors import CheckpointError
from tests.backends.dist_util import run_ranks
from tests.backends.megatron_util import TINY_QWEN2, make_hf_checkpoint

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")
pytestmark = pytest.mark.transformers


def _edited(src: Path, dst: Path, edit: Any) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _wide_down_proj(t: dict[str, torch.Tensor]) -> None:
    t["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 130)


def _gate_up_moved(t: dict[str, torch.Tensor]) -> None:
    """The same 256 rows the bridge concatenates into fc1, split at another place."""
    both = torch.cat([t["model.layers.0.mlp.gate_proj.weight"], t["model.layers.0.mlp.up_proj.weight"]])
    t["model.layers.0.mlp.gate_proj.weight"], t["model.layers.0.mlp.up_proj.weight"] = both[:64], both[64:]


def _load_each_at_tp2(rank: int, world_size: int, tmp: Path) -> dict[str, str]:
    from backends.mbridge import MBridgeBackend
    from backends.megatron import build_model

    model = build_model(tmp / "hf", tp=2)
    out: dict[str, str] = {}
    for name in ("wide", "moved", "hf"):
        try:
            MBridgeBackend().load_model(model, tmp / name)
            out[name] = "loaded"
        except CheckpointError as exc:
            out[name] = str(exc)
    return out


def test_a_tensor_of_another_shape_is_refused_on_every_tp_rank_before_the_scatter(tmp_path: Path) -> None:
    """Before: rank 0 failed in ProcessGroupGloo::scatter and rank 1 waited in it forever; a
    gate/up split moved by 64 rows loaded silently (transformers refuses both)."""
    hf = make_hf_checkpoint(tmp_path / "hf")
    _edited(hf, tmp_path / "wide", _wide_down_proj)
    _edited(hf, tmp_path / "moved", _gate_up_moved)
    for out in run_ranks(_load_each_at_tp2, tmp_path, world_size=2, timeout_s=120):
        assert "down_proj.weight: [64, 130], expected [64, 128]" in out["wide"]
        assert "gate_proj.weight: [64, 64], expected [128, 64]" in out["moved"]
        assert out["hf"] == "loaded"


def _bridge(**fields: Any) -> Any:
    import transformers

    return SimpleNamespace(hf_config=transformers.Qwen2Config(**{**TINY_QWEN2, **fields}))


def _problem(bridge: Any, folder: Path) -> str | None:
    """What `_load_problem` makes of the folder's config.json: a problem, or None."""
    from backends.mbridge import _architecture_problem

    try:
        return _architecture_problem(bridge, folder)
    except CheckpointError as exc:
        return str(exc)


@pytest.mark.parametrize(("config", "says"), [
    ("[1, 2]", "must be a JSON object, found list"),
    ('{"vocab_size": 256}', "has no model_type"),
    ('{"model_type": "qwen2"}', "hidden_size: checkpoint 4096, model 64"),
], ids=["a-list", "no-model-type", "only-a-model-type"])
def test_a_config_json_that_does_not_say_the_models_architecture_is_refused(
    tmp_path: Path, config: str, says: str,
) -> None:
    """Before: a list or an object without the compared keys skipped the check, and an untied
    checkpoint loaded into a tied model lost its lm_head."""
    (tmp_path / "config.json").write_text(config)
    assert says in str(_problem(_bridge(tie_word_embeddings=True), tmp_path))


def test_untied_embeddings_saved_by_default_are_told_from_a_tied_model(tmp_path: Path) -> None:
    """A key save_pretrained left out takes the config class's default (qwen2: untied)."""
    fields = {k: v for k, v in _bridge().hf_config.to_dict().items() if k != "tie_word_embeddings"}
    (tmp_path / "config.json").write_text(json.dumps(fields))
    assert "tie_word_embeddings: checkpoint False, model True" in str(_problem(_bridge(tie_word_embeddings=True),
                                                                                tmp_path))
    assert _problem(_bridge(tie_word_embeddings=False), tmp_path) is None


def test_a_fifo_config_json_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "config.json")
    assert "a FIFO, not a regular file" in str(_problem(_bridge(), tmp_path))
