"""A small, fast RL recipe for the Ray tests: a tiny Qwen2 policy learns to answer with digits.

REINFORCE with the critic's value as baseline. The lr falls every step and the prompts come
from a `ResumableBatchSampler`, so a test can see that a resumed run continues both exactly.
`BigramRecipe` is the same recipe on a plain torch model: a worker process that builds it never
imports transformers (about 4 CPU-seconds a process, three processes a worker group).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from lifecycle.data import ResumableBatchSampler
from lifecycle.types import Parts
from tests.backends.megatron_util import TINY_QWEN2

PROMPT, RESPONSE = 4, 4
DIGITS = torch.arange(48, 58)
VOCAB = 128


def tiny_qwen2(kind: str) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

    torch.manual_seed(0)
    config = Qwen2Config(**TINY_QWEN2, max_position_embeddings=32, tie_word_embeddings=True, num_labels=1)
    return Qwen2ForTokenClassification(config) if kind == "critic" else Qwen2ForCausalLM(config)


@dataclass
class DigitsRecipe:
    """Trainer roles actor (the policy) and critic; `batch` prompts a step."""

    batch: int = 8
    roles: tuple[str, ...] = ("actor", "critic")

    def model(self, role: str) -> torch.nn.Module:
        """The role's fresh model (`rollout`: the policy's architecture)."""
        return tiny_qwen2(role)

    def build(self, role: str) -> Parts:
        torch.set_num_threads(1)
        model = self.model(role)
        if role == "rollout":
            return Parts(model=model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=50)
        sampler = ResumableBatchSampler(40, self.batch, seed=3) if role == self.roles[0] else None
        return Parts(model=model, optimizer=optimizer, lr_scheduler=scheduler, dataloader=sampler)

    def prompts(self, parts: Parts, step: int) -> torch.Tensor:
        indices = torch.tensor(next(iter(parts.dataloader)))
        return 97 + (indices[:, None] * 7 + torch.arange(PROMPT)) % 26

    def generate(self, model: Any, prompts: torch.Tensor, step: int) -> dict[str, Any]:
        torch.manual_seed(step)
        with torch.no_grad():
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=RESPONSE,
                                 min_new_tokens=RESPONSE, do_sample=True, top_k=0, pad_token_id=0, eos_token_id=None)
        reward = torch.isin(out[:, PROMPT:], DIGITS).float().mean(1)
        return {"sequences": out, "reward": reward}

    def score(self, role: str, parts: Parts, batch: Mapping[str, Any]) -> dict[str, Any]:
        if role != "critic":
            return {}
        with torch.no_grad():
            return {"values": parts.model(batch["sequences"]).logits[:, PROMPT - 1:-1, 0]}

    def update(self, role: str, parts: Parts, batch: Mapping[str, Any], step: int) -> dict[str, float]:
        seq, reward = batch["sequences"], batch["reward"]
        lr = parts.optimizer.param_groups[0]["lr"]
        if role == "critic":
            values = parts.model(seq).logits[:, PROMPT - 1:-1, 0]
            loss = F.mse_loss(values, reward[:, None].expand_as(values))
        else:
            logits = parts.model(seq).logits[:, PROMPT - 1:-1]
            logp = torch.log_softmax(logits, -1).gather(-1, seq[:, PROMPT:, None])[..., 0]
            advantage = reward[:, None] - batch["values"]
            loss = -(advantage * logp).mean()
        parts.optimizer.zero_grad()
        loss.backward()
        parts.optimizer.step()
        parts.lr_scheduler.step()
        return {"loss": loss.item(), "lr": lr, "reward": reward.mean().item()}


class Bigram(torch.nn.Module):
    """Next-token logits from the current token alone, read as `.logits` like the tiny Qwen2's, so
    the digits recipe trains it unchanged; it spares each worker process the import of transformers."""

    def __init__(self, out: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, out)

    def forward(self, ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.head(self.embed(ids)))


@dataclass
class BigramRecipe(DigitsRecipe):
    """The digits recipe on `Bigram`s, sampling its responses token by token."""

    def model(self, role: str) -> torch.nn.Module:
        torch.manual_seed(0)
        return Bigram(1 if role == "critic" else VOCAB)

    def generate(self, model: Any, prompts: torch.Tensor, step: int) -> dict[str, Any]:
        torch.manual_seed(step)
        sequences = prompts
        with torch.no_grad():
            for _ in range(RESPONSE):
                probs = torch.softmax(model(sequences[:, -1:]).logits[:, -1], -1)
                sequences = torch.cat([sequences, torch.multinomial(probs, 1)], 1)
        return {"sequences": sequences, "reward": torch.isin(sequences[:, PROMPT:], DIGITS).float().mean(1)}
