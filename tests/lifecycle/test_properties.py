"""Random trigger sequences with random failures injected into the work."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from lifecycle import DELETE, TABLE, InvalidTransition, Lifecycle, State
from lifecycle.machine import ROWS
from lifecycle.testing import InjectedFailure, MemoryRollout, capture_transitions
from tests.lifecycle.probes import make_lifecycle

TRIGGERS = [row.trigger for row in TABLE]
REACHABLE = {State.CREATED} | {s for row in TABLE for s in (row.working, row.done, row.failed) if s}


class Target:
    def __init__(self) -> None:
        self.mode = "train"
        self.callback = print


def _expected(state: State, trigger: str, fails: bool) -> State | None:
    row = ROWS[trigger]
    if state not in row.sources:
        return None
    if row.working is None:
        return row.done
    return row.failed if fails else row.done


def _fire(lc: Lifecycle, trigger: str, work) -> None:  # type: ignore[no-untyped-def]
    if trigger == "train_step":
        with lc.train_step(lc.progress.step + 1):
            work()
        return
    lc.checkpointer.probe = work  # type: ignore[attr-defined]
    lc.engine.probe = work  # type: ignore[attr-defined]
    if trigger == "sync_weights":
        lc.sync_weights(MemoryRollout())
    else:
        getattr(lc, trigger)()


steps = st.lists(st.tuples(st.sampled_from(TRIGGERS), st.booleans(), st.booleans()), max_size=25)


@settings(max_examples=150, deadline=None)
@given(steps)
def test_random_sequences_follow_the_table_restore_everything_and_log_once(sequence) -> None:  # type: ignore[no-untyped-def]
    lc = make_lifecycle()
    target = Target()
    expected_records = 0
    with capture_logs() as logs, capture_transitions(lc) as cap:
        for trigger, fails, undo_fails in sequence:
            before = lc.state
            nothing_to_resume = (trigger == "resume" and before is State.FAILED and lc._trained
                                 and not lc.checkpointer.saved)  # type: ignore[attr-defined]
            want = _expected(before, trigger, fails or nothing_to_resume)  # that resume refuses: no fresh start

            def work(fails: bool = fails, undo_fails: bool = undo_fails) -> None:
                lc.temporarily(target, mode="eval", callback=DELETE)
                if undo_fails:
                    lc.on_exit(lambda: (_ for _ in ()).throw(OSError("undo failed")))
                if fails:
                    raise InjectedFailure("random")

            try:
                _fire(lc, trigger, work)
            except InvalidTransition:
                assert want is None and lc.state is before
                continue
            except Exception:  # noqa: BLE001 - the failure we injected, or the undo's
                pass
            expected_records += 1
            if ROWS[trigger].working is not None and undo_fails:
                want = ROWS[trigger].failed
            assert lc.state is want, (before, trigger, fails, undo_fails)
            assert lc.state in REACHABLE
            assert target.mode == "train" and target.callback is print
    records = [e for e in logs if e["event"] == "lifecycle.transition"]
    assert len(records) == expected_records == len(lc.history) == len(cap.records)
    assert all(r["ok"] == h.ok for r, h in zip(records, lc.history, strict=True))
