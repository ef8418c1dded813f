"""The manifest that commits one role's checkpoint folder, and the checks that trust it.

The manifest is written last: a folder without a valid one is not a checkpoint, whatever
else it holds. Paths read back from a manifest are untrusted input and never leave the folder.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import tempfile
from collections.abc import Callable, Collection, Iterable, Mapping
from contextlib import suppress
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from lifecycle.boundary import (
    MANIFEST, inside, kind, lstat, os_errors, read_bytes, real_dir, problem, regular_size, rel_problem, scan,
)
from lifecycle.checksum import ALGORITHM, ALGORITHMS, file_digest, side_by_side
from lifecycle.errors import CheckpointError, shorten
from lifecycle.jsontree import parse_json
from lifecycle.types import Content
from lifecycle.version import __version__

FORMAT_VERSION = 2
"""2: file checksums are keyed by their algorithm's name (1: always `xxh3_64`); both are read."""
HASH_THREADS = 2
MANIFEST_LIMIT = 64 * 1024 * 1024
"""The largest manifest read: about a hundred bytes per file, so several hundred thousand files fit."""
MAX_SIZE = 1 << 62
"""A file size a manifest may state; anything larger is not a size."""

_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "format_version": int,
    "step": int,
    "role": str,
    "created_at": str,
    "contents": dict,
    "parallel": dict,
    "model_config_hash": (str, type(None)),
    "versions": dict,
    "files": list,
    "meta": dict,
}

Progress = Callable[[int, int], None]


class NewerFormat(CheckpointError):
    """A manifest written by a newer release: intact as far as anyone here can tell, so never
    taken for damage (nor set aside); only refused."""


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable, not only the file data."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any) -> None:
    """Readers see the old file or the whole new one, never a torn write."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write a temporary file beside `path`, then rename it over `path`; the temporary file is
    created fresh under a random name (never opened through something planted there) and
    removed when anything fails, so a failed write leaves nothing behind."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def checksum_of(entry: Mapping[str, Any]) -> tuple[str, str]:
    """(algorithm, digest) of a manifest's file entry: the first of `ALGORITHMS` it names."""
    for algorithm in ALGORITHMS:
        if isinstance(digest := entry.get(algorithm), str):
            return algorithm, digest
    raise CheckpointError(f"file entry {entry.get('path')!r} names none of the checksums {list(ALGORITHMS)}")


def _hash_all(
    folder: Path, algorithms: Mapping[str, str], *, fsync: bool, progress: Progress | None
) -> dict[str, str]:
    """Digest of each file `algorithms` names (relative path: algorithm), files hashed side by side.

    A file that cannot be read raises a `CheckpointError` naming it, with the errno's text."""
    sizes = {rel: regular_size(folder / rel) for rel in algorithms}
    total, done = sum(sizes.values()), 0
    out: dict[str, str] = {}

    def hash_one(rel: str) -> str:
        with os_errors("cannot read to checksum it", folder / rel):
            return file_digest(folder / rel, fsync=fsync, algorithm=algorithms[rel])

    for rel, digest in side_by_side(hash_one, list(algorithms), HASH_THREADS):
        out[rel] = digest
        done += sizes[rel]
        if progress is not None:
            progress(done, total)
    return out


def _is_digest(value: object) -> bool:
    return isinstance(value, str) and len(value) == 16 and all(c in "0123456789abcdef" for c in value)


def _digests(folder: Path, rels: list[str], written: Mapping[str, str], *, fsync: bool) -> dict[str, str]:
    """The digests the save's writers returned (`written`), taken as they are; the rest of
    `rels` read and hashed.

    A returned digest is trusted without a look at the file: it comes from this process, from
    this save's own writer, which hashed the very bytes it handed to the kernel. That is the
    digest the manifest should state. Were the file changed between its write and this commit
    (by anyone), a re-hash here would bless the change; the writer's digest instead makes
    resume refuse it, as it refuses any later damage. Nothing is kept between saves, so no
    digest can outlive its file (the size and mtime check an earlier process-wide cache
    needed). A digest for a file the folder does not hold is a broken save, refused.
    """
    if missing := sorted(set(written) - set(rels)):
        raise CheckpointError(f"{folder}: the save returned digests for files it does not hold: "
                              + ", ".join(missing[:10]))
    if odd := sorted(rel for rel, digest in written.items() if not _is_digest(digest)):
        raise CheckpointError(f"{folder}: the save returned digests that are not {ALGORITHM} digests (16 lowercase "
                              f"hex digits, as lifecycle.checksum.file_digest gives) for: " + ", ".join(odd[:10]))
    out = dict(written)
    if fsync:
        for rel in out:
            fd = os.open(folder / rel, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    out.update(_hash_all(folder, {rel: ALGORITHM for rel in rels if rel not in out}, fsync=fsync, progress=None))
    return out


def library_versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for dist in ("torch", "safetensors"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    out["trainer_lifecycle"] = __version__
    return out


def build_manifest(
    folder: Path,
    *,
    step: int,
    role: str,
    contents: Mapping[str, Mapping[str, str]],
    parallel: Mapping[str, Any],
    model_config_hash: str | None,
    meta: Mapping[str, Any],
    fsync: bool = False,
    digests: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Describe every file the ranks wrote; with `fsync`, make their data durable first.

    `digests`: relative path -> `ALGORITHM` digest for the files this process's writers hashed
    while writing them; those are not read again (see `_digests`).
    Without fsync a process crash loses nothing (the kernel holds the written pages); a
    power loss may, and the checksums then refuse the damaged step on resume.
    """
    found, odd = scan(folder)
    if odd:
        raise CheckpointError(f"{folder}: cannot commit:\n  " + "\n  ".join(odd[:20]))
    rels = [rel for rel in found if rel != MANIFEST and not rel.startswith(f".{MANIFEST}")]
    digests = _digests(folder, rels, digests or {}, fsync=fsync)
    for sub in sorted({(folder / rel).parent for rel in rels} | {folder}):
        fsync_dir(sub)
    files = [{"path": rel, "size": (folder / rel).stat().st_size, ALGORITHM: digests[rel]} for rel in rels]
    return {
        "format_version": FORMAT_VERSION,
        "step": step,
        "role": role,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "contents": {name: dict(entry) for name, entry in contents.items()},
        "parallel": dict(parallel),
        "model_config_hash": model_config_hash,
        "versions": library_versions(),
        "files": files,
        "meta": dict(meta),
    }


def read_manifest_file(folder: Path) -> dict[str, Any]:
    """Parse and shape-check a manifest; everything after this may trust its types.

    Read through the filesystem boundary: a manifest that is a symlink, a FIFO or larger
    than `MANIFEST_LIMIT` is refused before a byte of it is read."""
    path = folder / MANIFEST
    if lstat(path) is None:
        raise CheckpointError(f"{path}: manifest missing (checkpoint not committed)")
    data = parse_json(read_bytes(path, MANIFEST_LIMIT, "the manifest"), path)  # a key named twice refused too
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: manifest must be a JSON object, got {type(data).__name__}")
    version = data.get("format_version")
    if type(version) is int and version > FORMAT_VERSION:
        raise NewerFormat(f"{path}: format_version {version} is not one this version reads (1 to "
                          f"{FORMAT_VERSION}): written by a newer release? Resume with that release")
    problems = _shape_problems(data)
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems[:10]))
    _lowercase_digests(data["files"])
    return data


def _lowercase_digests(files: list[dict[str, Any]]) -> None:
    """Digests in the one form every reader compares: lowercase hex, as `file_digest` gives.

    Uppercase hex states the same digest; read as written, `verify` (which lowercased) passed
    a step that resume (which compared as written) refused as damaged."""
    for entry in files:
        for algorithm in ALGORITHMS:
            if isinstance(digest := entry.get(algorithm), str):
                entry[algorithm] = digest.lower()


_CONTENT_NAMES = frozenset(content.value for content in Content)
_BACKEND_RE = re.compile(r"(?=.{1,400}$)[A-Za-z_][\w.-]*(?::[A-Za-z_]\w*)?", re.DOTALL)
"""What a backend's name may be (a registered name, or `module:Class`): a manifest's name is
printed and looked up, never followed."""


def _shape_problems(data: dict[str, Any]) -> list[str]:
    problems = [f"missing key {key!r}" for key in _REQUIRED if key not in data]
    for key, expected in _REQUIRED.items():
        value = data.get(key)
        if key in data and (not isinstance(value, expected) or isinstance(value, bool)):
            problems.append(f"key {key!r} has type {type(value).__name__}")
    if problems:
        return problems
    if not 1 <= data["format_version"] <= FORMAT_VERSION:
        return [f"format_version {data['format_version']} is not one this version reads (1 to {FORMAT_VERSION}): "
                "written by a newer release?"]
    for name, entry in data["contents"].items():
        if name not in _CONTENT_NAMES:
            problems.append(f"contents names {shorten(name)}, which is none of {sorted(_CONTENT_NAMES)}")
        elif not (isinstance(entry, dict) and isinstance(entry.get("backend"), str)
                  and isinstance(entry.get("folder"), str)):
            problems.append(f"contents[{name!r}] needs string 'backend' and 'folder'")
        elif not _BACKEND_RE.fullmatch(entry["backend"]):
            problems.append(f"contents[{name!r}] names backend {shorten(entry['backend'])}, which no backend "
                            "is called")
    for i, entry in enumerate(data["files"]):
        ok = (isinstance(entry, dict) and isinstance(entry.get("path"), str)
              and type(entry.get("size")) is int and 0 <= entry["size"] <= MAX_SIZE
              and any(isinstance(entry.get(a), str) for a in ALGORITHMS))
        if not ok:
            problems.append(f"files[{i}] needs 'path' (str), 'size' (int, 0 to 2**62) and one of "
                            f"{list(ALGORITHMS)} (str)")
    return problems


def check_folder(
    folder: Path,
    *,
    deep: bool,
    expect_step: int | None = None,
    expect_role: str | None = None,
    progress: Progress | None = None,
    verified_later: Collection[str] = (),
    manifest: dict[str, Any] | None = None,
) -> list[str]:
    """Every reason not to trust `folder`.

    Cheap mode (presence, sizes, file types) decides completeness; deep mode adds checksums
    and unlisted files, so a tampered step is refused loudly at resume instead of skipped.
    Files in `verified_later` are left to the reader that checks them while loading.
    `manifest`: the folder's manifest when the caller has already read it. `OutOfResources` (the
    reader short of file descriptors or memory) is raised, never listed: it is no reason.
    """
    try:
        if not real_dir(folder, "a role folder"):
            return [f"{folder}: role folder missing"]
        if manifest is None:
            manifest = read_manifest_file(folder)
    except CheckpointError as exc:
        return [problem(exc)]
    data = manifest  # the name the checks below use
    mpath = folder / MANIFEST
    problems: list[str] = []
    if expect_step is not None and data["step"] != expect_step:
        problems.append(f"{mpath}: step {data['step']} but the folder is for step {expect_step}")
    if expect_role is not None and data["role"] != expect_role:
        problems.append(f"{mpath}: role {data['role']!r} but the folder is for role {expect_role!r}")
    for name, entry in data["contents"].items():
        try:
            inside(folder, entry["folder"])
        except CheckpointError as exc:
            problems.append(f"{mpath}: contents[{name!r}] folder {entry['folder']!r} escapes {folder} "
                            f"({problem(exc)})")
    listed, to_hash = _check_listed(folder, data["files"], problems)
    found, odd = scan(folder)
    problems.extend(odd)
    if deep:
        problems.extend(f"{folder / rel}: file not listed in {mpath}"
                        for rel in found if rel != MANIFEST and rel not in listed)
    if deep and not problems:
        wanted = {rel: checksum for rel, checksum in to_hash.items() if rel not in verified_later}
        try:
            digests = _hash_all(folder, {rel: algorithm for rel, (algorithm, _) in wanted.items()},
                                fsync=False, progress=progress)
        except CheckpointError as exc:
            return [problem(exc)]
        problems.extend(
            f"{folder / rel}: checksum {digests[rel]} != manifest {want}"
            for rel, (_, want) in wanted.items() if digests[rel] != want
        )
    return problems


def _check_listed(
    folder: Path, files: Iterable[dict[str, Any]], problems: list[str]
) -> tuple[set[str], dict[str, tuple[str, str]]]:
    """Listed paths, and (algorithm, digest) of each listed file whose presence and size check out."""
    listed: set[str] = set()
    to_hash: dict[str, tuple[str, str]] = {}
    base = os.fspath(folder)
    for entry in files:
        rel = entry["path"]
        if rel in listed:
            problems.append(f"{folder / MANIFEST}: lists {rel!r} twice")
            continue
        listed.add(rel)
        if rel == MANIFEST:
            problems.append(f"{folder / MANIFEST}: lists the manifest itself")
            continue
        if refused := rel_problem(rel):  # no resolving: scan() refuses any symlink in the folder
            problems.append(f"{folder / MANIFEST}: file path {rel!r} is refused: {folder}: {refused}")
            continue
        target = f"{base}/{rel}"
        try:
            st = lstat(target)
        except CheckpointError as exc:
            problems.append(f"{folder / MANIFEST}: file path {rel!r} is refused: {problem(exc)}")
            continue
        if st is None:
            problems.append(f"{target}: listed in the manifest but missing")
        elif not stat.S_ISREG(st.st_mode):
            problems.append(f"{target}: listed in the manifest but a {kind(st.st_mode)}, not a regular file")
        elif st.st_size != entry["size"]:
            problems.append(f"{target}: size {st.st_size} != manifest {entry['size']}")
        else:
            to_hash[rel] = checksum_of(entry)
    return listed, to_hash
