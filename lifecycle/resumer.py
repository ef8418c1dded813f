"""Resume: find the step to restart from, verify it, load it, and decide what damage means.

`resume.mode` is decided here once: `disable` loads nothing, `path` loads the one step it
names or refuses, `auto` walks the committed steps from the newest. A step whose files are
missing, short, unreadable or fail their checksums is *damaged*; one whose files are intact
but do not fit the model or the config is *refused*, and so is one this process could not read
for want of its own resources (`OutOfResources`: file descriptors, memory), which says nothing
about the files. With `resume.on_damaged: fallback` (in `auto`) a damaged step is renamed aside
and the next newest one is tried; a refusal always stops resume, and so does running out of
steps once any step was set aside.

Every role and rank must land on the same step. Ranks agree through the process group (the
worst outcome of any rank holds for all). Roles in other processes agree through the disk:
with `fallback` each role checks every role's folder of a step, so each reaches the same
verdict on the same bytes, and a step one role renames aside is gone for all. A step that
changes while it is checked (a role committing it again) is no damage: it is checked again.
Once `auto` has its step (or none), each role sets its own folders of newer steps aside
(`lifecycle.aside.abandon_line`): left from a line of training given up, they would pair with
another role's folders of the new line.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, TypeVar

from backends.base import listed, reduce_int
from lifecycle.aside import abandon_line
from lifecycle.boundary import OutOfResources, inside, os_errors, parse_step, real_dir, same_folder
from lifecycle.checksum import ALGORITHM, check_unverified
from lifecycle.contents import CONTENTS, Reading, has_state, say_unread
from lifecycle.errors import CheckpointError, DamagedCheckpoint, shorten
from lifecycle.load_format import format_for, value_of, verifies_reads
from lifecycle.manifest import MANIFEST, NewerFormat, check_folder, checksum_of, read_manifest_file
from lifecycle.records import say
from lifecycle.role import RoleRank
from lifecycle.store import CheckpointStore, Identity
from lifecycle.types import Content, Parts, Progress

HashFn = Callable[[Parts], str | None]
_T = TypeVar("_T")
FLUX_CHECKS, FLUX_WAIT_S = 5, 0.2  # checks of a step changing while checked (a commit in flight), the pause


@dataclass(frozen=True, slots=True)
class Resumed:
    """What a resume restored: the step, the role folder it came from, and the progress."""

    step: int
    folder: Path
    progress: Progress


@dataclass(frozen=True, slots=True)
class NotResumed:
    """Why a resume restored nothing, so the caller starts fresh."""

    reason: str


class Verdict(IntEnum):
    """One rank's outcome for one step; ranks agree on the worst (the largest)."""

    OK = 0
    DAMAGED = 1
    REFUSED = 2


class Resumer:
    """Picks, verifies and loads the step one role resumes from; see the module docstring."""

    def __init__(self, at: RoleRank, *, model_hash: HashFn, also_accepted: tuple[HashFn, ...] = ()) -> None:
        self.at = at
        self.config = at.config
        self._hashes = (model_hash, *also_accepted)
        """The running model's hash, and those earlier releases computed for it (still accepted)."""
        self.overwritten: str | None = None
        """Set when a failed load may have left the model's weights half-replaced."""

    def resume(self, parts: Parts) -> Resumed | NotResumed:
        """The step resumed from, or why there is none to resume from (the caller starts fresh)."""
        mode = value_of(self.config.resume.mode)
        if mode == "disable":
            return NotResumed("resume.mode is disable")
        model_hash = self._agreed_hash(parts)
        if mode == "path":
            folder, step = self._agreed_path()
            resumed = Resumed(step, folder, self._one(parts, folder, step, model_hash, fallback=False))
            self._supersede(resumed)
            return resumed
        if self.config.checkpoint.root is None:
            return NotResumed("checkpoint.root is not set")
        found = self._auto(parts, model_hash, fallback=value_of(self.config.resume.on_damaged) == "fallback")
        return found or NotResumed("no complete checkpoint")

    def _auto(self, parts: Parts, model_hash: tuple[str, ...] | None, *, fallback: bool) -> Resumed | None:
        store = self.at.store()
        self._all_or_none(lambda: store.tidy(self.at.role) if self.at.rank == 0 else None,
                          f"{store.root}: rank 0 cannot tidy what crashed saves left",
                          what=f"{store.root}: cannot tidy what crashed saves left")
        below: int | None = None
        set_aside, waits = list[str](), Counter[int]()  # waits: per step, for a commit in flight only
        while True:
            newest = self._all_or_none(lambda: store.newest_committed(self.at.roles, below=below),
                                       f"{store.root}: another rank cannot list the committed steps",
                                       what=f"{store.root}: cannot list the committed steps")
            step = self._agreed_step(newest)
            if step is None:
                break
            folder, before = store.role_dir(step, self.at.role), store.identity(step, self.at.roles)
            try:
                resumed = Resumed(step, folder, self._one(parts, folder, step, model_hash, fallback=fallback))
                if self.at.rank == 0:  # its own folders of the steps past this one: another line's
                    abandon_line(store, self.at.role, step, self.at.roles)
                return resumed
            except DamagedCheckpoint as exc:
                if self._in_flux(store, step, before, waits[step], exc):
                    waits[step] += 1
                    continue
                set_aside.append(f"step {step}, {self._set_aside(store, step, exc.problems)}:\n    "
                                 + "\n    ".join(exc.problems[:10]))
                below = step
        earlier = store.quarantined()
        if set_aside or earlier:
            found = "\n  ".join(set_aside) if set_aside else "earlier: " + ", ".join(earlier)
            raise CheckpointError(f"{store.root}: no undamaged checkpoint is left to resume from; resume refuses "
                                  "rather than start fresh over damaged ones (repair or remove them, or set "
                                  f"resume.mode to disable to start fresh). Set aside as damaged:\n  {found}")
        if self.at.rank == 0:
            abandon_line(store, self.at.role, None, self.at.roles)
        return None

    def _set_aside(self, store: CheckpointStore, step: int, problems: list[str]) -> str:
        """Rank 0 renames the damaged step aside; every rank learns whether it could, so none
        walks on to the next step's collectives while rank 0 has stopped. Returns where it went."""
        folder = store.step_dir(step)
        aside = self._all_or_none(lambda: store.quarantine(step, problems, self.at.roles) if self.at.rank == 0
                                  else None, f"{folder}: damaged, and rank 0 could not set it aside",
                                  what=f"{folder}: damaged, and cannot be set aside")
        return ("set aside by rank 0" if self.at.rank != 0 else f"now {aside}" if aside
                else "gone before it could be set aside (by another role, or removed)")

    def _in_flux(self, store: CheckpointStore, step: int, before: Identity, waited: int, exc: Exception) -> bool:
        """Whether the damage found in `step` is a commit in flight (see `CheckpointStore.in_flux`):
        then resume waits a moment and checks the step again, and never sets it aside; a step
        still changing after `FLUX_CHECKS` checks of it stops resume. Rank 0 looks; all agree."""
        moving = self.at.rank == 0 and store.in_flux(step, self.at.roles, before)
        if self._agree(Verdict.DAMAGED if moving else Verdict.OK) is Verdict.OK:
            return False
        if waited >= FLUX_CHECKS - 1:
            raise CheckpointError(f"{store.step_dir(step)}: changed while resume checked it, {FLUX_CHECKS} times (a "
                                  "commit in flight, or a role's copy a crashed re-commit left aside, which that "
                                  f"role's own resume or save puts back: resume that role first):\n  {exc}")
        time.sleep(FLUX_WAIT_S)
        return True

    def _supersede(self, resumed: Resumed) -> None:
        """A resume by path into this run's own root is a rollback: the steps past it are set aside
        (best effort, rank 0), so nothing takes that abandoned line for the new one; another root's
        step leaves this root alone."""
        if self.config.checkpoint.root is not None and self.at.rank == 0:
            store = self.at.store()
            if same_folder(resumed.folder.parent, store.step_dir(resumed.step)):
                store.supersede(resumed.step)

    def _agreed_hash(self, parts: Parts) -> tuple[str, ...] | None:
        """The running model's config hashes a step may carry (with `resume.strict`); a rank whose
        hash function raises stops them all before any of them waits in a collective."""
        if not self.config.resume.strict:
            return None
        return self._all_or_none(lambda: tuple(h for fn in self._hashes if (h := fn(parts)) is not None) or None,
                                 "another rank cannot compute the model-config hash",
                                 what="the model-config hash cannot be computed")

    def _agreed_path(self) -> tuple[Path, int]:
        """`resume.path` resolved on every rank; one rank that cannot stops them all."""
        path = Path(str(self.config.resume.path))
        return self._all_or_none(lambda: self._resolve_path(path), f"{path}: another rank cannot read resume.path",
                                 what=f"{path}: cannot read resume.path")

    def _all_or_none(self, work: Callable[[], _T], failed_elsewhere: str, *, what: str) -> _T:
        return all_or_none(work, self._any_failed, failed_elsewhere, what=what)

    def _any_failed(self, failed: bool) -> bool:
        return self._agree(Verdict.REFUSED if failed else Verdict.OK) is not Verdict.OK

    def _agreed_step(self, found: int | None) -> int | None:
        """Ranks that saw the disk at different moments take the oldest step any of them saw."""
        if not self.at.collective():
            return found
        agreed = reduce_int(-1 if found is None else found, "min")
        return None if agreed < 0 else agreed

    def _agree(self, verdict: Verdict) -> Verdict:
        return Verdict(reduce_int(int(verdict), "max")) if self.at.collective() else verdict

    def _one(
        self, parts: Parts, folder: Path, step: int, model_hash: tuple[str, ...] | None, *, fallback: bool,
    ) -> Progress:
        """Verify and load one step; `DamagedCheckpoint` (with `fallback`) for one to set aside."""
        verify = self.config.checkpoint.load.verify
        verdict, problems, manifest, later = Verdict.OK, [], None, dict[str, str]()
        try:
            manifest = read_manifest_file(folder)
            later = self._checked_while_loading(manifest, parts) if verify else {}
            problems = check_folder(folder, deep=verify, expect_step=step, expect_role=self.at.role,
                                    verified_later=later, manifest=manifest)
            if fallback and not problems:
                problems = self._other_roles(step, deep=verify)
            if problems:
                verdict = Verdict.DAMAGED
            elif (refusal := _hash_refusal(model_hash, manifest, folder)) is not None:
                verdict, problems = Verdict.REFUSED, [refusal]
        except (NewerFormat, OutOfResources) as exc:
            verdict, problems = Verdict.REFUSED, [str(exc)]
        except CheckpointError as exc:
            verdict, problems = Verdict.DAMAGED, [str(exc)]
        agreed = self._agree(verdict)
        if agreed is Verdict.OK:
            then: list[Callable[[], None]] = []  # `Loaded.then`: the RNGs, once the ranks agree to the step
            undos: list[Callable[[], None]] = []  # `Loaded.undo`: the data position put back, should they not
            progress, verdict, problems = self._load_verified(parts, manifest, folder, step, later, then, undos)
            agreed = self._agree(verdict)
            for each in then if agreed is Verdict.OK else undos:
                each()
            if agreed is not Verdict.OK:  # every rank loaded (some of) it: none may trust its weights now
                self.overwritten = f"a failed resume from {folder}"
        if agreed is Verdict.OK:
            self.overwritten = None
            return progress
        what = f"{folder}: cannot resume from step {step}"
        detail = listed(problems) if problems else "another rank refused it (see its error)"
        if agreed is Verdict.DAMAGED and fallback:
            raise DamagedCheckpoint(f"{what}:\n  {detail}", problems or [f"{folder}: damaged on another rank"])
        raise CheckpointError(f"{what}:\n  {detail}")

    def _load_verified(
        self, parts: Parts, manifest: Any, folder: Path, step: int, later: dict[str, str],
        then: list[Callable[[], None]], undos: list[Callable[[], None]],
    ) -> tuple[Progress, Verdict, list[str]]:
        """Load, handing the readers the digests of `later` (see `_checked_while_loading`), then hash
        those they did not verify; a failure is damage when a full check finds a bad file, else a refusal
        (always one when this process ran short of resources: `OutOfResources`). A failure runs
        `undos` here and empties both lists."""
        try:
            with os_errors(f"cannot read step {step}", folder):
                progress, verified = self._load(parts, manifest, folder, step, later, then, undos)
                check_unverified(folder, later, verified)
        except Exception as exc:  # a backend or a dataloader raising its own type: still a refusal, typed
            for undo in undos:  # the data position, as it was before this resume
                undo()
            then.clear()
            undos.clear()
            if not isinstance(exc, CheckpointError):
                exc = CheckpointError(f"{folder}: loading step {step} failed: {type(exc).__name__}: {exc}")
            try:
                damage = [] if isinstance(exc, OutOfResources) else check_folder(
                    folder, deep=True, expect_step=step, expect_role=self.at.role, manifest=manifest)
            except OutOfResources as short:
                damage, exc = [], short
            if damage:
                return Progress(), Verdict.DAMAGED, [*damage, f"(loading it failed with: {exc})"]
            return Progress(), Verdict.REFUSED, [str(exc)]
        return progress, Verdict.OK, []

    def _other_roles(self, step: int, *, deep: bool) -> list[str]:
        """The same check of every other role's folder, so every role reaches one verdict
        (rank 0 of a process group checks; the verdict is agreed)."""
        if self.at.collective() and self.at.rank != 0:
            return []
        store = self.at.store()
        return [problem for role in self.at.roles if role != self.at.role
                for problem in store.validate(step, role, deep=deep)]

    def _checked_while_loading(self, manifest: dict[str, Any], parts: Parts) -> dict[str, str]:
        """The files whose checks wait for their content's load (role-folder path: digest): the
        `.safetensors` files (reading one unverified runs nothing in it) of the contents read with
        a format that checks as it reads (`verifies_reads`), digests of the current `ALGORITHM`
        only. Their reader gets the digests, so their bytes are read once; whichever it did not
        verify is hashed right after the load. Any other file is verified before anything reads
        it, so a damaged step never overwrites the model."""
        reads = self._reads(parts)
        prefixes = tuple(_prefix(entry) for name, entry in manifest["contents"].items()
                         if name in reads and CONTENTS[name].by_format and verifies_reads(self.config, entry["backend"]))
        checked = ((f["path"], checksum_of(f)) for f in manifest["files"]
                   if f["path"].endswith(".safetensors") and f["path"].startswith(prefixes))
        return {path: digest for path, (algorithm, digest) in checked if algorithm == ALGORITHM}

    def _reads(self, parts: Parts) -> list[str]:
        """The contents of `checkpoint.load.contents` this worker has the objects to load."""
        wanted = (value_of(c) for c in self.config.checkpoint.load.contents)
        return [name for name in wanted if name in CONTENTS and has_state(CONTENTS[name], parts)]

    def _resolve_path(self, path: Path) -> tuple[Path, int]:
        """resume.path may name the step folder or this role's folder inside it. Neither may be
        a symlink, as on an automatic resume: a planted link would load another run's weights
        as this one's step."""
        with os_errors("cannot read resume.path", path):
            if not real_dir(path, "resume.path"):
                raise CheckpointError(f"{path}: resume.path is neither a committed role folder nor a "
                                      f"global_step_N folder holding role {self.at.role!r} (nothing is there)")
            if (path / MANIFEST).is_file():
                folder = path
                real_dir(folder.parent, "the step folder of resume.path")
            elif real_dir(path / self.at.role, f"the folder of role {self.at.role!r}"):
                folder = path / self.at.role
            else:
                raise CheckpointError(f"{path}: resume.path is neither a committed role folder nor a "
                                      f"global_step_N folder holding role {self.at.role!r}")
        step = parse_step(folder.parent.name)
        return folder, read_manifest_file(folder)["step"] if step is None else step

    def _load(
        self, parts: Parts, manifest: dict[str, Any], folder: Path, step: int, expected: Mapping[str, str],
        then: list[Callable[[], None]], undos: list[Callable[[], None]],
    ) -> tuple[Progress, set[str]]:
        """Restore each content of `checkpoint.load.contents` with its reader (`lifecycle.contents`)
        and, for a format's content, the backend its manifest names; returns the progress and the
        files of `expected` (role-folder paths) the readers verified. What to run once the ranks
        agree (`Loaded.then`) goes to `then`, what to put back should they not (`Loaded.undo`) to `undos`."""
        entries: dict[str, dict[str, str]] = manifest["contents"]
        say_unread([value_of(c) for c in self.config.checkpoint.load.contents], entries, parts, folder, step)
        progress, verified = Progress(step=step), set[str]()
        for name in sorted(self._reads(parts), key=lambda name: name != Content.EXTRA.value):  # its step first
            content, entry = CONTENTS[name], entries.get(name)
            if entry is None and content.optional_on_resume:
                say("warning", f"checkpoint.resume.no_{name}", path=str(folder), step=step, reset=content.resets)
                continue
            if entry is None:
                raise CheckpointError(f"{folder / MANIFEST}: no {name!r} content to resume from "
                                      f"(holds {sorted(entries)})")
            if content.read is None:
                raise CheckpointError(f"{folder / MANIFEST}: {name!r} is an export, which no resume reads")
            sub = inside(folder, entry["folder"])  # check_folder refused a bad one already; belt and braces
            prefix = _prefix(entry)
            mine = {rel.removeprefix(prefix): digest for rel, digest in expected.items() if rel.startswith(prefix)}
            loaded = content.read(Reading(
                backend=format_for(self.config, name, entry["backend"], sub) if content.by_format else None,
                parts=parts, folder=sub, expected=mine, rank=self.at.rank, world_size=self.at.world_size,
                saved_world_size=manifest["parallel"].get("world_size"), step=step))
            verified |= {prefix + rel for rel in loaded.verified if rel in mine}
            progress = progress if loaded.progress is None else loaded.progress
            then += [] if loaded.then is None else [loaded.then]
            undos += [] if loaded.undo is None else [loaded.undo]
        if progress.step != step:  # a save writes the step it commits; another is damage
            raise CheckpointError(f"{folder}: its progress says step {shorten(progress.step)}, but it is the "
                                  f"folder of step {step}")
        return progress, verified

def all_or_none(work: Callable[[], _T], any_failed: Callable[[bool], object] | None, failed_elsewhere: str, *,
                what: str) -> _T:
    """`work()` on this rank; an error it raises on any rank stops every rank (the others with
    `failed_elsewhere`), before any of them waits in a later collective. `any_failed(failed)`
    tells every rank whether one failed (None: this rank alone). Any exception counts: one not
    ours (a caller's hash function, a bug) is reported typed, as `what`, never leaving this rank
    before the agreement its peers wait in."""
    error: CheckpointError | None = None
    try:
        found = work()
    except CheckpointError as failure:
        error = failure
    except Exception as failure:
        error = CheckpointError(f"{what}: {type(failure).__name__}: {failure}")
    if any_failed(error is not None) if any_failed is not None else error is not None:
        raise error or CheckpointError(f"{failed_elsewhere} (see its error)")
    return found  # bound: a rank whose work raised reported it, and every rank raised above


def _prefix(entry: Mapping[str, str]) -> str:
    """How the paths of a content's files begin, in its manifest (`model/`)."""
    return entry["folder"].rstrip("/") + "/"


def _hash_refusal(current: tuple[str, ...] | None, manifest: dict[str, Any], folder: Path) -> str | None:
    saved = manifest["model_config_hash"]
    if saved is not None and current is not None and saved not in current:
        return (f"{folder / MANIFEST}: model-config hash {saved} differs from the running model's "
                f"{current[0]}; set resume.strict=false to load anyway")
    return None

