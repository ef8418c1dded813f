"""Export a lifecycle's history as a Chrome trace (chrome://tracing, Perfetto).

It reads transition records only, so the core imports it and not the other way round.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lifecycle.errors import LifecycleError, shorten
from lifecycle.logging import dumps, jsonable, open_log
from lifecycle.manifest import write_text_atomic
from lifecycle.phase import Observer, TransitionRecord
from lifecycle.table import DONE, FAIL

if TYPE_CHECKING:
    from lifecycle.stateful import Stateful


def chrome_trace_events(history: Iterable[TransitionRecord], *, role: str, rank: int) -> list[dict[str, Any]]:
    """Complete ('X') events, one per transition: process = rank, thread = role."""
    return process_events(role, rank) + [transition_event(record, rank) for record in history]


def process_events(role: str, rank: int) -> list[dict[str, Any]]:
    """The metadata events that name a trace's process (the rank) and thread (the role)."""
    return [
        {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
        {"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": role}},
    ]


def transition_event(record: TransitionRecord, rank: int) -> dict[str, Any]:
    """One transition as a complete ('X') event with its edge, step, outcome and figures (a NaN
    or an integer outside int64 as text: see `jsonable`)."""
    args: dict[str, Any] = {
        "src": record.src.name, "dst": record.dst.name, "step": record.step, "ok": record.ok,
        "path": " -> ".join(state.name for state in record.path),
    }
    if record.error:
        args["error"] = record.error
    args.update({k: jsonable(v) for k, v in record.figures.items() if isinstance(v, (str, int, float, bool))})
    return {
        "ph": "X", "name": record.trigger, "cat": "lifecycle", "pid": rank, "tid": 0,
        "ts": round(record.start * 1e6, 3), "dur": round(record.duration_s * 1e6, 3), "args": args,
    }


class EventLog:
    """A trace kept as JSON lines, one event appended and flushed at a time.

    Each event costs one small write however long the process runs, and a process killed
    mid-write loses at most the line it was writing (`read_events` skips it). Only a regular
    file is appended to (`open_log`): a FIFO, a folder or a symlink there is a `LifecycleError`.
    """

    def __init__(self, path: str | os.PathLike[str], *, role: str, rank: int) -> None:
        self._file = open_log(path)
        self.path = Path(path)
        for event in process_events(role, rank):
            self.append(event)

    def append(self, event: dict[str, Any]) -> None:
        self._file.write(dumps(event, plain) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TraceFile(Observer):
    """An observer (`add_observer` of any machine) that appends each transition to an `EventLog`
    as it happens, so a worker's trace outlives the worker when it is killed. Every phase's begin
    is an instant event (`<trigger> began`) too, `close` and the other phases without a working
    state included: a phase in flight when its process hung or was killed shows there, though
    its complete event never came."""

    def __init__(self, log: EventLog) -> None:
        self.log = log

    def on_state_change(self, lc: Stateful[Any], src: Enum, dst: Enum, trigger: str) -> None:
        if trigger not in (DONE, FAIL):  # the moves that end a phase: its complete event follows
            self.log.append({"ph": "i", "s": "t", "name": f"{trigger} began", "cat": "lifecycle.begin",
                             "pid": lc.rank, "tid": 0, "ts": round(time.time() * 1e6, 3),
                             "args": {"src": src.name, "state": dst.name}})

    def on_transition(self, lc: Stateful[Any], record: TransitionRecord) -> None:
        self.log.append(transition_event(record, lc.rank))


PLAIN_ITEMS = 1024
"""The most items of an array `plain` writes out; a larger one is quoted (bounded) instead."""


def plain(value: Any) -> Any:
    """A value JSON has no type for, as one it has: a numpy scalar or array (a step the
    application counted in numpy) as its number or list, an Enum as its name, anything else as
    its bounded repr, so no value can cost the whole trace."""
    if isinstance(value, Enum):
        return value.name
    tolist = getattr(value, "tolist", None)  # numpy scalars and arrays; a tensor's `tolist` is as plain
    numel = getattr(value, "numel", None)  # a tensor's `size` is its shape
    size = numel() if callable(numel) else getattr(value, "size", 1)
    if callable(tolist) and isinstance(size, int) and size <= PLAIN_ITEMS:
        try:
            return tolist()
        except Exception:  # noqa: BLE001 - one that fails is quoted instead
            return shorten(value, 200)
    return shorten(value, 200)


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of an `EventLog` file; a torn last line (its writer was killed), or any line
    that is no JSON object, is left out. Anything but a regular file (a FIFO would block the
    read for good) is an `OSError`, as a file that cannot be read is."""
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    events = []
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            event = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def write_trace_events(events: list[dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """A Chrome trace file, replaced atomically: a reader never sees half of one. Only a regular
    file (or nothing) at `path` is replaced: the rename would put a file in place of a device, a
    FIFO or a folder (as root, `/dev/null` itself); every failure is a `LifecycleError` naming it.
    The file is strict JSON (`dumps`): a NaN a worker's trace holds is written `"nan"`."""
    if not isinstance(path, (str, os.PathLike)):
        raise LifecycleError(f"a trace path must be a str or os.PathLike, got {type(path).__name__}")
    target = Path(path)
    try:
        found = target.stat() if target.exists() or target.is_symlink() else None
        if found is not None and not stat.S_ISREG(found.st_mode):
            raise LifecycleError(f"{target}: not a regular file (a device, a FIFO or a folder); a trace replaces "
                                 "only a file")
        target.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(target, dumps({"traceEvents": events, "displayTimeUnit": "ms"}, plain))
    except (OSError, ValueError, TypeError, RecursionError) as exc:
        raise LifecycleError(f"{target}: cannot write the trace: {exc}") from exc
    return target


def write_chrome_trace(
    history: Iterable[TransitionRecord], path: str | os.PathLike[str], *, role: str, rank: int
) -> Path:
    return write_trace_events(chrome_trace_events(history, role=role, rank=rank), path)
