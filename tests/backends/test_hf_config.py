"""The HF-config shim: what mbridge reads is supplied from a transformers-5 config's own
`rope_parameters` for a block only, a transformers-4 config is left alone, and what cannot be
derived is refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from backends.hf_config import bridge_attributes, bridge_view, config_dtype
from lifecycle import ConfigError, Lifecycle, State
from lifecycle.testing import InjectedFailure, MemoryCheckpointer
from tests.backends.megatron_util import make_hf_checkpoint

pytestmark = pytest.mark.transformers


class Tf5Config:
    """The shape of a transformers-5 config: RoPE lives only in `rope_parameters`."""

    def __init__(self, **rope_parameters: Any) -> None:
        self.rope_parameters = rope_parameters


class Tf4Config:
    """The shape of a transformers-4 config: `rope_theta` and `rope_scaling` are attributes."""

    def __init__(self) -> None:
        self.rope_theta = 1_000_000.0
        self.rope_scaling = None


def test_a_transformers_5_config_has_rope_theta_during_the_block_only() -> None:
    config = Tf5Config(rope_type="default", rope_theta=1_000_000.0)
    with bridge_view(config):
        assert config.rope_theta == 1_000_000.0
    assert not hasattr(config, "rope_theta")
    assert vars(config) == {"rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}}


def test_the_supplied_attributes_are_removed_when_the_block_raises() -> None:
    config = Tf5Config(rope_type="default", rope_theta=10_000.0, partial_rotary_factor=0.5)
    with pytest.raises(InjectedFailure), bridge_view(config):
        assert (config.rope_theta, config.partial_rotary_factor) == (10_000.0, 0.5)
        raise InjectedFailure("the bridge failed")
    assert not hasattr(config, "rope_theta") and not hasattr(config, "partial_rotary_factor")


def test_the_running_phase_removes_them_even_when_the_caller_never_restores() -> None:
    config = Tf5Config(rope_type="default", rope_theta=10_000.0)
    seen: dict[str, float] = {}

    class Failing(MemoryCheckpointer):
        def load_initial(self, parts: object) -> dict[str, object]:
            bridge_view(config)  # not used as a `with` block: only the phase's undo stack restores
            seen["rope_theta"] = config.rope_theta
            raise InjectedFailure("disk full")

    lc = Lifecycle(role="actor", checkpointer=Failing())
    with pytest.raises(InjectedFailure):
        lc.init_load()
    assert lc.state is State.FAILED and seen == {"rope_theta": 10_000.0}
    assert not hasattr(config, "rope_theta")


def test_a_transformers_4_config_is_left_untouched() -> None:
    config = Tf4Config()
    before = dict(vars(config))
    assert bridge_attributes(config) == {}
    with bridge_view(config):
        assert vars(config) == before
    assert vars(config) == before


def test_a_transformers_4_config_read_from_a_transformers_5_file_must_agree_with_its_rope_parameters() -> None:
    config = Tf4Config()
    config.rope_parameters = {"rope_type": "default", "rope_theta": 1_000_000.0}
    assert bridge_attributes(config) == {}
    config.rope_theta = 10_000.0  # transformers 4's default: the file's rope_theta went unread
    with pytest.raises(ConfigError) as info:
        bridge_view(config)
    assert info.value.key == "hf_config.rope_theta" and "1000000.0" in str(info.value)


def test_per_layer_type_parameters_that_agree_give_their_one_theta() -> None:
    same = {"rope_type": "default", "rope_theta": 10_000.0}
    assert bridge_attributes(Tf5Config(full_attention=same, sliding_attention=dict(same))) == {"rope_theta": 10_000.0}


@pytest.mark.parametrize(("config", "key"), [
    (Tf5Config(), "hf_config.rope_theta"),
    (object(), "hf_config.rope_theta"),
    (Tf5Config(rope_type="default"), "hf_config.rope_parameters.rope_theta"),
    (Tf5Config(rope_theta=10_000.0), "hf_config.rope_parameters.rope_type"),
    (Tf5Config(rope_type="yarn", rope_theta=10_000.0, factor=4.0), "hf_config.rope_parameters.rope_type"),
    (Tf5Config(rope_type="linear", rope_theta=10_000.0, factor=2.0), "hf_config.rope_parameters.rope_type"),
    (Tf5Config(full_attention={"rope_type": "default", "rope_theta": 1_000_000.0},
               sliding_attention={"rope_type": "default", "rope_theta": 10_000.0}), "hf_config.rope_parameters"),
])
def test_what_cannot_be_derived_is_refused_naming_the_key_and_nothing_is_set(config: Any, key: str) -> None:
    before = dict(getattr(config, "__dict__", {}))
    with pytest.raises(ConfigError) as info:
        bridge_view(config)
    assert info.value.key == key and str(info.value).startswith(f"{key}: ")
    assert dict(getattr(config, "__dict__", {})) == before


def test_a_real_config_reads_rope_theta_in_the_block_and_is_as_before_after_it() -> None:
    """On transformers 5 the value comes from rope_parameters, on 4 it is the config's own."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     rope_theta=500_000.0)
    before = config.to_dict()
    with bridge_view(config):
        assert config.rope_theta == 500_000.0
    assert config.to_dict() == before  # what save_pretrained writes and the fingerprint hashes


def _config_file(folder: Path, **rope: Any) -> Path:
    folder.mkdir()
    fields = {"model_type": "qwen2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, **rope}
    (folder / "config.json").write_text(json.dumps(fields), encoding="utf-8")
    return folder


def test_a_config_json_of_either_major_gives_its_own_rope_theta_or_is_refused(tmp_path: Path) -> None:
    """transformers 4 writes rope_theta, 5 writes rope_parameters; each major reads its own form,
    5 converts 4's, and 4 reading 5's would fall back to its default theta: refused."""
    transformers = pytest.importorskip("transformers")
    old = transformers.AutoConfig.from_pretrained(str(_config_file(tmp_path / "tf4", rope_theta=500_000.0,
                                                                   rope_scaling=None)))
    with bridge_view(old):
        assert old.rope_theta == 500_000.0
    new = transformers.AutoConfig.from_pretrained(str(_config_file(
        tmp_path / "tf5", rope_parameters={"rope_type": "default", "rope_theta": 500_000.0})))
    if int(transformers.__version__.split(".")[0]) >= 5:
        assert bridge_attributes(new) == {"rope_theta": 500_000.0}
    else:
        with pytest.raises(ConfigError, match="^hf_config.rope_theta: "):
            bridge_attributes(new)


class Tf5Dtype:
    dtype = torch.bfloat16

    @property
    def torch_dtype(self) -> torch.dtype:
        raise AssertionError("the deprecated name was read")


class Tf451Dtype:
    torch_dtype = "float16"


def test_dtype_is_read_under_the_name_the_config_has() -> None:
    assert config_dtype(Tf5Dtype()) is torch.bfloat16
    assert config_dtype(Tf451Dtype()) is torch.float16
    assert config_dtype(object()) is None


def test_a_checkpoint_saved_in_float32_gives_float32_on_either_major(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    make_hf_checkpoint(tmp_path)
    assert config_dtype(transformers.AutoConfig.from_pretrained(str(tmp_path))) is torch.float32


class Tf5Model(Tf5Config):
    """A transformers-5 config of the tiny qwen2 model, one attribute overridable."""

    def __init__(self, **fields: Any) -> None:
        super().__init__(rope_type="default", rope_theta=fields.pop("rope_theta", 10_000.0))
        self.model_type, self.hidden_act, self.dtype = "qwen2", "silu", torch.float32
        self.vocab_size, self.hidden_size, self.intermediate_size = 256, 64, 128
        self.num_hidden_layers, self.num_attention_heads, self.num_key_value_heads = 2, 4, 2
        vars(self).update(fields)


@pytest.mark.parametrize(("fields", "key"), [
    ({"rope_theta": float("nan")}, "hf_config.rope_theta"),
    ({"rope_theta": -5.0}, "hf_config.rope_theta"),
    ({"rope_theta": "big"}, "hf_config.rope_theta"),
    ({"hidden_act": "gelu"}, "hf_config.hidden_act"),
    ({"vocab_size": 0}, "hf_config.vocab_size"),
    ({"num_attention_heads": 0}, "hf_config.num_attention_heads"),
    ({"num_hidden_layers": 0}, "hf_config.num_hidden_layers"),
    ({"num_key_value_heads": 3}, "hf_config.num_key_value_heads"),
    ({"dtype": torch.int64}, "hf_config.dtype"),
    ({"dtype": torch.float8_e4m3fn}, "hf_config.dtype"),
], ids=["rope-nan", "rope-negative", "rope-string", "gelu-for-qwen2", "vocab-0", "heads-0", "layers-0",
        "kv-heads-not-dividing", "int64", "float8"])
def test_a_config_the_bridge_would_build_wrong_or_crash_on_is_refused_naming_the_key(
    fields: dict[str, Any], key: str,
) -> None:
    """Before: NaN rotary frequencies, SiLU in place of GELU and an embedding of no rows were
    built without a word; 0 heads or layers and an int64 dtype raised raw ZeroDivisionError and
    RuntimeError from inside Megatron."""
    config = Tf5Model(**fields)
    before = dict(vars(config))
    with pytest.raises(ConfigError) as info:
        bridge_view(config)
    assert info.value.key == key and vars(config) == before


def test_the_tiny_model_config_passes_the_checks() -> None:
    config = Tf5Model()
    with bridge_view(config):
        assert config.rope_theta == 10_000.0
