"""What a Megatron model writes beside its weights: `transformer_config.json`, and, through its
bridge, the HF `config.json` (with the dtype the model was built in) and a full HF export."""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Any

import torch

from backends.base import current_rank
from backends.hf import write_hf_folder
from backends.megatron import (
    TRANSFORMER_CONFIG,
    bridge_of,
    chunks_of,
    cpu_safe,
    on_rank0,
    plain_value,
)
from lifecycle.phase import DELETE, Temporary, temporarily


def _jsonable(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, enum.Enum)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_jsonable(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _jsonable(v) for k, v in value.items())
    return False


def write_transformer_config(config: Any, folder: Path) -> Path:
    """`transformer_config.json` next to the weights. Functions, process groups and other
    objects JSON cannot hold are removed from the config for the write and put back after it,
    even when the write fails (through the running phase's finally hooks)."""
    unserializable = {name: DELETE for name, value in vars(config).items() if not _jsonable(value)}
    path = folder / TRANSFORMER_CONFIG
    with temporarily(config, **unserializable):
        data = {name: plain_value(value) for name, value in sorted(vars(config).items())}
        text = json.dumps({"removed": sorted(unserializable), "config": data}, indent=1) + "\n"
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return path


def hf_config_as_built(model: Any) -> Temporary:
    """The bridge's HF config, for a `with` block, with the dtype the model was built in (its
    `params_dtype`): a float32 config built in bfloat16 wrote "float32" over bfloat16 weights,
    and the converter refused the library's own checkpoint."""
    config = bridge_of(model, "an HF config of a Megatron model").hf_config
    name = "dtype" if hasattr(config, "dtype") else "torch_dtype"
    return temporarily(config, **{name: chunks_of(model)[0].config.params_dtype})


def write_hf_export(model: Any, folder: Path) -> dict[str, str]:
    """Full HF safetensors through the model's bridge: every rank joins the gathers, rank 0,
    which receives every full tensor, writes (checksummed as it writes, like the hf backend).
    Returns the weight files' digests (none on other ranks), for the manifest."""
    bridge = bridge_of(model, "an HF copy of a Megatron model")
    chunks = chunks_of(model)
    with cpu_safe():
        weights = bridge.export_weights(chunks)
        if current_rank() != 0:
            for _ in weights:
                pass
        state = {name: tensor.cpu() for name, tensor in weights}  # empty on other ranks: consumed above

    def write() -> dict[str, str]:
        with hf_config_as_built(model):
            digests = write_hf_folder(state, folder, config=bridge.hf_config)
        write_transformer_config(chunks[0].config, folder)
        return digests

    return on_rank0(write, "HF export", folder) or {}
