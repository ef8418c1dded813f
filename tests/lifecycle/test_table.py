"""`lifecycle.table.Table`: the one code path every machine's table goes through, and what it refuses."""

from __future__ import annotations

import re
from enum import Enum
from typing import Any

import pytest
from transitions import MachineError

from lifecycle.errors import InvalidTransition, LifecycleError
from lifecycle.machine import MACHINES
from lifecycle.stateful import Stateful
from lifecycle.table import DONE, FAIL, MachineModel, Row, Table


class S(Enum):
    A = "a"
    B = "b"
    W = "w"
    X = "x"


class Model(MachineModel):
    def go(self) -> bool: raise NotImplementedError  # noqa: E704
    def stop(self) -> bool: raise NotImplementedError  # noqa: E704


@pytest.mark.parametrize(("rows", "message"), [
    ([Row("go", (S.A,), S.W, S.B, S.X), Row("go", (S.B,), None, S.X, None)], "more than one row"),
    ([Row("done", (S.A,), None, S.B, None)], "machine's own trigger"),
    ([Row("go", (S.A,), S.W, S.B, S.X), Row("stop", (S.B,), S.W, S.A, S.X)], "more than one row"),
    ([Row("go", (S.A,), S.W, S.B, S.X), Row("stop", (S.W,), None, S.X, None)], "working state W of 'go' is a source"),
    ([Row("go", (S.A,), None, S.B, S.X)], "no working state to fail from"),
    ([Row("jump", (S.A,), None, S.B, None)], "declares no stub for ['jump']"),
    ([Row("go", (S.A,), S.W, S.B, S.X), Row("stop", (S.B,), None, S.W, None)],
     "'stop' ends (done) in W, the working state of 'go'"),
    ([Row("go", (S.A,), S.W, S.B, None), Row("stop", (S.B,), S.X, S.A, S.W)],
     "'stop' ends (failed) in W, the working state of 'go'"),
    ([Row("go", (S.A,), S.W, S.W, S.X)], "'go' ends (done) in W, the working state of 'go'"),
])
def test_a_table_that_cannot_work_is_refused_when_built(rows: list[Row[S]], message: str) -> None:
    with pytest.raises(LifecycleError, match=re.escape(message)):
        Table("t", S, rows, initial=S.A, model=Model)


@pytest.mark.parametrize(("initial", "message"), [
    (S.X, "initial state X is left by no trigger"),
    (S.W, "initial state W is a working state"),
])
def test_a_table_whose_initial_state_no_trigger_leaves_is_refused(initial: S, message: str) -> None:
    rows = [Row("go", (S.A,), S.W, S.B, S.X), Row("stop", (S.B,), None, S.A, None)]
    with pytest.raises(LifecycleError, match=re.escape(message)):
        Table("t", S, rows, initial=initial, model=Model)
    with pytest.raises(LifecycleError, match="initial state A is left by no trigger"):
        Table("t", S, [], initial=S.A, model=Model)


def test_terminal_states_are_the_ones_no_trigger_leaves() -> None:
    table = Table("t", S, [Row("go", (S.A,), S.W, S.B, S.X), Row("stop", (S.B,), None, S.A, None)],
                  initial=S.A, model=Model)
    assert table.terminal == {S.X} and table.working == {S.W}
    assert table.allowed(S.A) == ["go"] and table.allows("stop", S.B) and not table.allows("stop", S.A)


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_every_machine_answers_allowed_triggers_from_its_rows_alone(name: str) -> None:
    table = MACHINES[name]
    for state in table.states:
        assert table.allowed(state) == [row.trigger for row in table.rows if state in row.sources]
        assert not (state in table.working and table.allowed(state)), "nothing fires while a phase runs"


def _machine_move(table: Table[Any], state: Enum, trigger: str) -> Enum | None:
    """Where the `transitions` machine built from `table` goes on `trigger` from `state`; None: it refuses."""
    model = table.model()
    table.build(model, initial=state)
    try:
        getattr(model, trigger)()
    except MachineError:
        return None
    return model.state  # type: ignore[no-any-return]


ODD_TABLE = Table("t", S, [Row("go", (S.A, S.B), S.W, S.B, S.X), Row("stop", (S.B,), None, S.A, None)],
                  initial=S.A, model=Model)


@pytest.mark.parametrize("table", [*(MACHINES[name] for name in sorted(MACHINES)), ODD_TABLE],
                         ids=[*sorted(MACHINES), "test"])
def test_every_move_of_a_machine_is_the_one_its_transitions_machine_makes(table: Table[Any]) -> None:
    """`Stateful._move` sets the state from `Table.moves` instead of firing the `transitions`
    machine: from every state, every trigger (done and fail too) goes where the machine goes,
    and what the machine refuses raises `InvalidTransition` and changes nothing."""
    triggers = [*table.by_trigger, DONE, FAIL]
    for state in table.states:
        for trigger in triggers:
            expected = _machine_move(table, state, trigger)
            machine = Stateful(table, role="t", rank=0)
            machine._machine.set_state(state, machine._model)
            if expected is None:
                with pytest.raises(InvalidTransition) as info:
                    machine._move(trigger)
                assert (info.value.state, info.value.trigger) == (state, trigger)
                assert info.value.allowed == table.allowed(state)
                assert machine.state is state
            else:
                assert machine._move(trigger) == (state, expected), (state.name, trigger)
                assert machine.state is expected


def test_a_name_that_is_no_edge_of_the_table_goes_to_the_transitions_machine() -> None:
    machine = Stateful(ODD_TABLE, role="t", rank=0)
    with pytest.raises(AttributeError, match="jump"):
        machine._move("jump")
    assert machine.state is S.A
