"""`--write-docs`: append a dated entry of a benchmark's figures to docs/benchmarks.md.

Every bench script adds the flag with `add_write_docs(parser)` and, after it printed its
figures, calls `write_docs(args, script, figures)`. The entry states the date, the machine,
the Python, torch and library versions, the script's arguments and each figure with its
baseline and ratio, so a figure is never quoted without where and with what it was taken.
The file keeps every entry, oldest first: it is the history of how the figures moved.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "benchmarks.md"
HEADER = """# Benchmark history

Entries are appended by the scripts in `examples/bench/` run with `--write-docs`, oldest
first; each states its date, machine, versions and arguments. The README's figures table
quotes the newest entry of each figure.
"""


@dataclass(frozen=True, slots=True)
class Figure:
    """One measured comparison, already formatted with its units."""

    name: str
    value: str
    baseline: str
    ratio: str
    target: str = ""


_load_at_start: str | None = None


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type for a count (tensors, repeats, rounds): an integer of at least `low`, so a
    value the bench cannot run with is refused with a message, not met as a traceback later."""
    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    return count


positive_int = at_least(1)


def positive_float(text: str) -> float:
    """An argparse type for a size (GiB, MiB): a finite number > 0."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type for a duration that may be none (seconds of compute): a finite number >= 0."""
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def existing_folder(text: str) -> Path:
    """An argparse type for a folder the bench writes into: it must exist (a mistyped path is
    refused rather than created)."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not an existing folder (create it first)")
    return path


def file_in_existing_folder(text: str) -> Path:
    """An argparse type for a file written at the end of a run (a plot): its folder must exist,
    or the run's minutes of measuring end in an error."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    existing_folder(str(path.parent))
    return path


def add_write_docs(parser: argparse.ArgumentParser) -> None:
    global _load_at_start
    _load_at_start = _load()
    parser.add_argument("--write-docs", nargs="?", const=DOCS, type=Path, metavar="FILE",
                        help=f"append a dated entry with the figures to FILE (default {DOCS.relative_to(REPO)})")


def machine() -> str:
    """CPU model, core count, memory, OS and GPU: what the figures depend on most."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        memory = f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB memory"
    except (ValueError, OSError, AttributeError):
        memory = "memory unknown"
    return f"{cpu}, {os.cpu_count()} logical CPUs, {memory}, {_gpu()}, {platform.system()} {platform.release()}"


def _gpu() -> str:
    """Count and name of the GPUs, with the driver and the CUDA runtime torch was built with."""
    import torch

    if not torch.cuda.is_available():
        return "no GPU"
    return (f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)} (driver {_nvidia_driver()}, "
            f"CUDA {torch.version.cuda} runtime in torch)")


def _nvidia_driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out[0] if out else "unknown"


def versions() -> str:
    import torch

    import lifecycle

    return (f"Python {platform.python_version()}, torch {torch.__version__}, "
            f"trainer-lifecycle {lifecycle.__version__} ({_commit(Path(lifecycle.__file__).resolve().parents[1])})")


def _commit(root: Path) -> str:
    """The commit the library was imported from, and whether its code differed from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "--no-optional-locks", "-C", str(root), *args], capture_output=True,
                              text=True, timeout=30, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--", "lifecycle", "backends")
    except (OSError, subprocess.SubprocessError):
        return "commit unknown"
    return f"commit {commit}" + (", with uncommitted changes to the library" if changed else "")


def _without_write_docs(argv: list[str]) -> list[str]:
    kept, skip = [], False
    for arg in argv:
        if skip and not arg.startswith("-"):
            skip = False
            continue
        skip = arg == "--write-docs"
        if not arg.startswith("--write-docs"):
            kept.append(arg)
    return kept


def _load() -> str:
    """The 1- and 5-minute load averages: how much other work competed with the run."""
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "unknown"
    return f"{one:.1f} (1 min), {five:.1f} (5 min)"


def entry(args: argparse.Namespace, script: str, figures: list[Figure], note: str = "") -> str:
    settings = ", ".join(f"{k}={v}" for k, v in sorted(vars(args).items()) if k != "write_docs")
    argv = _without_write_docs(sys.argv[1:])
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [
        f"## {now:%Y-%m-%d %H:%M} UTC, `{script}`",
        "",
        f"- command: `python examples/bench/{script.split()[0]}{''.join(' ' + a for a in argv)}`",
        f"- settings: {settings}",
        f"- machine: {machine()}",
        f"- load average (other work on the machine): {_load_at_start or 'unknown'} at the start, {_load()} at the end",
        f"- versions: {versions()}",
        "",
        "| figure | value | baseline | ratio | target |",
        "|---|---|---|---|---|",
        *(f"| {f.name} | {f.value} | {f.baseline} | {f.ratio} | {f.target} |" for f in figures),
    ]
    if note:
        lines += ["", note]
    return "\n".join(lines) + "\n"


def write_docs(args: argparse.Namespace, script: str, figures: list[Figure], note: str = "") -> None:
    """Append this run's entry when `--write-docs` was given; otherwise do nothing."""
    path: Path | None = getattr(args, "write_docs", None)
    if path is None:
        return
    text = entry(args, script, figures, note)
    path.parent.mkdir(parents=True, exist_ok=True)
    exists = path.is_file() and path.stat().st_size > 0
    with open(path, "a") as out:
        out.write(("\n" if exists else HEADER + "\n") + text)
    print(f"appended this run's figures to {path}")
