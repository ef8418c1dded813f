"""Run a test function on N ranks of a gloo process group on loopback, without ever hanging.

Each rank is forked from multiprocessing's forkserver, a fresh interpreter (no fork of
pytest's state) that imported torch, this library and, where installed, megatron-core,
transformers and mbridge once for the whole session (`PRELOAD`): a rank starts in milliseconds
instead of importing them again (5-9 s of CPU a rank on the 2-core CI machine). A rank takes
the test's environment as it is when the rank starts. The group meets on a free port of
127.0.0.1. A rank reports through a file in the test's tmp folder: its return value
as JSON, or its traceback. A rank that is still alive at the deadline is killed, and the test
fails naming it, so a collective that never completes costs seconds, not the suite.

Each rank leads a process group of its own, and whatever it starts joins it: megatron's
dist_checkpointing starts a multiprocessing manager in a rank that saves, and a rollout test
starts a process from a rank. Once a rank has ended, or is killed at the deadline, its whole
group is killed (`_end`), so nothing a rank started outlives the test, even when the rank
died by SIGKILL (a crash test) and never shut its children down. A rank whose parent (the
forkserver, which ends with pytest) died kills its own group (`lifecycle.procgroup`).
"""

from __future__ import annotations

import gc
import importlib.util
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
from lifecycle.procgroup import lead_own_group

RankFn = Callable[[int, int, Path], Any]
"""fn(rank, world_size, tmp_path) -> a JSON-serialisable value; must be a module-level function."""
PRELOAD = ("torch", "torch.distributed", "lifecycle", "backends.base", "megatron.core", "transformers", "mbridge")
"""What the forkserver imports before it forks a rank; those not installed are left out."""
_context: Any = None


def _result_file(tmp_path: Path, rank: int) -> Path:
    return tmp_path / f".rank{rank}.result.json"


def _forkserver() -> Any:
    """The forkserver context, its preload set: one forkserver for the session, started by the
    first rank; it exits once pytest does (its end of a pipe closes)."""
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload([name for name in PRELOAD if importlib.util.find_spec(name.split(".")[0])])
    return _context


def _end(proc: mp.process.BaseProcess) -> None:
    """SIGKILL what is left of the process group `proc` leads (proc itself, a manager it started),
    then join it. The forkserver, not pytest, reaps a rank, so the group is killed by its id even
    after the rank was reaped: that id is not given to a new process while the group has members."""
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left in it, or the rank never got to lead one
    proc.kill()  # does nothing once its exit code is known
    proc.join()


def _child(
    fn: RankFn, rank: int, world_size: int, port: int, tmp_path: Path, pg_timeout_s: float, backend: str,
    env: dict[str, str],
) -> None:
    os.environ.clear()  # the forkserver's environment is pytest's when it started; the test's is now
    os.environ.update(env)
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
    # NCCL ranks start fresh: a CUDA driver initialised by an import in the forkserver would not
    # survive the fork.
    ctx = mp.get_context("spawn") if backend == "nccl" else _forkserver()
    port = free_port()
    for r in range(world_size):
        _result_file(tmp_path, r).unlink(missing_ok=True)
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, tmp_path, timeout_s / 2, backend,
                                                      dict(os.environ)),
                         name=f"rank{r}") for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        running = list(procs)
        while running and time.monotonic() < deadline:
            for p in [p for p in running if p.exitcode is not None]:
                running.remove(p)
                _end(p)  # kills what the rank left behind in its group (a manager, a process it started)
            time.sleep(0.05)
        hung = [p.name for p in running]
    finally:
        for p in procs:
            _end(p)
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
