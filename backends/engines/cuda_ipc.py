"""`cuda_ipc`: a trainer and a rollout that share one GPU (the colocated setup).

The data plane is `shared.SharedSlotEngine`'s, with the two shared slots in the sender's GPU
memory: the sender exports a CUDA IPC handle of each slot (torch's own `_share_cuda_`, the
handles `torch.multiprocessing` sends), and every receiver opens them once and reads each
bucket where it lies. Packing, the checksum (`word_sum_digest`, computed on the device), the
receiver's check and its copy into private buffers (atomic) or into the rollout's weights
all run on the GPU; no byte of weights crosses to the host.

What the sender publishes is plain JSON, never a pickle, and a receiver checks every field
before it opens anything: the GPU's UUID must be the receiver's own device's (a rollout on
another GPU, or another host, is refused: use `nccl`), each handle must be a plain CUDA IPC
memory handle as torch's allocator writes it (an expandable segment's handle would make the
receiver take file descriptors from a process the sender names), the reference counter must
name one of torch's counter files and a slot inside it, and each slot's size must be the
plan's bucket size. `backend: auto` never picks this engine: it is named in config, for a
rollout known to share the trainer's GPU.

Torch's IPC reference counting is left as it is: the sender's buckets are kept until
`close()` or a change of `bucket_bytes`, and new buckets are published under new handles,
so a receiver re-opens them. A mapping opens the whole allocator segment the bucket sits in
(torch's handles are per segment, with an offset), which may hold other tensors of the
trainer; a receiver only ever reads the bucket's range.

Memory: the sender keeps two buckets of `bucket_bytes` on the GPU between syncs (until
`close()`); an atomic receiver holds one more copy of the whole sync, a streamed one nothing.

`apply: flip` (on both sides) lands each sync in one of two weight sets that the rollout's
process allocates and exports (`rollout_owns_sets`, see `shared`): the sender opens them and
writes the sync into the set the rollout does not serve, and the rollout adopts views into it.
One copy a byte, no private copy, and one receiver a sync. The sets are the rollout's memory,
so nothing the trainer does with its own (closing the engine, freeing, dying) reaches them.
Sets the trainer allocated and shared would not be safe: torch's IPC reference counting,
which keeps shared memory from reuse, counts one use per export, not per opening, and on an
H100 a rollout serving such a set saw its weights change once the trainer had closed its
engine and allocated new memory. A receiver's old sets (after new shapes) stay allocated
until the sender lets go of them, at its next sync or `close()`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from backends.engines.slots import HEADER_BYTES, SLOTS
from backends.engines.control import PARSE_ERRORS, clip
from backends.engines.options import MIN_BUCKET_BYTES, EngineCapabilities
from backends.engines.plan import ALIGN, PlanRefused
from backends.engines.registry import CheckpointEngineRegistry
from backends.engines.shared import SharedSlotEngine
from lifecycle.errors import ConfigError, EngineError

_EVENT_BYTES = 64
"""sizeof(cudaIpcEventHandle_t)."""
_HANDLE_BYTES = 66
"""torch's allocator handle of a plain segment: a version byte, the type `c`, and a 64-byte
cudaIpcMemHandle_t. An expandable segment's (type `e`) names a process and its descriptors."""
_PLAIN = ord("c")
_COUNTERS = 10_000
"""Slots in one of torch's IPC reference-counter files (CUDA_IPC_REF_COUNTER_FILE_SIZE)."""
_REF_COUNTER = re.compile(rb"/torch_[0-9]{1,10}_[0-9]{1,20}_[0-9]{1,20}")
"""How torch names the shared-memory file of its CUDA IPC reference counters."""
_MAX_OFFSET = 1 << 48


@CheckpointEngineRegistry.register("cuda_ipc")
class CudaIpcEngine(SharedSlotEngine):
    """Sender and receivers on one GPU; `device` defaults to the current CUDA device."""

    capabilities = EngineCapabilities(devices=frozenset({"cuda"}), flips=True)
    rollout_owns_sets = True

    def __init__(self, *, device: int | str | torch.device | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._requested = device
        self._shared: list[dict[str, Any]] = []
        """The sender's exported handles, as it publishes them."""

    @classmethod
    def check_available(cls) -> None:
        if not torch.cuda.is_available():
            raise ConfigError("engine.backend", "checkpoint engine 'cuda_ipc' needs the package torch built with "
                                                f"CUDA and a visible GPU; this is torch {torch.__version__}")

    def prepare(self) -> dict[str, Any]:
        device = torch.device("cuda") if self._requested is None else torch.device(self._requested)
        if device.type != "cuda":
            raise EngineError(f"cuda_ipc engine: device {self._requested!r} is not a CUDA device")
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        return {**super().prepare(), "gpu": _uuid(self.device)}

    def _fence(self) -> None:
        """The whole device: a rollout's `load_weights` may copy on a stream of its own."""
        torch.cuda.synchronize(self.device)

    def _create(self, size: int) -> list[torch.Tensor]:
        self._free_buckets()
        buffers = self._buffers([size] * SLOTS, self.device)
        self._shared = [_export(buffer) for buffer in buffers]
        return buffers

    def _free_buckets(self) -> None:
        super()._free_buckets()
        self._shared = []

    def _publish(self) -> bytes:
        return json.dumps({"gpu": _uuid(self.device), "slots": self._shared}).encode()

    def _open(self, raw: bytes) -> list[torch.Tensor]:
        published = _parse(raw)
        own = _uuid(self.device)
        if published["gpu"] != own:
            raise PlanRefused(f"the sender's buckets are on GPU {clip(published['gpu'], 80)}, this receiver's device "
                              f"{self.device} is GPU {own}; cuda_ipc needs one GPU shared by trainer and rollout "
                              "(use nccl between GPUs)")
        return [_open_slot(entry, self.device) for entry in published["slots"]]


def _uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _export(slot: torch.Tensor) -> dict[str, Any]:
    """The slot's handle; refuses an expandable segment's, which a receiver should not open."""
    (_, handle, size, offset, ref, ref_offset, event, event_sync) = slot.untyped_storage()._share_cuda_()
    if len(handle) != _HANDLE_BYTES or handle[1] != _PLAIN:
        raise EngineError("cuda_ipc engine: torch's CUDA allocator gave the buckets an expandable segment "
                          "(PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True), whose handles this engine "
                          "does not publish; turn expandable segments off in the trainer, or use nccl")
    return {"handle": handle.hex(), "size": int(size), "offset": int(offset), "ref": ref.hex(),
            "ref_offset": int(ref_offset), "event": (event or b"").hex(), "event_sync": bool(event_sync)}


def _parse(raw: bytes) -> dict[str, Any]:
    """The sender's published slots, every field checked; `PlanRefused` naming the first that is not."""
    try:
        published = json.loads(raw)
    except PARSE_ERRORS:
        published = None
    slots = published.get("slots") if isinstance(published, dict) else None
    if not (isinstance(published, dict) and isinstance(published.get("gpu"), str)
            and isinstance(slots, list) and len(slots) == SLOTS):
        raise PlanRefused(f"the sender published {raw[:120]!r} ({len(raw)} bytes) as its buckets, "
                          f"not a GPU and {SLOTS} CUDA IPC handles")
    for i, entry in enumerate(slots):
        if (problem := _slot_problem(entry)) is not None:
            raise PlanRefused(f"the sender's bucket {i}: {problem}")
    spans = sorted((bytes.fromhex(e["handle"]), e["offset"], e["offset"] + e["size"]) for e in slots)
    if any(a[0] == b[0] and b[1] < a[2] for a, b in zip(spans, spans[1:])):
        raise PlanRefused("the sender published two buckets that overlap")
    return published


def _slot_problem(entry: Any) -> str | None:
    fields = {"handle": str, "size": int, "offset": int, "ref": str, "ref_offset": int, "event": str,
              "event_sync": bool}
    if not isinstance(entry, dict) or set(entry) != set(fields):
        return f"{clip(repr(entry), 200)} has not exactly the fields {', '.join(fields)}"
    for key, kind in fields.items():
        value = entry[key]
        if type(value) is not kind:
            return f"its {key} is {clip(repr(value), 80)}, not {kind.__name__}"
    handles = {key: _hex(entry[key]) for key in ("handle", "ref", "event")}
    handle = handles["handle"]
    if handle is None or len(handle) != _HANDLE_BYTES or handle[1] != _PLAIN:
        return f"its handle is not a plain CUDA IPC memory handle ({_HANDLE_BYTES} bytes of hex, type 'c')"
    if handles["event"] is None or len(handles["event"]) != _EVENT_BYTES:
        return f"its event handle is not {_EVENT_BYTES} bytes of hex"
    if handles["ref"] is None or not _REF_COUNTER.fullmatch(handles["ref"]):
        return "its reference counter is not one of torch's shared-memory files (/torch_<pid>_<n>_<n>)"
    if not 0 <= entry["ref_offset"] < _COUNTERS:
        return f"its reference counter's slot {entry['ref_offset']} is outside 0..{_COUNTERS - 1}"
    size = entry["size"]
    if size < HEADER_BYTES + MIN_BUCKET_BYTES or size % ALIGN or size > _MAX_OFFSET:
        return f"its size {size} is no bucket's size"
    if not 0 <= entry["offset"] < _MAX_OFFSET:
        return "its offset is out of range"
    return None


def _hex(text: str) -> bytes | None:
    try:
        return bytes.fromhex(text) if len(text) <= 4 * _HANDLE_BYTES and text.isalnum() else None
    except ValueError:
        return None


def _open_slot(entry: dict[str, Any], device: torch.device) -> torch.Tensor:
    """Open one exported slot on `device` as a flat uint8 tensor of its size."""
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index, bytes.fromhex(entry["handle"]), entry["size"], entry["offset"],
            bytes.fromhex(entry["ref"]), entry["ref_offset"], bytes.fromhex(entry["event"]), entry["event_sync"])
    except (RuntimeError, TypeError, ValueError) as exc:
        raise PlanRefused(f"cannot open the sender's CUDA IPC handle on {device}: {clip(str(exc), 300)}") from None
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (entry["size"],))
