"""Checkpoint engines: bucketed weight transfers from trainer to rollout.

`CheckpointEngineRegistry` names the engines (gloo, nccl, hccl, shm, naive, and any added
from outside); `WeightSync` is the trainer side a `Lifecycle` drives, `receive_into` the
rollout side. Engine modules are imported only when their engine is asked for.
"""

from backends.engines.base import (
    CheckpointEngine, Incoming, Rendezvous, SyncStats, Topology, TransportError,
)
from backends.engines.registry import DEVICE_BACKENDS, ENTRY_POINT_GROUP, CheckpointEngineRegistry
from backends.engines.sync import WeightSync, profiled, receive_into

__all__ = [
    "DEVICE_BACKENDS", "ENTRY_POINT_GROUP", "CheckpointEngine", "CheckpointEngineRegistry", "Incoming",
    "Rendezvous", "SyncStats", "Topology", "TransportError", "WeightSync", "profiled", "receive_into",
]
