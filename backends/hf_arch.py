"""An HF architecture taken from a checkpoint's word: its config, and its model built on the meta device.

A `config.json` may name Python files beside it (`auto_map`) for transformers to import, and
transformers, when `trust_remote_code` is not given, asks on stdin whether to run them: a "y" on a
worker's stdin ran the checkpoint's code. Every transformers call here passes
`trust_remote_code=False`, and a config whose `model_type` only that code would define is refused
naming the file and the key. A config that names code for an architecture transformers defines
itself (DeepSeek-V3's official checkpoint does) is read into transformers' own class; the folder's
code is never imported.

Models are built on the meta device: shapes and parameter counts without allocating a byte.
transformers is imported inside the functions only.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from backends.hf_config import KEY
from lifecycle.errors import CheckpointError, ConfigError, shorten
from lifecycle.jsontree import read_config_json
from lifecycle.records import say

CONFIG_JSON = "config.json"
MAX_COUNTED_LAYERS = 512
"""Layers `parameter_floor` builds at most (per stack): the deepest published decoders have about
130, and a meta build takes a few milliseconds a layer, so a config claiming a million layers is
counted in about a second (as a floor: more layers never have fewer parameters)."""
_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "depth")
"""Layer counts read through a config's `attribute_map` (GPT-2's `n_layer`, BART's `encoder_layers`)."""
_COUNTS_LAYERS = re.compile(r"(?:layers|n_layer|depth|blocks)$")
"""An attribute that counts layers or blocks of a stack: BART's `decoder_layers` and T5's
`num_decoder_layers` are no `num_hidden_layers`, yet each builds a stack of its own."""


def remote_code_problem(config: Any, path: Path) -> str | None:
    """Why a parsed config.json cannot be read without running the code it names, or None."""
    from transformers import CONFIG_MAPPING

    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    if auto_map is None:
        return None
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return None  # transformers' own class is used; the named code is never imported
    return (f"{path}: auto_map names code shipped in the checkpoint folder ({shorten(auto_map, 120)}) for "
            f"model_type {shorten(model_type)}, which transformers does not define itself; a checkpoint's "
            "code is never run")


def read_hf_config(folder: Path) -> Any:
    """The `PretrainedConfig` of an HF folder, read without running any code it names.

    config.json is read bounded and never blocking on a FIFO first; a refusal is a `ConfigError`
    naming the folder (`hf_config.auto_map` for code it would need)."""
    from transformers import AutoConfig

    path = folder / CONFIG_JSON
    try:
        parsed = read_config_json(path)
    except CheckpointError as exc:
        raise _unreadable(folder, exc) from None
    if problem := remote_code_problem(parsed, path):
        raise ConfigError(f"{KEY}.auto_map", problem)
    try:
        return AutoConfig.from_pretrained(os.fspath(folder), trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - a value of the wrong type fails anywhere in transformers, as anything
        raise _unreadable(folder, exc) from None


def _unreadable(folder: Path, exc: Exception) -> ConfigError:
    return ConfigError(KEY, f"{folder}: no model config transformers can read: "
                            f"{type(exc).__name__}: {shorten(str(exc), 300)}")


def meta_model(config: Any) -> nn.Module | None:
    """The model transformers builds for `config` (a copy: building may set attributes on it),
    on the meta device; None for an architecture no causal-LM or image-text auto class builds
    there (one that does not map it, or a model whose construction reads a tensor's value)."""
    import transformers

    config = copy.deepcopy(config)
    failures: list[str] = []
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText):
        try:
            with torch.device("meta"):
                return auto.from_config(config, trust_remote_code=False)
        except Exception as exc:  # noqa: BLE001 - not this auto class's, or not buildable on meta: no shapes, no error
            failures.append(f"{auto.__name__}: {type(exc).__name__}: {shorten(exc, 200)}")
    say("warning", "hf_config.not_built_on_meta", model_type=getattr(config, "model_type", None), tried=failures,
        effect="tensor shapes and the parameter count are not checked against this config")
    return None


def expected_shapes(config: Any) -> dict[str, tuple[int, ...]] | None:
    """The shape transformers gives each HF tensor of `config`; None when no auto class builds it."""
    model = meta_model(config)
    if model is None:
        return None
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def parameter_floor(config: Any) -> int | None:
    """Parameters `config`'s model has at least (tied ones once), experts and every part
    included; None when no auto class builds it. A stack of more than `MAX_COUNTED_LAYERS`
    layers is counted at that depth, so the count stays cheap and is never above the real one."""
    config = copy.deepcopy(config)
    try:
        _clamp_layers(config, set())
    except (ValueError, TypeError, AttributeError) as exc:
        raise ConfigError(KEY, f"{type(config).__name__}: cannot count the parameters of a model of more than "
                               f"{MAX_COUNTED_LAYERS} layers: {type(exc).__name__}: {shorten(str(exc), 200)}") from None
    model = meta_model(config)
    return None if model is None else sum(p.numel() for p in model.parameters())


def _clamp_layers(config: Any, seen: set[int]) -> None:
    """Every layer count of `config` and its sub-configs (text, vision) at most `MAX_COUNTED_LAYERS`."""
    from transformers import PretrainedConfig

    if id(config) in seen:
        return
    seen.add(id(config))
    names = [*_LAYER_COUNTS, *(name for name in vars(config) if _COUNTS_LAYERS.search(name))]
    for name in names:
        value = getattr(config, name, None)
        if type(value) is int and value > MAX_COUNTED_LAYERS:
            setattr(config, name, MAX_COUNTED_LAYERS)
    for value in list(vars(config).values()):
        if isinstance(value, PretrainedConfig):
            _clamp_layers(value, seen)
