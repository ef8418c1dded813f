"""Trace and log files against hostile paths and values: a FIFO or a folder where the file should
be, figures JSON has no token for, bad `configure` arguments, and an earlier run's traces."""

from __future__ import annotations

import io
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import structlog

from lifecycle import ConfigError, Lifecycle, LifecycleError
from lifecycle.logging import configure, dumps
from lifecycle.ray.run_report import merge_traces
from lifecycle.ray.workers import WorkerSpec, setup_process
from lifecycle.rollout import RolloutWeights
from lifecycle.trace import EventLog, TraceFile, read_events
from lifecycle.watchdog import WATCHDOG


def _strict(text: str) -> Any:
    """`json.loads` as a browser's JSON.parse reads it: NaN and Infinity are no JSON."""
    def refuse(token: str) -> Any:
        raise ValueError(f"not JSON: {token}")
    return json.loads(text, parse_constant=refuse)


def _weights_with(**figures: Any) -> RolloutWeights:
    rw = RolloutWeights(lambda t: None)
    with rw.receiving() as landed:
        landed(1)
    with rw.generating(3) as phase:
        phase.figures.update(figures)
    return rw


@pytest.fixture
def _logging_restored() -> Any:
    backstop = WATCHDOG.backstop_s
    yield
    structlog.reset_defaults()
    WATCHDOG.backstop_s = backstop


# -- 1. a FIFO, a folder or a symlink where the event log or the worker's log file goes --------

def test_an_event_log_on_a_fifo_with_a_reader_is_refused_naming_the_file(tmp_path: Path) -> None:
    fifo = tmp_path / "actor-0-pid1.jsonl"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader: a plain open would not block, but write there
    try:
        with pytest.raises(LifecycleError, match="actor-0-pid1.jsonl.*FIFO"):
            EventLog(fifo, role="actor", rank=0)
    finally:
        os.close(reader)


def test_an_event_log_on_a_fifo_without_a_reader_is_refused_instead_of_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "actor-0-pid1.jsonl"
    os.mkfifo(fifo)
    outcome: list[BaseException | EventLog] = []

    def build() -> None:
        try:
            outcome.append(EventLog(fifo, role="actor", rank=0))
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "EventLog blocked on the FIFO"
    [error] = outcome
    assert isinstance(error, LifecycleError) and str(fifo) in str(error)


def test_an_event_log_on_a_folder_is_a_lifecycle_error_naming_it(tmp_path: Path) -> None:
    folder = tmp_path / "actor-0-pid1.jsonl"
    folder.mkdir()
    with pytest.raises(LifecycleError, match="actor-0-pid1.jsonl"):
        EventLog(folder, role="actor", rank=0)


def test_an_event_log_through_a_symlink_is_refused_and_its_target_left_alone(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.txt"
    target.write_text("keep\n")
    (tmp_path / "actor-0-pid1.jsonl").symlink_to(target)
    with pytest.raises(LifecycleError, match="actor-0-pid1.jsonl"):
        EventLog(tmp_path / "actor-0-pid1.jsonl", role="actor", rank=0)
    assert target.read_text() == "keep\n"


def test_an_event_log_still_appends_to_an_existing_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "actor-0-pid1.jsonl"
    path.write_text('{"ph": "X", "name": "earlier", "ts": 1, "dur": 1}\n')
    log = EventLog(path, role="actor", rank=0)
    log.close()
    assert [e["name"] for e in read_events(path)] == ["earlier", "process_name", "thread_name"]


@pytest.mark.usefixtures("_logging_restored")
@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_worker_log_file_that_is_a_fifo_or_a_folder_is_refused_naming_it(tmp_path: Path, kind: str) -> None:
    spec = WorkerSpec(role="actor", recipe=None, config={}, log_dir=str(tmp_path / "logs"))
    path = tmp_path / "logs" / f"{spec.file_stem}.jsonl"
    path.parent.mkdir()
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO with a reader: a plain open would not block
    try:
        with pytest.raises(LifecycleError, match=spec.file_stem):
            setup_process(spec)
    finally:
        os.close(reader)


@pytest.mark.usefixtures("_logging_restored")
def test_a_worker_log_file_gets_one_json_line_per_record(tmp_path: Path) -> None:
    spec = WorkerSpec(role="actor", recipe=None, config={}, log_dir=str(tmp_path / "logs"))
    setup_process(spec)
    structlog.get_logger().info("worker.hello", n=1)
    [line] = (tmp_path / "logs" / f"{spec.file_stem}.jsonl").read_text().splitlines()
    assert _strict(line)["event"] == "worker.hello"


# -- 2. close, a phase with no working state, shows its begin too ----------------------------

def test_close_writes_a_close_began_event_before_its_complete_event(lc: Lifecycle, tmp_path: Path) -> None:
    """A worker hung or killed in close (waiting on an async save, under `watchdog.close_s`)
    shows it was closing, not idle in READY."""
    path = tmp_path / "worker.jsonl"
    lc.add_observer(TraceFile(EventLog(path, role="actor", rank=0)))
    lc.init_load()
    lc.close()
    events = [(e["ph"], e["name"]) for e in read_events(path) if e["ph"] != "M"]
    assert events[-2:] == [("i", "close began"), ("X", "close")]
    assert read_events(path)[-2]["args"] == {"src": "READY", "state": "CLOSED"}


def test_each_phase_writes_exactly_one_begin_event(lc: Lifecycle, tmp_path: Path) -> None:
    path = tmp_path / "worker.jsonl"
    lc.add_observer(TraceFile(EventLog(path, role="actor", rank=0)))
    lc.init_load()
    with lc.train_step(1):
        pass
    lc.close()
    begun = [e["name"] for e in read_events(path) if e["ph"] == "i"]
    assert begun == ["init_load began", "train_step began", "close began"]


# -- 3 and 4. figures JSON has no token for, and ints past the digit limit ------------------

def test_a_nan_or_inf_figure_leaves_the_chrome_trace_strict_json(tmp_path: Path) -> None:
    rw = _weights_with(loss=float("nan"), grad_norm=float("inf"), low=float("-inf"))
    trace = _strict(rw.export_chrome_trace(tmp_path / "trace.json").read_text())
    [generate] = [e for e in trace["traceEvents"] if e.get("name") == "generate"]
    assert (generate["args"]["loss"], generate["args"]["grad_norm"], generate["args"]["low"]) == ("nan", "inf", "-inf")


def test_a_nan_figure_leaves_the_event_log_lines_strict_json(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    rw = RolloutWeights(lambda t: None)
    rw.add_observer(TraceFile(EventLog(path, role="rollout", rank=0)))
    with rw.receiving() as landed:
        landed(1)
    with rw.generating(3) as phase:
        phase.figures["loss"] = float("nan")
    lines = [_strict(line) for line in path.read_text().splitlines()]
    assert lines[-1]["name"] == "generate" and lines[-1]["args"]["loss"] == "nan"


def test_a_nan_read_back_from_an_old_worker_trace_is_merged_as_strict_json(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "actor-0-pid1.jsonl").write_text('{"ph": "X", "name": "save", "ts": 1, "dur": 2, "args": {"x": NaN}}\n')
    out = merge_traces(traces, tmp_path / "trace.json", [])
    [save] = [e for e in _strict(out.read_text())["traceEvents"] if e.get("name") == "save"]
    assert save["args"]["x"] == "nan"


def test_a_numpy_array_figure_holding_nan_is_written_as_strict_json(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    from lifecycle.trace import write_trace_events

    out = write_trace_events([{"ph": "i", "name": "x", "args": {"a": np.array([1.0, np.nan])}}], tmp_path / "t.json")
    assert _strict(out.read_text())["traceEvents"][0]["args"]["a"] == [1.0, "nan"]


@pytest.mark.usefixtures("_logging_restored")
def test_a_nan_or_inf_figure_leaves_a_json_log_line_strict_json() -> None:
    out = io.StringIO()
    configure(json=True, file=out)
    _weights_with(loss=float("nan"), grad_norm=float("-inf"))
    record = _strict(out.getvalue().splitlines()[-1])
    assert record["event"] == "lifecycle.transition" and (record["loss"], record["grad_norm"]) == ("nan", "-inf")


@pytest.mark.usefixtures("_logging_restored")
def test_an_int_past_the_digit_limit_in_a_json_log_line_is_shown_bounded() -> None:
    out = io.StringIO()
    configure(json=True, file=out)
    structlog.get_logger().info("big", tokens=10**5000, fine=2**40)
    record = _strict(out.getvalue())
    assert record["fine"] == 2**40 and isinstance(record["tokens"], str) and len(record["tokens"]) < 100


def test_an_int_figure_past_4300_digits_is_shown_bounded_and_the_trace_still_written(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    rw = RolloutWeights(lambda t: None)
    rw.add_observer(TraceFile(EventLog(path, role="rollout", rank=0)))
    with rw.receiving() as landed:
        landed(1)
    with rw.generating(9) as phase:
        phase.figures["tokens"] = 10**5000
        phase.figures["count"] = 12
    trace = _strict(rw.export_chrome_trace(tmp_path / "trace.json").read_text())
    [generate] = [e for e in trace["traceEvents"] if e.get("name") == "generate"]
    assert isinstance(generate["args"]["tokens"], str) and len(generate["args"]["tokens"]) < 100
    assert generate["args"]["count"] == 12
    assert [e["name"] for e in read_events(path) if e["ph"] == "X"] == ["receive_weights", "generate"]


def test_an_int_figure_outside_int64_is_shown_as_bounded_text_and_one_inside_as_a_number(tmp_path: Path) -> None:
    rw = _weights_with(big=2**63, small=-(2**63), edge=2**63 - 1)
    trace = _strict(rw.export_chrome_trace(tmp_path / "trace.json").read_text())
    [generate] = [e for e in trace["traceEvents"] if e.get("name") == "generate"]
    assert generate["args"]["big"] == str(2**63) and generate["args"]["small"] == -(2**63)
    assert generate["args"]["edge"] == 2**63 - 1


# -- 5. configure's arguments ---------------------------------------------------------------

def _closed() -> io.StringIO:
    stream = io.StringIO()
    stream.close()
    return stream


@pytest.mark.usefixtures("_logging_restored")
@pytest.mark.parametrize("kwargs, key", [
    ({"file": _closed()}, "file"),
    ({"file": "log.txt"}, "file"),
    ({"file": io.BytesIO()}, "file"),
    ({"level": None, "file": io.StringIO()}, "level"),
    ({"level": 15, "file": io.StringIO()}, "level"),
    ({"level": True, "file": io.StringIO()}, "level"),
    ({"level": "loud", "file": io.StringIO()}, "level"),
    ({"json": "no", "file": io.StringIO()}, "json"),
    ({"json": 1, "file": io.StringIO()}, "json"),
])
def test_configure_refuses_an_argument_it_cannot_use_with_a_config_error_naming_it(
    kwargs: dict[str, Any], key: str
) -> None:
    with pytest.raises(ConfigError) as info:
        configure(**kwargs)
    assert info.value.key == key


def test_configure_refuses_a_file_opened_for_reading(tmp_path: Path) -> None:
    (tmp_path / "log.txt").write_text("")
    with open(tmp_path / "log.txt", encoding="utf-8") as fh, pytest.raises(ConfigError) as info:
        configure(file=fh)
    assert info.value.key == "file"


@pytest.mark.usefixtures("_logging_restored")
@pytest.mark.parametrize("level", ["warning", "WARNING", logging.WARNING])
def test_configure_takes_a_level_as_a_number_or_a_name(level: Any) -> None:
    out = io.StringIO()
    configure(json=True, level=level, file=out)
    structlog.get_logger().info("quiet")
    structlog.get_logger().warning("loud")
    assert [_strict(line)["event"] for line in out.getvalue().splitlines()] == ["loud"]


# -- 6. an earlier run's worker traces in the same work_dir ---------------------------------

def _worker_trace(folder: Path, stem: str, at: float) -> None:
    folder.mkdir(exist_ok=True)
    path = folder / f"{stem}.jsonl"
    path.write_text(json.dumps({"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "rollout"}})
                    + "\n" + json.dumps({"ph": "X", "name": "generate", "ts": at * 1e6, "dur": 5}) + "\n")
    os.utime(path, (at, at))


def _rows(trace: Path) -> list[str]:
    """The process rows of a merged trace, in order."""
    return [e["args"]["name"] for e in _strict(trace.read_text())["traceEvents"] if e.get("name") == "process_name"]


def test_merge_traces_leaves_out_the_worker_traces_of_an_earlier_run_in_the_same_folder(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    now = time.time()
    _worker_trace(traces, "rollout0-0-pid1111", now - 3600)  # the run before, crashed, same work_dir
    _worker_trace(traces, "rollout0-0-pid2222", now + 1)
    spans = [{"name": "start", "step": 0, "start": now, "end": now + 2, "incarnation": 0}]
    out = merge_traces(traces, tmp_path / "trace.json", spans)
    rows = _rows(out)
    assert rows == ["driver", "rollout0-0-pid2222"]


def test_merge_traces_keeps_a_worker_trace_written_during_the_run_even_with_an_old_mtime(tmp_path: Path) -> None:
    """The file's own clock (a network filesystem's) may lag; its events' times say it is this run's."""
    traces = tmp_path / "traces"
    now = time.time()
    _worker_trace(traces, "actor-0-pid3333", now + 1)
    os.utime(traces / "actor-0-pid3333.jsonl", (now - 60, now - 60))
    spans = [{"name": "start", "step": 0, "start": now, "end": now + 2, "incarnation": 0}]
    out = merge_traces(traces, tmp_path / "trace.json", spans)
    rows = _rows(out)
    assert rows == ["driver", "actor-0-pid3333"]


def test_merge_traces_with_no_spans_or_transitions_merges_every_worker_trace(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    _worker_trace(traces, "rollout0-0-pid1111", time.time() - 3600)
    out = merge_traces(traces, tmp_path / "trace.json", [])
    rows = _rows(out)
    assert rows == ["driver", "rollout0-0-pid1111"]


def test_a_value_that_holds_itself_twice_is_written_bounded_in_about_its_size() -> None:
    """The second pass followed every path down 64 levels: a list holding itself twice took 2**64 steps."""
    twice: list[Any] = []
    twice += [twice, twice]
    done = threading.Event()
    out: list[str] = []
    worker = threading.Thread(target=lambda: (out.append(dumps({"x": twice}, str)), done.set()), daemon=True)
    worker.start()
    assert done.wait(30), "writing a self-containing value did not end"
    assert json.loads(out[0])["x"][0].startswith("[")


def test_a_nan_or_inf_dict_key_leaves_strict_json() -> None:
    assert json.loads(dumps({float("nan"): 1, float("-inf"): 2, "y": float("inf")}, str)) == {
        "nan": 1, "-inf": 2, "y": "inf"}
