"""Export a lifecycle's history as a Chrome trace (chrome://tracing, Perfetto)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from lifecycle.phase import Transition


def chrome_trace_events(history: Iterable[Transition], *, role: str, rank: int) -> list[dict[str, Any]]:
    """Complete ('X') events, one per transition: process = rank, thread = role."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
        {"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": role}},
    ]
    for record in history:
        args: dict[str, Any] = {
            "src": record.src.name, "dst": record.dst.name, "step": record.step, "ok": record.ok,
            "path": " -> ".join(state.name for state in record.path),
        }
        if record.error:
            args["error"] = record.error
        args.update({k: v for k, v in record.figures.items() if isinstance(v, (str, int, float, bool))})
        events.append({
            "ph": "X", "name": record.trigger, "cat": "lifecycle", "pid": rank, "tid": 0,
            "ts": round(record.start * 1e6, 3), "dur": round(record.duration_s * 1e6, 3), "args": args,
        })
    return events


def write_trace_events(events: list[dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """A Chrome trace file, replaced atomically: a reader never sees half of one."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    os.replace(tmp, target)
    return target


def write_chrome_trace(
    history: Iterable[Transition], path: str | os.PathLike[str], *, role: str, rank: int
) -> Path:
    return write_trace_events(chrome_trace_events(history, role=role, rank=rank), path)
