"""`gloo`: buckets in CPU memory, broadcast over TCP by a private gloo group. Also the CI path."""

from __future__ import annotations

import ipaddress
import os
from datetime import timedelta
from typing import Any

from backends.engines.base import Topology
from backends.engines.collective import GroupEngine
from backends.engines.options import EngineCapabilities
from backends.engines.registry import CheckpointEngineRegistry


@CheckpointEngineRegistry.register("gloo")
class GlooEngine(GroupEngine):
    """CPU tensors over gloo; the sender's buckets go to every receiver in one broadcast each."""

    capabilities = EngineCapabilities(devices=frozenset({"cpu"}), flips=True, lands_in_place=True)

    def _make_group(self, store: Any, topology: Topology, timeout: timedelta) -> Any:
        import torch.distributed as dist

        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        # Never None here: StoreLink.begin refuses a topology without a rendezvous before any group forms.
        options._devices = [_device(topology.rendezvous.host)]  # type: ignore[union-attr]
        return dist.ProcessGroupGloo(store, topology.rank, topology.world_size, options)


def _device(host: str) -> Any:
    """Loopback rendezvous: stay on loopback; otherwise GLOO_SOCKET_IFNAME or the host's name."""
    import torch.distributed as dist

    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        return dist.ProcessGroupGloo.create_device(interface=interface)
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    return dist.ProcessGroupGloo.create_default_device()
