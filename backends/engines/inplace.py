"""Landing a sync straight into the rollout's own weights: `receive_weights(..., into=...)`.

When the rollout's parameters sit in one storage laid out as the sender's plan lays out its
buckets (flattened by `flat.flatten_parameters`, in the trainer's order and wire dtype; the
trainer itself need not be flattened), bucket k's data region is a byte range of that
storage, so an engine that receives into slots of its own (`EngineCapabilities.lands_in_place`:
the group engines) receives it there: no receive buffer, no copy into the model. The bytes
land before their bucket is verified, in the weights the rollout serves, so only a streamed
receive may do this: a bucket that fails its checksum, or a sync that fails half-way, leaves
the weights partly overwritten, and `receive_into` leaves the rollout stale until a sync
completes.

The plan decides where the sender's bytes land, so none of it is trusted. Every tensor it
names must be one of `into`, of the plan's dtype and shape; every bucket's pieces must sit
at their offsets from one `ALIGN`-aligned base in one storage, each piece at the aligned end
of the one before (as `plan.make_plan` lays them out, so the bytes between pieces are the
alignment padding flattening leaves unused); bucket ranges must not overlap, and no other
tensor of `into` (nor, for a module, any of its buffers) may share a byte with one; a name of
`into` that is another name of a tensor the plan sends (tied weights) is that tensor; host memory
a bucket lands in must be writable (not mapped read-only). A plan that fails any of this is
refused before a byte moves, with the reason, and the sender is told.
"""

from __future__ import annotations

import bisect
import ctypes
import os

import torch

from backends.engines.buckets import Layout
from backends.engines.slots import HEADER_BYTES, Slot
from backends.engines.flat import Named, is_model, kind_problem, named_pairs
from backends.engines.plan import Plan, PlanRefused, align
from backends.engines.sources import Source, describe, outside_storage, place, span
from lifecycle.errors import EngineError

_LIBC = ctypes.CDLL(None, use_errno=True)


class Landing:
    """A receiver's landing layout, kept from one sync to the next while the plan and the
    rollout's tensors and a module's buffers beside them (as `sources.describe` finds them:
    names, shapes, addresses, contiguity) stay as
    they were: working it out costs a few microseconds a tensor, as much as receiving their bytes.
    The kept ranges hold the rollout's storage alive until the next sync that lands elsewhere, or
    `close()` (a device engine lets it go after every sync)."""

    def __init__(self) -> None:
        self.layout: Layout | None = None
        self._sources: Source | None = None

    def layout_for(self, plan: Plan, raw: bytes, into: Named, device: torch.device) -> Layout:
        """The layout whose slots are `into`'s storage, for `plan` (`landing_slots`)."""
        named, beside = rollout_tensors(into)
        sources = describe([*named.items(), *beside], self._sources)  # a buffer moved into a range is seen too
        layout = self.layout
        if layout is None or layout.plan is not plan or sources is None or sources is not self._sources:
            self.layout = None
            layout = self.layout = Layout(plan, _slots(plan, named, beside, device), raw=raw)
        self._sources = sources
        return layout

    def plan_of(self, raw: bytes) -> Plan | None:
        """The plan parsed from these very bytes for the layout kept, if any."""
        return self.layout.plan if self.layout is not None and self.layout.raw == raw else None


def rollout_tensors(into: Named) -> tuple[dict[str, torch.Tensor], list[tuple[str, torch.Tensor]]]:
    """`into`'s tensors by name, and what else lives beside them (a module's buffers);
    `PlanRefused` for what cannot be landed in."""
    try:
        pairs = [(name, tensor) for name, tensor in named_pairs(into)]
        buffers = list(into.named_buffers(remove_duplicate=False)) if is_model(into) else []  # type: ignore[union-attr]
    except (TypeError, ValueError, EngineError) as exc:
        raise PlanRefused(f"into= is no module, state dict or (name, tensor) pairs: {exc}") from None
    named: dict[str, torch.Tensor] = {}
    for name, tensor in pairs:
        problem = (f"is a {type(tensor).__name__}, not a tensor" if not isinstance(tensor, torch.Tensor)
                   else "is named twice" if name in named else kind_problem(tensor))
        if problem is not None:
            raise PlanRefused(f"into= holds {name!r}, which {problem}")
        named[name] = tensor.detach()
    beside = [(f"buffer {name}", buffer.detach()) for name, buffer in buffers
              if isinstance(buffer, torch.Tensor) and kind_problem(buffer) is None]
    return named, beside


def landing_slots(plan: Plan, into: Named, device: torch.device) -> list[Slot]:
    """One slot per bucket of `plan`: a header of its own, and the byte range of the rollout's
    storage its data lands in; `PlanRefused` says why the rollout's tensors cannot take it."""
    return _slots(plan, *rollout_tensors(into), device)


def _slots(plan: Plan, tensors: dict[str, torch.Tensor], beside: list[tuple[str, torch.Tensor]],
           device: torch.device) -> list[Slot]:
    """`landing_slots` of `rollout_tensors`' answer."""
    ordered, places = [], {}
    for meta in plan.tensors:
        tensor = tensors.get(meta.name)
        if tensor is None:
            raise PlanRefused(f"it sends {meta.name!r}, which the rollout's tensors (into=) do not hold")
        if tensor.dtype != meta.dtype or tuple(tensor.shape) != meta.shape:
            raise PlanRefused(f"it sends {meta.name!r} as {meta.dtype} {list(meta.shape)}; the rollout holds "
                              f"{tensor.dtype} {list(tensor.shape)}")
        if (held := outside_storage(tensor)) is not None:
            raise PlanRefused(f"into= holds {meta.name!r}, whose storage holds {held} bytes, fewer than it reads: "
                              "freed or shrunk (untyped_storage().resize_)")
        other = places.setdefault(place(tensor), meta.name) if tensor.numel() else meta.name
        if other != meta.name:
            raise PlanRefused(f"it sends {other!r} and {meta.name!r}, which the rollout ties (one tensor under two "
                              "names): send tied weights once, as named_parameters() does")
        ordered.append(tensor)
    heads = torch.zeros(HEADER_BYTES * len(plan.buckets), dtype=torch.uint8, device=device)
    probe = Layout(plan, [Slot(heads[:HEADER_BYTES], heads[:0])])
    slots = []
    for k, bucket in enumerate(plan.buckets):
        at = 0
        for j, piece in enumerate(bucket):
            if piece.offset != align(at):
                raise PlanRefused(f"bucket {k} piece {j} sits at offset {piece.offset}, not at {align(at)} where the "
                                  "piece before it ends: bytes between pieces would land on memory no tensor of "
                                  "the plan owns")
            at = piece.offset + piece.nbytes
        head = heads[k * HEADER_BYTES:(k + 1) * HEADER_BYTES]
        region = probe.region(k, ordered) if plan.used(k) else heads[:0]
        if region is None:
            raise PlanRefused(f"bucket {k} does not lie in one storage of the rollout at the plan's offsets "
                              f"(it holds {', '.join(probe.names(k)[:3])}); flatten both sides' models with "
                              "flatten_parameters, from the same model, or receive without into=")
        _check_writable(k, region, plan, ordered)
        slots.append(Slot(head, region))
    unsent = [(name, tensor) for name, tensor in tensors.items()
              if tensor.numel() and places.get(place(tensor)) is None] + beside
    _check_apart(slots, unsent)
    return slots


def _check_writable(k: int, region: torch.Tensor, plan: Plan, ordered: list[torch.Tensor]) -> None:
    """`PlanRefused` naming the tensor bucket k would land on whose memory cannot be written."""
    if writable(region):
        return
    bucket = plan.buckets[k]
    name = next((plan.tensors[p.index].name for p in bucket if not writable(ordered[p.index])),
                plan.tensors[bucket[0].index].name)
    raise PlanRefused(f"bucket {k} would land on {name!r}, whose memory cannot be written (mapped read-only, as "
                      "torch.frombuffer of a read-only buffer gives): give the rollout's weights memory of their own "
                      "(clone, then flatten_parameters)")


def writable(tensor: torch.Tensor) -> bool:
    """Whether a host tensor's first and last bytes can be written, told without a signal: the
    kernel copies each out to a pipe and back onto itself (the same value), failing with EFAULT
    on memory mapped read-only, where a transport's receive would fail only once `timeout_s`
    ran out. A tensor on a device, or empty, counts as writable."""
    if tensor.device.type != "cpu" or not tensor.numel():
        return True
    low, high = span(tensor)
    out, back = os.pipe()
    try:
        return all(_LIBC.write(back, ctypes.c_void_p(at), 1) == 1 and _LIBC.read(out, ctypes.c_void_p(at), 1) == 1
                   for at in {low, high - 1})
    finally:
        os.close(out)
        os.close(back)


def _check_apart(slots: list[Slot], unsent: list[tuple[str, torch.Tensor]]) -> None:
    """No two buckets' ranges overlap, and no tensor the plan does not send (`unsent`) shares a byte with one."""
    ranges = sorted((slot.data.data_ptr(), slot.data.data_ptr() + slot.data.numel(), k)
                    for k, slot in enumerate(slots) if slot.data.numel())
    for (_, end, k), (start, _, later) in zip(ranges, ranges[1:]):
        if start < end:
            raise PlanRefused(f"buckets {k} and {later} would land on the same bytes of the rollout's storage")
    starts = [start for start, _, _ in ranges]
    for name, tensor in unsent:
        if not tensor.numel():
            continue
        low, high = span(tensor)
        i = bisect.bisect_right(starts, high - 1) - 1
        if i >= 0 and ranges[i][1] > low:
            raise PlanRefused(f"bucket {ranges[i][2]} would land on {name!r}, a tensor of the rollout's the plan "
                              "does not send")


__all__ = ["Landing", "landing_slots", "rollout_tensors"]
