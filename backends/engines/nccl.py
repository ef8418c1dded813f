"""`nccl`: buckets in CUDA memory, broadcast by a private NCCL group. Imports without CUDA."""

from __future__ import annotations

from typing import Any

import torch

from backends.engines.collective import DeviceGroupEngine
from backends.engines.options import EngineCapabilities
from backends.engines.registry import CheckpointEngineRegistry
from lifecycle.errors import ConfigError


@CheckpointEngineRegistry.register("nccl")
class NcclEngine(DeviceGroupEngine):
    """One GPU per rank (NCCL refuses two ranks on one device); the current device by default."""

    capabilities = EngineCapabilities(devices=frozenset({"cuda"}), flips=True, lands_in_place=True)

    @classmethod
    def check_available(cls) -> None:
        import torch.distributed as dist

        if not (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()):
            raise ConfigError("engine.backend", "checkpoint engine 'nccl' needs the package torch built with "
                                                f"CUDA and NCCL, and a visible GPU; this is torch {torch.__version__}")

    def _current_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def _group_class(self) -> Any:
        import torch.distributed as dist

        return dist.ProcessGroupNCCL
