"""A transition table as data, and everything derived from one: the machine, the allowed triggers, the diagram.

Every machine of the library (the trainer's `Lifecycle`, a rollout's weights, the Ray driver's
run) is one `Table` of `Row`s; `lifecycle.machine` holds the three. This module is the single
code path that turns any of them into a `transitions` machine, answers which triggers a state
allows and draws the Mermaid diagram, so the three cannot drift apart in how they are read.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, TypeVar

from transitions import Machine, Transition

from lifecycle.errors import LifecycleError

S = TypeVar("S", bound=Enum)
DONE, FAIL = "done", "fail"
"""The internal triggers that end a phase; users fire only the table's own triggers."""


@dataclass(frozen=True, slots=True)
class Row(Generic[S]):
    """One trigger of a table: from `sources` to `working`, then `done` or `failed`.

    A row with no working state moves straight to `done` (its work, if any, runs there).
    """

    trigger: str
    sources: tuple[S, ...]
    working: S | None
    done: S
    failed: S | None


class MachineModel:
    """The object `transitions` drives. A table's model subclass declares one stub per trigger
    (and `done`, `fail`), so type checkers see them; `Table` refuses a model that lacks one."""

    state: Any

    def done(self) -> bool: raise NotImplementedError  # noqa: E704
    def fail(self) -> bool: raise NotImplementedError  # noqa: E704


class _Edge(Transition):
    """An edge that only changes the state.

    The tables' edges carry no conditions and no callbacks: work runs outside the machine,
    and observers see every move. Evaluating empty callback lists and looking up enter/exit
    hooks on every trigger would cost more than the state change itself, so an edge skips
    them, and refuses to be built with any.
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


class _TableMachine(Machine):
    transition_cls = _Edge


class Table(Generic[S]):
    """One machine's whole contract: its states, its rows and where it starts.

    Checked when built: triggers are unique and not `done`/`fail`, a working state belongs to
    one row, is no row's source and no row's done or failed state (a phase ends by done or fail
    only, and only its own phase may enter it), some trigger leaves the initial state, and the
    model declares every trigger. `terminal` is derived: the states no trigger leaves.
    """

    def __init__(self, name: str, states: type[S], rows: Sequence[Row[S]], *, initial: S,
                 model: type[MachineModel]) -> None:
        self.name = name
        self.states = states
        self.rows: tuple[Row[S], ...] = tuple(rows)
        self.initial = initial
        self.model = model
        self.by_trigger: dict[str, Row[S]] = {row.trigger: row for row in self.rows}
        self.working: frozenset[S] = frozenset(row.working for row in self.rows if row.working is not None)
        self.names: dict[S, str] = {state: state.name for state in states}
        """Each state's name (`machine.NAMES`); the per-transition path reads `state._name_`, the same
        string without hashing the Enum (a Python-level `__hash__`) or calling its `.name` descriptor."""
        sources = {state for row in self.rows for state in row.sources}
        self.terminal: frozenset[S] = frozenset(s for s in states if s not in sources and s not in self.working)
        self._check()
        self.moves: dict[str, dict[str, S]] = self._moves()
        """trigger (`done` and `fail` too) -> source state's `_name_` -> destination: the edges of
        `transitions()`, indexed once so that `Stateful._move` changes the state with two dict
        look-ups instead of a `transitions` trigger (an Enum key hashes through a Python call, a
        name's hash is cached). A pair that is absent is a move the machine refuses."""
        self.working_names: frozenset[str] = frozenset(state._name_ for state in self.working)
        """The working states' names: whether a phase's move left it in one, without hashing an Enum."""

    def _check(self) -> None:
        where = f"table {self.name!r}"
        if len(self.by_trigger) != len(self.rows):
            raise LifecycleError(f"{where}: a trigger appears in more than one row")
        working = [row.working for row in self.rows if row.working is not None]
        if len(set(working)) != len(working):
            raise LifecycleError(f"{where}: a working state belongs to more than one row")
        for row in self.rows:
            if row.trigger in (DONE, FAIL):
                raise LifecycleError(f"{where}: {row.trigger!r} is the machine's own trigger, not a row's")
            if row.working is not None and any(row.working in other.sources for other in self.rows):
                raise LifecycleError(f"{where}: working state {row.working.name} of {row.trigger!r} is a source")
            if row.working is None and row.failed is not None:
                raise LifecycleError(f"{where}: {row.trigger!r} has no working state to fail from")
            for end, state in (("done", row.done), ("failed", row.failed)):
                if state is not None and state in self.working:
                    owner = next(other.trigger for other in self.rows if other.working is state)
                    raise LifecycleError(f"{where}: {row.trigger!r} ends ({end}) in {state.name}, the working state "
                                         f"of {owner!r}: the machine would sit in a phase that nobody runs")
        if self.initial in self.working or not self.allowed(self.initial):
            raise LifecycleError(f"{where}: initial state {self.initial.name} is "
                                 f"{'a working state' if self.initial in self.working else 'left by no trigger'}: "
                                 "the machine could never move")
        missing = [t for t in (*self.by_trigger, DONE, FAIL) if not callable(getattr(self.model, t, None))]
        if missing:
            raise LifecycleError(f"{where}: {self.model.__name__} declares no stub for {missing}")

    def edges(self) -> Iterator[tuple[str, tuple[S, ...], S]]:
        """Every edge as (trigger, sources, destination): begin edges, then one done and one fail per phase."""
        for row in self.rows:
            yield row.trigger, row.sources, row.working if row.working is not None else row.done
        for row in self.rows:
            if row.working is None:
                continue
            yield DONE, (row.working,), row.done
            if row.failed is not None:
                yield FAIL, (row.working,), row.failed

    def transitions(self) -> list[dict[str, object]]:
        """The table in `transitions` form: begin edges, then one done and one fail per phase."""
        return [{"trigger": trigger, "source": sources[0] if trigger in (DONE, FAIL) else list(sources), "dest": dest}
                for trigger, sources, dest in self.edges()]

    def _moves(self) -> dict[str, dict[str, S]]:
        moves: dict[str, dict[str, S]] = {}
        for trigger, sources, dest in self.edges():
            for src in sources:
                moves.setdefault(trigger, {})[src._name_] = dest
        return moves

    def build(self, model: MachineModel, initial: S | None = None) -> Machine:
        """A `transitions` machine driving `model` (an instance of this table's model class)."""
        return _TableMachine(model=model, states=self.states, transitions=self.transitions(),
                             initial=self.initial if initial is None else initial, auto_transitions=False,
                             model_override=True)

    def allowed(self, state: S) -> list[str]:
        """The triggers that may fire from `state` (the internal done/fail are not listed)."""
        return [row.trigger for row in self.rows if state in row.sources]

    def allows(self, trigger: str, state: S) -> bool:
        row = self.by_trigger.get(trigger)
        return row is not None and state in row.sources

    def mermaid(self) -> str:
        """The machine as a Mermaid state diagram, generated from the rows."""
        lines = ["stateDiagram-v2", f"    [*] --> {self.initial.name}"]
        for row in self.rows:
            begin = row.working if row.working is not None else row.done
            for src in row.sources:
                lines.append(f"    {src.name} --> {begin.name}: {row.trigger}")
            if row.working is not None:
                lines.append(f"    {row.working.name} --> {row.done.name}: {DONE}")
                if row.failed is not None:
                    lines.append(f"    {row.working.name} --> {row.failed.name}: {FAIL}")
        for state in self.states:
            if state in self.terminal:
                lines.append(f"    {state.name} --> [*]")
        return "\n".join(lines) + "\n"


__all__ = ["DONE", "FAIL", "MachineModel", "Row", "Table"]
