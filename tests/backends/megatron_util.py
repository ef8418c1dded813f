"""Shared pieces of the Megatron tests: the tiny HF checkpoint and reading tensors back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def train_steps(lc: Any, model: Any, optimizer: Any, scheduler: Any = None, steps: tuple[int, ...] = (1, 2)) -> None:
    """Optimizer steps on made-up gradients, each inside `lc.train_step`: every weight moves."""
    for step in steps:
        with lc.train_step(step):
            for i, p in enumerate(model.parameters()):
                p.grad = torch.full_like(p, 0.01 * (i + 1)) + p.detach() * 0.1
            optimizer.step()
            if scheduler is not None:
                scheduler.step()


def weights_and_moments(model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    """A copy of the first chunk's weights (`param/{name}`) and their AdamW moments (`exp_avg/{name}`, `exp_avg_sq/{name}`)."""
    named = dict(model.chunks[0].named_parameters())
    state = {f"param/{n}": p.detach().clone() for n, p in named.items()}
    state.update({f"{k}/{n}": optimizer.state[p][k].clone() for n, p in named.items() for k in ("exp_avg", "exp_avg_sq")})
    return state
