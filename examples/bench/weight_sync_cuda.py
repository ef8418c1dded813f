"""`weight_sync.py --device cuda`: the cuda_ipc engine against one device-to-device copy, one GPU.

One sender (this process) and one receiver (a spawned process) share one GPU, as a colocated
trainer and rollout do. The weights are `--gib` GiB of float32 tensors on the GPU (the same
mix as the host bench). The baseline is one device-to-device copy of the same bytes in this
process (`dst.copy_(src)`), the least any transfer into a second set of weights costs. The
engine's time runs from the first byte packed to the receiver's verdict on every bucket; the
receiver takes each tensor (a view of a verified bucket) without copying it into a model,
as in the host bench. The sync is also timed with checksums off and, receiver side, with
`apply: streamed` (no private copy), so where the time goes can be read off the figures.
`--apply flip` times the flip instead (two weight sets in the receiver's GPU memory, which the
sender writes into and the receiver hands out as views: one copy a byte), with checksums on
and off. `--flat` puts the sender's tensors in one storage first (`flatten_parameters`), so
each bucket is packed with one copy. Each variant's line also gives the sender's phases.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from backends.base import free_port
from backends.engines import CheckpointEngineRegistry, Rendezvous, receive_into
from weight_sync import PHASES, _Reader  # the host bench's reader: takes every tensor, keeps none

HOST = "127.0.0.1"
VARIANTS = (("atomic", True), ("atomic", False), ("streamed", True), ("streamed", False))
FLIP_VARIANTS = (("flip", True), ("flip", False))


def variants(args: argparse.Namespace) -> tuple[tuple[str, bool], ...]:
    """(apply, verify) of each timed sync: the flip's, or the copying receivers'."""
    return FLIP_VARIANTS if args.apply == "flip" else VARIANTS


def _engine(args: argparse.Namespace, apply: str, verify: bool) -> Any:
    return CheckpointEngineRegistry.new("cuda_ipc", bucket_bytes=args.bucket, verify=verify, apply=apply,
                                        timeout_s=600)


def receiver(args: argparse.Namespace, ports: dict[str, int]) -> None:
    torch.cuda.set_device(0)
    engines = {variant: _engine(args, *variant) for variant in variants(args)}
    for _ in range(args.repeat + 1):
        for variant in variants(args):
            receive_into(engines[variant], _Reader(), Rendezvous(HOST, ports[f"{variant}"]), rank=1)
    for engine in engines.values():
        engine.close()


def _copy_seconds(src: torch.Tensor, dst: torch.Tensor) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    dst.copy_(src)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run(args: argparse.Namespace, tensors: list[tuple[str, torch.Tensor]]) -> dict[str, list[float]]:
    """Figures per key: 'copy' and one per variant, in seconds, after an untimed first round.
    `tensors` are on the GPU already."""
    torch.cuda.set_device(0)
    flat = torch.empty(args.total, dtype=torch.uint8, device="cuda").fill_(7)
    dst = torch.empty_like(flat)
    ports = {f"{variant}": free_port(HOST) for variant in variants(args)}
    child = mp.get_context("spawn").Process(target=receiver, args=(args, ports), daemon=True)
    child.start()
    engines = {variant: _engine(args, *variant) for variant in variants(args)}
    times: dict[str, list[float]] = defaultdict(list)
    try:
        for rep in range(args.repeat + 1):
            got = {"copy": _copy_seconds(flat, dst)}
            for variant in variants(args):
                engine = engines[variant]
                with engine.session(Rendezvous(HOST, ports[f"{variant}"]), rank=0):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    stats = engine.send_weights(tensors, rep + 1)
                    got[f"{variant}"] = time.perf_counter() - start
                for phase in PHASES:
                    got[f"{variant}_phase_{phase}"] = stats.phases[phase]
            if rep:
                for key, seconds in got.items():
                    times[key].append(seconds)
    finally:
        for engine in engines.values():
            engine.close()
        child.join(120)
    return times


def report(args: argparse.Namespace, times: dict[str, list[float]]) -> list[tuple[str, float, float]]:
    """Prints the table; returns (label, GB/s, ratio to the copy, where the time goes) per variant."""
    gbps = {key: args.total / statistics.median(v) / 1e9 for key, v in times.items() if "_phase_" not in key}
    print(f"{args.total / 2**30:.3g} GiB in {args.tensors} float32 tensors{' (flattened)' if args.flat else ''} "
          f"on {torch.cuda.get_device_name()}, "
          f"buckets of {args.bucket / 2**20:g} MiB, median of {args.repeat}")
    print(f"  {'one device-to-device copy':40s} {gbps['copy']:8.1f} GB/s")
    rows = []
    for apply, verify in variants(args):
        key = f"{(apply, verify)}"
        label = f"cuda_ipc, apply {apply}, checksums {'on' if verify else 'off'}"
        ratio = gbps[key] / gbps["copy"]
        spread = ", ".join(f"{args.total / s / 1e9:.1f}" for s in times[key])
        print(f"  {label:40s} {gbps[key]:8.1f} GB/s  {ratio:5.2f}x of the copy   (runs: {spread})")
        rows.append((label, gbps[key], ratio, phases(times, key)))
        print(f"    {'where the time goes (sender)':38s} {rows[-1][3]}")
    return rows


def phases(times: dict[str, list[float]], key: str) -> str:
    """The sender's phases of the variant `key`, median milliseconds of each, beside the whole sync's."""
    spent = ", ".join(f"{phase} {statistics.median(times[f'{key}_phase_{phase}']) * 1e3:.2f}" for phase in PHASES)
    return f"{spent} of {statistics.median(times[key]) * 1e3:.2f} ms (hash alongside)"
