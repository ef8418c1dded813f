"""One structured record per transition, context for records inside a phase, and exports."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import structlog
import torch
from structlog.testing import capture_logs

from lifecycle import InvalidTransition, Lifecycle, State
from lifecycle.logging import configure
from lifecycle.testing import InjectedFailure, MemoryRollout
from lifecycle.trace import EventLog, TraceFile, read_events

FIELDS = {"trigger", "src", "dst", "role", "rank", "step", "duration_s", "ok"}


def _transitions(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e["event"] == "lifecycle.transition"]


def test_each_transition_logs_exactly_one_record_with_the_contract_fields(lc: Lifecycle) -> None:
    with capture_logs() as logs:
        lc.init_load()
        with lc.train_step(1):
            pass
        lc.save(1)
        lc.sync_weights(MemoryRollout())
        lc.close()
    records = _transitions(logs)
    assert [r["trigger"] for r in records] == ["init_load", "train_step", "save", "sync_weights", "close"]
    for record in records:
        assert FIELDS <= record.keys()
        assert record["ok"] is True and "error" not in record and record["log_level"] == "info"
        assert record["role"] == "actor" and record["rank"] == 0
    assert records[1]["step"] == 1 and records[1]["src"] == "READY" and records[1]["dst"] == "READY"
    assert records[3]["version"] == 1 and records[3]["bytes"] > 0


def test_a_failed_transition_logs_one_error_record_naming_the_error(lc: Lifecycle) -> None:
    lc.init_load()
    lc.checkpointer.fail_next("save")  # type: ignore[attr-defined]
    with capture_logs() as logs, pytest.raises(InjectedFailure):
        lc.save(3)
    (record,) = _transitions(logs)
    assert record["ok"] is False and record["log_level"] == "error"
    assert record["dst"] == "FAILED" and "injected failure at 'save'" in record["error"]


def test_an_invalid_trigger_logs_no_transition(lc: Lifecycle) -> None:
    with capture_logs() as logs, pytest.raises(InvalidTransition):
        lc.save(1)
    assert _transitions(logs) == []


def test_records_emitted_inside_a_phase_carry_role_rank_and_step() -> None:
    from tests.lifecycle.probes import make_lifecycle

    lc = make_lifecycle(rank=3, world_size=4)
    lc.init_load()
    lc.checkpointer.probe = lambda: structlog.get_logger().info("backend.wrote", files=2)  # type: ignore[attr-defined]
    out = io.StringIO()
    configure(json=True, file=out)
    try:
        lc.save(9)
    finally:
        structlog.reset_defaults()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    wrote = next(line for line in lines if line["event"] == "backend.wrote")
    assert (wrote["role"], wrote["rank"], wrote["step"]) == ("actor", 3, 9)
    after = next(line for line in lines if line["event"] == "lifecycle.transition")
    assert after["step"] == 9 and "timestamp" in after
    assert structlog.contextvars.get_contextvars() == {}


def test_configure_writes_json_lines_when_asked_and_console_otherwise() -> None:
    json_out, console_out = io.StringIO(), io.StringIO()
    try:
        configure(json=True, file=json_out)
        structlog.get_logger().info("hello", n=1)
        configure(json=False, file=console_out)
        structlog.get_logger().info("hello", n=1)
    finally:
        structlog.reset_defaults()
    assert json.loads(json_out.getvalue())["n"] == 1
    assert "hello" in console_out.getvalue() and not console_out.getvalue().startswith("{")


def test_configure_picks_json_when_the_stream_is_not_a_terminal() -> None:
    out = io.StringIO()
    try:
        configure(file=out)
        structlog.get_logger().info("auto")
    finally:
        structlog.reset_defaults()
    assert json.loads(out.getvalue())["event"] == "auto"


def test_importing_the_library_does_not_configure_logging() -> None:
    code = "import structlog, lifecycle, lifecycle.testing; print(structlog.is_configured())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_an_event_log_appends_each_transition_and_a_torn_last_line_is_left_out(
    lc: Lifecycle, tmp_path: Path
) -> None:
    path = tmp_path / "worker.jsonl"
    log = EventLog(path, role="actor", rank=3)
    lc.init_load()
    lc.add_observer(TraceFile(log))
    for step in (1, 2):
        before = path.read_bytes()
        with lc.train_step(step):
            pass
        assert path.read_bytes().startswith(before) and path.stat().st_size > len(before)
    log.close()
    with open(path, "a", encoding="utf-8") as fh:
        fh.write('{"ph": "X", "name": "sa')  # a writer killed half-way through its line
    events = read_events(path)
    assert [e["args"]["name"] for e in events if e["ph"] == "M"] == ["rank 3", "actor"]
    assert [(e["name"], e["args"]["step"]) for e in events if e["ph"] == "X"] == [("train_step", 1), ("train_step", 2)]


def test_an_event_log_shows_a_phase_in_flight_by_its_begin_event(lc: Lifecycle, tmp_path: Path) -> None:
    """A worker killed or hung inside a phase never writes its complete event; the begin, written
    as the phase starts, says which phase it was in."""
    path = tmp_path / "worker.jsonl"
    log = EventLog(path, role="actor", rank=0)
    lc.add_observer(TraceFile(log))
    lc.init_load()
    with lc.train_step(1):
        events = read_events(path)  # what a process killed here leaves
        assert [(e["ph"], e["name"]) for e in events if e["ph"] != "M"] == \
            [("i", "init_load began"), ("X", "init_load"), ("i", "train_step began")]
        assert events[-1]["args"] == {"src": "READY", "state": "TRAINING"}
    log.close()
    assert [e["name"] for e in read_events(path) if e["ph"] != "M"][-1] == "train_step"


def test_chrome_trace_has_one_complete_event_per_transition(lc: Lifecycle, tmp_path: Path) -> None:
    lc.init_load()
    with lc.train_step(1):
        pass
    lc.checkpointer.fail_next("save")  # type: ignore[attr-defined]
    with pytest.raises(InjectedFailure):
        lc.save(1)
    path = lc.export_chrome_trace(tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in events] == ["init_load", "train_step", "save"]
    for event in events:
        assert {"ts", "dur", "pid", "tid", "args"} <= event.keys() and event["dur"] >= 0
    assert events[0]["ts"] <= events[1]["ts"] <= events[2]["ts"]
    assert events[2]["args"]["ok"] is False and "SAVING" in events[2]["args"]["path"]
    assert lc.state is State.FAILED


def test_a_trace_never_replaces_what_is_not_a_regular_file(lc: Lifecycle, tmp_path: Path) -> None:
    """The atomic rename put a file in place of a FIFO or a device node (as root, /dev/null
    itself); a folder or None raised raw errors."""
    import os
    import stat

    from lifecycle.errors import LifecycleError

    lc.init_load()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    (tmp_path / "to-fifo").symlink_to(tmp_path / "fifo")
    for target in ("fifo", "folder", "to-fifo"):
        with pytest.raises(LifecycleError, match="not a regular file"):
            lc.export_chrome_trace(tmp_path / target)
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode) and (tmp_path / "folder").is_dir()
    with pytest.raises(LifecycleError, match="must be a str or os.PathLike, got NoneType"):
        lc.export_chrome_trace(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("mode", "reason"), [("disable", "resume.mode is disable"),
                                              ("auto", "no complete checkpoint")])
def test_a_resume_that_restores_nothing_logs_why_and_the_mode(tmp_path: Path, mode: str, reason: str) -> None:
    lc = Lifecycle({"checkpoint": {"root": str(tmp_path)}, "resume": {"mode": mode}}, model=torch.nn.Linear(2, 2))
    with capture_logs() as logs:
        assert lc.resume() is None
    lc.close()
    none = [e for e in logs if e["event"] == "checkpoint.resume.none"]
    fallback = [e for e in logs if e["event"] == "lifecycle.resume_fallback"]
    assert [e["reason"] for e in none] == [reason]
    assert [(e["mode"], e["action"]) for e in fallback] == [(mode, "init_load")]
