"""Shared pieces of the Megatron tests: the tiny HF checkpoint and reading tensors back."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

TINY_QWEN2 = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2}


def make_hf_checkpoint(folder: Path, seed: int = 0) -> Path:
    """A real HF checkpoint written by `transformers` itself (float32)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY_QWEN2))
    model.save_pretrained(str(folder))
    return folder


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in any byte (dtype included); empty when identical."""
    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]
