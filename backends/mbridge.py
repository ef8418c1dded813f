"""NVIDIA mbridge: a Megatron-Core model saved and loaded as plain HF safetensors.

The files are what `transformers` reads, so `model` and `hf_model` are the same bytes and
are written once. Loading goes through the bridge, which splits each full tensor across the
current TP / PP layout: a checkpoint saved at TP2 loads at TP1. Optimizer state has no HF
form; it is written in Megatron's sharded format by the `dist_ckpt` backend's code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

from backends.dist_ckpt import DistCkptBackend
from backends.megatron import bridge_of, check_megatron_model, chunks_of, cpu_safe, write_hf_export
from lifecycle.errors import CheckpointError

_ARCH_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size", "tie_word_embeddings")


def _check_architecture(bridge: Any, folder: Path) -> None:
    """Refuse another architecture on every rank alike, before any rank enters the bridge's
    scatters (a rank failing alone there would leave the others waiting for it)."""
    path = folder / "config.json"
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: not an HF folder (no config.json)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not valid JSON: {exc}") from exc
    mine = bridge.hf_config.to_dict()
    differ = [f"{k}: checkpoint {saved.get(k)!r}, model {mine.get(k)!r}"
              for k in _ARCH_KEYS if k in saved and saved.get(k) != mine.get(k)]
    if differ:
        raise CheckpointError(f"{path}: another architecture than the model's:\n  " + "\n  ".join(differ))
    if not any(folder.glob("*.safetensors")):
        raise CheckpointError(f"{folder}: no .safetensors files (pickled .bin weights are not read)")


class MBridgeBackend:
    """Megatron-Core models built with `backends.megatron.build_model` (they carry a bridge)."""

    name: ClassVar[str] = "mbridge"
    parallel_invariant: ClassVar[bool] = True
    supports_async: ClassVar[bool] = False
    native_hf: ClassVar[bool] = True
    verifies_reads: ClassVar[bool] = False

    @staticmethod
    def check_model(model: Any, contents: list[str]) -> None:
        check_megatron_model(model, "mbridge")
        bridge_of(model, "the mbridge format")

    def save_model(self, model: Any, folder: Path) -> None:
        write_hf_export(model, folder)

    def export_hf(self, model: Any, folder: Path) -> None:
        write_hf_export(model, folder)

    def load_model(self, model: Any, folder: Path) -> None:
        bridge = bridge_of(model, "the mbridge format")
        _check_architecture(bridge, folder)
        try:
            with cpu_safe():
                bridge.load_weights(chunks_of(model), str(folder))
        except (ValueError, KeyError, RuntimeError) as exc:
            raise CheckpointError(f"{folder}: mbridge could not load the weights: {exc}") from exc

    def save_optimizer(self, optimizer: Any, lr_scheduler: Any, folder: Path, *, model: Any = None) -> None:
        DistCkptBackend().save_optimizer(optimizer, lr_scheduler, folder, model=model)

    def load_optimizer(self, optimizer: Any, lr_scheduler: Any, folder: Path, *, model: Any = None) -> None:
        DistCkptBackend().load_optimizer(optimizer, lr_scheduler, folder, model=model)
