"""NVIDIA mbridge: a Megatron-Core model saved and loaded as plain HF safetensors.

The files are what `transformers` reads, so `model` and `hf_model` are the same bytes and
are written once. Loading goes through the bridge, which splits each full tensor across the
current TP / PP layout: a checkpoint saved at TP2 loads at TP1. Optimizer state has no HF
form; it is written in Megatron's sharded format by the `dist_ckpt` backend's code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from backends.base import MBRIDGE_CAPABILITIES, FormatBackend, FormatCapabilities
from backends.dist_ckpt import DistCkptBackend
from backends.megatron import (
    MegatronModel,
    agree,
    as_megatron_model,
    bridge_of,
    chunks_of,
    cpu_safe,
    library_errors,
    write_hf_export,
)
from backends.hf import _weight_files
from backends.safetensors_io import read_header
from lifecycle.errors import CheckpointError

_ARCH_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size", "tie_word_embeddings")


def _architecture_problem(bridge: Any, folder: Path) -> str | None:
    path = folder / "config.json"
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"{folder}: not an HF folder (no config.json)"
    except (OSError, ValueError) as exc:
        return f"{path}: not valid JSON: {exc}"
    mine = bridge.hf_config.to_dict()
    differ = [f"{k}: checkpoint {saved.get(k)!r}, model {mine.get(k)!r}"
              for k in _ARCH_KEYS if k in saved and saved.get(k) != mine.get(k)]
    return f"{path}: another architecture than the model's:\n  " + "\n  ".join(differ) if differ else None


def _stored_names(folder: Path) -> set[str]:
    """Every tensor name the folder's weight files hold (the index's, else each file's header)."""
    return {name for path, names in _weight_files(folder) for name in (names or read_header(path)[0])}


def _missing_problem(bridge: Any, chunks: list[Any], folder: Path) -> str | None:
    """HF tensors this rank's chunks will ask the bridge for that the folder does not hold."""
    wanted: set[str] = set()
    for chunk in chunks:
        for local, global_name in bridge._weight_name_mapping_mcore_local_to_global(chunk).items():
            if "_extra_state" not in local:
                wanted.update(bridge._weight_name_mapping_mcore_to_hf(global_name))
    missing = sorted(wanted - _stored_names(folder))
    return f"{folder}: missing tensors {missing[:10]}{' ...' if len(missing) > 10 else ''}" if missing else None


def _load_problem(bridge: Any, chunks: list[Any], folder: Path) -> str | None:
    """Why this rank cannot load `folder`, found before any rank enters the bridge's scatters."""
    try:
        if not any(folder.glob("*.safetensors")):
            return f"{folder}: no .safetensors files (pickled .bin weights are not read)"
        return _architecture_problem(bridge, folder) or _missing_problem(bridge, chunks, folder)
    except CheckpointError as exc:
        return str(exc)


class MBridgeBackend(FormatBackend):
    """Megatron-Core models built with `backends.megatron.build_model` (they carry a bridge)."""

    name: ClassVar[str] = "mbridge"
    capabilities: ClassVar[FormatCapabilities] = MBRIDGE_CAPABILITIES

    @staticmethod
    def check_model(model: Any, contents: list[str], key: str) -> MegatronModel:
        wrapped = as_megatron_model(model, "mbridge", key)
        bridge_of(wrapped, "the mbridge format", key=key)
        return wrapped

    def save_model(self, model: Any, folder: Path) -> dict[str, str]:
        return write_hf_export(model, folder)

    def export_hf(self, model: Any, folder: Path) -> dict[str, str]:
        return write_hf_export(model, folder)

    def load_model(self, model: Any, folder: Path, *, expected: Mapping[str, str] | None = None) -> set[str]:
        """The bridge reads the files itself, unhashed: mbridge does not claim `verifies_reads`,
        so resume hashes every file against the manifest before this load starts."""
        bridge, chunks = bridge_of(model, "the mbridge format"), chunks_of(model)
        agree(_load_problem(bridge, chunks, folder))
        with library_errors("mbridge load", folder), cpu_safe():
            bridge.load_weights(chunks, str(folder))
        return set()

    def save_optimizer(
        self, optimizer: Any, lr_scheduler: Any, folder: Path, *, model: Any = None
    ) -> dict[str, str]:
        return DistCkptBackend().save_optimizer(optimizer, lr_scheduler, folder, model=model)

    def load_optimizer(
        self, optimizer: Any, lr_scheduler: Any, folder: Path, *, model: Any = None,
        expected: Mapping[str, str] | None = None,
    ) -> set[str]:
        return DistCkptBackend().load_optimizer(optimizer, lr_scheduler, folder, model=model, expected=expected)
