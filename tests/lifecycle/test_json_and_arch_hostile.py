"""Crafted JSON trees, manifests and model configs: refused (or read) the same way by every
reader, with the library's own errors, before any quadratic or unbounded work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lifecycle.checksum import ALGORITHM
from lifecycle.errors import CheckpointError, ConfigError
from lifecycle.extra import load_extra, save_extra
from lifecycle.jsontree import decode, encode
from lifecycle.manifest import check_folder, read_manifest_file
from lifecycle.types import Progress
from tests.lifecycle.hostile import lifecycle_at, saved_run

M61 = (1 << 61) - 1
"""CPython hashes an int modulo this prime: every multiple of it hashes to 0."""
PAIRS = 3000
"""Keys in one crafted dict: quadratic enough to show, yet quick before the fix."""


def _extra_with_user(folder: Path, user: Any) -> Path:
    """A saved extra.json whose `progress.user` is replaced by the raw JSON tree `user`."""
    save_extra(folder, Progress(step=3))
    path = folder / "extra.json"
    doc = json.loads(path.read_text())
    doc["progress"]["user"] = user
    path.write_text(json.dumps(doc))
    return path


def _colliding_keys(kind: str) -> list[Any]:
    """JSON-tree keys that all hash alike once decoded."""
    if kind == "int":
        return [k * M61 for k in range(1, PAIRS + 1)]
    if kind == "tuple":
        return [{"__tuple__": [k * M61]} for k in range(1, PAIRS + 1)]
    return [2.0 ** (61 * j) for j in range(-17, 17)]  # every power 2**(61j) hashes to 1: 34 of them


@pytest.mark.parametrize("kind", ["int", "tuple", "float"])
def test_an_extra_json_dict_whose_keys_all_share_one_hash_is_refused_naming_the_file(
    tmp_path: Path, kind: str,
) -> None:
    path = _extra_with_user(tmp_path, {"__dict__": [[k, None] for k in _colliding_keys(kind)]})
    with pytest.raises(CheckpointError, match="share one hash") as info:
        load_extra(tmp_path, step=3)
    assert str(path) in str(info.value)


def test_an_optimizer_json_state_whose_keys_all_share_one_hash_is_refused_naming_the_file() -> None:
    tree = {"state": {"__dict__": [[k, {"step": 1}] for k in _colliding_keys("int")]}, "param_groups": []}
    with pytest.raises(CheckpointError, match="share one hash") as info:
        decode(tree, where="/ckpt/optimizer.json")
    assert "/ckpt/optimizer.json" in str(info.value) and "state" in str(info.value)


def test_a_legitimate_dict_of_as_many_int_and_tuple_keys_still_loads(tmp_path: Path) -> None:
    ints = {k: k % 7 for k in range(-PAIRS // 2, PAIRS // 2)}
    tuples = {(k, -k): str(k) for k in range(PAIRS)}
    _extra_with_user(tmp_path, {"ints": encode(ints, where="t"), "tuples": encode(tuples, where="t")})
    user = load_extra(tmp_path, step=3).user
    assert user == {"ints": ints, "tuples": tuples}


def test_keys_the_library_writes_round_trip_including_int64_extremes_and_floats() -> None:
    value = {-(2**63): 1, 2**63 - 1: 2, -1: 3, -2: 4, 0: 5, 1.5: 6, float("inf"): 7, (1, "a", None): 8, True: 9}
    assert decode(encode(value, where="t"), where="t") == value


def test_a_manifest_stating_uppercase_digests_gets_one_verdict_from_verify_and_resume(tmp_path: Path) -> None:
    """Before: `verify` compared lowercased and said ok; resume compared exactly and refused the step."""
    saved_run(tmp_path, steps=(1, 2))
    folder = tmp_path / "global_step_2" / "actor"
    mpath = folder / "manifest.json"
    manifest = json.loads(mpath.read_text())
    for entry in manifest["files"]:
        entry[ALGORITHM] = entry[ALGORITHM].upper()
    mpath.write_text(json.dumps(manifest))
    assert all(entry[ALGORITHM] == entry[ALGORITHM].lower() for entry in read_manifest_file(folder)["files"])
    assert check_folder(folder, deep=True) == []
    assert lifecycle_at(tmp_path).resume() == 2


def test_a_manifest_digest_that_differs_only_in_case_of_a_wrong_digest_is_still_refused(tmp_path: Path) -> None:
    saved_run(tmp_path, steps=(1,))
    folder = tmp_path / "global_step_1" / "actor"
    mpath = folder / "manifest.json"
    manifest = json.loads(mpath.read_text())
    manifest["files"][0][ALGORITHM] = "F" * 16
    mpath.write_text(json.dumps(manifest))
    assert any("!= manifest ffffffffffffffff" in p for p in check_folder(folder, deep=True))


BART = {"model_type": "bart", "architectures": ["BartForCausalLM"], "d_model": 8, "encoder_layers": 1,
        "encoder_attention_heads": 1, "decoder_attention_heads": 1, "encoder_ffn_dim": 8, "decoder_ffn_dim": 8,
        "vocab_size": 16, "max_position_embeddings": 8}


@pytest.mark.transformers
def test_a_bart_config_of_many_decoder_layers_is_counted_at_the_clamp_as_a_floor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """BART's `num_hidden_layers` is its encoder's: before, 30000 decoder layers were all built."""
    import transformers

    from backends import hf_arch

    monkeypatch.setattr(hf_arch, "MAX_COUNTED_LAYERS", 8)
    one, two, deep = (hf_arch.parameter_floor(transformers.BartConfig(**{**BART, "decoder_layers": n}))
                      for n in (1, 2, 100))
    assert one is not None and two is not None and deep == one + 7 * (two - one)


BAD_CONFIGS = [
    {"model_type": "llama", "torch_dtype": "nonsense"},
    {"model_type": "llama", "rope_scaling": "x"},
    {"model_type": "llama", "quantization_config": 5},
    {"model_type": "llama", "id2label": [1, 2]},
    {"model_type": "llama", "num_attention_heads": 0},
    {"model_type": "gpt2", "n_layer": "x"},
    {"model_type": "llava", "text_config": 5},
    {"model_type": "qwen2_vl", "vision_config": []},
]


@pytest.mark.transformers
@pytest.mark.parametrize("config", BAD_CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
def test_a_config_json_value_of_the_wrong_type_is_a_config_error_naming_the_folder_never_a_raw_error(
    tmp_path: Path, config: dict[str, Any],
) -> None:
    """transformers 5 refuses every one of these; 4.x reads some (`n_layer: "x"`, a list as
    `vision_config`), and then nothing may escape raw either."""
    import transformers

    from backends.hf_arch import parameter_floor, read_hf_config

    (tmp_path / "config.json").write_text(json.dumps(config))
    try:
        parameter_floor(read_hf_config(tmp_path))
    except ConfigError as exc:
        assert exc.key == "hf_config" and str(tmp_path) in str(exc) and "no model config transformers can read" in str(exc)
    else:
        assert int(transformers.__version__.split(".")[0]) < 5, "transformers 5 reads a config it should refuse"


@pytest.mark.transformers
def test_convert_reports_a_config_json_of_the_wrong_value_type_as_a_usage_error(tmp_path: Path) -> None:
    """Before: a traceback and exit 1."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "nonsense"}))
    (src / "model.safetensors").write_bytes(bytes(100_000))
    done = subprocess.run([sys.executable, "-m", "lifecycle", "convert", str(src), str(tmp_path / "dst"),
                           "--to", "dist_ckpt"], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: --hf-config" in done.stderr and "Traceback" not in done.stderr
