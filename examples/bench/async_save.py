"""Training-loop stall per save: `checkpoint.save.async` against a synchronous save, same run.

    python examples/bench/async_save.py [--gib 1.0] [--saves 4] [--step-s 5.0] [--format hf] [--device cpu]

A model of `--gib` GiB of float32 parameters (no optimizer state: the state is the weights)
trains between saves: each "step" updates every parameter in place, then computes for
`--step-s` seconds (matrix products, which compete with the background write for the
cores). The stall is the time `lc.save()` takes to return, including any wait for the
previous async save to commit (a save interval shorter than the write shows up here). The
sync save's stall is the whole write and commit. Prints the median of `--saves` saves of
each mode after a first one (which, async, allocates the host buffers) and the ratio; the
target is async <= 10% of sync.

`--device cuda`: the parameters live on the GPU and the step's matrix products run there
(4096x4096 float32, the host waiting for each as a step waits for its loss); the step ends
with the in-place update, which is still running on the GPU when `save()` is called. The
async stall is then the copy into pinned host memory; the target is <= 5% of the sync save,
which copies each tensor to pageable memory as it writes. `--step-s` must exceed the
background write, or the next save waits for it (shown as such).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from record import (
    Figure, add_write_docs, existing_folder, non_negative_float, positive_float, positive_int, write_docs,
)
from save_load import Blob, tensor_sizes

from lifecycle import Lifecycle, SaveInfo
from lifecycle.logging import configure
from lifecycle.async_save import PendingSave


TARGET = {"cpu": 0.10, "cuda": 0.05}
"""Async stall / sync save time to reach, per device."""
WORK_SIDE = {"cpu": 256, "cuda": 4096}
"""Side of the square matrix multiplied in the step's compute."""


def compute(work: torch.Tensor, step_s: float) -> None:
    """Matrix products for `step_s`; on a GPU the host waits for each, as a step waits for its loss."""
    deadline = time.perf_counter() + step_s
    while time.perf_counter() < deadline:
        work.copy_(torch.tanh(work @ work))
        if work.is_cuda:
            torch.cuda.synchronize(work.device)


def train_step(model: torch.nn.Module, step_s: float, work: torch.Tensor) -> None:
    """In-place update of every weight (what makes the host copy necessary) and compute. On a
    GPU the update comes last, as an optimizer step does, and is left running."""
    with torch.no_grad():
        if work.is_cuda:
            compute(work, step_s)
            torch._foreach_add_(list(model.parameters()), 1e-3)
            return
        torch._foreach_add_(list(model.parameters()), 1e-3)
        compute(work, step_s)


def run(mode: str, fmt: str, sizes: list[int], root: Path, saves: int, step_s: float, device: str) -> list[float]:
    with torch.device(device):
        model = Blob(sizes)
        side = WORK_SIDE[device]
        work = torch.randn(side, side) / side**0.5
    config = {"checkpoint": {"root": str(root / mode), "keep_last": 2,
                             "save": {"format": fmt, "contents": ["model"], "async": mode == "async"}}}
    lc = Lifecycle(config, role="actor", model=model)
    lc.init_load()
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
    del lc, model
    if device == "cuda":
        torch.cuda.empty_cache()
    return stalls


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=positive_float, default=1.0, help="state size (default 1 GiB)")
    parser.add_argument("--tensors", type=positive_int, default=200)
    parser.add_argument("--saves", type=positive_int, default=4, help="saves measured per mode, after a warm-up save")
    parser.add_argument("--step-s", type=non_negative_float, default=5.0,
                        help="compute per training step between saves")
    parser.add_argument("--format", default="hf", choices=["hf", "torch_dcp"])
    parser.add_argument("--dir", type=existing_folder,
                        help="an existing work folder, kept after (default: a temp folder, removed after)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the parameters live")
    add_write_docs(parser)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    torch.manual_seed(0)
    configure(json=True, file=open(os.devnull, "w"))
    sizes = tensor_sizes(int(args.gib * 1024**3), args.tensors)
    work = args.dir or Path(tempfile.mkdtemp(prefix="bench-async-save-"))
    where = torch.cuda.get_device_name() if args.device == "cuda" else "the CPU"
    print(f"{len(sizes)} float32 tensors, {4 * sum(sizes) / 2**30:.2f} GiB on {where}, format {args.format}, "
          f"{args.step_s} s of compute per step, in {work}")
    try:
        sync = run("sync", args.format, sizes, work, args.saves, args.step_s, args.device)
        asyn = run("async", args.format, sizes, work, args.saves, args.step_s, args.device)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    sync_s, async_s = statistics.median(sync[1:]), statistics.median(asyn[1:])
    target = TARGET[args.device]
    print(f"sync save (write + commit):        {sync_s:.3f} s per save (median of {args.saves})")
    print(f"async save (copy to host):         {async_s:.3f} s per save (median of {args.saves}); "
          f"first save, allocating host buffers: {asyn[0]:.3f} s")
    print(f"async stall / sync save time:      {async_s / sync_s:.1%} (target <= {target:.0%})")
    state = f"{4 * sum(sizes) / 2**30:.2f} GiB of state" + (f" on {where}" if args.device == "cuda" else "")
    write_docs(args, "async_save.py", [Figure(
        f"training stall per save, {state}, `save.async` against a synchronous save ({args.format})",
        f"{async_s * 1e3:.0f} ms" if async_s < 1 else f"{async_s:.2f} s", f"{sync_s:.2f} s", f"{async_s / sync_s:.1%}",
        f"<= {target:.0%}")],
        f"Median of {args.saves} saves of each mode after a warm-up save; the first async save, which allocates "
        f"the host buffers{' (pinned)' if args.device == 'cuda' else ''}, stalled {asyn[0]:.2f} s.")


if __name__ == "__main__":
    main()
