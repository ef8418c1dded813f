"""Run a test function on N ranks of a gloo process group on loopback, without ever hanging.

Each rank is a fresh 'spawn' process (no fork of pytest's state); the group meets on a free
port of 127.0.0.1. A rank reports through a file in the test's tmp folder: its return value
as JSON, or its traceback. A rank that is still alive at the deadline is killed, and the test
fails naming it, so a collective that never completes costs seconds, not the suite.

Each rank leads a process group of its own, and whatever it starts joins it: megatron's
dist_checkpointing starts a multiprocessing manager in a rank that saves, and a rollout test
starts a process from a rank. Once a rank has ended, or is killed at the deadline, its whole
group is killed (`lifecycle.procgroup`, as `lifecycle convert` does for its ranks), so nothing
a rank started outlives the test, even when the rank died by SIGKILL (a crash test) and never
shut its children down. A rank whose parent (pytest) died kills its own group.
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from backends.base import free_port
from lifecycle.procgroup import end_group, exited, lead_own_group

RankFn = Callable[[int, int, Path], Any]
"""fn(rank, world_size, tmp_path) -> a JSON-serialisable value; must be a module-level function."""


def _result_file(tmp_path: Path, rank: int) -> Path:
    return tmp_path / f".rank{rank}.result.json"


def _child(
    fn: RankFn, rank: int, world_size: int, port: int, tmp_path: Path, pg_timeout_s: float, backend: str
) -> None:
    lead_own_group()
    import torch
    import torch.distributed as dist

    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    out: dict[str, Any]
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=pg_timeout_s))
        try:
            out = {"ok": True, "value": fn(rank, world_size, tmp_path)}
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - whatever it is, the parent fails the test with it
        out = {"ok": False, "error": traceback.format_exc()}
    _result_file(tmp_path, rank).write_text(json.dumps(out), encoding="utf-8")
    # The rank's work is done and reported: spare the interpreter's last garbage collection at
    # exit a walk over everything torch, megatron and transformers allocated (a second or two of
    # CPU per rank); atexit handlers and module teardown still run.
    gc.freeze()


def run_ranks(
    fn: RankFn, tmp_path: Path, *, world_size: int = 2, timeout_s: float = 60.0, killed_ok: bool = False,
    backend: str = "gloo",
) -> list[Any]:
    """fn's return value on each rank, in rank order; any rank's error fails the calling test.

    With `killed_ok`, a rank that ended by SIGKILL (a crash test killing itself) gives None.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    for r in range(world_size):
        _result_file(tmp_path, r).unlink(missing_ok=True)
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, tmp_path, timeout_s / 2, backend),
                         name=f"rank{r}") for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        running = list(procs)
        while running and time.monotonic() < deadline:
            for p in [p for p in running if exited(p) is not False]:
                running.remove(p)
                end_group(p)  # kills what the rank left behind in its group (a manager, a process it started)
            time.sleep(0.05)
        hung = [p.name for p in running]
    finally:
        for p in procs:
            end_group(p)
    results, errors = [], []
    for r in range(world_size):
        path = _result_file(tmp_path, r)
        if not path.is_file() and killed_ok and procs[r].exitcode == -signal.SIGKILL:
            results.append(None)
            continue
        if not path.is_file():
            errors.append(f"rank {r}: no result (exit code {procs[r].exitcode})")
            continue
        out = json.loads(path.read_text(encoding="utf-8"))
        if out["ok"]:
            results.append(out["value"])
        else:
            errors.append(f"rank {r} raised:\n{out['error']}")
    if hung:
        errors.insert(0, f"killed after {timeout_s}s: {', '.join(hung)}")
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)
    return results
