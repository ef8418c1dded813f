"""`hccl`: buckets in Ascend NPU memory, broadcast by a private HCCL group.

`torch_npu` is imported only when an engine is prepared, so this module imports anywhere.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

from backends.engines.collective import DeviceGroupEngine
from backends.engines.options import EngineCapabilities
from backends.engines.registry import CheckpointEngineRegistry
from lifecycle.errors import ConfigError


@CheckpointEngineRegistry.register("hccl")
class HcclEngine(DeviceGroupEngine):
    """One NPU per rank; the current NPU by default."""

    capabilities = EngineCapabilities(devices=frozenset({"npu"}), flips=True, lands_in_place=True)

    @classmethod
    def check_available(cls) -> None:
        if importlib.util.find_spec("torch_npu") is None:
            raise ConfigError("engine.backend", "checkpoint engine 'hccl' needs the package torch_npu "
                                                "(Ascend's PyTorch adapter), which is not installed")

    def _current_device(self) -> torch.device:
        importlib.import_module("torch_npu")
        return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]

    def _group_class(self) -> Any:
        return importlib.import_module("torch_npu._C._distributed_c10d").ProcessGroupHCCL
