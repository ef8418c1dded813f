"""The filesystem boundary: every name and path read from a checkpoint root passes here.

A checkpoint root is input like any other: a manifest, a tracker, a step folder or a planted
file may have been written by a crash, a broken tool or an attacker. Before anything is
opened, a path is checked as a string (no NUL byte, no over-long name, no way out of its
folder) and then with `lstat` (a regular file, or a real directory, never a symlink at the
step and role level, never a FIFO, device or socket), so an open can neither block nor be
led elsewhere. Files are opened with `O_NOFOLLOW | O_NONBLOCK` and checked again on the open
descriptor. Every `OSError` leaves as a `CheckpointError` that names the file and carries the
errno's own text (disk full says disk full). One that describes the reading process, not the
file (out of file descriptors or memory, a stale network handle) leaves as `OutOfResources`,
which is never taken for damage: resume stops, and sets nothing aside.
"""

from __future__ import annotations

import errno
import operator
import os
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from lifecycle.errors import CheckpointError, LifecycleError, shorten
from lifecycle.types import plain_digits

NAME_MAX = 255
"""Bytes in one path component (Linux, macOS and every common filesystem)."""
PATH_MAX = 4096
"""Bytes in a whole path (Linux)."""
STEP_PREFIX = "global_step_"
MANIFEST = "manifest.json"
"""A role folder's commit marker: it appears with the folder, listing every file the folder holds."""
TRACKER = "latest_checkpointed_iteration.txt"
"""The file of a checkpoint root naming its newest step, as verl and Megatron-LM read it."""
_STEP_RE = re.compile(r"global_step_(0|[1-9][0-9]{0,17})")
"""Canonical step folders only: no sign, no zero padding, at most 18 digits (fits int64)."""
_PADDED_RE = re.compile(r"global_step_[0-9]+")
RESOURCE_ERRNOS = frozenset(getattr(errno, name) for name in (
    "EMFILE", "ENFILE", "ENOMEM", "EAGAIN", "ENOBUFS", "EINTR", "ESTALE", "ETIMEDOUT") if hasattr(errno, name))
"""Errors of the process that reads, not of the file read: a retry with the resource back reads it."""
_NOT_DAMAGE = "the process ran short of a resource; this says nothing about the file, which is not taken for damage"


class OutOfResources(CheckpointError):
    """Reading a checkpoint failed for want of the reader's own resources (file descriptors,
    memory, a network filesystem's handle): the files may be intact, so this is never damage,
    and resume stops without setting any step aside."""


def os_error(exc: OSError, what: str, path: str | os.PathLike[str] | None = None) -> CheckpointError:
    """`exc` as a `CheckpointError`: the file, what was being done, and the errno's text; an
    `OutOfResources` for an errno of `RESOURCE_ERRNOS`."""
    where = exc.filename if exc.filename is not None else path
    code = errno.errorcode.get(exc.errno or 0)
    text = exc.strerror or str(exc) or type(exc).__name__
    prefix = f"{os.fsdecode(where)}: " if where is not None else ""
    message = f"{prefix}{what}: {text}" + (f" ({code})" if code else "")
    if exc.errno in RESOURCE_ERRNOS:
        return OutOfResources(f"{message}: {_NOT_DAMAGE}")
    return CheckpointError(message)


def out_of_memory(what: str, path: str | os.PathLike[str] | None = None) -> OutOfResources:
    """A `MemoryError` met while `what` was done to `path`, as an `OutOfResources`."""
    prefix = f"{os.fsdecode(path)}: " if path is not None else ""
    return OutOfResources(f"{prefix}{what}: out of memory: {_NOT_DAMAGE}")


def file_problem(exc: OSError, what: str, path: str | os.PathLike[str] | None = None) -> str:
    """`exc` as one problem of a file, for a list of them (see `os_error`); an `OutOfResources`
    is raised instead, since it tells nothing about the file."""
    return problem(os_error(exc, what, path), exc)


def problem(error: CheckpointError, cause: BaseException | None = None) -> str:
    """`error` as one problem of a file, for a list of them; an `OutOfResources` is raised
    instead (from `cause`, when given), since it tells nothing about the file."""
    if isinstance(error, OutOfResources):
        raise error from (cause or error.__cause__)
    return str(error)


@contextmanager
def os_errors(what: str, path: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Turn an `OSError` (or a path Python refuses, such as one with a NUL byte) raised in the
    block into a `CheckpointError` naming the file and `what` was being done."""
    try:
        yield
    except LifecycleError:  # already typed (a ConfigError is a ValueError too: keep its key)
        raise
    except OSError as exc:
        raise os_error(exc, what, path) from exc
    except MemoryError as exc:
        raise out_of_memory(what, path) from exc
    except ValueError as exc:  # "embedded null byte" and friends, from os.* on a bad path
        where = f"{os.fsdecode(path)}: " if path is not None else ""
        raise CheckpointError(f"{where}{what}: {exc}") from exc


def _size(text: str) -> int | None:
    """Bytes `text` takes as a file name, None when it cannot be one (a lone surrogate)."""
    try:
        return len(os.fsencode(text))
    except UnicodeError:
        return None


def name_problem(name: str) -> str | None:
    """Why `name` cannot be one path component, or None when it can."""
    if not name or name in (".", ".."):
        return f"{name!r} is not a file name"
    if "\x00" in name:
        return f"{name!r} holds a NUL byte"
    if "/" in name or "\\" in name:
        return f"{name!r} holds a path separator"
    size = _size(name)
    if size is None:
        return f"{name!r} cannot be encoded as a file name"
    if size > NAME_MAX:
        return f"name of {size} bytes is longer than {NAME_MAX}"
    return None


def rel_problem(rel: str) -> str | None:
    """Why an untrusted relative path (posix, from a manifest) cannot name a file inside its
    folder, or None when it can."""
    if not isinstance(rel, str) or not rel:
        return f"{rel!r} is not a relative path"
    if "\x00" in rel:
        return f"{rel!r} holds a NUL byte"
    if "\\" in rel or rel.startswith("/"):
        return f"{rel!r} is not a relative posix path"
    size = _size(rel)
    if size is not None and size > PATH_MAX:
        return f"path of {size} bytes is longer than {PATH_MAX}"
    for part in rel.split("/"):
        if part == "..":
            return f"{rel!r} leaves its folder"
        if problem := name_problem(part):
            return f"{rel!r}: {problem}"
    return None


def path_problem(path: str) -> str | None:
    """Why `path`, a path a user gives (absolute or relative: a config key, a command-line
    argument), cannot name a file or folder on this system, or None when it can. A string check
    only: nothing is looked up on disk."""
    if not path:
        return "an empty path names no file"
    if "\x00" in path:
        return f"{shorten(path)} holds a NUL byte, which no path can"
    size = _size(path)
    if size is None:
        return f"{shorten(path)} cannot be encoded as a file name"
    if size > PATH_MAX:
        return f"a path of {size} bytes is longer than {PATH_MAX}"
    if any((_size(part) or 0) > NAME_MAX for part in path.split("/")):
        return f"{shorten(path)} has a component longer than {NAME_MAX} bytes"
    return None


def inside(folder: Path, rel: str) -> Path:
    """The path `rel` names inside `folder`: refused when the string is malformed or the path,
    symlinks resolved, would lead out of `folder`."""
    if problem := rel_problem(rel):
        raise CheckpointError(f"{folder}: {problem}")
    target = folder / rel
    try:
        escapes = not target.resolve().is_relative_to(folder.resolve())
    except OSError as exc:
        raise os_error(exc, "cannot resolve", target) from exc
    except (RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{target}: cannot resolve: {exc}") from exc
    if escapes:
        raise CheckpointError(f"{folder}: {rel!r} leads out of the folder")
    return target


def kind(mode: int) -> str:
    """A file type in words, for messages."""
    for test, word in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "folder"), (stat.S_ISLNK, "symlink"),
                       (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return word
    return "special file"


def lstat(path: str | Path, what: str = "cannot stat") -> os.stat_result | None:
    """`os.lstat`, None when nothing is there (or a path component is not a folder)."""
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise os_error(exc, what, path) from exc
    except ValueError as exc:
        raise CheckpointError(f"{path}: {what}: {exc}") from exc


def regular_size(path: Path) -> int:
    """Size of the regular file at `path`; a `CheckpointError` for anything else or nothing."""
    st = lstat(path)
    if st is None:
        raise CheckpointError(f"{path}: missing")
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: a {kind(st.st_mode)}, not a regular file")
    return st.st_size


def real_dir(path: Path, what: str) -> bool:
    """True for a folder that is not a symlink, False when nothing is there; `CheckpointError`
    naming `what` the folder is for when something else is (a symlink, a file, a FIFO)."""
    st = lstat(path)
    if st is None:
        return False
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{path}: {what} is a {kind(st.st_mode)}, not a folder; refusing to follow it")
    return True


def special_files(folder: Path) -> list[str]:
    """Entries of `folder` (one level, symlinks followed: an HF cache snapshot is all links)
    that are not regular files or folders: a FIFO, socket or device would block or misread."""
    problems: list[str] = []
    with os_errors("cannot list the folder", folder):
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    for entry in entries:
        try:
            mode = entry.stat(follow_symlinks=True).st_mode
        except OSError as exc:
            problems.append(file_problem(exc, "cannot stat", entry.path))
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            problems.append(f"{entry.path}: a {kind(mode)}, not a regular file")
    return problems


def scan(folder: Path) -> tuple[list[str], list[str]]:
    """Relative posix paths of every regular file under `folder`, and a problem for every entry
    that is neither a regular file nor a real folder (symlinks, FIFOs, sockets, devices) or
    that cannot be listed. Symlinks are reported, never followed; nothing is opened. The reader's
    own shortage (`OutOfResources`) is raised: it is no problem of the folder."""
    files: list[str] = []
    problems: list[str] = []
    pending = [(folder, "")]
    while pending:
        here, prefix = pending.pop()
        try:
            with os.scandir(here) as entries:
                found = sorted((entry.name, entry) for entry in entries)
        except OSError as exc:
            problems.append(file_problem(exc, "cannot list the folder", here))
            continue
        for name, entry in found:
            rel = f"{prefix}{name}"
            try:
                if entry.is_dir(follow_symlinks=False):
                    pending.append((Path(entry.path), f"{rel}/"))
                elif entry.is_file(follow_symlinks=False):
                    files.append(rel)
                else:
                    mode = entry.stat(follow_symlinks=False).st_mode
                    problems.append(f"{entry.path}: a {kind(mode)}; a checkpoint holds regular files only")
            except OSError as exc:
                problems.append(file_problem(exc, "cannot stat", entry.path))
    return sorted(files), problems


def open_regular(path: Path, *, follow: bool = False) -> BinaryIO:
    """Open a regular file for reading without blocking on a FIFO; the descriptor is checked to
    be a regular file before anything is read. A symlink is refused, unless `follow` (weights a
    user points at, such as an HF cache snapshot, whose files are all links into its blobs; a
    committed step's own symlinks are refused by its manifest check first)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow else os.O_NOFOLLOW)
    with os_errors("cannot open", path):
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: file missing") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP and not follow:
                raise CheckpointError(f"{path}: a symlink, not a regular file; refusing to follow it") from exc
            raise
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise CheckpointError(f"{path}: a {kind(mode)}, not a regular file")
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise


def read_bytes(path: Path, limit: int, what: str, *, follow: bool = False) -> bytes:
    """The whole of a small regular file (`open_regular`); one larger than `limit` bytes is
    refused unread."""
    with open_regular(path, follow=follow) as fh, os_errors(f"cannot read {what}", path):
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{path}: {what} is larger than {limit} bytes; refusing to read it")
    return data


def parse_step(name: str) -> int | None:
    """The step a folder name stands for: `global_step_<digits>`, canonical only."""
    match = _STEP_RE.fullmatch(name)
    return int(match.group(1)) if match else None


def step_name_problem(name: str) -> str | None:
    """Why a name that looks like a step folder is not one (zero padding, too many digits)."""
    if parse_step(name) is None and _PADDED_RE.fullmatch(name):
        return "not a canonical step folder name (global_step_<number>, no zero padding, at most 18 digits)"
    return None


MAX_STEP = 10**18 - 1
"""The largest step a folder name holds (18 digits)."""


def check_step(step: object) -> int:
    """A step number to save under: an integer (numpy and 0-d torch integers included), 0 to
    `MAX_STEP`; anything else would name a folder resume never reads, or none."""
    try:
        number = operator.index(step)  # type: ignore[arg-type]
    except TypeError:
        raise CheckpointError(f"step must be an integer, got {shorten(step)} ({type(step).__name__})") from None
    if isinstance(step, bool) or not 0 <= number <= MAX_STEP:
        raise CheckpointError(f"step must be an integer from 0 to {MAX_STEP}, got {shorten(number)}")
    return int(number)


def parse_step_number(text: str, where: Path) -> int:
    """A step number written in a file (the tracker): digits only, at most 18 of them."""
    if (number := plain_digits(text)) is None:
        raise CheckpointError(f"{where}: must hold a step number, found {text[:40]!r}")
    return number


ROLE_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
"""A role is a folder name: letters, digits, `_ . -`, not starting with `.` or `-`, at most 128."""
_ROLE_RE = re.compile(ROLE_PATTERN)


def role_problem(role: object) -> str | None:
    """Why `role` cannot name a role folder (and its staging and lock files), or None."""
    if not isinstance(role, str) or not _ROLE_RE.fullmatch(role):
        return (f"{role!r} is not a valid role name (letters, digits, '_', '.' or '-', not starting with "
                "'.' or '-', at most 128 characters)")
    return None


def same_folder(a: Path, b: Path) -> bool:
    """Whether two spellings name one folder (relative, `..`, a symlinked parent): by device
    and inode, since a root may be written `ckpt` and a path `/abs/ckpt/global_step_1`."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
