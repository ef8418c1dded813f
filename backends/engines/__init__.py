"""Checkpoint engines: bucketed weight transfers from trainer to rollout.

`CheckpointEngineRegistry` names the engines (gloo, nccl, hccl, shm, cuda_ipc, naive, and any added
from outside); `WeightSync` is the trainer side a `Lifecycle` drives, `receive_into` the
rollout side. Names resolve on first use, so importing `backends.engines.options` or
`backends.engines.registry` (as the config does) imports neither torch nor an engine.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE: dict[str, str] = {
    "CheckpointEngine": "base", "Incoming": "base", "Rendezvous": "base", "SyncStats": "base", "Topology": "base",
    "TransportError": "base", "EngineCapabilities": "options", "EngineOptions": "options",
    "DEVICE_BACKENDS": "registry", "ENTRY_POINT_GROUP": "registry", "CheckpointEngineRegistry": "registry",
    "WeightSync": "sync", "profiled": "sync", "receive_into": "sync",
    "FlatLayout": "flat", "FlattenRefused": "flat", "contiguous_layout": "flat", "flatten_parameters": "flat",
    "adopt_weights": "adopt",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
