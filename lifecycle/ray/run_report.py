"""What a driver run leaves: step records, failures, the merged trace, and a summary table.

Also the small batch helpers the driver uses to spread a step's prompts over its rollouts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lifecycle.trace import read_events, write_trace_events


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
    """Tear-down, rebuild, resume and the first sync."""


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
        return [r.metrics[name] for r in self.steps if name in r.metrics]


def fingerprint(value: Any) -> str:
    """A short digest of a batch of prompts (tensors by their bytes, anything else by its repr)."""
    digest = hashlib.sha256()
    if isinstance(value, torch.Tensor):
        digest.update(str((value.dtype, tuple(value.shape))).encode())
        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    else:
        digest.update(repr(value).encode())
    return digest.hexdigest()[:16]


def split_batch(prompts: Any, parts: int) -> list[Any]:
    """Split along the first dimension into `parts` nearly equal chunks (tensor or list)."""
    if parts == 1:
        return [prompts]
    if isinstance(prompts, torch.Tensor):
        return list(torch.tensor_split(prompts, parts))
    if isinstance(prompts, Sequence):
        size = -(-len(prompts) // parts)
        return [list(prompts[i:i + size]) for i in range(0, len(prompts), size)]
    raise TypeError(f"cannot split prompts of type {type(prompts).__name__} between {parts} rollouts")


def merge_batches(batches: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Join the rollouts' batches key by key: tensors concatenated, lists extended, numbers averaged."""
    if len(batches) == 1:
        return dict(batches[0])
    merged: dict[str, Any] = {}
    for key in batches[0]:
        values = [b[key] for b in batches]
        if isinstance(values[0], torch.Tensor):
            merged[key] = torch.cat(values)
        elif isinstance(values[0], list):
            merged[key] = [item for v in values for item in v]
        else:
            merged[key] = sum(values) / len(values)
    return merged


def merge_traces(folder: Path, out: Path, spans: Sequence[Mapping[str, Any]]) -> Path:
    """One Chrome trace: the driver's phases, then each worker incarnation as its own process row."""
    events: list[dict[str, Any]] = [_meta("process_name", 0, "driver"), _meta("thread_name", 0, "loop")]
    for span in spans:
        events.append({"ph": "X", "name": span["name"], "cat": "driver", "pid": 0, "tid": 0,
                       "ts": round(span["start"] * 1e6, 3), "dur": round((span["end"] - span["start"]) * 1e6, 3),
                       "args": {"step": span["step"], "incarnation": span["incarnation"]}})
    files = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
    for pid, path in enumerate(files, start=1):
        try:
            worker = read_events(path)
        except OSError:
            continue  # gone or unreadable: the summary goes on without that worker's row
        events += [_meta("process_name", pid, path.stem), _meta("process_sort_index", pid, pid)]
        events += [{**e, "pid": pid} for e in worker if e.get("ph") != "M" or e.get("name") == "thread_name"]
    return write_trace_events(events, out)


def _meta(name: str, pid: int, value: Any) -> dict[str, Any]:
    key = "sort_index" if name == "process_sort_index" else "name"
    return {"ph": "M", "name": name, "pid": pid, "tid": 0, "args": {key: value}}


def render_summary(summary: RunSummary, reward: str) -> str:
    """The end-of-run table: steps, reward, saves and syncs with their speeds, failures and resumes."""
    steps = summary.steps
    rewards = summary.metric(reward)
    rows = [("steps", f"{len(steps)} in the final run ({len(summary.attempts)} run, "
                      f"{len(summary.attempts) - len(steps)} redone after resuming); from step "
                      f"{summary.started_at + 1} to {steps[-1].step if steps else summary.started_at}")]
    if rewards:
        rows.append(("reward", f"{rewards[0]:.3f} at step {steps[0].step} -> {rewards[-1]:.3f} at step "
                               f"{steps[-1].step} (best {max(rewards):.3f})"))
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
    for f in summary.failures:
        rows.append(("failure", f"{f.worker} in {f.phase} of step {f.step}: {f.error[:70]}"))
        rows.append(("  resumed", f"at step {f.resumed_at} after {f.recovery_s:.1f} s "
                                  f"({max(0, f.step - 1 - (f.resumed_at or 0))} step(s) redone)"))
    rows.append(("wall time", f"{summary.wall_s:.1f} s"))
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 3 + max(len(v) for _, v in rows))
    return "\n".join([line, *(f"{k:<{width}} | {v}" for k, v in rows), line])


def _rate(size: int, seconds: float) -> str:
    return f"{size / seconds / 1e9:.3f} GB/s" if seconds > 0 else "n/a GB/s"


__all__ = ["Failure", "RunSummary", "StepRecord", "fingerprint", "merge_batches", "merge_traces", "render_summary",
           "split_batch"]
