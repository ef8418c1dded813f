"""Training-loop stall per save: `checkpoint.save.async` against a synchronous save, same run.

    python examples/bench/async_save.py [--gib 1.0] [--saves 4] [--step-s 5.0] [--format hf]

A model of `--gib` GiB of float32 parameters (no optimizer state: the state is the weights)
trains between saves: each "step" updates every parameter in place, then computes for
`--step-s` seconds (matrix products, which compete with the background write for the
cores). The stall is the time `lc.save()` takes to return, including any wait for the
previous async save to commit (a save interval shorter than the write shows up here). The
sync save's stall is the whole write and commit. Prints the median of `--saves` saves of
each mode after a first one (which, async, allocates the host buffers) and the ratio; the
target is async <= 10% of sync.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from record import Figure, add_write_docs, write_docs
from save_load import Blob, tensor_sizes

from lifecycle import Lifecycle, SaveInfo
from lifecycle.logging import configure
from lifecycle.async_save import PendingSave


def train_step(model: torch.nn.Module, step_s: float, work: torch.Tensor) -> None:
    """In-place update of every weight (what makes the host copy necessary), then compute."""
    with torch.no_grad():
        torch._foreach_add_(list(model.parameters()), 1e-3)
        deadline = time.perf_counter() + step_s
        while time.perf_counter() < deadline:
            work.copy_(torch.tanh(work @ work))


def run(mode: str, fmt: str, sizes: list[int], root: Path, saves: int, step_s: float) -> list[float]:
    model = Blob(sizes)
    config = {"checkpoint": {"root": str(root / mode), "keep_last": 2,
                             "save": {"format": fmt, "contents": ["model"], "async": mode == "async"}}}
    lc = Lifecycle(config, role="actor", model=model)
    lc.init_load()
    work = torch.randn(256, 256) / 16
    stalls = []
    info: SaveInfo | None = None
    for step in range(1, saves + 2):
        with lc.train_step(step):
            train_step(model, step_s, work)
        busy = isinstance(info, PendingSave) and not info.committed.done()
        start = time.perf_counter()
        info = lc.save(step)
        stalls.append(time.perf_counter() - start)
        note = " (waited for the previous commit)" if busy else ""
        print(f"  {mode:>5} save {step}: training stalled {stalls[-1]:.3f} s{note}", flush=True)
    lc.close()
    return stalls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="state size (default 1 GiB)")
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--saves", type=int, default=4, help="saves measured per mode, after a warm-up save")
    parser.add_argument("--step-s", type=float, default=5.0, help="compute per training step between saves")
    parser.add_argument("--format", default="hf", choices=["hf", "torch_dcp"])
    parser.add_argument("--dir", type=Path, help="work folder (default: a temp folder, removed after)")
    add_write_docs(parser)
    args = parser.parse_args()
    torch.manual_seed(0)
    configure(json=True, file=open(os.devnull, "w"))
    sizes = tensor_sizes(int(args.gib * 1024**3), args.tensors)
    work = args.dir or Path(tempfile.mkdtemp(prefix="bench-async-save-"))
    print(f"{len(sizes)} float32 tensors, {4 * sum(sizes) / 2**30:.2f} GiB, format {args.format}, "
          f"{args.step_s} s of compute per step, in {work}")
    try:
        sync = run("sync", args.format, sizes, work, args.saves, args.step_s)
        asyn = run("async", args.format, sizes, work, args.saves, args.step_s)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    sync_s, async_s = statistics.median(sync[1:]), statistics.median(asyn[1:])
    print(f"sync save (write + commit):        {sync_s:.3f} s per save (median of {args.saves})")
    print(f"async save (copy to host):         {async_s:.3f} s per save (median of {args.saves}); "
          f"first save, allocating host buffers: {asyn[0]:.3f} s")
    print(f"async stall / sync save time:      {async_s / sync_s:.1%} (target <= 10%)")
    write_docs(args, "async_save.py", [Figure(
        f"training stall per save, {4 * sum(sizes) / 2**30:.2f} GiB of state, `save.async` against a synchronous "
        f"save ({args.format})", f"{async_s * 1e3:.0f} ms" if async_s < 1 else f"{async_s:.2f} s", f"{sync_s:.2f} s", f"{async_s / sync_s:.1%}", "<= 10%")],
        f"Median of {args.saves} saves of each mode after a warm-up save; the first async save, which allocates "
        f"the host buffers, stalled {asyn[0]:.2f} s.")


if __name__ == "__main__":
    main()
