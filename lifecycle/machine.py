"""The transition table, as data, and everything derived from it: the machine, the diagram."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from typing import Any

from transitions import Machine, Transition

from lifecycle.errors import LifecycleError


class State(Enum):
    """A worker's lifecycle state; `working` states are the ones a phase runs in."""

    CREATED = "created"
    LOADING = "loading"
    READY = "ready"
    TRAINING = "training"
    SAVING = "saving"
    SYNCING = "syncing"
    RESUMING = "resuming"
    FAILED = "failed"
    CLOSED = "closed"

    @property
    def working(self) -> bool:
        return self in WORKING

    @property
    def terminal(self) -> bool:
        return self is State.CLOSED


@dataclass(frozen=True, slots=True)
class Row:
    """One trigger of the table: from `sources` to `working`, then `done` or `failed`.

    A row with no working state (close) moves straight to `done`.
    """

    trigger: str
    sources: tuple[State, ...]
    working: State | None
    done: State
    failed: State | None


S = State
TABLE: tuple[Row, ...] = (
    Row("init_load", (S.CREATED,), S.LOADING, S.READY, S.FAILED),
    Row("train_step", (S.READY,), S.TRAINING, S.READY, S.FAILED),
    Row("save", (S.READY,), S.SAVING, S.READY, S.FAILED),
    Row("sync_weights", (S.READY,), S.SYNCING, S.READY, S.FAILED),
    Row("resume", (S.CREATED, S.FAILED), S.RESUMING, S.READY, S.FAILED),
    Row("close", (S.CREATED, S.READY, S.FAILED), None, S.CLOSED, None),
)
"""The whole contract. The machine, `allowed_triggers` and the Mermaid diagram read it."""

ROWS: dict[str, Row] = {row.trigger: row for row in TABLE}
WORKING = frozenset(row.working for row in TABLE if row.working is not None)
NAMES: dict[State, str] = {state: state.name for state in State}
"""Enum `.name` is a descriptor call; the per-transition record reads this instead."""
DONE, FAIL = "done", "fail"
"""The internal triggers that end a phase; users fire only the table's triggers."""


def machine_transitions() -> list[dict[str, object]]:
    """The table in `transitions` form: begin edges, then one done and one fail per phase."""
    edges: list[dict[str, object]] = []
    for row in TABLE:
        begin_dest = row.working if row.working is not None else row.done
        edges.append({"trigger": row.trigger, "source": list(row.sources), "dest": begin_dest})
    for row in TABLE:
        if row.working is None:
            continue
        edges.append({"trigger": DONE, "source": row.working, "dest": row.done})
        if row.failed is not None:
            edges.append({"trigger": FAIL, "source": row.working, "dest": row.failed})
    return edges


class MachineModel:
    """The object `transitions` drives; the stubs let type checkers see the triggers."""

    state: State

    def init_load(self) -> bool: raise NotImplementedError  # noqa: E704
    def train_step(self) -> bool: raise NotImplementedError  # noqa: E704
    def save(self) -> bool: raise NotImplementedError  # noqa: E704
    def sync_weights(self) -> bool: raise NotImplementedError  # noqa: E704
    def resume(self) -> bool: raise NotImplementedError  # noqa: E704
    def close(self) -> bool: raise NotImplementedError  # noqa: E704
    def done(self) -> bool: raise NotImplementedError  # noqa: E704
    def fail(self) -> bool: raise NotImplementedError  # noqa: E704


class _Edge(Transition):
    """An edge that only changes the state.

    The lifecycle's edges carry no conditions and no callbacks: work runs outside the
    machine, and observers see every move. Evaluating empty callback lists and looking up
    enter/exit hooks on every trigger would cost more than the state change itself, so an
    edge skips them, and refuses to be built with any.
    """

    def __init__(self, source: str, dest: str, *hooks: Any) -> None:
        if any(hooks):
            raise LifecycleError(f"lifecycle edge {source} -> {dest} takes no conditions or callbacks")
        super().__init__(source, dest)

    def execute(self, event_data: Any) -> bool:
        machine = event_data.machine
        machine.set_state(self.dest, event_data.model)
        event_data.update(getattr(event_data.model, machine.model_attribute))
        return True


class _LifecycleMachine(Machine):
    transition_cls = _Edge


def build_machine(model: MachineModel, initial: State = State.CREATED) -> Machine:
    return _LifecycleMachine(
        model=model,
        states=State,
        transitions=machine_transitions(),
        initial=initial,
        auto_transitions=False,
        model_override=True,
    )


def allowed_triggers(state: State) -> list[str]:
    """The table's triggers that may fire from `state` (the internal done/fail are not listed)."""
    return [row.trigger for row in TABLE if state in row.sources]


def mermaid() -> str:
    """The machine as a Mermaid state diagram, generated from the same table."""
    lines = ["stateDiagram-v2", f"    [*] --> {State.CREATED.name}"]
    for row in TABLE:
        begin = row.working if row.working is not None else row.done
        for src in row.sources:
            lines.append(f"    {src.name} --> {begin.name}: {row.trigger}")
        if row.working is not None:
            lines.append(f"    {row.working.name} --> {row.done.name}: {DONE}")
            if row.failed is not None:
                lines.append(f"    {row.working.name} --> {row.failed.name}: {FAIL}")
    for state in State:
        if state.terminal:
            lines.append(f"    {state.name} --> [*]")
    return "\n".join(lines) + "\n"
