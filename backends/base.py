"""The protocol every checkpoint format strategy follows, and the registry that names them."""

from __future__ import annotations

import importlib
import socket
from pathlib import Path
from typing import Any, ClassVar, Protocol

from lifecycle.errors import ConfigError


class FormatBackend(Protocol):
    """Writes and reads one worker's model and optimizer state in one on-disk format.

    Every rank of a role calls each method with the same folder; a backend decides which
    ranks write (replicated state: rank 0; sharded state: every rank its own shards).
    """

    name: ClassVar[str]
    parallel_invariant: ClassVar[bool]
    """True when a checkpoint saved at one parallel layout loads at another."""
    supports_async: ClassVar[bool]
    native_hf: ClassVar[bool]
    """True when `save_model` already writes HF safetensors: `model` and `hf_model` are written once."""
    verifies_reads: ClassVar[bool]
    """True when its reads check each .safetensors file against `lifecycle.checksum.expecting`."""

    def save_model(self, model: Any, folder: Path) -> None: ...

    def load_model(self, model: Any, folder: Path) -> None: ...

    def save_optimizer(self, optimizer: Any, lr_scheduler: Any, folder: Path, *, model: Any = None) -> None:
        """`model` is given for formats that place optimizer state by the model's sharding."""

    def load_optimizer(self, optimizer: Any, lr_scheduler: Any, folder: Path, *, model: Any = None) -> None: ...

    def export_hf(self, model: Any, folder: Path) -> None:
        """Write full HF safetensors (plus index when sharded) that `transformers` can load."""


_MAX_LISTED = 20


def current_rank() -> int:
    """This process's rank, 0 without an initialised process group."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def failed_ranks(failed: bool, group: Any = None) -> int:
    """How many ranks of `group` (the default group when None) report a failure; every rank
    must call it. Without a process group of more than one rank, this rank's own count."""
    return reduce_int(int(failed), "sum", group)


def reduce_int(value: int, op: str = "sum", group: Any = None) -> int:
    """`value` reduced over the ranks of `group` (`op`: sum, max or min); every rank must call
    it. Without a process group of more than one rank, `value` itself."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1):
        return value
    backend = str(dist.get_backend(group))
    device = (torch.device("cpu") if "gloo" in backend or "mpi" in backend
              else torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index()))
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=ops[op], group=group)
    return int(tensor.item())


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS just handed out on `host`, for a rendezvous; a race with another binder
    before it is used is possible but rare, and fails loudly at bind time."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def listed(problems: list[str]) -> str:
    """Problems one per line for an error message, the first 20 and a count of the rest."""
    more = len(problems) - _MAX_LISTED
    return "\n  ".join(problems[:_MAX_LISTED] + ([f"... and {more} more"] if more > 0 else []))


_BACKENDS: dict[str, str] = {
    "hf": "backends.hf:HFBackend",
    "torch_dcp": "backends.torch_dcp:TorchDCPBackend",
    "mbridge": "backends.mbridge:MBridgeBackend",
    "dist_ckpt": "backends.dist_ckpt:DistCkptBackend",
}
_EXTRAS: dict[str, str] = {"mbridge": "megatron", "dist_ckpt": "megatron"}


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def backend_class(name: str) -> type[FormatBackend]:
    """Import a backend only when asked for, so megatron and mbridge stay optional."""
    try:
        target = _BACKENDS[name]
    except KeyError:
        raise ConfigError("format", f"unknown format {name!r}; known: {', '.join(backend_names())}") from None
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        extra = _EXTRAS.get(name)
        hint = f"; install the extra: pip install 'trainer-lifecycle[{extra}]'" if extra else ""
        raise ConfigError("format", f"format {name!r} needs {exc.name or exc}{hint}") from exc
    return getattr(module, attr)
