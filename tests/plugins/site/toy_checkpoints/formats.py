"""`ToyFormat`: the model's weights as one JSON file of nested lists, for float32 modules."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from backends.base import PLAIN_TORCH, FormatBackend, FormatCapabilities, current_rank
from lifecycle.errors import CheckpointError

WEIGHTS = "weights.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class ToyFormatOptions:
    """The toy format's own key of `checkpoint.save`."""

    indent: int = field(default=0, metadata={"ge": 0, "le": 8})
    """Spaces per level in the JSON file; 0 writes it on one line."""


class ToyFormat(FormatBackend):
    """Model weights only: rank 0 writes, every rank reads."""

    capabilities: ClassVar[FormatCapabilities] = FormatCapabilities(family=PLAIN_TORCH, contents=frozenset({"model"}))
    Options: ClassVar[type[ToyFormatOptions]] = ToyFormatOptions

    def save_model(self, model: Any, folder: Path) -> dict[str, str]:
        if current_rank() == 0:
            folder.mkdir(parents=True, exist_ok=True)
            state = {name: tensor.tolist() for name, tensor in model.state_dict().items()}
            (folder / WEIGHTS).write_text(json.dumps(state, indent=self.options.indent or None), encoding="utf-8")
        return {}

    def load_model(self, model: Any, folder: Path, *, expected: Mapping[str, str] | None = None) -> set[str]:
        saved = json.loads((folder / WEIGHTS).read_text(encoding="utf-8"))
        state = model.state_dict()
        if set(saved) != set(state):
            raise CheckpointError(f"{folder / WEIGHTS}: holds {sorted(saved)}, the model has {sorted(state)}")
        with torch.no_grad():
            for name, tensor in state.items():
                tensor.copy_(torch.tensor(saved[name], dtype=tensor.dtype))
        return set()
