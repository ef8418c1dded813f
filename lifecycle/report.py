"""What `python -m lifecycle inspect` and `verify` print: the state of a checkpoint root.

A root can hold anything: half-written steps, steps set aside as damaged, folders a person
made, files nobody can read. Both commands report what they cannot read and go on; runs of
junk collapse into a summary line, so the output stays bounded; the exit status is non-zero
when anything is wrong.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from lifecycle.boundary import kind, lstat, os_error, parse_step, role_problem, step_name_problem
from lifecycle.errors import CheckpointError
from lifecycle.manifest import MANIFEST, read_manifest_file
from lifecycle.retention import REPLACED, STAGING, TRASH, only_copy, orphaned, replaced_copies
from lifecycle.store import TRACKER, CheckpointStore
from lifecycle.writer_lock import LOCK_PREFIX


class Out(Protocol):
    """Where a report goes: a text stream (`sys.stdout`), or one that escapes what it shows (the CLI's)."""

    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...

    def isatty(self) -> bool: ...


MAX_LINES = 20
"""Lines of one kind (junk entries, problems of one role) shown before a summary line."""
MAX_ROWS = 200
"""Rows of the steps x roles table `inspect` prints at most, the newest; the rest are counted."""
_HOUSEKEEPING = (TRACKER, f".{TRACKER}.tmp-", LOCK_PREFIX, TRASH, REPLACED)


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
    committed: bool = False
    """Its manifest was read: a committed folder, so any problem is damage, not a save that
    never finished (which an older step may show after a crash)."""

    @property
    def complete(self) -> bool:
        return not self.problems

    @property
    def damaged(self) -> bool:
        return self.committed and bool(self.problems)


@dataclass(slots=True)
class Survey:
    """What a root holds, read without trusting any of it."""

    steps: list[int] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)
    """Steps resume set aside (`global_step_N.damaged-<time>`)."""
    superseded: list[str] = field(default_factory=list)
    """Steps a rollback set aside (`global_step_N.superseded-<time>`)."""
    wrong: list[str] = field(default_factory=list)
    """Entries that look like checkpoint data but cannot be one (padded names, symlinks, unreadable)."""
    ignored: list[str] = field(default_factory=list)
    """Entries that are none of this library's business."""
    replaced: list[str] = field(default_factory=list)
    """Role folders a re-commit moved aside (`root/.replaced-*`) and left there."""
    staging: list[str] = field(default_factory=list)
    """Staging folders (`global_step_N/.staging-<role>`): a save in progress, or a crash's leftover."""
    incomplete: list[str] = field(default_factory=list)
    """Role folders missing from a step older than the one resume picks: never committed, or pruned
    by that role's own retention (see `older_gap`); shown, not wrong."""
    removed: list[str] = field(default_factory=list)
    """Steps and role folders that went while they were read (retention, a rollback): not damage."""


def survey(store: CheckpointStore, roles: list[str] | None) -> Survey:
    """Every step, the roles they hold, and what else is in the root; nothing here raises for
    a bad entry (only for a root that cannot be listed at all)."""
    found = Survey(steps=store.steps(), damaged=store.quarantined(), superseded=store.superseded())
    for entry in sorted(store.entries(), key=lambda e: e.name):
        name = entry.name
        if parse_step(name) is not None:
            if not _is_dir(entry):
                found.wrong.append(f"{entry.path}: a {_kind(entry)}, not a step folder; not followed")
        elif name in found.damaged or name in found.superseded:
            continue
        elif problem := step_name_problem(name):
            found.wrong.append(f"{entry.path}: {problem}")
        elif not name.startswith(_HOUSEKEEPING):
            found.ignored.append(f"{entry.path}: not a checkpoint entry; ignored")
    seen: set[str] = set()
    stray: list[tuple[str, str]] = []
    """Folders of role names that no step holds a manifest in: none of a save's (a role folder
    appears with its manifest, by the commit's rename), so they name no role."""
    for step in found.steps:
        try:
            entries = sorted(os.scandir(store.step_dir(step)), key=lambda e: e.name)
        except FileNotFoundError:
            found.removed.append(f"{store.step_dir(step)}: removed while it was read")
            continue
        except OSError as exc:
            found.wrong.append(str(os_error(exc, "cannot list", store.step_dir(step))))
            continue
        for entry in entries:
            if entry.name.startswith("."):
                if entry.name.startswith(STAGING) and role_problem(entry.name.removeprefix(STAGING)) is None:
                    found.staging.append(_staging_note(entry))
                continue
            if role_problem(entry.name):
                found.wrong.append(f"{entry.path}: not a role name; ignored")
            elif not _is_dir(entry):
                found.wrong.append(f"{entry.path}: a {_kind(entry)}, not a role folder; not followed")
            else:
                if _holds_manifest(entry):
                    seen.add(entry.name)
                else:
                    stray.append((entry.name, entry.path))
    found.roles = roles or sorted(seen)
    found.wrong += [f"{path}: a folder no save committed (no manifest in any step): junk, or a role whose every "
                    "step lost its manifest (a job with that role would start fresh); name it with --roles to "
                    "check it as one" for name, path in stray if name not in found.roles]
    found.replaced = [f"{path}: {_replaced_note(store, step, role)}" for step, role, path in replaced_copies(store)]
    return found


def _replaced_note(store: CheckpointStore, step: int, role: str) -> str:
    try:
        gone = orphaned(store, step)
    except CheckpointError:
        gone = False
    if gone:
        return f"orphaned: a replaced copy of step {step}, role {role}, whose step is gone; the next save removes it"
    if only_copy(store, step, role):
        return (f"the only committed copy of step {step}, role {role} (a re-commit was interrupted between its "
                "renames); the next resume, or save, of that role puts it back")
    return f"a replaced copy of step {step}, role {role}; the next save removes it"


def _staging_note(entry: os.DirEntry[str]) -> str:
    role = entry.name.removeprefix(STAGING)
    what = ("holds a manifest: the copy a re-commit replaced (a crash right after the swap), or a save killed "
            "just before its commit" if _holds_manifest(entry) else "a save in progress, or one a crash cut short")
    return f"{entry.path}: {what}; the next resume, or save, of role {role} removes it"


def older_gap(store: CheckpointStore, step: int, role: str, newest: int | None) -> str | None:
    """Why `role`'s folder of `step` is missing without being wrong: the step is older than
    `newest` (the one resume picks), so the role never committed it (a crash between roles) or
    its own retention pruned it first (a role that saves first holds one folder more than its
    `keep_last` until its next save, never removing another role's folder). None otherwise."""
    try:
        if newest is None or step >= newest or lstat(store.role_dir(step, role)) is not None:
            return None
    except CheckpointError:
        return None  # a folder that cannot be examined: the check reports it
    return f"{store.role_dir(step, role)}: not committed (an older step than {newest}, which resume picks)"


def checked(store: CheckpointStore, step: int, role: str,
            check: Callable[[int, str], list[str]]) -> tuple[list[str], bool]:
    """`check(step, role)` of one role folder, and whether that folder (or its step, listed a
    moment before) went while it was checked: retention, a rollback or a fallback moved it, which
    is no damage. A folder that changed while checked (a re-commit) is checked once more; one
    missing from the start stays a problem."""
    first = now = store.identity(step, [role])
    for _ in range(2):
        before = now
        problems = check(step, role)
        now = store.identity(step, [role])
        if not problems or now == before:
            break
    gone = bool(problems) and now == (None,) and (first != now or not os.path.lexists(store.step_dir(step)))
    return problems, gone


def _holds_manifest(entry: os.DirEntry[str]) -> bool:
    """Whether a role folder holds a manifest; True when that cannot be told (no permission):
    such a folder is reported as damaged, not left out."""
    try:
        return lstat(Path(entry.path) / MANIFEST) is not None
    except CheckpointError:
        return True


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _kind(entry: os.DirEntry[str]) -> str:
    try:
        return kind(entry.stat(follow_symlinks=False).st_mode)
    except OSError:
        return "file that cannot be examined"


def role_row(store: CheckpointStore, step: int, role: str, found: Survey) -> RoleRow | None:
    """One row of the table; None, noted in `found.removed`, for a folder that went while read."""
    listed, gone = checked(store, step, role, partial(store.validate, deep=False))
    if gone:
        found.removed.append(f"{store.role_dir(step, role)}: removed while it was read")
        return None
    problems = tuple(listed)
    try:
        data = read_manifest_file(store.role_dir(step, role))
    except CheckpointError:
        return RoleRow(step, role, problems)
    contents = data["contents"]
    return RoleRow(
        step, role, problems,
        contents=",".join(contents),
        formats=contents.get("model", next(iter(contents.values()), {})).get("backend", ""),
        size=sum(f["size"] for f in data["files"]),
        files=len(data["files"]),
        committed=True,
    )


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{size} B"
        value /= 1024
    return f"{size} B"


def _bounded(lines: list[str], out: Out, indent: str, what: str) -> None:
    for line in lines[:MAX_LINES]:
        out.write(f"{indent}{line}\n")
    if len(lines) > MAX_LINES:
        out.write(f"{indent}... and {len(lines) - MAX_LINES} more {what}\n")


def _root_notes(found: Survey, out: Out) -> None:
    for lines, title, what in (
        (found.damaged, "set aside as damaged ({}; resume never reads them; inspect, then remove)", "damaged steps"),
        (found.superseded, "superseded by a rollback ({}; resume never reads them)", "superseded steps"),
        (found.replaced, "left aside by a re-commit ({})", "replaced folders"),
        (found.staging, "staging folders ({}; saves in progress, or left by a crash; not damage)", "staging folders"),
        (found.incomplete, "incomplete older steps ({}; not wrong)", "missing role folders"),
        (found.removed, "removed while being read ({}; retention or a rollback at work; not damage)", "removed"),
        (found.wrong, "wrong ({})", "wrong entries"),
        (found.ignored, "ignored ({})", "ignored entries"),
    ):
        if lines:
            out.write(title.format(len(lines)) + ":\n")
            _bounded(lines, out, "  ", what)


def _open_root(root: Path) -> CheckpointStore:
    if not root.is_dir():
        found = lstat(root)
        what = "no such checkpoint root" if found is None else f"a {kind(found.st_mode)}, not a checkpoint root folder"
        raise CheckpointError(f"{root}: {what}")
    return CheckpointStore(root)


def inspect_root(root: Path, roles: list[str] | None, out: Out) -> int:
    """Print a table of steps and roles; 0 when the newest step is complete, no committed role
    folder of any step is damaged and nothing in the root is wrong, else 1."""
    store = _open_root(root)
    found = survey(store, roles)
    rows = [row for step in found.steps for role in found.roles if (row := role_row(store, step, role, found))]
    out.write(f"{'step':>8}  {'role':<10} {'complete':<8}  {'contents':<30} {'format':<10} {'size':>10} files\n")
    if len(rows) > MAX_ROWS:  # the newest rows: what resume reads; the older ones only counted
        older, shown = rows[:-MAX_ROWS], rows[-MAX_ROWS:]
        out.write(f"{'...':>8}  {len(older)} older rows not shown ({sum(not r.complete for r in older)} of them "
                  f"incomplete, {sum(r.damaged for r in older)} damaged)\n")
    else:
        shown = rows
    for row in shown:
        out.write(f"{row.step:>8}  {row.role:<10} {'yes' if row.complete else 'NO':<8}  {row.contents:<30} "
                  f"{row.formats:<10} {_human(row.size):>10} {row.files:>5}\n")
        _bounded([f"why: {p}" for p in row.problems], out, " " * 10, "problems")
    _root_notes(found, out)
    try:
        newest = store.newest_committed(found.roles) if found.roles else None
    except CheckpointError as exc:  # a role folder it cannot search: resume stops there too
        out.write(f"\nroles: {', '.join(found.roles)}; resume stops: {exc}\n")
        return 1
    out.write(f"\nroles: {', '.join(found.roles) or 'none'}; resume picks step: {newest}; ")
    try:
        tracker = store.read_tracker()
    except CheckpointError as exc:
        out.write(f"tracker: unreadable ({exc})\n")
        return 1
    lost = tracker is not None and tracker not in found.steps and tracker not in store.steps()  # or saved since
    if lost:
        note = (" (WRONG: no such step on disk; this library's resume reads the steps on disk, but a trainer "
                "that reads the tracker, as verl does, would start fresh)")
    else:
        note = "" if tracker is None or tracker == newest else " (resume ignores it: it reads the steps on disk)"
    out.write(f"tracker: {tracker}{note}\n")
    there = [step for step in found.steps if os.path.lexists(store.step_dir(step))]
    complete = bool(there) and not any(row.problems for row in rows if row.step == newest)
    damaged = any(row.damaged for row in rows)  # an older committed step too: a fallback would need it
    fine = complete and newest == there[-1] and not damaged and not lost
    return 0 if fine and not found.wrong and not found.damaged else 1


class _Muted:
    """A stream that shows nothing: the progress of a folder whose failure is only counted."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


class _ProgressLine:
    """A one-line progress display on a terminal; a single summary line otherwise."""

    def __init__(self, label: str, stream: Out) -> None:
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


def verify_root(root: Path, step: int | None, roles: list[str] | None, out: Out,
                err: Out = sys.stderr) -> int:
    """Deep-check sizes and checksums; 0 only when every checked role folder verifies (one missing
    from a step older than the one resume picks is listed, not checked: `older_gap`), the root
    holds nothing wrong and no step is set aside as damaged."""
    store = _open_root(root)
    found = survey(store, roles)
    steps = found.steps if step is None else [step]
    if step is not None and step not in found.steps:
        raise CheckpointError(f"{store.step_dir(step)}: no such step")
    if not steps or not found.roles:
        out.write(f"{root}: nothing to verify\n")
        _root_notes(found, out)
        return 1
    failures = 0
    try:
        newest = store.newest_committed(found.roles)
    except CheckpointError:
        newest = None  # each folder's own check says why
    for number in steps:
        for role in found.roles:
            if (gap := older_gap(store, number, role, newest)) is not None:
                found.incomplete.append(gap)
                continue
            quiet = failures >= MAX_ROWS  # past that many failed folders, each is only counted
            progress = _ProgressLine(f"{store.step_dir(number).name}/{role}", _Muted() if quiet else err)
            problems, gone = checked(store, number, role, partial(store.verify, progress=progress))
            if gone:
                found.removed.append(f"{store.role_dir(number, role)}: removed while it was read")
                continue
            if not (quiet and problems):
                progress.close(not problems)
                _bounded(problems, out, "    ", "problems")
            failures += bool(problems)
    if failures > MAX_ROWS:
        out.write(f"... and {failures - MAX_ROWS} more role folders failed, not shown\n")
    read = len(steps) * len(found.roles) - len(found.removed) - len(found.incomplete)
    out.write(f"{read - failures} of {read} role folders verified\n")
    _root_notes(found, out)
    return 0 if failures == 0 and not found.wrong and not found.damaged else 1
