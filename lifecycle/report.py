"""What `python -m lifecycle inspect` and `verify` print: the state of a checkpoint root."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from lifecycle.errors import CheckpointError
from lifecycle.manifest import read_manifest_file
from lifecycle.store import CheckpointStore


@dataclass(frozen=True, slots=True)
class RoleRow:
    """One role of one step, as inspect shows it."""

    step: int
    role: str
    problems: tuple[str, ...]
    contents: str = ""
    formats: str = ""
    size: int = 0
    files: int = 0

    @property
    def complete(self) -> bool:
        return not self.problems


def roles_on_disk(store: CheckpointStore) -> list[str]:
    """Every role any step holds: a step missing one of them is not complete."""
    found: set[str] = set()
    for step in store.steps():
        found.update(p.name for p in store.step_dir(step).iterdir() if p.is_dir() and not p.name.startswith("."))
    return sorted(found)


def role_row(store: CheckpointStore, step: int, role: str) -> RoleRow:
    folder = store.role_dir(step, role)
    if not folder.is_dir():
        return RoleRow(step, role, (f"{folder}: role folder missing",))
    problems = tuple(store.validate(step, role, deep=False))
    try:
        data = read_manifest_file(folder)
    except CheckpointError:
        return RoleRow(step, role, problems)
    contents = data["contents"]
    return RoleRow(
        step, role, problems,
        contents=",".join(contents),
        formats=contents.get("model", next(iter(contents.values()), {})).get("backend", ""),
        size=sum(f["size"] for f in data["files"]),
        files=len(data["files"]),
    )


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{size} B"
        value /= 1024
    return f"{size} B"


def inspect_root(root: Path, roles: list[str] | None, out: TextIO) -> int:
    """Print a table of steps and roles; 0 when the newest step is complete, else 1."""
    store = CheckpointStore(root)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint root")
    wanted = roles or roles_on_disk(store)
    rows = [role_row(store, step, role) for step in store.steps() for role in wanted]
    out.write(f"{'step':>8}  {'role':<10} {'complete':<8}  {'contents':<30} {'format':<10} {'size':>10} files\n")
    for row in rows:
        out.write(f"{row.step:>8}  {row.role:<10} {'yes' if row.complete else 'NO':<8}  {row.contents:<30} "
                  f"{row.formats:<10} {_human(row.size):>10} {row.files:>5}\n")
        for problem in row.problems:
            out.write(f"{'':>10}why: {problem}\n")
    newest = store.newest_committed(wanted) if wanted else None
    out.write(f"\nroles: {', '.join(wanted) or 'none'}; resume picks step: {newest}; ")
    try:
        tracker = store.read_tracker()
    except CheckpointError as exc:
        out.write(f"tracker: unreadable ({exc})\n")
        return 1
    note = "" if tracker is None or tracker == newest else " (resume ignores it: it reads the steps on disk)"
    out.write(f"tracker: {tracker}{note}\n")
    steps = store.steps()
    complete = bool(steps) and not any(row.problems for row in rows if row.step == newest)
    return 0 if complete and newest == steps[-1] else 1


class _ProgressLine:
    """A one-line progress display on a terminal; a single summary line otherwise."""

    def __init__(self, label: str, stream: TextIO) -> None:
        self.label = label
        self.stream = stream
        self.live = stream.isatty()
        self.started = time.perf_counter()
        self.total = 0

    def __call__(self, done: int, total: int) -> None:
        self.total = total
        if self.live:
            pct = 100 * done / total if total else 100.0
            self.stream.write(f"\r  {self.label}: {_human(done)} / {_human(total)} ({pct:5.1f}%)")
            self.stream.flush()

    def close(self, ok: bool) -> None:
        seconds = time.perf_counter() - self.started
        rate = self.total / seconds / 1e9 if seconds > 0 else 0.0
        prefix = "\r" if self.live else ""
        self.stream.write(f"{prefix}  {self.label}: {'ok' if ok else 'FAILED'}, {_human(self.total)} "
                          f"checked in {seconds:.2f} s ({rate:.2f} GB/s)\n")


def verify_root(root: Path, step: int | None, roles: list[str] | None, out: TextIO,
                err: TextIO = sys.stderr) -> int:
    """Deep-check sizes and checksums; 0 only when every checked role verifies."""
    store = CheckpointStore(root)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint root")
    steps = store.steps() if step is None else [step]
    if step is not None and step not in store.steps():
        raise CheckpointError(f"{store.step_dir(step)}: no such step")
    wanted = roles or roles_on_disk(store)
    if not steps or not wanted:
        out.write(f"{root}: nothing to verify\n")
        return 1
    failures = 0
    for number in steps:
        for role in wanted:
            progress = _ProgressLine(f"global_step_{number}/{role}", err)
            if not store.role_dir(number, role).is_dir():
                problems = [f"{store.role_dir(number, role)}: role folder missing"]
            else:
                problems = store.verify(number, role, progress)
            progress.close(not problems)
            for problem in problems:
                out.write(f"    {problem}\n")
            failures += bool(problems)
    out.write(f"{len(steps) * len(wanted) - failures} of {len(steps) * len(wanted)} role folders verified\n")
    return 0 if failures == 0 else 1
