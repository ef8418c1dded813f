"""What a driver run leaves: step records, failures, the merged trace, and a summary table.

Also the small batch helpers the driver uses to spread a step's prompts over its rollouts.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lifecycle.errors import LifecycleError, shorten
from lifecycle.phase import TransitionRecord
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
    """`text` as it is when a terminal shows it as such, else its bounded `repr`: a worker's error
    text (a file name in it) cannot set the clipboard or the title, or forge a row of the summary."""
    return text[:limit] if text.isprintable() else shorten(text, limit)


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        if isinstance(value, torch.Tensor):
            return float(value.item()) if value.numel() == 1 else None
        return float(value) if isinstance(value, numbers.Real) else None
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return None


def fingerprint(value: Any) -> str:
    """A short digest of a batch of prompts: equal prompts give equal digests, and prompts that
    differ anywhere (one element of a tensor or numpy array, one item of a list, tuple or dict
    of them) differ. Tensors and arrays go in by dtype, shape and bytes (bf16 and float8 too),
    containers item by item (a dict's order is no part of it), anything else by its repr."""
    digest = hashlib.sha256()
    _feed(digest, value, _DEPTH)
    return digest.hexdigest()[:16]


_DEPTH = 64
"""How deep `fingerprint` follows containers; deeper (a list holding itself), a bounded repr."""


def _feed(digest: Any, value: Any, depth: int) -> None:
    if depth <= 0:
        _tagged(digest, "deep", shorten(value).encode())
    elif isinstance(value, torch.Tensor):
        _tagged(digest, f"tensor {value.dtype} {tuple(value.shape)}", _tensor_bytes(value))
    elif isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)
        if array.dtype.hasobject:
            _tagged(digest, f"objects {array.shape}", b"")
            for item in array.ravel():
                _feed(digest, item, depth - 1)
        else:
            _tagged(digest, f"array {array.dtype!r} {array.shape}", np.ascontiguousarray(array).tobytes())
    elif isinstance(value, Mapping):
        _tagged(digest, f"{type(value).__qualname__} {len(value)}", b"")
        for pair in sorted(_sub(key, depth) + _sub(item, depth) for key, item in value.items()):
            digest.update(pair)
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):  # a list, tuple, deque
        numbers = _numbers(value)
        if numbers is not None:  # token ids: one array, not a walk item by item
            _tagged(digest, f"{type(value).__qualname__} of numbers {numbers.dtype!r} {numbers.shape}",
                    numbers.tobytes())
            return
        _tagged(digest, f"{type(value).__qualname__} {len(value)}", b"")
        for item in value:
            _feed(digest, item, depth - 1)
    else:
        _tagged(digest, type(value).__qualname__, _scalar_bytes(value))


def _numbers(value: Sequence[Any]) -> np.ndarray | None:
    """A sequence of plain numbers, or of equal-length sequences of them (token ids), as one
    numpy array; None for anything else (strings, ragged or mixed items, integers past 64 bits)."""
    first = value[0] if len(value) else None
    if not isinstance(first, (int, float, list, tuple)) or isinstance(first, bool):
        return None
    try:
        array = np.asarray(value)
    except (ValueError, TypeError, OverflowError):
        return None
    if array.dtype.kind == "f":  # exact only if no integer is past float64's 2**53: it would round, prompts collide
        leaves: Any = value
        for _ in range(array.ndim - 1):
            leaves = itertools.chain.from_iterable(leaves)
        if any(isinstance(leaf, (int, np.integer)) and not -2**53 <= leaf <= 2**53 for leaf in leaves):
            return None
    return array if array.dtype.kind in "biuf" else None


def _sub(value: Any, depth: int) -> bytes:
    digest = hashlib.sha256()
    _feed(digest, value, depth - 1)
    return digest.digest()


def _tagged(digest: Any, tag: str, data: bytes) -> None:
    """The tag and the data's length before the data: no two values feed the same bytes."""
    digest.update(f"{tag}\0{len(data)}\0".encode())
    digest.update(data)


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes, through a uint8 view (numpy has no bf16 or float8); a tensor with no plain
    storage to read (a meta or quantized one) by its repr."""
    try:
        flat = tensor.detach().cpu()
        flat = (flat.to_dense() if flat.layout != torch.strided else flat).contiguous().reshape(-1)
        return flat.view(torch.uint8).numpy().tobytes()
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return shorten(tensor, 10_000).encode()


def _scalar_bytes(value: Any) -> bytes:
    if isinstance(value, int) and not isinstance(value, bool):
        return hex(value).encode()  # any size (repr refuses integers past 4300 digits)
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    try:
        return repr(value).encode("utf-8", "surrogatepass")
    except Exception:  # noqa: BLE001 - a repr that fails still gets a digest
        return shorten(value).encode("utf-8", "surrogatepass")


def split_batch(prompts: Any, parts: int) -> list[Any]:
    """Split along the first dimension into `parts` nearly equal chunks (a tensor, a numpy
    array, or a sequence such as a list; a sequence into no more chunks than it has items, an
    empty one into one empty list); anything else is a `LifecycleError` naming its type."""
    if parts == 1:
        return [prompts]
    if isinstance(prompts, torch.Tensor) and prompts.dim() > 0:
        return list(torch.tensor_split(prompts, parts))
    if isinstance(prompts, np.ndarray) and prompts.ndim > 0:
        return list(np.array_split(prompts, parts))
    if isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)):
        items = list(prompts)  # a deque or a user's sequence need not slice
        if not items:
            return [[]]  # the first rollout gets the empty batch; the recipe decides what it means
        size = -(-len(items) // parts)
        return [items[i:i + size] for i in range(0, len(items), size)]
    raise LifecycleError(f"the policy's prompts are a {type(prompts).__name__}, which cannot be split between "
                         f"{parts} rollouts: return a tensor, a numpy array or a list (one item per prompt)")


def merge_batches(batches: Sequence[Any], names: Sequence[str] | None = None) -> dict[str, Any]:
    """Join the rollouts' batches key by key: tensors and numpy arrays concatenated, lists and
    tuples extended, real numbers (a rollout's mean) averaged. Batches that are no mappings of
    the same keys, a key whose values are of different kinds, or of any other kind (a string,
    a dict) are a `LifecycleError` naming the rollout and the key: nothing is joined by guess."""
    names = list(names) if names is not None else [f"rollout{i}" for i in range(len(batches))]
    for name, batch in zip(names, batches):
        if not isinstance(batch, Mapping):
            raise LifecycleError(f"{name}'s generate returned a {type(batch).__name__}; it returns a dict of the batch")
    if len(batches) == 1:
        return dict(batches[0])
    keys = list(batches[0])
    for name, batch in zip(names[1:], batches[1:]):
        if set(batch) != set(keys):
            raise LifecycleError(f"{name}'s batch has keys {sorted(map(str, batch))}, {names[0]}'s "
                                 f"{sorted(map(str, keys))}: every rollout returns the same keys")
    return {key: _joined(key, [batch[key] for batch in batches], names) for key in keys}


def _joined(key: Any, values: list[Any], names: Sequence[str]) -> Any:
    kinds = {_kind(value) for value in values}
    kind = kinds.pop() if len(kinds) == 1 else None
    try:
        if kind in ("tensor", "array"):
            _check_dtypes(key, values, names)
        if kind == "tensor":
            return torch.cat(values)
        if kind == "array":
            return np.concatenate(values)
        if kind == "list":
            return [item for value in values for item in value]
        if kind == "number":
            return sum(float(value) for value in values) / len(values)
    except (RuntimeError, ValueError, TypeError, OverflowError) as exc:  # shapes or dtypes that do not join
        raise LifecycleError(f"batch key {key!r}: the rollouts' values do not join: {type(exc).__name__}: "
                             f"{shorten(str(exc))}") from None
    found = ", ".join(f"{name}: {type(value).__name__}" for name, value in zip(names, values))
    raise LifecycleError(f"batch key {key!r} cannot be joined across rollouts ({found}): give tensors, numpy "
                         "arrays or lists (one item per sample), or real numbers (averaged)")


def _check_dtypes(key: Any, values: list[Any], names: Sequence[str]) -> None:
    """`LifecycleError` unless the dtype the tensors or arrays join as holds each of theirs exactly
    (int64 ids beside float32 would join as float32 and change past 2**24). Numbers join with
    numbers; any other kind (strings, dates, objects) only with its own: numpy would make text."""
    dtypes = [value.dtype for value in values]
    found = ", ".join(f"{name}: {dtype}" for name, dtype in zip(names, dtypes))
    if isinstance(values[0], np.ndarray) and len(kinds := {d.kind for d in dtypes}) > 1 and not kinds <= set("biufc"):
        raise LifecycleError(f"batch key {key!r}: the rollouts' arrays hold different kinds of values ({found}); "
                             "numbers join with numbers, and strings, dates or objects only with their own kind")
    joined = functools.reduce(torch.promote_types if isinstance(values[0], torch.Tensor) else np.promote_types, dtypes)
    if not all(_exact(dtype, joined) for dtype in dtypes):
        raise LifecycleError(f"batch key {key!r}: joining the rollouts' dtypes ({found}) as {joined} would change "
                             "values; return the same dtype from every rollout")


def _exact(src: Any, dst: Any) -> bool:
    """Every value of dtype `src` (torch's or numpy's) is one of `dst` too. numpy's 'safe' casting,
    which this follows otherwise, takes int64 to float64 (rounding past 2**53); `torch.can_cast`
    takes it even to float16."""
    if src == dst:
        return True
    if isinstance(src, torch.dtype):
        try:
            src, dst = (torch.empty(0, dtype=d).numpy().dtype for d in (src, dst))
        except (TypeError, RuntimeError):  # bf16, float8 (no numpy dtype): a float widens exactly to float32 and up
            return src == torch.bool or (src.is_floating_point and dst in _WIDE)
    rounds = src.kind in "iu" and dst.kind in "fc" and src.itemsize >= 8
    return bool(np.can_cast(src, dst, "safe")) and not rounds


_WIDE = (torch.float32, torch.float64, torch.complex64, torch.complex128)


def _kind(value: Any) -> str | None:
    if isinstance(value, torch.Tensor) and value.ndim == 0:  # a rollout's mean (`rewards.mean()`): a number
        return "number" if not (value.dtype.is_complex or value.dtype == torch.bool) else None
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return "number" if np.issubdtype(value.dtype, np.integer) or np.issubdtype(value.dtype, np.floating) else None
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, np.ndarray):
        return "array"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return "number"
    return None


def merge_traces(folder: Path, out: Path, spans: Sequence[Mapping[str, Any]],
                 transitions: Sequence[TransitionRecord] = (), overdue: Sequence[Overdue] = ()) -> Path:
    """One Chrome trace on one time line: the driver's loop phases (thread `loop`), its machine's
    transitions (thread `machine`) and the overdue reports it got, then each worker incarnation
    as its own process row."""
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
