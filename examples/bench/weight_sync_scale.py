"""`weight_sync.py --scale`: the host engines against their baselines over sizes and tensor counts.

Two sweeps, every point a row with its own ratios measured in the same run: sizes
(`--sizes`, default 256 MiB, 1 GiB and 2 GiB) at `--tensors` tensors (4096), and tensor
counts (`--counts`, default 256, 4096 and 65536) at `--gib` GiB (1). A row times what the
default bench times: gloo against (a) one flat broadcast and (b) one broadcast per tensor,
shm against one memcpy; the median of `--repeat` rounds after an untimed first one, and of
more at a size under `--gib` (`rounds`): every row times about as many bytes, so a small row's
median is not left to two short syncs on a noisy machine.

Each engine of each row runs in a fresh pair of processes (sender and receiver), so what one
engine keeps mapped never counts against another, nor a row against the next. A side's
memory figure is the rise of its peak resident set over its resident set just before the
engine's first sync: the peak (VmHWM) is reset to the current RSS through
/proc/self/clear_refs right before each of the engine's syncs and read right after, and the
highest rise over the rounds is kept. The model and the baselines' buffers are resident
before and untouched during, so the rise is what the sync itself holds: the engine's buckets
and staging, a tensor larger than a bucket rejoined on the receiver, bookkeeping per tensor,
and the few MiB of library code a first sync pages in. Shared memory counts on every side
that touches it. The bound (the issue's) is the model plus two buckets per side, plus one
weight set on a receiver that holds a second one (atomic: the whole sync until the last
bucket verified; flip: the set its rollout does not serve): as a rise, two buckets, or two
buckets and the weights; a flip receiver's rollout weights are one of its two sets, so it
may rise by both sets and two buckets. Library code is
shown apart ("code": the rise of RssFile, file-backed pages, shared with every process that
maps the library and dropped under pressure) and the verdict does not count it; /dev/shm
pages are not in RssFile, so the shared buckets count in full (without /dev/shm, `shm` would
keep its buckets in the temp folder, where they would count as code: --scale refuses to run).

    python examples/bench/weight_sync.py --scale --repeat 2 --plot scale.png     # minutes
    python examples/bench/weight_sync.py --scale --sizes 0.0625 0.25 --counts 256 4096 --gib 0.25 --repeat 1
"""

from __future__ import annotations

import argparse
import ctypes
import math
import multiprocessing as mp
import os
import statistics
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import pairwise
from multiprocessing.connection import Connection

import torch
from record import Figure, write_docs
from weight_sync import (
    _LANDS, HOST, _barrier, _broadcast, _engine, _group, _Reader, _shares, _timed, _timed_engine, make_tensors, numels,
    phase_shares, warmup,
)

from backends.base import free_port
from backends.engines import Rendezvous, receive_into

SIZES_GIB = (0.25, 1.0, 2.0)
COUNTS = (256, 4096, 65536)
BASELINES = {"gloo": ("flat", "per_tensor"), "shm": ("memcpy",)}
LABELS = {"gloo": "gloo engine", "flat": "(a) one flat broadcast", "per_tensor": "(b) one broadcast per tensor",
          "shm": "shm engine", "memcpy": "one memcpy"}
AGAINST = {"flat": "one flat broadcast", "per_tensor": "one broadcast per tensor", "memcpy": "one memcpy"}
LINEAR_WITHIN = 0.15
"""GB/s at the largest size within this fraction of GB/s at the smallest: cost linear in size."""
PER_TENSOR_AT, PER_TENSOR_TARGET = 4096, 3.0
"""gloo at least this many times one broadcast per tensor, at this tensor count."""


@dataclass(frozen=True, slots=True, order=True)
class Point:
    """One row: `total` bytes of weights in `count` float32 tensors."""

    total: int
    count: int

    @property
    def label(self) -> str:
        return f"{self.total / 2**30:g} GiB in {self.count} tensors"


@dataclass(frozen=True, slots=True)
class Peak:
    """One side's resident memory around one engine's syncs, in bytes."""

    start: int
    """RSS just before the engine's first sync: runtime, model and the baselines' buffers."""
    rise: int | None
    """The highest peak RSS during any of its syncs, less `start`; None where the peak cannot be reset."""
    code: int = 0
    """Of `rise`, file-backed pages the syncs mapped (RssFile's rise: library code a first sync
    pages in, shared and reclaimable); shown apart, and not counted against the bound."""


@dataclass(frozen=True, slots=True)
class Row:
    point: Point
    seconds: dict[str, list[float]]
    """Per engine and baseline, one duration per timed round."""
    peaks: dict[str, tuple[Peak, Peak]] = field(default_factory=dict)
    """Per engine, (sender, receiver)."""

    def gbps(self, key: str) -> float:
        return self.point.total / statistics.median(self.seconds[key]) / 1e9


def _status(name: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS: resident now, VmHWM: the peak)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{name}:"):
                return int(line.split()[1]) * 1024
    raise SystemExit(f"/proc/self/status has no {name}: the memory figures need Linux")


def _reset_peak() -> bool:
    """Set VmHWM to the current RSS (Linux 4.0 on); False where the kernel or a sandbox refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


class _Meter:
    """The highest rise of the peak RSS during `around` over the RSS at the first `around`."""

    def __init__(self) -> None:
        self.start: int | None = None
        self.file = 0
        self.rise = 0
        self.code = 0
        self.resets = True

    @contextmanager
    def around(self) -> Iterator[None]:
        if self.start is None:
            self.start, self.file = _status("VmRSS"), _status("RssFile")
        self.resets = _reset_peak() and self.resets
        yield
        self.rise = max(self.rise, _status("VmHWM") - self.start)
        self.code = max(self.code, _status("RssFile") - self.file)  # mapped pages stay: no pressure here

    def peak(self) -> Peak:
        return Peak(self.start or 0, self.rise if self.resets else None, min(self.code, self.rise))


def rounds(args: argparse.Namespace, point: Point) -> int:
    """Timed rounds at `point`: `--repeat`, or as many as move `--repeat` times `--gib` bytes."""
    return max(args.repeat, math.ceil(args.repeat * args.total / point.total))


def _sender(args: argparse.Namespace, point: Point, name: str, ports: dict[str, int], out: Connection) -> None:
    torch.set_num_threads(args.threads)
    tensors = make_tensors(point.total, point.count, args.flat)
    flat = torch.empty(point.total, dtype=torch.uint8).fill_(7)
    copy_dst = torch.zeros_like(flat) if name == "shm" else flat
    _, group = _group(ports["group"], 0)
    engine, meter = _engine(name, args), _Meter()
    steps: dict[str, Callable[[], object]] = {
        "flat": lambda: (_broadcast(group, [flat]), _barrier(group)),
        "per_tensor": lambda: (_broadcast(group, [t for _, t in tensors]), _barrier(group)),
        "memcpy": lambda: ctypes.memmove(copy_dst.data_ptr(), flat.data_ptr(), point.total),
    }
    seconds: dict[str, list[float]] = {key: [] for key in (*BASELINES[name], name)}
    for rep in range(rounds(args, point) + warmup(args)):
        got: dict[str, float] = {}
        for key in BASELINES[name]:
            if key != "memcpy":
                _barrier(group)
            got[key] = _timed(steps[key])
        _barrier(group)
        with meter.around():
            _, got[name], phases = _timed_engine(engine, ports[name], tensors, rep + 1)
        got.update({f"{name}_phase_{phase}": secs for phase, secs in phases.items()})
        _barrier(group)
        if rep >= warmup(args):  # untimed rounds touch every buffer first; first touches are not transfers
            for key, value in got.items():
                seconds.setdefault(key, []).append(value)
    out.send((seconds, meter.peak()))


def _receiver(args: argparse.Namespace, point: Point, name: str, ports: dict[str, int], out: Connection) -> None:
    torch.set_num_threads(args.threads)
    flat = torch.zeros(point.total if name == "gloo" else 0, dtype=torch.uint8)
    landing = [torch.zeros(n) for n in numels(point.total, point.count)] if name == "gloo" else []
    _, group = _group(ports["group"], 1)
    engine, meter = _engine(name, args), _Meter()
    into = dict(make_tensors(point.total, point.count, flat=True)) if args.into and name == "gloo" else None
    for _ in range(rounds(args, point) + warmup(args)):
        for key in BASELINES[name]:
            if key != "memcpy":
                _barrier(group)
                _broadcast(group, [flat] if key == "flat" else landing)
                _barrier(group)
        _barrier(group)
        with meter.around():
            receive_into(engine, _Reader(), Rendezvous(HOST, ports[name]), rank=1, into=into)
        _barrier(group)
    out.send(meter.peak())


def measure(args: argparse.Namespace, point: Point, name: str) -> tuple[dict[str, list[float]], Peak, Peak]:
    """One engine and its baselines at one point, in a fresh sender and a fresh receiver process."""
    context = mp.get_context("spawn")
    ports = {"group": free_port(HOST), name: free_port(HOST)}
    pipes = [context.Pipe(duplex=False) for _ in range(2)]
    procs = [context.Process(target=target, args=(args, point, name, ports, send), daemon=True)
             for target, (_, send) in zip((_sender, _receiver), pipes, strict=True)]
    for proc in procs:
        proc.start()
    for _, send in pipes:
        send.close()
    try:
        seconds, sender_peak = pipes[0][0].recv()
        receiver_peak = pipes[1][0].recv()
    except EOFError as exc:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
        codes = ", ".join(f"{role} {proc.exitcode}" for role, proc in zip(("sender", "receiver"), procs, strict=True))
        raise SystemExit(f"{name} at {point.label}: a bench process died before its figures "
                         f"(exit codes: {codes})") from exc
    for proc in procs:
        proc.join(60)
    return seconds, sender_peak, receiver_peak


def sweeps(args: argparse.Namespace) -> tuple[list[Point], list[Point]]:
    """(the size sweep at --tensors tensors, the count sweep at --gib GiB), each in ascending order."""
    by_size = sorted({Point(int(gib * 2**30) // 4 * 4, args.tensors) for gib in args.sizes})
    by_count = sorted({Point(args.total, count) for count in args.counts}, key=lambda p: p.count)
    return by_size, by_count


def run(args: argparse.Namespace, points: Sequence[Point]) -> dict[Point, Row]:
    rows: dict[Point, Row] = {}
    for point in sorted(set(points)):
        row = Row(point, {})
        for name in BASELINES:
            print(f"  measuring {name} at {point.label} ...", flush=True)
            seconds, sender_peak, receiver_peak = measure(args, point, name)
            row.seconds.update(seconds)
            row.peaks[name] = (sender_peak, receiver_peak)
        rows[point] = row
    return rows


def main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.sizes = args.sizes or list(SIZES_GIB)
    args.counts = args.counts or list(COUNTS)
    if not os.path.isdir("/dev/shm"):
        parser.error("--scale needs /dev/shm: shm's buckets would be files elsewhere, and count as library code")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401 - drawn at the end; missing, say so before minutes of measuring
        except ImportError:
            parser.error("--plot draws with matplotlib, which is not installed (pip install -e \".[examples]\")")
    by_size, by_count = sweeps(args)
    for point in (*by_size, *by_count):
        if not 3 <= point.count <= point.total // 4:
            parser.error(f"{point.label}: a sweep needs 3 tensors to one per float32 (see --tensors, --counts)")
    torch.set_num_threads(args.threads)
    rows = run(args, [*by_size, *by_count])
    size_rows, count_rows = [rows[p] for p in by_size], [rows[p] for p in by_count]
    print_rows(args, [rows[p] for p in sorted(rows)])
    figures = [*row_figures(args, rows), *checks(size_rows, count_rows)]
    if args.plot is not None:
        plot(args, size_rows, count_rows)
    write_docs(args, "weight_sync.py --scale", figures, note(args, [rows[p] for p in sorted(rows)]))


def bound(args: argparse.Namespace, point: Point, side: int, name: str) -> int:
    """The rise side 0 (sender) or 1 (receiver) may show, as the issue words it: the model, two
    buckets a side, and one weight set for a receiver that holds a second (atomic: the whole
    sync until the last bucket verified; flip: the set its rollout does not serve). The model
    is resident before the first sync, except a flip receiver's: its rollout's weights are one
    of the two sets, so its rise may be two sets and two buckets; with shm the sender touches
    the same pages, which count on its side too."""
    if args.apply == "flip" and (side == 1 or name == "shm"):
        return 2 * point.total + 2 * args.bucket
    return 2 * args.bucket + (point.total if side == 1 and args.apply == "atomic" else 0)


def bound_text(args: argparse.Namespace) -> str:
    """`bound` in words."""
    if args.apply == "flip":
        return "two buckets a side, plus two weight sets on the receiver (and with shm on the sender: the same pages)"
    return "two buckets a side, plus the weights on an atomic receiver"


def _bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.0f} MiB"


def _gib(row: Row) -> str:
    return f"{row.point.total / 2**30:g} GiB"


def memory(args: argparse.Namespace, row: Row, name: str) -> tuple[list[str], str]:
    """Per side 'rise of bound' (or 'n/a'), and the verdict: holds, NOT held or not measured."""
    texts, overs = [], []
    for side, peak in enumerate(row.peaks[name]):
        limit = bound(args, row.point, side, name)
        texts.append("n/a" if peak.rise is None else f"+{_bytes(peak.rise)} of {_bytes(limit)} ({_bytes(peak.code)} code)")
        overs.append(None if peak.rise is None else peak.rise - peak.code - limit)
    if None in overs:
        return texts, "not measured"
    worst = max(over for over in overs if over is not None)
    return texts, "holds" if worst <= 0 else f"NOT held (+{_bytes(worst)} over)"


def print_rows(args: argparse.Namespace, rows: Sequence[Row]) -> None:
    print(f"{args.bucket / 2**20:g} MiB buckets, checksums {'on' if args.verify else 'off'}, apply {args.apply}"
          f"{_LANDS if args.into else ''}, median of {args.repeat} (more below {args.gib:g} GiB), torch threads {args.threads}; "
          "GB/s, and the engine's over its baseline's")
    print(f"  {'weights':>11s} {'tensors':>7s} {'gloo':>7s} {'(a)flat':>7s} {'(b)each':>7s} {'/(a)':>6s} "
          f"{'/(b)':>6s}   {'shm':>7s} {'memcpy':>7s} {'/memcpy':>7s}")
    for row in rows:
        gbps = {key: row.gbps(key) for key in row.seconds}
        print(f"  {_gib(row):>11s} {row.point.count:7d} {gbps['gloo']:7.2f} {gbps['flat']:7.2f} "
              f"{gbps['per_tensor']:7.2f} {gbps['gloo'] / gbps['flat']:5.2f}x {gbps['gloo'] / gbps['per_tensor']:5.2f}x"
              f"   {gbps['shm']:7.2f} {gbps['memcpy']:7.2f} {gbps['shm'] / gbps['memcpy']:6.2f}x")
    print("where a sync's time goes (the sender's phases, medians as shares of the median sync)")
    for row in rows:
        for name in BASELINES:
            print(f"  {row.point.label:27s} {name:5s} {_shares(phase_shares(row.seconds, name))}")
    print("peak resident memory: the rise over the RSS before the engine's first sync, of the bound "
          f"({bound_text(args)}); the verdict leaves out library code")
    for row in rows:
        for name in BASELINES:
            (sender, receiver), verdict = memory(args, row, name)
            starts = " / ".join(_bytes(peak.start) for peak in row.peaks[name])
            print(f"  {row.point.label:27s} {name:5s} sender {sender:33s} receiver {receiver:35s} "
                  f"{verdict:24s} (RSS at the start {starts})")


def row_figures(args: argparse.Namespace, rows: dict[Point, Row]) -> list[Figure]:
    figures = []
    for point, row in sorted(rows.items()):
        for name, baselines in BASELINES.items():
            for base in baselines:
                target = f">= {PER_TENSOR_TARGET:g}x" if base == "per_tensor" and point.count == PER_TENSOR_AT else ""
                figures.append(Figure(f"`{name}` against {AGAINST[base]}, {point.label}",
                                      f"{row.gbps(name):.2f} GB/s", f"{row.gbps(base):.2f} GB/s",
                                      f"{row.gbps(name) / row.gbps(base):.2f}x", target))
            (sender, receiver), verdict = memory(args, row, name)
            figures.append(Figure(f"`{name}` peak memory rise, sender / receiver, {point.label}",
                                  f"{sender} / {receiver}", f"bound: {bound_text(args)}", verdict, "holds"))
    return figures


def checks(size_rows: Sequence[Row], count_rows: Sequence[Row]) -> list[Figure]:
    """Cost linear in size (each engine), and gloo's lead over one broadcast per tensor growing
    with the tensor count; printed, and returned as figures."""
    print("checks:")
    figures = []
    small, large = size_rows[0], size_rows[-1]
    for name in BASELINES if len(size_rows) > 1 else ():
        ratio = large.gbps(name) / small.gbps(name)
        verdict = "met" if abs(ratio - 1) <= LINEAR_WITHIN else "NOT met"
        base = BASELINES[name][0]
        control = large.gbps(base) / small.gbps(base)  # the machine's own: the baseline over the same sizes
        print(f"  {name}: cost linear in size: {large.gbps(name):.2f} GB/s at {_gib(large)}, {small.gbps(name):.2f} "
              f"at {_gib(small)}: {ratio:.2f}x, target within {LINEAR_WITHIN:.0%}: {verdict}; its baseline "
              f"({AGAINST[base]}) over the same sizes in the same run: {control:.2f}x")
        figures.append(Figure(f"`{name}` cost linear in size: GB/s at {_gib(large)} against at {_gib(small)}",
                              f"{large.gbps(name):.2f} GB/s", f"{small.gbps(name):.2f} GB/s", f"{ratio:.2f}x",
                              f"{1 - LINEAR_WITHIN:.2f}x to {1 + LINEAR_WITHIN:.2f}x"))
        figures.append(Figure(f"{AGAINST[base]} (the baseline) over the same sizes: GB/s at {_gib(large)} against at "
                              f"{_gib(small)}", f"{large.gbps(base):.2f} GB/s", f"{small.gbps(base):.2f} GB/s",
                              f"{control:.2f}x", ""))
    for name, base in (("gloo", "per_tensor"), ("shm", "memcpy")):
        ratios = {row.point.count: row.gbps(name) / row.gbps(base) for row in count_rows}
        listed = ", ".join(f"{count}: {ratio:.2f}x" for count, ratio in ratios.items())
        if name == "shm":
            print(f"  shm / one memcpy at {_gib(count_rows[0])} by tensor count: {listed}")
            continue
        growing = "met" if all(b > a for a, b in pairwise(ratios.values())) else "NOT met"
        at = ratios.get(PER_TENSOR_AT)
        target = ("not measured" if at is None else "met" if at >= PER_TENSOR_TARGET else "NOT met")
        print(f"  gloo / (b) one broadcast per tensor at {_gib(count_rows[0])}: {listed}; target >= "
              f"{PER_TENSOR_TARGET:g}x at {PER_TENSOR_AT} tensors: {target}; growing with the tensor count: {growing}")
        figures.append(Figure(f"`gloo` against one broadcast per tensor, {_gib(count_rows[0])}, by tensor count",
                              listed, "", f"growing: {growing}", "growing"))
    return figures


STYLES = {"gloo": ("C0", "-", "o"), "flat": ("C0", "--", "s"), "per_tensor": ("C0", ":", "v"),
          "shm": ("C1", "-", "o"), "memcpy": ("C1", "--", "s")}


def plot(args: argparse.Namespace, size_rows: Sequence[Row], count_rows: Sequence[Row]) -> None:
    """Two panels, GB/s against size and against tensor count, each engine beside its baselines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    figure, panels = plt.subplots(1, 2, figsize=(12, 4.8))
    sweeps_drawn = ((size_rows, [row.point.total / 2**30 for row in size_rows], "weights (GiB)",
                     f"against size, {args.tensors} tensors"),
                    (count_rows, [row.point.count for row in count_rows], "tensors",
                     f"against tensor count, {args.gib:g} GiB"))
    for panel, (rows, xs, xlabel, title) in zip(panels, sweeps_drawn, strict=True):
        for key, (color, line, marker) in STYLES.items():
            panel.plot(xs, [row.gbps(key) for row in rows], color=color, linestyle=line, marker=marker,
                       label=LABELS[key])
        panel.set_xscale("log")
        panel.set_yscale("log")
        panel.set_xticks(xs, [f"{x:g}" for x in xs])
        panel.xaxis.set_minor_formatter(NullFormatter())
        panel.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        panel.set(xlabel=xlabel, ylabel="GB/s", title=f"GB/s {title}")
        panel.grid(True, which="both", alpha=0.3)
    figure.legend(*panels[0].get_legend_handles_labels(), loc="lower center", ncol=len(STYLES), fontsize=9)
    figure.suptitle(f"weight sync, one sender and one receiver process: {args.bucket / 2**20:g} MiB buckets, "
                    f"checksums {'on' if args.verify else 'off'}, apply {args.apply}{_LANDS if args.into else ''}, "
                    f"median of {args.repeat} (more below {args.gib:g} GiB)")
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    figure.savefig(args.plot, dpi=120)
    plt.close(figure)
    print(f"plot: {args.plot}")


def note(args: argparse.Namespace, rows: Sequence[Row]) -> str:
    """The entry's prose and its table of every row's GB/s and peak memory rises."""
    lines = [
        f"Sizes at {args.tensors} tensors and tensor counts at {args.gib:g} GiB, float32; {args.bucket / 2**20:g} MiB "
        f"buckets, checksums {'on' if args.verify else 'off'}, apply {args.apply}{_LANDS if args.into else ''}"
        f"{' (the sender flattened)' if args.flat else ''}; each engine of each row in a fresh "
        f"sender and receiver process, median of {args.repeat} syncs (of as many as move {args.repeat} x {args.gib:g} GiB at "
        f"a smaller size) after {warmup(args)} untimed round(s). Peak memory: the "
        "rise of each side's peak RSS (VmHWM, reset through /proc/self/clear_refs before each sync) over its RSS "
        "before the engine's first sync, with the library code the syncs paged in (RssFile's rise) in brackets; the "
        f"bound is {bound_text(args)}, and the verdict leaves the code out."
        + (f" Plot: `{args.plot}`." if args.plot is not None else ""),
        "",
        ("| weights | tensors | gloo GB/s | (a) flat | (b) per tensor | shm GB/s | memcpy "
         "| gloo rise, sender / receiver | shm rise, sender / receiver |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        rises = [" / ".join(memory(args, row, name)[0]) for name in BASELINES]
        lines.append(f"| {_gib(row)} | {row.point.count} | "
                     + " | ".join(f"{row.gbps(key):.2f}" for key in ("gloo", "flat", "per_tensor", "shm", "memcpy"))
                     + f" | {rises[0]} | {rises[1]} |")
    lines += ["", "Where a sync's time goes (the sender's phases: medians as shares of the median sync):", "",
              "| weights | tensors | gloo | shm |", "|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {_gib(row)} | {row.point.count} | "
                     + " | ".join(_shares(phase_shares(row.seconds, name)) for name in BASELINES) + " |")
    return "\n".join(lines)
