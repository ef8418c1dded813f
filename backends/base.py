"""The contract every checkpoint format follows, and the registry that names the formats.

A format is a `FormatBackend` subclass: one frozen `FormatCapabilities` object says what it
can do (callers ask it, never test a format's name), an optional options dataclass holds its
own config keys, and five methods write and read the bytes. It is selected by name like a
built-in once registered: `@FORMATS.register("name")`, an entry point in the group
`trainer_lifecycle.formats`, or an import path `pkg.module:Class` in the config.
"""

from __future__ import annotations

import socket
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from backends.registry import Builtin, Registry
from lifecycle.errors import CheckpointError, ConfigError, shorten
from lifecycle.types import FORMAT_CONTENTS

FORMAT_ENTRY_POINT_GROUP = "trainer_lifecycle.formats"
PLAIN_TORCH = "plain-torch"
"""Model family of torch modules whose state dict is the weights (HF, FSDP2, DTensor)."""
MEGATRON = "Megatron"
"""Model family of Megatron-Core models (`backends.megatron.MegatronModel`)."""
MODEL_CONTENTS: frozenset[str] = FORMAT_CONTENTS
"""The step-folder contents a format writes; `extra` (RNG, data position) is the lifecycle's own."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FormatCapabilities:
    """What a format can do, declared once: the config and the checkpointer ask this object."""

    family: str
    """The model implementation it loads into (`PLAIN_TORCH`, `MEGATRON` or a family of its own):
    one worker runs one implementation, so all the formats a config names must share it."""
    contents: frozenset[str] = frozenset({"model", "optimizer"})
    """Which of model, hf_model and optimizer it can write into a step folder; hf_model only with
    `native_hf` or an `export_hf` of its own (checked at registration)."""
    parallel_invariant: bool = False
    """A checkpoint saved at one parallel layout loads at another."""
    collective_save: bool = False
    """Every rank takes part in a save through collectives, which in the background would
    interleave with training's own: no async save at a world size above one."""
    supports_async: bool = False
    """It can write from a host copy on a background thread."""
    native_hf: bool = False
    """`save_model` already writes HF safetensors: `model` and `hf_model` are written once."""
    verifies_reads: bool = False
    """`load_model` and `load_optimizer` check files against the digests they are given as they
    read them."""
    reads_pickles: bool = False
    """Its reads unpickle metadata (DCP's .metadata, Megatron's byte entries), through an
    allow-list: a folder that no committed manifest vouches for is loaded with a warning."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "contents", frozenset(self.contents))
        if "model" not in self.contents or not self.contents <= MODEL_CONTENTS:
            raise ConfigError("capabilities.contents", f"a format holds 'model' and any of "
                                                       f"{sorted(MODEL_CONTENTS)}, got {sorted(self.contents)}")
        if not (isinstance(self.family, str) and self.family):
            raise ConfigError("capabilities.family", f"a format names the model family it loads into, "
                                                     f"got {shorten(self.family)}")


class FormatBackend:
    """Writes and reads one worker's model and optimizer state in one on-disk format.

    Every rank of a role calls each method with the same folder; a format decides which ranks
    write (replicated state: rank 0; sharded state: every rank its own shards). A subclass sets
    `capabilities`, and `Options` when it takes config keys of its own; its `name` is the one
    it was registered under (its import path until then).
    """

    name: ClassVar[str] = "format"
    capabilities: ClassVar[FormatCapabilities]
    Options: ClassVar[type[Any] | None] = None
    """The format's options dataclass: its fields are keys of `checkpoint.save` when the
    format is saved with, bounded by plain field metadata (`ge`, `le`, `choices`)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = f"{cls.__module__}:{cls.__qualname__}"

    def __init__(self, options: Any = None, /, **values: Any) -> None:
        """`options`: an instance of `Options`, or its fields as keyword values; neither: defaults."""
        if self.Options is None:
            if options is not None or values:
                raise CheckpointError(f"format {self.name!r} takes no options, got {options or values!r}")
            self.options: Any = None
            return
        if options is not None and values:
            raise CheckpointError(f"format {self.name!r}: give an options object or keyword values, not both")
        try:
            self.options = options if options is not None else self.Options(**values)
        except TypeError as exc:
            raise CheckpointError(f"format {self.name!r}: {exc}") from None

    @classmethod
    def check_model(cls, model: Any, contents: Collection[str], key: str) -> Any:
        """Refuse, when the lifecycle is built, a model this format could only refuse mid-save
        (`ConfigError` on `key`), or wrap it into the type it works on. `contents`: what the
        save writes (empty for loads). The default takes the model as it is."""
        return model

    def save_model(self, model: Any, folder: Path) -> dict[str, str]:
        """Write the weights; returns {path relative to `folder`: digest (`lifecycle.checksum.
        ALGORITHM`)} for the files it hashed while writing, which the manifest takes as they are."""
        raise NotImplementedError

    def load_model(self, model: Any, folder: Path, *, expected: Mapping[str, str] | None = None) -> set[str]:
        """Read the weights into `model`; returns the relative paths it checked against
        `expected` while reading (the rest are hashed apart by the resume)."""
        raise NotImplementedError

    def save_optimizer(
        self, optimizer: Any, lr_scheduler: Any, folder: Path, *, model: Any = None
    ) -> dict[str, str]:
        """As `save_model`; `model` is given for formats that place optimizer state by the model's sharding."""
        raise NotImplementedError

    def load_optimizer(
        self, optimizer: Any, lr_scheduler: Any, folder: Path, *, model: Any = None,
        expected: Mapping[str, str] | None = None,
    ) -> set[str]:
        """Read the optimizer and scheduler state; returns, as `load_model`, the relative paths it
        checked against `expected` while reading."""
        raise NotImplementedError

    def export_hf(self, model: Any, folder: Path) -> dict[str, str]:
        """Write full HF safetensors (plus index when sharded) that `transformers` can load; returns as `save_model`."""
        raise NotImplementedError


HF_CAPABILITIES = FormatCapabilities(family=PLAIN_TORCH, contents=MODEL_CONTENTS, supports_async=True,
                                     native_hf=True, verifies_reads=True)
TORCH_DCP_CAPABILITIES = FormatCapabilities(family=PLAIN_TORCH, contents=MODEL_CONTENTS, parallel_invariant=True,
                                            collective_save=True, supports_async=True, reads_pickles=True)
MBRIDGE_CAPABILITIES = FormatCapabilities(family=MEGATRON, contents=MODEL_CONTENTS, parallel_invariant=True,
                                          collective_save=True, native_hf=True)
DIST_CKPT_CAPABILITIES = FormatCapabilities(family=MEGATRON, contents=MODEL_CONTENTS, parallel_invariant=True,
                                            collective_save=True, reads_pickles=True)


def _contract(cls: type) -> str | None:
    """What the config and the checkpointer rely on beyond subclassing `FormatBackend`, checked
    when a format is registered or looked up rather than when a save needs it (its `Options`
    are checked where the config composes them)."""
    capabilities = getattr(cls, "capabilities", None)
    if not isinstance(capabilities, FormatCapabilities):
        return "declares no FormatCapabilities as its `capabilities`"
    if ("hf_model" in capabilities.contents and not capabilities.native_hf
            and getattr(cls, "export_hf", None) is FormatBackend.export_hf):
        return ("its capabilities hold hf_model, but it neither writes HF safetensors (native_hf) nor overrides "
                "export_hf: leave hf_model out of its contents")
    return None


FORMATS: Registry[FormatBackend] = Registry("format", base=FormatBackend, group=FORMAT_ENTRY_POINT_GROUP,
                                            key="checkpoint.save.format", check=_contract, builtins={
    "hf": Builtin("backends.hf:HFBackend", info=HF_CAPABILITIES),
    "torch_dcp": Builtin("backends.torch_dcp:TorchDCPBackend", info=TORCH_DCP_CAPABILITIES),
    "mbridge": Builtin("backends.mbridge:MBridgeBackend", extra="megatron", info=MBRIDGE_CAPABILITIES),
    "dist_ckpt": Builtin("backends.dist_ckpt:DistCkptBackend", extra="megatron", info=DIST_CKPT_CAPABILITIES),
})
"""Every format by name. The built-ins' capabilities are declared here, beside their import
path, and their classes take these very objects: a config that names one is checked without
importing torch, megatron or mbridge."""


def backend_names() -> list[str]:
    return FORMATS.names()


def backend_class(name: str, key: str = "checkpoint.save.format") -> type[FormatBackend]:
    """The format class `name` selects, imported only now, so megatron and mbridge stay optional."""
    return FORMATS.get(name, key)


def format_capabilities(name: str, key: str = "checkpoint.save.format") -> FormatCapabilities:
    """What format `name` can do; a built-in's without importing it."""
    builtin = FORMATS.builtin(name)
    if builtin is not None and isinstance(builtin.info, FormatCapabilities):
        return builtin.info
    return FORMATS.get(name, key).capabilities  # the registry's check vouches for the type


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
    """A TCP port the OS just handed out on `host` (a name or an IPv4 or IPv6 address, probed in
    the family it resolves to first), for a rendezvous; a race with another binder before it is
    used is possible but rare, and fails loudly at bind time. `OSError` (`socket.gaierror`
    among them) when `host` does not resolve or is no address of this machine. `""` is every
    IPv4 address, as `bind` takes it; an IPv6 address may come in brackets (`[::1]`)."""
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    family, kind, proto, _, address = socket.getaddrinfo(host or None, 0, socket.AF_INET if host == "" else 0,
                                                         socket.SOCK_STREAM, 0, socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.bind(address)
        return int(sock.getsockname()[1])


def listed(problems: list[str]) -> str:
    """Problems one per line for an error message, the first 20 and a count of the rest."""
    more = len(problems) - _MAX_LISTED
    return "\n  ".join(problems[:_MAX_LISTED] + ([f"... and {more} more"] if more > 0 else []))

