"""What mbridge reads of an HF config, on transformers 4 and 5 alike.

mbridge 0.15.1 was written against transformers 4, whose configs carry `rope_theta` (and, for
GLM-4 MoE, `partial_rotary_factor`) as attributes. transformers 5 keeps both inside
`config.rope_parameters`, so the bridge fails on a missing attribute. Its `rope_scaling` became
a property returning that same dict, and mbridge's `"rope_scaling" in config` test looks at the
instance's own attributes only: on a transformers-5 config any RoPE scaling would be dropped
without a word.

The other way round, transformers 4 reading a config.json that transformers 5 wrote keeps
`rope_parameters` as an unknown key and its class default for `rope_theta`.

`bridge_attributes` derives the old attributes from the config's own `rope_parameters`, never
from a default, and refuses what the bridge would build differently from the checkpoint;
`bridge_view` sets them for a block only, through the running phase's undo stack, so they never
reach a saved config.json or the model's fingerprint. This module imports neither transformers
nor mbridge: it reads the config object it is given.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from lifecycle.errors import ConfigError, shorten
from lifecycle.phase import Temporary, temporarily

KEY = "hf_config"
"""The config key the errors name: the HF config (folder or object) given to build_model."""

FROM_ROPE_PARAMETERS: dict[str, bool] = {"rope_theta": True, "partial_rotary_factor": False}
"""Each transformers-4 attribute mbridge reads that transformers 5 moved into `rope_parameters`
(under the same name) -> whether every RoPE config has it (`partial_rotary_factor` only the
models with partial rotary embeddings, and only their bridges read it)."""

BRIDGE_ROPE_TYPES = frozenset({"default"})
"""The rope types a bridge builds from a transformers-5 config: mbridge passes on `rope_theta`
and nothing of the scaling (see the module docstring)."""


def _describe(params: Mapping[str, Any]) -> str:
    return f"rope_type {shorten(params.get('rope_type'))}, rope_theta {shorten(params.get('rope_theta'))}"


def rope_parameters(config: Any) -> Mapping[str, Any]:
    """The config's one set of RoPE parameters. Per-layer-type parameters (`{"full_attention":
    {...}, "sliding_attention": {...}}`) are accepted only when every layer type has the same,
    since a bridge builds one rotary embedding for all layers."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, Mapping) or not params:
        raise ConfigError(f"{KEY}.rope_theta", f"mbridge reads rope_theta, which this {type(config).__name__} "
                          f"neither has nor holds in rope_parameters (got {shorten(params)}); it cannot be derived")
    nested = {name: value for name, value in params.items() if isinstance(value, Mapping)}
    if not nested:
        return params
    if len(nested) != len(params) or any(value != next(iter(nested.values())) for value in nested.values()):
        per_type = "; ".join(f"{name}: {_describe(value) if isinstance(value, Mapping) else shorten(value)}"
                             for name, value in params.items())
        raise ConfigError(f"{KEY}.rope_parameters", f"the layer types' RoPE differ ({per_type}), and an "
                          "mbridge model has one rotary embedding for every layer")
    return next(iter(nested.values()))


def bridge_attributes(config: Any) -> dict[str, Any]:
    """The attributes mbridge reads that `config` lacks, derived from its `rope_parameters`.

    A config with the attributes and no `rope_parameters` (transformers 4) gets nothing and is
    read by the bridge as it is. One with both (a config.json written by transformers 5, read by
    transformers 4, which keeps `rope_parameters` as an unknown key and its own defaults for the
    rest) must agree with itself. A ConfigError names the key that cannot be derived or that
    disagrees, or the rope type the bridge would not build.
    """
    required = [name for name, always in FROM_ROPE_PARAMETERS.items() if always]
    if all(hasattr(config, name) for name in required) and getattr(config, "rope_parameters", None) is None:
        return {}
    params = rope_parameters(config)
    rope_type = params.get("rope_type")
    if rope_type not in BRIDGE_ROPE_TYPES:
        raise ConfigError(f"{KEY}.rope_parameters.rope_type", f"{shorten(rope_type)}: from a config that keeps "
                          "its RoPE in rope_parameters (transformers 5's form) mbridge 0.15.1 takes rope_theta "
                          "alone and would build the model without this scaling; it builds only "
                          f"{', '.join(sorted(BRIDGE_ROPE_TYPES))} RoPE from one")
    supplied: dict[str, Any] = {}
    for name, always in FROM_ROPE_PARAMETERS.items():
        if hasattr(config, name):
            if name in params and getattr(config, name) != params[name]:
                raise ConfigError(f"{KEY}.{name}", f"the config says {shorten(getattr(config, name))} and its "
                                  f"rope_parameters {shorten(params[name])}: a config.json written by transformers 5 "
                                  "read by transformers 4, which ignores rope_parameters; read it with "
                                  f"transformers 5, or write {name} into config.json")
        elif name in params:
            supplied[name] = params[name]
        elif always:
            raise ConfigError(f"{KEY}.rope_parameters.{name}", f"mbridge reads {name}, and this config's "
                              f"rope_parameters ({_describe(params)}) has none")
    return supplied


POSITIVE_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads")
"""Sizes a model needs at least one of: at 0 Megatron divides by it or builds an embedding of
no rows, which loads any checkpoint's tensors into nothing."""

SILU_MODEL_TYPES = frozenset({"qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "llama", "mixtral", "mimo", "deepseek_v3",
                              "glm4_moe"})
"""Architectures whose bridge takes mbridge's base config, which hard-codes SiLU whatever
`hidden_act` says and builds every layer with full attention (Megatron's `window_size` unset)."""
SILU_NAMES = frozenset({"silu", "swish"})

BRIDGE_BIASES: dict[str, dict[str, bool]] = {
    "llama": {"attention_bias": False, "mlp_bias": False},
    "qwen3": {"attention_bias": False},
    "qwen3_moe": {"attention_bias": False},
    "deepseek_v3": {"attention_bias": False},
    "qwen2_moe": {"qkv_bias": True},
    "glm4_moe": {"attention_bias": True},
}
"""Per architecture, each bias flag of the HF config -> the only value whose model the bridge
builds. Llama's attention_bias gives q/k/v and o_proj biases, the bridge builds the q/k/v ones
only; no bridge builds an MLP bias; Qwen2-MoE and GLM-4 MoE always get q/k/v biases. Another
value would lose biases on a save, or write ones transformers does not read."""

BRIDGE_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
"""The parameter dtypes Megatron builds a model in."""


def _size_problems(config: Any) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    for name in POSITIVE_SIZES:
        value = getattr(config, name, None)
        if value is not None and not (type(value) is int and value > 0):
            problems.append((name, f"must be a positive integer, got {shorten(value)}"))
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if not problems and type(heads) is int and type(kv) is int and heads % kv:
        problems.append(("num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}"))
    return problems


def _bias_problems(config: Any) -> list[tuple[str, str]]:
    model_type = getattr(config, "model_type", None)
    built = BRIDGE_BIASES.get(model_type, {}) if isinstance(model_type, str) else {}
    return [(flag, (f"{shorten(getattr(config, flag))}: mbridge builds a {model_type} model as if {flag} were "
                    f"{value}, so a load would drop this checkpoint's biases or a save write others than "
                    "transformers reads")) for flag, value in built.items() if getattr(config, flag, value) != value]


def _window_problem(config: Any) -> tuple[str, str] | None:
    """Sliding-window attention, as the config says it: `layer_types` where it has them
    (transformers 5, and 4 since 4.54); else `use_sliding_window` from layer `max_window_layers`
    on (Qwen on older transformers 4), or a `sliding_window` alone (Mixtral)."""
    if getattr(config, "model_type", None) not in SILU_MODEL_TYPES:
        return None
    says = "mbridge builds every layer with full attention, so it would not be this model"
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, (list, tuple)):
        sliding = sorted({t for t in layer_types if t != "full_attention"}, key=str)
        return ("layer_types", f"{shorten(sliding)} layers: {says}") if sliding else None
    window = getattr(config, "sliding_window", None)
    if not hasattr(config, "use_sliding_window"):
        return ("sliding_window", f"{shorten(window)}: {says}") if window is not None else None
    first, layers = getattr(config, "max_window_layers", 0), getattr(config, "num_hidden_layers", None)
    if config.use_sliding_window and window is not None and not (type(first) is int and type(layers) is int
                                                                  and first >= layers):
        return "use_sliding_window", f"sliding_window {shorten(window)} from layer {shorten(first)} on: {says}"
    return None


def check_config(config: Any) -> None:
    """Refuse, naming the key, an HF config the bridge would build into a model other than the
    one transformers builds from it, or would fail on with a raw error: a size of 0, a RoPE base
    that is not a positive number (NaN frequencies), an activation the bridge replaces by SiLU,
    biases it does not build, sliding-window attention, a parameter dtype Megatron cannot train
    in. Attributes the config lacks are left to the bridge."""
    problems = _size_problems(config) + _bias_problems(config)
    if window := _window_problem(config):
        problems.append(window)
    theta = bridge_attributes(config).get("rope_theta", getattr(config, "rope_theta", None))
    if theta is not None and not (isinstance(theta, (int, float)) and not isinstance(theta, bool)
                                  and math.isfinite(theta) and theta > 0):
        problems.append(("rope_theta", f"must be a finite positive number, got {shorten(theta)}"))
    act = getattr(config, "hidden_act", None)
    if getattr(config, "model_type", None) in SILU_MODEL_TYPES and act is not None and act not in SILU_NAMES:
        problems.append(("hidden_act", (f"{shorten(act)}: mbridge builds a {config.model_type} model with SiLU "
                                        "whatever the config says, so it would not be this model")))
    dtype = config_dtype(config)
    if dtype is not None and dtype not in BRIDGE_DTYPES:
        allowed = ", ".join(sorted(str(d) for d in BRIDGE_DTYPES))
        problems.append(("dtype", f"{dtype}: Megatron builds parameters in {allowed} only"))
    if problems:
        key, message = problems[0]
        more = "".join(f"; {k}: {m}" for k, m in problems[1:])
        raise ConfigError(f"{KEY}.{key}", message + more)


def bridge_view(config: Any) -> Temporary:
    """`config` with the attributes mbridge reads, for a `with` block (and at the latest until
    the running phase ends); a transformers-4 config is left untouched. A config the bridge
    cannot build faithfully is refused first (`check_config`)."""
    check_config(config)
    return temporarily(config, **bridge_attributes(config))


def config_dtype(config: Any) -> torch.dtype | None:
    """The config's parameter dtype under the name it has: `dtype` (transformers 4.56 and 5),
    else `torch_dtype` (4.51 to 4.55), so no deprecation warning is raised on either major."""
    value = getattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None
