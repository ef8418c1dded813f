"""A receiver's two weight sets for `apply: flip`: where each sync lands, which one its rollout serves.

A flip receiver hands its rollout views into the set a sync landed in, once every bucket of it
verified, and the rollout adopts them as its weights (`adopt_weights`): no copy on the
receiving side. The next sync lands in the other set; the set the rollout serves is written
again only after a later sync has completed into the other one. A failed sync leaves the
rollout on the set it serves, untouched.

Where the sets live is the engine's business: the group engines allocate them as private
buffers, one per set with its buckets `join`ed (a receiver's own choice, whatever the sender
does); `shm` maps two files the sender writes into, and asks the sender for the set (see
`shared`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from backends.engines.buckets import Layout
from backends.engines.slots import SLOTS, Slot, join, joined_bytes, mark
from backends.engines.plan import Plan

Carve = Callable[[int, Plan], list[Slot]]
"""Set `index`'s slots for `plan`, one per bucket (`slots.join`)."""


class WeightSets:
    """Both sets' memory and layouts, and which set the rollout serves."""

    def __init__(self) -> None:
        self.memory: list[torch.Tensor] = []
        """Per set, the one buffer its buckets are carved from (a mapped file, or private memory)."""
        self.layouts: list[Layout | None] = [None] * SLOTS
        self.serving: int | None = None
        """The set whose tensors the rollout adopted last; None before any, or after new memory."""
        self.target: int | None = None
        """The set this sync lands in, once known."""

    def hold(self, memory: Sequence[torch.Tensor]) -> None:
        """New memory for both sets: none of it is served yet; views of it a rollout may keep (`slots.mark`)."""
        for buffer in memory:
            mark(buffer, keepable=True)
        self.memory, self.layouts = list(memory), [None] * SLOTS
        self.serving = self.target = None

    def forget(self) -> None:
        self.hold([])

    def ask(self) -> int | None:
        """The set the next sync may land in: the one not served, or None when either will do."""
        self.target = None if self.serving is None else 1 - self.serving
        return self.target

    def layout(self, index: int, plan: Plan, raw: bytes, carve: Carve) -> Layout:
        """Set `index` laid out for `plan`: bucket k in slot k of `carve(index, plan)`, built
        once per plan and set; two sets of one plan keep one copy of its bytes (megabytes at
        tens of thousands of tensors)."""
        layout = self.layouts[index]
        if layout is None or layout.plan is not plan:
            raw = next((other.raw for other in self.layouts if other is not None and other.plan is plan), raw)
            layout = self.layouts[index] = Layout(plan, carve(index, plan), raw=raw)
        return layout

    def plan_of(self, raw: bytes) -> Plan | None:
        """The plan parsed from these very bytes for a layout already built, if any."""
        for layout in self.layouts:
            if layout is not None and layout.raw == raw:
                return layout.plan
        return None

    def handed_out(self) -> None:
        """The rollout adopted the set this sync landed in (`Incoming.adopted`): it is served now."""
        self.serving = self.target


def private_sets(sets: WeightSets, plan: Plan, raw: bytes, allocate: Callable[[int], torch.Tensor]) -> Layout:
    """A receiver's own two sets, for an engine that lands buckets where it likes (the group
    engines): the layout of the set its rollout does not serve (set 0 when it serves neither).
    Each set is one buffer from `allocate(bytes)`, its buckets `join`ed, allocated again when
    the plan's buckets need another size."""
    sizes = plan.sizes()
    wanted = joined_bytes(sizes)
    if len(sets.memory) != SLOTS or any(memory.numel() != wanted for memory in sets.memory):
        sets.hold([allocate(wanted) for _ in range(SLOTS)])
    target = sets.ask()
    if target is None:
        target = sets.target = 0
    return sets.layout(target, plan, raw, lambda index, _: join(sizes, sets.memory[index]))
