"""`naive`: trainer and rollout in one process (a colocated, hybrid engine).

Nothing crosses a process boundary, so there are no buckets and no checksums: each receiver
is handed the trainer's tensors (cast to the rollout dtype when one is set) one at a time,
and copies them into its own weights as `load_weights` does. Any number of in-process
receivers may read one send.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Iterator
from typing import Any

import torch

from backends.engines.base import CheckpointEngine, Incoming, SyncStats, check_version, missing
from backends.engines.slots import mark
from backends.engines.options import EngineCapabilities
from backends.engines.registry import CheckpointEngineRegistry
from backends.engines.sources import sendable
from lifecycle.errors import EngineError


@CheckpointEngineRegistry.register("naive")
class NaiveEngine(CheckpointEngine):
    """Hands tensors over by reference within one process."""

    capabilities = EngineCapabilities(in_process=True)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sent: tuple[int, list[tuple[str, torch.Tensor]]] | None = None

    def send_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        start = time.perf_counter()
        version = check_version(self.name, version)
        pairs = [(name, tensor.detach()) for name, tensor in sendable(self.name, named_tensors)]
        named: dict[str, int] = {}
        for i, (name, _) in enumerate(pairs):
            if named.setdefault(name, i) != i:
                raise EngineError(f"naive engine: these weights cannot travel: tensors {named[name]} and {i} are both "
                                  f"named {name[:80]!r}")
        self._sent = (version, pairs)
        size = sum(tensor.numel() * self.wire_dtype(tensor).itemsize for _, tensor in pairs)
        return SyncStats(backend=self.name, version=version, bytes=size, buckets=0, tensors=len(pairs),
                         receivers=0, seconds=time.perf_counter() - start)

    def receive_weights(self, version: int | None = None, *, expected: Collection[str] | None = None) -> Incoming:
        if self._sent is None:
            raise EngineError("naive engine: nothing was sent in this process; call send_weights first")
        sent_version, pairs = self._sent
        if version is not None and version != sent_version:
            raise EngineError(f"naive engine: expected weights v{version}, the sender sent v{sent_version}")
        gaps = missing(expected, (name for name, _ in pairs))
        if gaps is not None:
            raise EngineError(f"naive engine: the rollout refuses weights v{sent_version}: {gaps}")
        incoming = Incoming(sent_version)
        return incoming.feed(self._stream(pairs, incoming))

    def _stream(self, pairs: list[tuple[str, torch.Tensor]], incoming: Incoming) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in pairs:
            mark(tensor)  # the trainer's own memory: a rollout adopting it would train along (`adopt_weights`)
            yield name, tensor.to(self.wire_dtype(tensor))
        incoming.complete = True

    def finalize(self) -> None:
        self._sent = None
        super().finalize()
