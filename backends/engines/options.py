"""What every checkpoint engine takes, and what one can do: the engines' own config.

`lifecycle.config.EngineConfig` composes `EngineOptions` (its keys are the `engine:` section's),
so each default, bound and allowed value here is the only copy. Bounds are plain field
metadata (`ge`, `gt`, `le`, `choices`, `path`) that the config reads; `problem()` is what an
engine checks when it is built. The config imports this module when it is imported itself,
so it imports nothing but the standard library: no torch, no lifecycle module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

O = TypeVar("O", bound="EngineOptions")

AUTO = "auto"
"""`engine.backend: auto`: the engine `backends.engines.registry.DEVICE_BACKENDS` names for the
device the model's weights are on."""

DEFAULT_BUCKET_BYTES: int = 2 * 1024**3
MIN_BUCKET_BYTES: int = 64
"""Smallest bucket an engine can pack (one aligned piece)."""
MAX_BUCKET_BYTES: int = 1 << 40
"""1 TiB: a sender allocates two buckets up front, and no device or host here holds two of more."""
MAX_TIMEOUT_S: float = 7 * 24 * 3600.0
"""A week: a sync still running then has hung, and a deadline this far out stays well inside what
`timedelta`, threading waits and the transports' steady-clock arithmetic can hold."""
ROLLOUT_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
"""The torch dtypes a rollout may ask floating weights to travel in."""
APPLY_MODES: tuple[str, ...] = ("atomic", "streamed", "flip")


@dataclass(kw_only=True, slots=True)
class EngineOptions:
    """Options of every engine; an engine with keys of its own subclasses this as its `Options`."""

    bucket_bytes: int = field(default=DEFAULT_BUCKET_BYTES, metadata={"ge": MIN_BUCKET_BYTES, "le": MAX_BUCKET_BYTES})
    """Largest transfer bucket; bounds the extra memory one sync needs."""
    verify: bool = True
    """Checksum each bucket so a corrupt transfer fails loudly instead of serving bad weights."""
    apply: str = field(default="atomic", metadata={"choices": APPLY_MODES})
    """When a receiver hands tensors to its rollout: `atomic` once every bucket of the sync has
    verified (it holds the whole sync meanwhile), `streamed` bucket by bucket (two buckets held;
    a later bad bucket leaves earlier ones applied and the rollout stale), `flip` into the one of
    two weight sets the rollout does not serve, handed out in place once every bucket verified,
    for a rollout that adopts them (`adopt_weights`); shm shares the sets with the sender, so
    set it on both sides there."""
    timeout_s: float = field(default=300.0, metadata={"gt": 0, "le": MAX_TIMEOUT_S})
    """Seconds one sync may take before it is an error."""
    rollout_dtype: str | None = field(default=None, metadata={"choices": ROLLOUT_DTYPES})
    """Dtype the rollout side expects; None sends the trainer's dtype unchanged."""
    profile: bool = False
    """Record a profiler trace of each sync."""
    profile_dir: str | None = field(default=None, metadata={"path": True})
    """Folder for profiler traces; required when `profile` is true."""

    def problem(self) -> tuple[str, str] | None:
        """The first field whose value cannot work and why, or None: an engine refuses it when
        built, the config (which checks types and bounds first) names its dotted key."""
        if not _is_number(self.bucket_bytes, int) or not MIN_BUCKET_BYTES <= self.bucket_bytes <= MAX_BUCKET_BYTES:
            span = f"{_binary_size(MIN_BUCKET_BYTES)}..{_binary_size(MAX_BUCKET_BYTES)}"
            bounds = f"{MIN_BUCKET_BYTES}..{MAX_BUCKET_BYTES} ({span})"
            return "bucket_bytes", f"must be in {bounds}, got {shown(self.bucket_bytes)}"
        if not _is_number(self.timeout_s, (int, float)) or not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            return "timeout_s", f"must be in (0, {MAX_TIMEOUT_S:g}], got {shown(self.timeout_s, (int, float))}"
        for flag in ("verify", "profile"):
            if type(getattr(self, flag)) is not bool:  # a truthy "no" must not switch checksums on or off
                return flag, f"must be true or false, got {getattr(self, flag)!r}"
        if self.apply not in APPLY_MODES:
            return "apply", f"must be one of {', '.join(APPLY_MODES)}, got {self.apply!r}"
        if self.rollout_dtype is not None and self.rollout_dtype not in ROLLOUT_DTYPES:
            return "rollout_dtype", f"must be one of {', '.join(ROLLOUT_DTYPES)}, got {self.rollout_dtype!r}"
        if self.profile and self.profile_dir is None:
            return "profile_dir", "profile is true but profile_dir is not set"
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineCapabilities:
    """What an engine can do, declared once per engine class."""

    in_process: bool = False
    """Sender and receivers live in one process: the target of a sync is the rollout object(s),
    not a `Rendezvous`."""
    devices: frozenset[str] | None = None
    """Device types its buckets live on (cpu, cuda, npu); None: any, since it moves no buckets."""
    flips: bool = False
    """It can take `apply: flip`: a receiver keeps two weight sets and hands out views into the
    one a sync filled (gloo, nccl, hccl: its own buffers; shm: the sender's shared sets)."""
    lands_in_place: bool = False
    """A streamed receive can land each bucket in the rollout's own flattened storage
    (`receive_weights(into=...)`, `inplace`): an engine that receives into buffers of its own."""


def _is_number(value: object, kinds: type | tuple[type, ...]) -> bool:
    return isinstance(value, kinds) and not isinstance(value, bool)


def shown(value: object, kinds: type | tuple[type, ...] = int) -> str:
    """A caller's argument in a message: its repr cut short, with its type unless it is one of
    `kinds` (the string "4096", numpy's 4096 and True all print like numbers)."""
    big = isinstance(value, int) and value.bit_length() > 128  # repr refuses integers past 4300 digits
    text = f"<integer of {value.bit_length()} bits>" if big else repr(value)[:40]
    if _is_number(value, kinds):
        return text
    kind = type(value)
    return f"{text} (a {kind.__name__ if kind.__module__ == 'builtins' else f'{kind.__module__}.{kind.__qualname__}'})"


def is_path(value: object) -> bool:
    """Whether an argument can name a file or folder: a str or path, not empty, without a NUL."""
    return isinstance(value, (str, os.PathLike)) and bool(str(value)) and "\0" not in str(value)


def _binary_size(n: int) -> str:
    """`n` bytes in the largest binary unit that divides it exactly: 64 B, 4 KiB, 1 TiB."""
    for shift, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift and not n % (1 << shift):
            return f"{n >> shift} {unit}"
    return f"{n} B"


class EngineSource(Protocol):
    """What an engine is built from (`lifecycle.config.EngineConfig`), seen from the engines
    without importing the config."""

    backend: str
    profile: bool
    profile_dir: str | None

    def options_for(self, options: type[O]) -> O:
        """The options of an engine whose `Options` class is `options`."""
        ...
