"""What a driver run leaves: step records, failures, the merged trace, and a summary table.

The batch helpers the driver uses to spread a step's prompts over its rollouts live in
`lifecycle.ray.batches`; they are named here too, where they were first.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lifecycle.errors import printable
from lifecycle.phase import TransitionRecord
from lifecycle.ray.batches import fingerprint, merge_batches, split_batch
from lifecycle.trace import read_events, transition_event, write_trace_events


@dataclass(kw_only=True, slots=True)
class StepRecord:
    """One run of one step (a step re-run after a failure has one record per run)."""

    step: int
    incarnation: int
    """Which build of the worker group ran it (0 first, +1 after each recovery)."""
    weights_version: int
    """Version of the policy weights the rollouts generated with."""
    prompts: str
    """Fingerprint of the step's prompts: equal runs of a step drew equal data."""
    metrics: dict[str, float] = field(default_factory=dict)
    """`role/name` -> value, from each role's update."""
    saved: list[dict[str, Any]] = field(default_factory=list)
    """Each trainer's save figures, when the step saved."""


@dataclass(kw_only=True, slots=True)
class Failure:
    """One caught failure and the recovery from it."""

    step: int
    phase: str
    worker: str
    error: str
    incarnation: int
    resumed_at: int | None = None
    """The step every role resumed from (0: a fresh start, nothing was complete)."""
    recovery_s: float = 0.0
    """Tear-down, rebuild, resume and the first sync, from when this failure was caught."""
    kind: str = ""
    """How the worker failed (`FailureKind`'s value: died, timed_out, raised)."""
    gave_up: bool = False
    """The policy gave up on it: the run ended ERRORED (a failure whose restart failed and was
    retried is resumed with the others, by the group that came up)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Overdue:
    """A worker's phase past its watchdog budget, as the driver learnt it while waiting on the worker."""

    worker: str
    trigger: str
    state: str
    step: int | None
    elapsed_s: float
    budget_s: float
    overdue: int
    """The budget multiple reached: 1 at the budget, 2 at twice it, ..."""
    where: str = ""
    """The innermost frame of the phase's thread."""
    at: float = 0.0
    """Wall-clock time the worker's watchdog reported it."""
    driver_phase: str = ""
    """The driver's loop phase (generate, train, sync...) while it waited."""

    @classmethod
    def from_report(cls, report: Mapping[str, Any], driver_phase: str) -> Overdue:
        """From a worker's `overdue_reports()` entry (the `lifecycle.phase_overdue` fields)."""
        return cls(worker=str(report["worker"]), trigger=str(report["trigger"]), state=str(report.get("state", "")),
                   step=report.get("step"), elapsed_s=float(report["elapsed_s"]), budget_s=float(report["budget_s"]),
                   overdue=int(report.get("overdue", 1)), where=str(report.get("where", "")),
                   at=float(report.get("at", 0.0)), driver_phase=driver_phase)

    def line(self) -> str:
        step = "" if self.step is None else f" of step {self.step}"
        return (f"{_shown(self.worker)} overdue in {_shown(self.trigger)}{step}: {self.elapsed_s:.1f} s so far, "
                f"{self.overdue}x its {self.budget_s:g} s budget")


@dataclass(kw_only=True, slots=True)
class RunSummary:
    """Everything `Driver.run()` saw."""

    started_at: int = 0
    """Step the run resumed from at its start (0: init-load)."""
    attempts: list[StepRecord] = field(default_factory=list)
    syncs: list[dict[str, Any]] = field(default_factory=list)
    saves: list[dict[str, Any]] = field(default_factory=list)
    """Committed saves reported by the last worker group at close (async saves included)."""
    failures: list[Failure] = field(default_factory=list)
    overdue: list[Overdue] = field(default_factory=list)
    """Worker phases past their watchdog budget, in the order the driver learnt of them."""
    spans: list[dict[str, Any]] = field(default_factory=list)
    """The driver's own phases, for the trace."""
    wall_s: float = 0.0
    trace: Path | None = None

    @property
    def steps(self) -> list[StepRecord]:
        """The run's trajectory: for each step, its last run (earlier ones were rolled back)."""
        final: dict[int, StepRecord] = {}
        for record in self.attempts:
            final[record.step] = record
            for later in [s for s in final if s > record.step]:
                del final[later]
        return [final[s] for s in sorted(final)]

    def metric(self, name: str) -> list[float]:
        """The metric's value at each step that reported it as a real number (a Python or numpy
        scalar, a one-element tensor); a value of any other kind is left out."""
        return [value for r in self.steps if name in r.metrics and (value := _number(r.metrics[name])) is not None]


def _shown(text: str, limit: int = 80) -> str:
    """`text` cut to `limit` characters, each one a terminal would act on escaped (`printable`): a
    worker's error text (a file name in it) cannot set the clipboard or the title, or forge a row
    of the summary."""
    return printable(text[:limit])


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        if isinstance(value, torch.Tensor):
            return float(value.item()) if value.numel() == 1 else None
        return float(value) if isinstance(value, numbers.Real) else None
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return None


def merge_traces(folder: Path, out: Path, spans: Sequence[Mapping[str, Any]],
                 transitions: Sequence[TransitionRecord] = (), overdue: Sequence[Overdue] = ()) -> Path:
    """One Chrome trace on one time line: the driver's loop phases (thread `loop`), its machine's
    transitions (thread `machine`) and the overdue reports it got, then each worker incarnation
    as its own process row. A worker file of an earlier run in the same folder (a job restarted
    in its work_dir) is left out: see `_of_this_run`."""
    events: list[dict[str, Any]] = [_meta("process_name", 0, "driver"), _meta("thread_name", 0, "loop"),
                                    {**_meta("thread_name", 0, "machine"), "tid": 1}]
    for span in spans:
        events.append({"ph": "X", "name": span["name"], "cat": "driver", "pid": 0, "tid": 0,
                       "ts": round(span["start"] * 1e6, 3), "dur": round((span["end"] - span["start"]) * 1e6, 3),
                       "args": {"step": span["step"], "incarnation": span["incarnation"]}})
    events += [{**transition_event(record, 0), "tid": 1} for record in transitions]
    events += [{"ph": "i", "s": "p", "name": f"overdue {o.worker} {o.trigger}", "cat": "overdue", "pid": 0, "tid": 0,
                "ts": round(o.at * 1e6, 3), "args": {"elapsed_s": o.elapsed_s, "budget_s": o.budget_s,
                                                     "step": o.step, "where": o.where}} for o in overdue]
    starts = [span["start"] for span in spans] + [record.start for record in transitions]
    since = min(starts) if starts else None
    files = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
    pid = 0
    for path in files:
        try:
            worker = read_events(path)
            if not _of_this_run(path, worker, since):
                continue
        except OSError:
            continue  # gone or unreadable: the summary goes on without that worker's row
        pid += 1
        events += [_meta("process_name", pid, path.stem), _meta("process_sort_index", pid, pid)]
        events += [{**e, "pid": pid} for e in worker if e.get("ph") != "M" or e.get("name") == "thread_name"]
    return write_trace_events(events, out)


def _of_this_run(path: Path, events: Sequence[Mapping[str, Any]], since: float | None) -> bool:
    """Whether a worker's trace file was written by the run that started at `since` (None: the
    run's start is unknown, every file is). A worker writes its file after the run started: a file
    last modified before then, none of whose events is timed since, is an earlier run's. An
    event's own time counts as well as the file's, whose clock (a network filesystem's) may lag."""
    if since is None or path.stat().st_mtime >= since:
        return True
    return any(isinstance(ts := event.get("ts"), (int, float)) and not isinstance(ts, bool) and ts >= since * 1e6
               for event in events)


def _meta(name: str, pid: int, value: Any) -> dict[str, Any]:
    key = "sort_index" if name == "process_sort_index" else "name"
    return {"ph": "M", "name": name, "pid": pid, "tid": 0, "args": {key: value}}


def render_summary(summary: RunSummary, reward: str) -> str:
    """The end-of-run table: steps, reward, saves and syncs with their speeds, failures and resumes."""
    steps = summary.steps
    points = [(r.step, value) for r in steps if (value := _number(r.metrics.get(reward))) is not None]
    rows = [("steps", f"{len(steps)} in the final run ({len(summary.attempts)} run, "
                      f"{len(summary.attempts) - len(steps)} redone after resuming); from step "
                      f"{summary.started_at + 1} to {steps[-1].step if steps else summary.started_at}")]
    if points:
        rows.append(("reward", f"{points[0][1]:.3f} at step {points[0][0]} -> {points[-1][1]:.3f} at step "
                               f"{points[-1][0]} (best {max(value for _, value in points):.3f})"))
    for role in sorted({s["role"] for s in summary.saves}):
        mine = [s for s in summary.saves if s["role"] == role]
        size, secs = sum(s["bytes"] for s in mine), sum(s["seconds"] for s in mine)
        stalls = sorted(s["seconds"] for r in steps for s in r.saved if s["role"] == role)
        mode = "async: host copy only" if any(s.get("async") for r in steps for s in r.saved) else "sync"
        stall = f"; training stalled {1e3 * stalls[len(stalls) // 2]:.1f} ms per save ({mode})" if stalls else ""
        rows.append((f"saves {role}", f"{len(mine)} committed by the last workers, {size / 1e6:.1f} MB, "
                                      f"write + commit {_rate(size, secs)}{stall}"))
    size, secs = sum(s["bytes"] for s in summary.syncs), sum(s["seconds"] for s in summary.syncs)
    rows.append(("syncs", f"{len(summary.syncs)}, {size / 1e6:.1f} MB, {_rate(size, secs)}, "
                          f"last weights v{summary.syncs[-1]['version'] if summary.syncs else 0}"))
    for o in summary.overdue[:5]:
        rows.append(("overdue", o.line()))
    if len(summary.overdue) > 5:
        rows.append(("overdue", f"... {len(summary.overdue) - 5} more"))
    for f in summary.failures:
        rows.append(("failure", f"{_shown(f.worker)} in {_shown(f.phase)} of step {f.step}: {_shown(f.error, 70)}"))
        if f.gave_up:
            rows.append(("  gave up", "no restart"))
            continue
        if f.resumed_at is None:
            rows.append(("  not resumed", "the run ended before a restart came up"))
            continue
        rows.append(("  resumed", f"at step {f.resumed_at} after {f.recovery_s:.1f} s "
                                  f"({max(0, f.step - 1 - f.resumed_at)} step(s) redone)"))
    rows.append(("wall time", f"{summary.wall_s:.1f} s"))
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 3 + max(len(v) for _, v in rows))
    return "\n".join([line, *(f"{k:<{width}} | {v}" for k, v in rows), line])


def _rate(size: int, seconds: float) -> str:
    return f"{size / seconds / 1e9:.3f} GB/s" if seconds > 0 else "n/a GB/s"


__all__ = ["Failure", "Overdue", "RunSummary", "StepRecord", "fingerprint", "merge_batches", "merge_traces", "render_summary",
           "split_batch"]
