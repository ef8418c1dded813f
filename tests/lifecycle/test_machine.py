"""The transition table is a contract: every (state, trigger) pair is pinned here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from lifecycle import TABLE, CheckpointError, InvalidTransition, Lifecycle, State
from lifecycle.errors import LifecycleError, shorten
from lifecycle.machine import allowed_triggers, machine_transitions, mermaid
from lifecycle.phase import Phase
from lifecycle.testing import InjectedFailure, MemoryRollout, capture_transitions
from tests.lifecycle.probes import drive_to, fire, make_lifecycle

S = State
CONTRACT = {
    # trigger: (sources, working state, state after success, state after failure)
    "init_load": ({S.CREATED}, S.LOADING, S.READY, S.FAILED),
    "train_step": ({S.READY}, S.TRAINING, S.READY, S.FAILED),
    "save": ({S.READY}, S.SAVING, S.READY, S.FAILED),
    "sync_weights": ({S.READY}, S.SYNCING, S.READY, S.FAILED),
    "resume": ({S.CREATED, S.FAILED}, S.RESUMING, S.READY, S.FAILED),
    "close": ({S.CREATED, S.READY, S.FAILED}, None, S.CLOSED, None),
}
TRIGGERS = list(CONTRACT)
STABLE = [S.CREATED, S.READY, S.FAILED, S.CLOSED]
WORKING = {
    S.LOADING: "init_load",
    S.TRAINING: "train_step",
    S.SAVING: "save",
    S.SYNCING: "sync_weights",
    S.RESUMING: "resume",
}
REPO = Path(__file__).resolve().parents[2]


def test_table_in_code_is_the_contract() -> None:
    table = {row.trigger: (set(row.sources), row.working, row.done, row.failed) for row in TABLE}
    assert table == CONTRACT


def test_every_state_is_covered_by_the_tests() -> None:
    assert set(STABLE) | set(WORKING) == set(State)


@pytest.mark.parametrize("state", STABLE)
@pytest.mark.parametrize("trigger", TRIGGERS)
def test_trigger_from_stable_state_reaches_the_table_state_or_raises(state: State, trigger: str) -> None:
    lc = make_lifecycle()
    drive_to(state, lc)
    sources, working, done, _ = CONTRACT[trigger]
    if state in sources:
        with capture_transitions(lc) as cap:
            fire(lc, trigger)
        expected = [state, working, done] if working else [state, done]
        cap.assert_path(expected)
        assert lc.state is done
    else:
        with pytest.raises(InvalidTransition) as info:
            fire(lc, trigger)
        assert lc.state is state
        assert info.value.state is state and info.value.trigger == trigger
        assert state.name in str(info.value) and trigger in str(info.value)
        for allowed in allowed_triggers(state):
            assert allowed in str(info.value)


@pytest.mark.parametrize("working", list(WORKING))
@pytest.mark.parametrize("trigger", TRIGGERS)
def test_no_trigger_fires_while_a_phase_runs(working: State, trigger: str) -> None:
    lc = make_lifecycle()
    owner = WORKING[working]
    if owner != "init_load" and owner != "resume":
        drive_to(S.READY, lc)
    seen: list[tuple[State, State]] = []

    def probe() -> None:
        if seen:
            return
        before = lc.state
        with pytest.raises(InvalidTransition, match=f"from state {working.name}"):
            fire(lc, trigger)
        seen.append((before, lc.state))

    if owner == "train_step":
        with lc.train_step(1):
            probe()
    elif owner == "sync_weights":
        lc.engine.probe = probe  # type: ignore[attr-defined]
        lc.sync_weights(MemoryRollout())
    else:
        lc.checkpointer.probe = probe  # type: ignore[attr-defined]
        fire(lc, owner)
    assert seen == [(working, working)]
    assert lc.state is S.READY


@pytest.mark.parametrize("trigger", [t for t, row in CONTRACT.items() if row[1] is not None])
def test_failure_inside_the_work_leaves_the_failure_state_and_reraises(trigger: str) -> None:
    lc = make_lifecycle()
    sources, working, _, failed = CONTRACT[trigger]
    drive_to(S.CREATED if S.CREATED in sources else S.READY, lc)
    start = lc.state

    def boom() -> None:
        raise InjectedFailure("inside the work")

    with capture_transitions(lc) as cap:
        with pytest.raises(InjectedFailure, match="inside the work"):
            if trigger == "train_step":
                with lc.train_step(1):
                    boom()
            else:
                target = lc.engine if trigger == "sync_weights" else lc.checkpointer
                target.probe = boom  # type: ignore[attr-defined]
                fire(lc, trigger)
    cap.assert_path([start, working, failed])
    assert lc.history[-1].ok is False and "inside the work" in (lc.history[-1].error or "")


def test_train_step_counts_the_step_only_when_it_finished(lc: Lifecycle) -> None:
    lc.init_load()
    with lc.train_step(7):
        assert lc.progress.step == 0
    assert lc.progress.step == 7
    with pytest.raises(ZeroDivisionError):
        with lc.train_step(8):
            raise ZeroDivisionError("bad batch")
    assert lc.state is S.FAILED and lc.progress.step == 7


def test_history_keeps_every_transition_with_its_fields(lc: Lifecycle) -> None:
    lc.init_load()
    with lc.train_step(1):
        pass
    lc.save(1)
    lc.close()
    assert [(r.trigger, r.src, r.dst, r.ok) for r in lc.history] == [
        ("init_load", S.CREATED, S.READY, True),
        ("train_step", S.READY, S.READY, True),
        ("save", S.READY, S.READY, True),
        ("close", S.READY, S.CLOSED, True),
    ]
    for record in lc.history:
        assert record.start > 1e9 and record.duration_s >= 0 and record.error is None
    assert lc.history[2].path == (S.READY, S.SAVING, S.READY)


def test_resume_without_a_checkpoint_falls_back_to_init_load(lc: Lifecycle) -> None:
    assert lc.resume() is None
    assert lc.state is S.READY
    assert lc.history[-1].figures["fallback"] == "init_load"
    assert [c[0] for c in lc.checkpointer.calls] == ["resume", "load_initial"]  # type: ignore[attr-defined]


def test_resume_from_failed_restores_the_saved_step() -> None:
    lc = make_lifecycle()
    lc.init_load()
    lc.save(5)
    with pytest.raises(RuntimeError):
        with lc.train_step(6):
            raise RuntimeError("bad batch")
    assert lc.resume() == 5
    assert lc.state is S.READY and lc.progress.step == 5


def test_resume_from_failed_with_nothing_saved_is_refused_not_a_fresh_start_over_the_failed_runs_state() -> None:
    """After a train step it reported a fresh start (None) while the optimizer, scheduler and
    data position were the failed run's: the machine stays FAILED and the error says to build
    anew. A failed init_load moved nothing, so its resume still starts fresh."""
    lc = make_lifecycle()
    lc.init_load()
    with pytest.raises(RuntimeError):
        with lc.train_step(1):
            raise RuntimeError("bad batch")
    with pytest.raises(CheckpointError, match="from FAILED found no checkpoint to restore; a fresh start needs"):
        lc.resume()
    assert lc.state is S.FAILED
    untrained = make_lifecycle()  # a failed init_load moved nothing: its resume may start fresh
    untrained.checkpointer.fail_next("load_initial")  # type: ignore[attr-defined]
    with pytest.raises(InjectedFailure):
        untrained.init_load()
    assert untrained.resume() is None and untrained.state is S.READY


def test_machine_edges_are_generated_from_the_table_only() -> None:
    edges = machine_transitions()
    begins = [e for e in edges if e["trigger"] in CONTRACT]
    assert len(begins) == len(TABLE)
    phases = [row for row in TABLE if row.working is not None]
    assert sum(e["trigger"] == "done" for e in edges) == len(phases)
    assert sum(e["trigger"] == "fail" for e in edges) == len(phases)


def _mermaid_edges(text: str) -> set[tuple[str, str, str]]:
    return {
        (m["src"], m["dst"], m["label"])
        for m in re.finditer(r"^\s*(?P<src>\w+) --> (?P<dst>\w+): (?P<label>\w+)$", text, re.M)
    }


def _expected_edges() -> set[tuple[str, str, str]]:
    edges = set()
    for trigger, (sources, working, done, failed) in CONTRACT.items():
        for src in sources:
            edges.add((src.name, (working or done).name, trigger))
        if working is not None:
            edges.add((working.name, done.name, "done"))
            edges.add((working.name, failed.name, "fail"))
    return edges


def test_mermaid_diagram_has_exactly_the_table_edges() -> None:
    assert _mermaid_edges(mermaid()) == _expected_edges()


Documented = tuple[set[State], State, State, State | None]


def _markdown_table(text: str) -> dict[str, Documented]:
    """Rows `| `trigger` ... | FROM, ... | TO (...) | DONE, or FAILED |`; `final` for a row with no phase."""
    rows = {}
    row = r"^\| `(\w+)`[^|]*\| ([A-Z, ]+) \| ([A-Z]+)[^|]*\| ([A-Za-z, ]+?) \|$"
    for m in re.finditer(row, text, re.MULTILINE):
        sources = {State[name.strip()] for name in m.group(2).split(",")}
        to = State[m.group(3)]
        then = m.group(4)
        if then == "final":
            done, failed = to, None
        else:
            done_name, failed_name = then.split(", or ")
            done, failed = State[done_name], State[failed_name]
        rows[m.group(1)] = (sources, to, done, failed)
    return rows


@pytest.mark.parametrize("doc", ["README.md"])  # the repository's own docs: a clone alone passes its tests
def test_documented_table_agrees_with_the_code(doc: str) -> None:
    """Every column of the README's machine table: trigger, sources, working state and outcome."""
    path = (REPO / doc).resolve()
    if not path.exists():
        pytest.fail(f"{path} is missing: the documented table cannot be checked")
    documented = _markdown_table(path.read_text())
    assert documented == {t: (row[0], row[1] or row[2], row[2], row[3]) for t, row in CONTRACT.items()}


def test_odd_arguments_to_the_machine_helpers_are_typed_errors_naming_them() -> None:
    """Each raised a raw KeyError, ValueError or OverflowError."""
    from lifecycle.errors import ConfigError, LifecycleError

    with pytest.raises(LifecycleError, match="mermaid\\('x'\\): no such machine; there are driver, rollout"):
        mermaid("x")
    lc = make_lifecycle()
    with pytest.raises(LifecycleError, match="not one of its observers"):
        lc.remove_observer(object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="history_limit"):
        make_lifecycle(history_limit=10**19)


@pytest.mark.parametrize("trigger", ["bogus", 5, None, ("save",), ["save"], "done", "fail", "state"])
def test_a_phase_of_a_trigger_the_table_lacks_is_refused_naming_it_and_the_triggers(trigger: Any) -> None:
    """'bogus' raised a raw AttributeError from the transitions model, 5 a TypeError; done and
    fail are the phase's own ends, never a phase of their own."""
    lc = make_lifecycle()
    with pytest.raises(LifecycleError) as info:
        Phase(lc, trigger, None)
    message = str(info.value)
    assert f"Phase({shorten(trigger)})" in message and f"its triggers: {', '.join(TRIGGERS)}" in message
    assert lc.state is S.CREATED and lc.history == []


@pytest.mark.parametrize("owner", [None, object(), "actor", TABLE])
def test_a_phase_on_something_that_is_no_machine_is_refused_naming_it(owner: Any) -> None:
    with pytest.raises(LifecycleError, match=f"a phase runs on a machine .*got {type(owner).__name__}"):
        Phase(owner, "save", None)


def test_a_trigger_on_a_closed_machine_says_closed_is_final_not_that_a_phase_is_running() -> None:
    lc = make_lifecycle()
    lc.close()
    with pytest.raises(InvalidTransition, match="cannot 'resume' from state CLOSED.*allowed from there: none: CLOSED is final"):
        lc.resume()


def test_a_save_started_the_moment_a_train_step_ends_saves_under_that_step() -> None:
    """The train step's progress was set after the machine had left TRAINING and told its
    observers: a save on another thread in that gap labelled step 2's weights as step 1."""
    import threading

    from lifecycle.phase import Observer
    from lifecycle.table import DONE

    saved: list[int] = []

    class SaveAtOnce(Observer):
        def on_state_change(self, lc: Any, src: Any, dst: Any, trigger: str) -> None:
            if trigger == DONE and src is S.TRAINING:
                saver = threading.Thread(target=lambda: saved.append(lc.save().step))
                saver.start()
                saver.join(10)

    lc = make_lifecycle(observers=[SaveAtOnce()])
    lc.init_load()
    for step in (1, 2):
        with lc.train_step(step):
            pass
    assert saved == [1, 2] and sorted(lc.checkpointer.saved) == [1, 2]  # type: ignore[attr-defined]
