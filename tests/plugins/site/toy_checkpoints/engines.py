"""`ToyEngine`: hands the trainer's tensors to rollouts in the same process, one by one."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from backends.engines import CheckpointEngine, EngineCapabilities, EngineOptions, Incoming, SyncStats
from lifecycle.errors import EngineError


@dataclass(kw_only=True, slots=True)
class ToyEngineOptions(EngineOptions):
    """Every engine's options, and the toy engine's own key `engine.clone`."""

    clone: bool = True
    """Hand out copies of the trainer's tensors rather than the tensors themselves."""


class ToyEngine(CheckpointEngine):
    """In process: what `send_weights` kept, `receive_weights` hands out."""

    capabilities: ClassVar[EngineCapabilities] = EngineCapabilities(in_process=True)
    Options: ClassVar[type[EngineOptions]] = ToyEngineOptions

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sent: tuple[int, list[tuple[str, torch.Tensor]]] | None = None

    def send_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        clone = getattr(self.options, "clone", True)
        pairs = [(name, tensor.detach().clone() if clone else tensor.detach()) for name, tensor in named_tensors]
        self.sent = (version, pairs)
        size = sum(tensor.numel() * tensor.element_size() for _, tensor in pairs)
        return SyncStats(backend=self.name, version=version, bytes=size, buckets=0, tensors=len(pairs),
                         receivers=0, seconds=0.0)

    def receive_weights(self, version: int | None = None, *, expected: Collection[str] | None = None) -> Incoming:
        if self.sent is None:
            raise EngineError(f"{self.name} engine: nothing was sent")
        incoming = Incoming(self.sent[0])
        return incoming.feed(self._stream(self.sent[1], incoming))

    @staticmethod
    def _stream(pairs: list[tuple[str, torch.Tensor]], incoming: Incoming) -> Iterator[tuple[str, torch.Tensor]]:
        yield from pairs
        incoming.complete = True
